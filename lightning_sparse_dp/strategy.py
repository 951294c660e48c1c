"""The ``sparse_dp`` strategy: single-process data parallelism for MinkowskiEngine networks.

A thin orchestrator over the stages of one step (see the package docstring):
split (:mod:`.split`) -> place (:mod:`.place`) -> replicate (:mod:`.replicate`) ->
apply (:mod:`.apply`) -> gather (:mod:`.gather`) -> log (:mod:`.log`).
Cut after Lightning Fabric's ``strategies/dp.py``: one process, world size 1, the root device is
the first device, and the LightningModule itself is never wrapped, so checkpoints hold its plain
state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_sparse_dp.apply import ReplicaExecutor
from lightning_sparse_dp.backward import split_backward
from lightning_sparse_dp.gather import LossWeighting, check_loss_weighting, gather_outputs, step_losses, step_weights
from lightning_sparse_dp.hints import explain_replica_error, min_points_per_chunk
from lightning_sparse_dp.log import LogRecorder, emit, install_recorder, reduce_log_calls, silence_print
from lightning_sparse_dp.metrics import ReplicaMetrics, merge_into_root
from lightning_sparse_dp.place import place_chunks
from lightning_sparse_dp.replicate import Replicas
from lightning_sparse_dp.presplit import PreSplitBatch, PreSplitCollate
from lightning_sparse_dp.split import ASSIGNMENTS, SplitPlan, split_batch
from lightning_sparse_dp.threads import ThreadSplit, available_cores, split_threads
from lightning_sparse_dp.timing import StageTimes
from lightning_sparse_dp.sync import convert_sync_batchnorm, join_replicas, revert_sync_batchnorm, sync_layers


class _NoTimes(StageTimes):
    """Records nothing (``record_stage_times=False``)."""

    def new_step(self) -> None:
        pass


_NO_TIMES = _NoTimes(max_steps=1)


def check_devices(devices: list[torch.device]) -> None:
    """Check that ``devices`` are usable replicas: one kind, CPU or CUDA, and present on this machine.

    Raises:
        MisconfigurationException: no devices, mixed kinds, a device type other than CPU/CUDA, or a
            CUDA index the machine does not have.
    """
    if not devices:
        raise MisconfigurationException("sparse_dp needs at least one device.")
    kinds = {d.type for d in devices}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise MisconfigurationException(
            f"sparse_dp runs on CPU or CUDA devices of one kind, got {devices}. Use accelerator='cpu' or 'gpu'."
        )
    if kinds == {"cuda"}:
        available = torch.cuda.device_count()
        missing = [d for d in devices if (d.index or 0) >= available]
        if missing:
            raise MisconfigurationException(
                f"sparse_dp was given devices {[str(d) for d in devices]} but this machine has {available} CUDA "
                f"device(s), so {[str(d) for d in missing]} do not exist. Pass devices=<at most {available}>."
            )


class SparseDataParallelStrategy(ParallelStrategy):
    """Data parallelism in one process for MinkowskiEngine sparse batches, registered as ``"sparse_dp"``.

    Every step: the batch is split into chunks of whole samples (batch indices renumbered), each chunk
    is placed on its device (SparseTensor / TensorField built there), the LightningModule is
    replicated onto the devices in use, the step runs on every replica at once, and the outputs are
    gathered on the root device: the loss is ``sum_i w_i * loss_i``, exactly the whole-batch mean for
    the chosen weighting. ``self.log`` calls in replicas are reduced and logged once.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning strategy;
            the Trainer fills them from ``accelerator=`` and ``devices=``.
        loss_weighting: ``"auto"`` (default: ``"samples"`` when the batch has a per-sample tensor,
            else ``"points"`` when it has per-point targets, else ``"samples"``; said once at info
            level), ``"samples"`` (``w_i`` = share of samples, exact for losses averaged over
            samples), ``"points"`` (share of points, exact for losses averaged over points),
            ``"equal"`` (``1/k``), or a callable ``fn(chunk) -> number`` giving what chunk ``i``'s
            loss is a mean over (e.g. ``lambda c: (c["labels"] != 255).sum()`` for
            ``ignore_index=255``); see :func:`~lightning_sparse_dp.gather.chunk_counts`.
        layout: roles for batch entries that cannot be told apart, passed to
            :func:`~lightning_sparse_dp.split.split_batch`, e.g. ``{"labels": "points"}``; a key that
            matches nothing in a batch is an error.
        output_layout: how step outputs are combined, by key: ``{"hist": "sum"}``, roles
            ``"samples"``, ``"points"``, ``"sum"``, ``"mean"``, ``"cat"``, ``"list"``
            (:func:`~lightning_sparse_dp.gather.gather_outputs`).
        split_fn: replaces :func:`~lightning_sparse_dp.split.split_batch` entirely:
            ``split_fn(batch, num_chunks) -> (chunks, SplitPlan)``.
        split: how whole samples are assigned to replicas: ``"balanced"`` (default; even point
            counts, :func:`~lightning_sparse_dp.split.balanced_assignment`) or ``"contiguous"``
            (consecutive samples, sizes differing by at most one). Outputs come back in the original
            order either way.
        presplit: split batches in DataLoader worker processes
            (:class:`~lightning_sparse_dp.presplit.PreSplitCollate`) for loaders with ``num_workers > 0``,
            unless ``split_fn`` is given or the module overrides ``on_before_batch_transfer`` (which
            must see the whole batch).
        record_stage_times: record each step's stage durations in :attr:`stage_times`
            (:class:`~lightning_sparse_dp.timing.StageTimes`).
        sync_batchnorm: swap batch norm (torch's BatchNorm1d/2d/3d and SyncBatchNorm, which covers
            ``ME.MinkowskiBatchNorm`` / ``ME.MinkowskiSyncBatchNorm``) for
            :class:`~lightning_sparse_dp.sync.ReplicaSyncBatchNorm`, synchronized across the
            replicas of each step, for the run; reverted at teardown. ``Trainer(sync_batchnorm=True)``
            turns it on too.

    Raises:
        ValueError: an unknown ``loss_weighting`` or ``split``.
        MisconfigurationException: at setup, for manual optimization or unusable devices.
    """

    strategy_name = "sparse_dp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        loss_weighting: LossWeighting = "auto",
        layout: Mapping[Any, str] | None = None,
        output_layout: Mapping[Any, str] | None = None,
        split_fn: Callable[[Any, int], tuple[list[Any], SplitPlan]] | None = None,
        sync_batchnorm: bool = False,
        split: str = "balanced",
        presplit: bool = True,
        record_stage_times: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_loss_weighting(loss_weighting)
        if split not in ASSIGNMENTS:
            raise ValueError(f"split={split!r}; use one of {sorted(ASSIGNMENTS)}.")
        self.assignment = split
        self.presplit = presplit
        self.stage_times = StageTimes() if record_stage_times else None
        self.loss_weighting = loss_weighting
        self.layout = dict(layout) if layout else None
        self.output_layout = dict(output_layout) if output_layout else None
        self._warnings = WarningCache()  # one-time warnings and infos of this strategy
        self.split_fn = split_fn
        self.sync_batchnorm = sync_batchnorm
        self._executor: ReplicaExecutor | None = None
        self._replicas: Replicas | None = None
        self._thread_split: ThreadSplit | None = None
        self._replica_sync_layers: list[list] = []
        self._warned_transfer_hooks = False
        self._bn_swaps: list = []
        self._replica_metrics = ReplicaMetrics()

    # --- what Lightning asks of a single-process parallel strategy -----------------------------
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> None:
        return None  # one process reads the whole batch; no DistributedSampler

    @property
    def is_distributed(self) -> bool:
        return False

    def setup_environment(self) -> None:
        check_devices(list(self.parallel_devices or []))
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise MisconfigurationException(
                "sparse_dp does not support manual optimization (automatic_optimization = False): the step runs on "
                "several replicas at once, and each would call manual_backward() and optimizer.step() on its own "
                "chunk. Use automatic optimization, or strategy='ddp' for manual optimization."
            )
        if module is not None and (self.sync_batchnorm or self._layer_sync is not None):
            self._bn_swaps = convert_sync_batchnorm(module)
        elif module is not None and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
            rank_zero_warn(
                "The model has SyncBatchNorm layers (e.g. ME.MinkowskiSyncBatchNorm) but sync_batchnorm is off: in one "
                "process they run as plain batch norm on each replica's chunk. Pass Trainer(sync_batchnorm=True) to "
                "synchronize them across sparse_dp replicas."
            )
        super().setup(trainer)
        if self._executor is None:
            self._executor = ReplicaExecutor(len(self.parallel_devices or [self.root_device]))
        self._split_threads()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Run the module's ``on_before_batch_transfer`` hook; the batch stays where it is.

        Each chunk is placed on its own device in the step, so ``transfer_batch_to_device`` and
        ``on_after_batch_transfer`` are not called; a warning says so once when they are overridden.
        """
        module = self.lightning_module
        if module is None:
            return batch
        if not self._warned_transfer_hooks:
            self._warned_transfer_hooks = True
            skipped = [h for h in ("transfer_batch_to_device", "on_after_batch_transfer") if is_overridden(h, module)]
            if skipped:
                rank_zero_warn(
                    f"sparse_dp does not call {' or '.join(skipped)}: it splits the batch and places each chunk on its "
                    "replica's device itself. Move per-batch work to on_before_batch_transfer (runs on the whole batch "
                    "before the split) or into the step (runs on each chunk, on its device)."
                )
        return module._call_batch_hook("on_before_batch_transfer", batch, dataloader_idx)

    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: Any = "mean") -> Tensor | Any:
        return tensor  # one process: nothing to reduce across processes

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def teardown(self) -> None:
        if self._bn_swaps:
            revert_sync_batchnorm(self._bn_swaps)  # the user's layer types come back, holding the trained values
            self._bn_swaps = []
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._replicas = None
        self._replica_sync_layers = []
        if self._thread_split is not None:
            self._thread_split.restore()
            self._thread_split = None
        Strategy.teardown(self)  # ParallelStrategy.teardown expects a cluster environment

    # --- the step ------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._parallel_step("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._parallel_step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._parallel_step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._parallel_step("predict_step", args, kwargs)

    def process_dataloader(self, dataloader: object) -> object:
        """Move the split into the loader's worker processes (``presplit``), when it has workers."""
        module = self.lightning_module
        if (
            self.presplit
            and self.split_fn is None
            and isinstance(dataloader, DataLoader)
            and dataloader.num_workers > 0
            and not isinstance(dataloader.collate_fn, PreSplitCollate)
            and not (module is not None and is_overridden("on_before_batch_transfer", module))
        ):
            dataloader.collate_fn = PreSplitCollate(
                dataloader.collate_fn,
                len(self.parallel_devices or [self.root_device]),
                self.layout,
                self.assignment,
                self._min_points(),
            )
        return dataloader

    def split(self, batch: Any) -> tuple[list[Any], SplitPlan]:
        """Split ``batch`` into at most one chunk per device (``split_fn`` or :func:`split_batch`).

        Raises:
            ValueError: a :class:`~lightning_sparse_dp.presplit.PreSplitBatch` with more chunks than devices.
        """
        num_devices = len(self.parallel_devices or [self.root_device])
        if isinstance(batch, PreSplitBatch):
            if batch.plan.num_chunks > num_devices:
                raise ValueError(
                    f"the batch was split into {batch.plan.num_chunks} chunks in the DataLoader but the strategy has "
                    f"{num_devices} device(s); make PreSplitCollate(num_chunks=...) match devices."
                )
            return batch.chunks, batch.plan
        if self.split_fn is not None:
            return self.split_fn(batch, num_devices)
        return split_batch(
            batch, num_devices, layout=self.layout, assignment=self.assignment, min_points=self._min_points()
        )

    def _min_points(self) -> int:
        """2 when replicas run batch norm on their own chunks (no chunk of one point), else 1."""
        module = self.lightning_module
        synchronized = bool(self._bn_swaps) or self.sync_batchnorm or self._layer_sync is not None
        return 1 if module is None else min_points_per_chunk(module, synchronized)

    def _parallel_step(self, step_name: str, args: tuple, kwargs: dict) -> Any:
        module = self.lightning_module
        assert module is not None and self.parallel_devices is not None
        if not args:
            raise TypeError(f"sparse_dp expects the batch as the first argument of {step_name}.")
        batch, rest = args[0], args[1:]
        times = self.stage_times or _NO_TIMES
        times.new_step()
        with times.stage("split"):
            chunks, plan = self.split(batch)
        devices = self.parallel_devices[: plan.num_chunks]
        with times.stage("place"):
            placed = place_chunks(chunks, devices)
        if self._executor is None:  # a step called outside fit/validate/test/predict
            self._executor = ReplicaExecutor(len(self.parallel_devices))
        try:
            with times.stage("replicate"):
                # one chunk on the root device: run the module itself, no replica needed
                replicas = [module] if devices == [self.root_device] else self._refresh_replicas(module, devices)
                metrics = self._replica_metrics.install(module, replicas, devices)
                recorders = [install_recorder(r) for r in replicas]
                silence_print(replicas)
                group = join_replicas(self._replica_sync_layers[: len(replicas)])  # None for one replica
            steps = [partial(getattr(r, step_name), chunk, *rest, **kwargs) for r, chunk in zip(replicas, placed)]
            if group is not None:
                steps = [partial(group.run, rank, step) for rank, step in enumerate(steps)]
            steps = [times.timed(f"replica{i}", step) for i, step in enumerate(steps)]
            with times.stage("apply"):
                try:
                    outputs = self._executor.run(steps, devices)
                except Exception as err:
                    raise explain_replica_error(err, plan)
        finally:
            if isinstance(module.__dict__.get("log"), LogRecorder):
                del module.__dict__["log"]  # a recorder installed on the module itself shadowed its method
        weights = step_weights(plan, placed, self.loss_weighting, self._warnings)
        with times.stage("gather"):
            output = gather_outputs(outputs, plan, weights, self.root_device, self.output_layout, self._warnings)
        if step_name == "training_step" and len(replicas) > 1 and torch.is_grad_enabled():
            # each replica runs its own backward in its own thread when Lightning calls backward on the loss
            assert self._replicas is not None
            output = split_backward(
                output,
                outputs,
                dict(weights=weights, replicas=self._replicas, executor=self._executor, group=group, times=times),
            )
        with times.stage("log"):
            merge_into_root(metrics)
            calls = reduce_log_calls(
                recorders, weights, plan.num_samples, self.root_device, module, step_losses(outputs), self._warnings
            )
            emit(module, calls)
        return output

    def _split_threads(self) -> None:
        """CPU replicas: ``cores // replicas`` intra-op threads each, for torch, ME's OpenMP and OpenBLAS (see :mod:`.threads`)."""
        devices = list(self.parallel_devices or [])
        if self._thread_split is not None or len(devices) < 2 or self.root_device.type != "cpu":
            return
        self._thread_split = split_threads(len(devices))
        if self._thread_split is not None and self._executor is not None:
            self._executor.threads_per_replica = self._thread_split.per_replica
            rank_zero_info(
                f"sparse_dp: {len(devices)} CPU replicas on {available_cores()} cores get "
                f"{self._thread_split.per_replica} intra-op thread(s) each (torch, ME's OpenMP, OpenBLAS), as Lightning's "
                "DDP splits cores between processes. Set OMP_NUM_THREADS (or call torch.set_num_threads) to choose."
            )

    def _refresh_replicas(self, module: nn.Module, devices: list[torch.device]) -> list[nn.Module]:
        """The persistent replicas for ``devices``, refreshed for this step (rebuilt when the module changed)."""
        if self._replicas is None or not self._replicas.matches(module, devices):
            self._replicas = Replicas(module, self.parallel_devices or devices)
            self._replica_sync_layers = [sync_layers(r) for r in self._replicas.modules]
        return self._replicas.refresh(len(devices))

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with (self.stage_times or _NO_TIMES).stage("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Single-process data parallelism for MinkowskiEngine sparse batches (lightning-sparse-dp)",
            )


SparseDataParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["SparseDataParallelStrategy", "check_devices"]
