"""Scatter: the batch cut into chunks of whole samples, and each chunk placed on its replica's device.

:func:`step_cutters` gives a ``sparse_dp`` step's chunks, each left to a callable that returns it, and the split's plan:
the chunks the DataLoader workers already split (a :class:`~lightning_sparse_dp.split.presplit.PreSplitBatch`, taken as
they are), those of the strategy's ``split_fn``, or the cutters of :func:`~lightning_sparse_dp.split.plan_split`, whose
cuts then run where the caller calls them. A batch of fewer chunks than replicas (fewer samples than devices) leaves
replicas idle in its step: :func:`say_idle` says so once.

Placing a chunk builds its SparseTensor / TensorField on the device (:func:`build_sparse`). ME's
``SparseTensor(features, coordinates, device=...)`` creates a new coordinate manager on the coordinates' device, and its
CUDA code allocates on the *current* CUDA device, so a SparseTensor for device ``d`` is built inside
``torch.cuda.device(d)`` (:func:`~lightning_sparse_dp.runtime.devices.device_context`; upstream MinkowskiEngine issue
#535, "All inputs must be on the same device"). A 0.5.x SparseTensor has no ``.to()``: it is never built on the host
first and moved, only built once where it is used, and one that reaches a GPU replica already built on another device is
refused (:func:`check_me_devices`). The rest of the chunk is moved by Lightning's ``move_data_to_device``, or by a
``transfer`` it is given (:func:`place_chunk`): the batch-transfer hooks, where the module or its datamodule has its own
(:func:`transfer_hooks_overridden`), which run where Lightning runs them (:mod:`~lightning_sparse_dp.step.prepare`,
through Lightning's hook call, or :func:`batch_transfer` for a copy of the module), as a DDP rank runs them on its batch.

:func:`place_chunks` places every chunk on the calling thread; :func:`pending_chunks` instead hands each replica a
:class:`PendingChunk` (moved without hooks), so that chunk ``i`` is cut and placed in replica ``i``'s thread, beside
the other replicas' (timed as stage ``scatter<i>``). :func:`place_batch` places a whole batch on one device,
rebuilding its ME tensors there, for a step that does not split it (plain Lightning's, or a ``sparse_ddp`` rank's, on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from operator import getitem
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_sparse_dp.runtime.compat import current_hook, has_hook_name, set_current_hook, trainer_of
from lightning_sparse_dp.runtime.devices import device_context
from lightning_sparse_dp.runtime.me import check_coordinate_manager_mode, is_me_tensor, is_tensor_field
from lightning_sparse_dp.split import SparseSpec, SplitPlan, plan_split, split_batch
from lightning_sparse_dp.split.leaves import path_name
from lightning_sparse_dp.split.presplit import PreSplitBatch


def build_sparse(spec: SparseSpec, device: torch.device, manager: Any = None) -> Any:
    """Build the ``ME.SparseTensor`` / ``ME.TensorField`` described by ``spec`` on ``device``.

    Args:
        spec: features ``[n, C]`` and coordinates ``[n, D+1]`` (column 0 = batch index) of one chunk,
            with the source tensor's ``tensor_stride`` / ``quantization_mode`` / ``minkowski_algorithm``.
        device: where the tensor and its coordinate manager live.
        manager: an ``ME.CoordinateManager`` on ``device`` to build it on (``None``: a new one).
    """
    if spec.source is not None and spec.source.device == device:
        return spec.source  # the whole batch, already where it is needed: no second coordinate manager
    with device_context(device):
        features = spec.features.to(device, non_blocking=True)
        coordinates = spec.coordinates.to(device, non_blocking=True)
        return spec.cls(features=features, coordinates=coordinates, device=device, coordinate_manager=manager,
                        **spec.kwargs)


class SharedManagers:
    """Builds :class:`~lightning_sparse_dp.split.SparseSpec` specs on ``device`` (:func:`build_sparse`; ``None``: where each
    one's features are), those whose tensors shared a coordinate manager (``spec.manager``: a completion network's
    input and target, which ME's union and kernel maps need on one manager) on one manager again, as they were."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.built: dict[int, Any] = {}

    def __call__(self, spec: SparseSpec) -> Any:
        first = self.built.get(spec.manager) if spec.manager is not None else None
        x = build_sparse(spec, self.device or spec.features.device, None if first is None else first.coordinate_manager)
        if spec.manager is not None:
            self.built.setdefault(spec.manager, x)
        return x


def build_specs(batch: Any, device: torch.device | None = None) -> Any:
    """Every :class:`~lightning_sparse_dp.split.SparseSpec` of ``batch`` built on ``device``, those of one coordinate
    manager on one (:class:`SharedManagers`)."""
    return apply_to_collection(batch, SparseSpec, SharedManagers(device))


def me_tensors_elsewhere(batch: Any, device: torch.device) -> list[Any]:
    """The ``ME.SparseTensor`` / ``ME.TensorField`` already built in ``batch`` that are not on ``device`` (they have
    no ``.to()``: only building them again moves them)."""
    return [x for x in pytree.tree_leaves(batch, is_leaf=is_me_tensor) if is_me_tensor(x) and torch.device(x.device) != device]


def check_me_devices(batch: Any, device: torch.device) -> None:
    """Check that every ``ME.SparseTensor`` / ``ME.TensorField`` already built in ``batch`` is on ``device``
    (:func:`me_tensors_elsewhere`).

    ME tensors have no ``.to()``, so one that reaches a replica from elsewhere stays where it was built, and ME's
    CUDA build was seen to crash the process (a segmentation fault while formatting its assertion message) when
    a CPU SparseTensor meets a layer on a GPU (issue 33). Pending tensors (:class:`SparseSpec`) are not checked:
    :func:`build_sparse` builds them on ``device``.

    Raises:
        RuntimeError: naming the first such entry (``batch['x']``), its device and ``device``.
    """
    elsewhere = me_tensors_elsewhere(batch, device)
    if not elsewhere:
        return
    x = elsewhere[0]
    path = next(p for p, leaf in pytree.tree_flatten_with_path(batch, is_leaf=is_me_tensor)[0] if leaf is x)
    kind = "ME.TensorField" if is_tensor_field(x) else "ME.SparseTensor"
    raise RuntimeError(
        f"{path_name(path)} is an {kind} on {torch.device(x.device)}, but the replica it goes to runs on "
        f"{device}: an ME tensor cannot be moved (0.5.x has no .to()), and ME's CUDA layers crash the process "
        "on a tensor from another device. Return its features and coordinates (or the ME tensor itself, in a "
        "dict, list or tuple the split can read) from the dataloader and let the strategy build it on each "
        "device, or build it in the step on self.device."
    )


#: moves a chunk to a device: ``transfer(chunk, device) -> chunk`` (the module's batch-transfer hooks, :func:`batch_transfer`)
Transfer = Callable[[Any, torch.device], Any]


def place_chunk(chunk: Any, device: torch.device, transfer: Transfer | None = None) -> Any:
    """Build ``chunk``'s pending sparse tensors on ``device``, then move the rest there: with ``transfer`` (the
    module's ``transfer_batch_to_device`` and ``on_after_batch_transfer``, :func:`batch_transfer`), as a DDP rank moves
    its batch, else with Lightning's ``move_data_to_device``.

    Raises:
        RuntimeError: on a CUDA ``device``, an ME tensor of ``chunk`` built elsewhere (:func:`check_me_devices`).
    """
    if device.type == "cuda":
        check_me_devices(chunk, device)
    values = chunk.values() if type(chunk) is dict else chunk if type(chunk) in (list, tuple) else None
    if values is None or not all(type(x) is torch.Tensor for x in values):  # one level of plain tensors: no spec
        chunk = build_specs(chunk, device)
    with device_context(device):
        return move_data_to_device(chunk, device) if transfer is None else transfer(chunk, device)


_TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")


def _own_hook(owner: Any, hook: str) -> bool:
    """Whether ``owner`` has its own ``hook``: overridden in its class (Lightning's ``is_overridden``) or set on the
    instance (a wrapper ``is_overridden`` reads through, e.g. ``functools.partial`` with ``update_wrapper``)."""
    return owner is not None and (is_overridden(hook, owner) or hook in vars(owner))


def transfer_hooks_overridden(module: Any) -> bool:
    """Whether ``module`` or its Trainer's datamodule has its own ``transfer_batch_to_device`` or
    ``on_after_batch_transfer`` (:func:`batch_transfer`'s rule)."""
    datamodule = getattr(trainer_of(module), "datamodule", None)
    return any(_own_hook(owner, hook) for owner in (module, datamodule) for hook in _TRANSFER_HOOKS)


def batch_transfer(module: Any, dataloader_idx: int = 0) -> Transfer:
    """The batch-transfer hooks a DDP rank runs on its batch, for one chunk: ``transfer_batch_to_device(chunk, device,
    dataloader_idx)`` then ``on_after_batch_transfer(chunk, dataloader_idx)``, each the datamodule's where it has its
    own (:func:`transfer_hooks_overridden`'s rule), else the module's (Lightning's ``LightningModule._call_batch_hook``
    rule). Called directly, not through the Trainer's hook machinery: for a module that is not the Trainer's (the exactness
    check's copy), whose hooks the Trainer cannot call; the module (and its trainer's) carry the hook's name meanwhile,
    as Lightning's hook call sets it, so that ``self.log`` in them is refused as there."""
    datamodule = getattr(trainer_of(module), "datamodule", None)
    owners = {hook: datamodule if _own_hook(datamodule, hook) else module for hook in _TRANSFER_HOOKS}

    # the modules whose self.log the hooks may reach: this one, and its trainer's (a copy's hooks may close over it)
    modules = {id(m): m for m in (module, getattr(trainer_of(module), "lightning_module", None)) if has_hook_name(m)}

    def call(hook: str, *args: Any) -> Any:
        before = {key: current_hook(m) for key, m in modules.items()}
        for m in modules.values():  # self.log refused inside, as Lightning's hook call refuses it
            set_current_hook(m, hook)
        try:
            return getattr(owners[hook], hook)(*args)
        finally:
            for key, m in modules.items():
                set_current_hook(m, before[key])

    def transfer(chunk: Any, device: torch.device) -> Any:
        chunk = call("transfer_batch_to_device", chunk, device, dataloader_idx)
        return call("on_after_batch_transfer", chunk, dataloader_idx)

    return transfer


class PendingChunk:
    """A chunk that its replica's thread makes itself: ``make()`` returns the chunk placed on its device.

    The strategy hands one per replica to :func:`~lightning_sparse_dp.step.apply.replica_steps` in place of a placed
    chunk, so that cutting chunk ``i`` out of the batch (:func:`~lightning_sparse_dp.split.plan_split`'s cutters)
    and placing it (:func:`place_chunk`: on CUDA the copies to the device and the SparseTensor / TensorField built
    there) run in replica ``i``'s thread, beside the other replicas', instead of one after another on the main
    thread before any replica starts.
    """

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __call__(self) -> Any:
        return self.make()


def cut_and_place(cut: Callable[[], Any], device: torch.device) -> Any:
    """``cut()``'s chunk placed on ``device`` (:func:`place_chunk`: tensors moved as Lightning moves a batch; a module's
    own transfer hooks run where Lightning runs them instead, :mod:`~lightning_sparse_dp.step.prepare`)."""
    return place_chunk(cut(), device)


def pending_chunks(
    cutters: Sequence[Callable[[], Any]], devices: Sequence[torch.device], timer: Any = None,
) -> list[PendingChunk]:
    """One :class:`PendingChunk` per cutter: ``cutters[i]()``'s chunk placed on ``devices[i]`` (:func:`cut_and_place`),
    timed as stage ``scatter<i>`` by ``timer`` (a :class:`~lightning_sparse_dp.runtime.timing.StepTimer`) when given.

    Raises:
        ValueError: more cutters than devices (:func:`check_chunk_count`).
        MisconfigurationException: ME's shared coordinate manager mode with several chunks
            (:func:`~lightning_sparse_dp.runtime.me.check_coordinate_manager_mode`).
    """
    check_chunk_count(len(cutters), devices)
    check_coordinate_manager_mode(len(cutters))
    makes = [partial(cut_and_place, cut, device) for cut, device in zip(cutters, devices)]
    return [PendingChunk(make if timer is None else timer.timed(f"scatter{i}", make)) for i, make in enumerate(makes)]


def place_chunks(chunks: Sequence[Any], devices: Sequence[torch.device], transfer: Transfer | None = None) -> list[Any]:
    """Place chunk ``i`` on ``devices[i]`` (with ``transfer``, see :func:`place_chunk`); ``len(chunks) <= len(devices)``.

    Raises:
        ValueError: more chunks than devices.
        MisconfigurationException: ME's shared coordinate manager mode with several chunks
            (:func:`~lightning_sparse_dp.runtime.me.check_coordinate_manager_mode`).
    """
    check_chunk_count(len(chunks), devices)
    check_coordinate_manager_mode(len(chunks))
    return [place_chunk(c, d, transfer) for c, d in zip(chunks, devices)]


def check_chunk_count(num_chunks: int, devices: Sequence[torch.device]) -> None:
    """Raises ``ValueError`` when there are more chunks than devices (at most one chunk per device)."""
    if num_chunks > len(devices):
        raise ValueError(f"{num_chunks} chunks for {len(devices)} devices: split into at most one chunk per device.")


def place_batch(batch: Any, device: torch.device, layout: Any = None) -> Any:
    """The whole batch on ``device``, its ``ME.SparseTensor`` / ``ME.TensorField`` rebuilt there (they have no
    ``.to()``, and Lightning's ``batch_to_device`` leaves them where they are): for plain Lightning on a GPU, whose
    step would otherwise meet a CPU TensorField with CUDA weights (ME's CUDA build then crashes in its assertion).

    Args:
        batch: a batch :func:`~lightning_sparse_dp.split.split_batch` can read (``layout`` as there).
        device: the target device.
    """
    chunks, _ = split_batch(batch, 1, layout=layout)
    return place_chunk(chunks[0], device)


def step_cutters(
    batch: Any, num_devices: int, split_fn: Callable[[Any, int], tuple[list[Any], SplitPlan]] | None = None,
    **split_kwargs: Any,
) -> tuple[list[Callable[[], Any]], SplitPlan]:
    """A ``sparse_dp`` step's chunks, each left to a callable (``cutters[j]()`` returns chunk ``j``), and its plan:
    the DataLoader workers' chunks (a :class:`PreSplitBatch`), ``split_fn``'s, or those of
    :func:`~lightning_sparse_dp.split.plan_split` with ``split_kwargs`` (``layout``, ``assignment``, ``min_points``,
    ``batch_sizes``),
    whose cuts then run where the caller calls them (in the replicas' threads).

    Raises:
        ValueError: a PreSplitBatch with more chunks than ``num_devices``.
        BatchLayoutError: a batch the split cannot read (raised here, never by a cutter).
    """
    if isinstance(batch, PreSplitBatch):
        if batch.plan.num_chunks > num_devices:
            raise ValueError(
                f"the batch was split into {batch.plan.num_chunks} chunks in the DataLoader but the strategy has "
                f"{num_devices} device(s); make PreSplitCollate(num_chunks=...) match devices."
            )
        return [partial(getitem, batch.chunks, j) for j in range(len(batch.chunks))], batch.plan
    if split_fn is not None:
        chunks, plan = split_fn(batch, num_devices)
        return [partial(getitem, chunks, j) for j in range(len(chunks))], plan
    return plan_split(batch, num_devices, **split_kwargs)


def say_idle(plan: SplitPlan, devices: int, warning_cache: WarningCache) -> None:
    """Say (info) that a batch split into ``plan.num_chunks`` chunks, fewer than the ``devices`` replicas (fewer samples
    than devices, or chunks kept to two points for batch norm), leaves replicas idle in its step (the strategy calls
    it for such a batch, once)."""
    warning_cache.info(
        f"sparse_dp: a batch of {plan.num_samples} sample(s) ran on {plan.num_chunks} of the {devices} replicas "
        f"(a chunk holds whole samples): {devices - plan.num_chunks} replica(s) idle in such steps (said once). "
        f"A batch_size of at least {devices} (and drop_last=True for a short last batch) keeps every replica busy."
    )


__all__ = [
    "batch_transfer", "build_sparse", "check_chunk_count", "check_me_devices", "cut_and_place",
    "me_tensors_elsewhere", "pending_chunks", "PendingChunk", "place_batch", "place_chunk", "place_chunks",
    "say_idle", "step_cutters", "Transfer", "transfer_hooks_overridden",
]
