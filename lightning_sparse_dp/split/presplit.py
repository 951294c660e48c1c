"""Pre-split: do the split in DataLoader worker processes instead of on the step's critical path.

:class:`PreSplitCollate` wraps a collate function: in each worker it collates the samples, then
splits the batch (:func:`~lightning_sparse_dp.split.split_batch`: batch indices, sample and point
rows, renumbering, the balanced assignment) and hands the main process a :class:`PreSplitBatch`,
so the main process only places the chunks on their devices. The ``sparse_dp`` strategy installs it
on DataLoaders with ``num_workers > 0`` by itself (``presplit=True``: :func:`presplit_loader`, on a copy of the
DataLoader, not where ``on_before_batch_transfer``, which must see the whole batch, is overridden); it can be used
directly too.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.utils._pytree as pytree
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, default_collate

from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.runtime.me import ME
from lightning_sparse_dp.split import SparseSpec, SplitPlan, check_num_chunks, split_batch
from lightning_sparse_dp.split.assign import Assignment
from lightning_sparse_dp.split.cut import sparse_kwargs


@dataclass(init=False)
class PreSplitBatch:
    """A batch split in a worker: the chunks (SparseTensor / TensorField as SparseSpec), the plan, and the collated
    batch itself (``batch``, its SparseTensor / TensorField as whole-batch SparseSpec, as they cannot cross processes;
    ``None`` when not kept), which the strategy's exactness check runs one device's step on.

    ``batch_size``: the batch size Lightning's ``self.log`` infers from the collated batch on one device
    (``lightning.pytorch.utilities.data.extract_batch_size``: the first tensor's length, the points of a dict batch of
    coordinates first), which weights epoch-level means of values logged without ``batch_size=``; Lightning cannot
    infer it from a PreSplitBatch that kept no batch, so the strategy gives it this one (``None``: not known; the
    batch's samples are given then, said once). :class:`PreSplitCollate` sets it on every batch.

    ``PreSplitBatch(chunks, plan, batch=None, batch_size=None)``. Lightning's precision plugins convert a batch before the step
    (``convert_input``: ``apply_to_collection`` over dataclass fields, e.g. floating tensors to float64
    for ``precision="64-true"``); the chunks are converted as a whole batch would be, and the plan, a
    frozen dataclass that holds no floating-point data, is a non-init field, so it is passed on as it is
    (``apply_to_collection`` cannot rebuild a frozen dataclass and raised here before).
    """

    chunks: list[Any]
    batch: Any
    batch_size: int | None
    plan: SplitPlan = field(init=False)

    def __init__(self, chunks: list[Any], plan: SplitPlan, batch: Any = None, batch_size: int | None = None) -> None:
        self.chunks = chunks
        self.batch = batch
        self.batch_size = batch_size
        self.plan = plan


class PreSplitCollate:
    """``collate_fn`` for a DataLoader: collate with ``collate_fn``, then split into ``num_chunks``.

    Args:
        collate_fn: the collate function to wrap (default ``torch.utils.data.default_collate``),
            e.g. one that calls ``ME.utils.sparse_collate``.
        num_chunks: the number of devices.
        layout, assignment, min_points, batch_sizes: as for :func:`~lightning_sparse_dp.split.split_batch` (a callable
            assignment must be picklable, e.g. ``functools.partial(balanced_assignment, groups=...)``).
        keep_batch: which batches keep the collated batch (:attr:`PreSplitBatch.batch`: what the strategy hands the
            hooks and callbacks that receive ``batch``, and what the exactness check runs one device's step on):
            ``"always"`` (default), ``"first"`` (each worker process's first batch: a fit's first training batch is
            worker 0's first; the rest travel without it, and their hooks get the PreSplitBatch), ``"never"``.

    Raises:
        ValueError: a ``keep_batch`` other than those three.

    Picklable when ``collate_fn`` is, so it runs in worker processes.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_chunks: int,
        layout: Mapping[Any, str] | None = None,
        assignment: str | Assignment = "balanced",
        min_points: int = 1,
        batch_sizes: Collection[int] | None = None,
        keep_batch: str = "always",
    ) -> None:
        if keep_batch not in ("always", "first", "never"):
            raise ValueError(f"keep_batch={keep_batch!r}; give 'always', 'first' or 'never'.")
        check_num_chunks(num_chunks)
        self.collate_fn = collate_fn or default_collate
        self.num_chunks = num_chunks
        self.layout = dict(layout) if layout else None
        self.assignment = assignment
        self.min_points = min_points
        self.batch_sizes = batch_sizes
        self.keep_batch = keep_batch
        self._calls = 0  # in this process (each worker has its own copy)

    def __call__(self, samples: list[Any]) -> PreSplitBatch:
        batch = self.collate_fn(samples)
        chunks, plan = split_batch(
            batch,
            self.num_chunks,
            layout=self.layout,
            assignment=self.assignment,
            min_points=self.min_points,
            batch_sizes=self.batch_sizes,
        )
        for chunk in chunks:  # a whole-batch chunk's source tensor cannot cross processes; it is rebuilt
            for spec in _specs(chunk):
                spec.source = None
        keep = self.keep_batch == "always" or (self.keep_batch == "first" and self._calls == 0)
        self._calls += 1
        return PreSplitBatch(chunks, plan, as_specs(batch) if keep else None, inferred_batch_size(batch))


def presplit_loader(
    dataloader: Any, num_chunks: int, layout: Mapping[Any, str] | None, assignment: str | Assignment, min_points: int,
    module: Any = None, layouts: Any = None,
) -> Any:
    """A shallow copy of ``dataloader`` whose collate function is wrapped in :class:`PreSplitCollate`, when that
    helps and is safe; the user's DataLoader itself is never changed (after ``fit`` it yields what it yielded).

    Only a ``torch.utils.data.DataLoader`` with ``num_workers > 0`` whose collate function is not one already,
    and only when neither ``module`` (the LightningModule) nor its Trainer's datamodule overrides
    ``on_before_batch_transfer``, which must see the whole batch. Anything else is returned unchanged.
    Every batch keeps the collated batch (``keep_batch="always"``): the hooks receive it. ``layouts``, the strategy's
    held layouts among its split options, is not used: each worker process derives its batches' layouts.
    """
    datamodule = getattr(trainer_of(module), "datamodule", None) if module is not None else None
    if (
        isinstance(dataloader, DataLoader)
        and dataloader.num_workers > 0
        and not isinstance(dataloader.collate_fn, PreSplitCollate)
        and not (module is not None and is_overridden("on_before_batch_transfer", module))
        and not (datamodule is not None and is_overridden("on_before_batch_transfer", datamodule))
    ):
        loader = copy.copy(dataloader)  # DataLoader.__setattr__ is bypassed: the copy has the same settings
        loader.__dict__["_iterator"] = None  # a persistent-workers iterator stays the user's
        sizes = (dataloader.batch_size,) if dataloader.batch_size is not None else None  # this loader's own
        loader.collate_fn = PreSplitCollate(dataloader.collate_fn, num_chunks, layout, assignment, min_points, sizes)
        return loader
    return dataloader


def inferred_batch_size(batch: Any) -> int | None:
    """The batch size Lightning's ``self.log`` infers from the collated ``batch`` on one device (``extract_batch_size``:
    the first tensor's length), or ``None`` where it finds none (one device's ``self.log`` raises there); its warning
    about an ambiguous collection is not given here (in a worker process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return extract_batch_size(batch)
        except Exception:  # noqa: BLE001 - Lightning's MisconfigurationException or a RecursionError: none to give
            return None


def as_specs(batch: Any) -> Any:
    """``batch`` with each ``ME.SparseTensor`` / ``ME.TensorField`` as a whole-batch
    :class:`~lightning_sparse_dp.split.SparseSpec` (features, coordinates, constructor keywords), which can cross
    processes; :func:`~lightning_sparse_dp.step.scatter.build_specs` builds it again."""
    return apply_to_collection(batch, (ME.SparseTensor, ME.TensorField), lambda x: SparseSpec(
        type(x), x.F, x.C, sparse_kwargs(x), manager=id(x.coordinate_manager)))


def _specs(chunk: Any) -> list[SparseSpec]:
    leaves = pytree.tree_leaves(chunk, is_leaf=lambda x: isinstance(x, SparseSpec))
    return [x for x in leaves if isinstance(x, SparseSpec)]


__all__ = ["PreSplitBatch", "PreSplitCollate", "as_specs", "inferred_batch_size", "presplit_loader"]
