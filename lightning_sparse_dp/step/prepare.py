"""Prepare: the batch at Lightning's ``batch_to_device``, the place where its loops move a batch.

Lightning's loops call ``Strategy.batch_to_device`` after ``on_before_batch_transfer`` and before the
``on_*_batch_start`` hooks, and hand what it returns to every hook and callback that receives ``batch`` and to the step
(``loops/training_epoch_loop.py``, ``evaluation_loop.py``, ``prediction_loop.py``). :func:`prepare_batch` gives both:

- :attr:`PreparedBatch.batch`, what the hooks see: the user's collated batch, as on one device (a batch split in the
  DataLoader's workers, :class:`~lightning_sparse_dp.split.presplit.PreSplitBatch`, gives the collated batch it kept,
  its ME tensors built again on the CPU, where the collate function built them); with one device, the batch after the
  transfer hooks, as plain Lightning's;
- :attr:`PreparedBatch.source`, what the step splits. Where the module or its datamodule overrides a batch-transfer
  hook (``transfer_batch_to_device``, ``on_after_batch_transfer``, in its class or set on the instance), the batch is
  split here and the hooks run here on each chunk with its device, through Lightning's own
  ``LightningModule._apply_batch_transfer_handler`` (its datamodule rule, profiler action and ``self.log`` refusal), as
  each DDP rank runs them on its batch: the step then takes the chunks as they are (:class:`PlacedChunks`). Otherwise
  the default hooks only move tensors (``move_data_to_device``), and the step cuts and places each chunk in its
  replica's thread (``prepare_in_threads``).

The strategy keeps the last prepared batch and its step takes it when given the batch it returned; a step driven by
hand (outside Lightning's loops) prepares its batch itself, the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_sparse_dp.runtime.compat import apply_batch_transfer, trainer_of
from lightning_sparse_dp.runtime.process import SAID_ONCE as _cache
from lightning_sparse_dp.split import SparseSpec, SplitPlan
from lightning_sparse_dp.split.presplit import PreSplitBatch
from lightning_sparse_dp.step.scatter import (
    Transfer,
    batch_transfer,
    build_sparse,
    me_tensors_elsewhere,
    place_chunks,
    transfer_hooks_overridden,
)


@dataclass(eq=False)
class PlacedChunks:
    """Chunks already placed on their devices (chunk ``i`` on device ``i``, the transfer hooks run on each) and the
    split's plan: the step's scatter takes them as they are."""

    chunks: list[Any]
    plan: SplitPlan
    marks: list[tuple[int, int]] | None = None  # the hooks' batch's tensors when cut: (id, version) each

    def changed_since(self, batch: Any) -> bool:
        """Whether ``batch`` (the hooks' batch, which the step is given) holds other tensors, or tensors changed in
        place, than when the chunks were cut: an ``on_*_batch_start`` hook changed it after the cut."""
        return self.marks is not None and _tensor_marks(batch) != self.marks


def _tensor_marks(batch: Any) -> list[tuple[int, int]]:
    marks: list[tuple[int, int]] = []
    # an inference tensor (made under Lightning's inference mode in evaluation) has no version counter: 0, as it
    # cannot be changed in place outside that mode
    apply_to_collection(batch, torch.Tensor, lambda t: marks.append((id(t), 0 if t.is_inference() else t._version)))
    return marks


def say_changed_after_cut(step_name: str) -> None:
    """Once per process: the hooks' batch changed after the chunks were cut (:meth:`PlacedChunks.changed_since`)."""
    hook = f"on_{step_name.removesuffix('_step').replace('training', 'train')}_batch_start"
    _cache.warn(
        f"sparse_dp: the batch given to {step_name} was changed after the module's own batch-transfer hooks ran (e.g. "
        f"in {hook}): with those hooks, the replicas' chunks are cut and moved before {hook}, so the step's chunks "
        "do not have that change, where one device's step does. Make the change in on_before_batch_transfer (the "
        "whole batch) or on_after_batch_transfer (each chunk), or in the step itself."
    )


@dataclass(eq=False)
class PreparedBatch:
    """One batch as Lightning's ``batch_to_device`` leaves it for ``sparse_dp``.

    Attributes:
        batch: what the hooks and callbacks receive (see the module's docstring).
        source: what the step splits: the batch, a PreSplitBatch, or :class:`PlacedChunks`.
        whole: with one device, the batch for the module's own step (on the device, the transfer hooks run); ``None``
            when the step takes the replica path.
    """

    batch: Any
    source: Any
    whole: Any = None
    marks: list[tuple[int, int]] | None = None  # a PreSplitBatch's: the hooks' batch's tensors when prepared

    def split_source(self, batch: Any) -> Any:
        """What the step splits, given ``batch``, the hooks' batch the step got: the DataLoader workers' chunks, unless
        an ``on_*_batch_start`` hook changed that batch since (other tensors, or tensors changed in place), which the
        chunks cut in the workers do not have: then ``batch`` itself, split in the step as one device's step gets it."""
        if self.marks is not None and _tensor_marks(batch) != self.marks:
            return batch
        return self.source


def lightning_transfer(module: Any, dataloader_idx: int) -> Transfer:
    """The batch-transfer hooks for ``module`` as Lightning calls them: through the module's
    ``_apply_batch_transfer_handler`` (Lightning's hook machinery: datamodule first, profiler, ``self.log`` refused)
    when ``module`` is its Trainer's module; else (a copy of it, e.g. the exactness check's) each hook called directly
    (:func:`~lightning_sparse_dp.step.scatter.batch_transfer`)."""
    trainer = trainer_of(module)
    if trainer is not None and trainer.lightning_module is module:
        return lambda chunk, device: apply_batch_transfer(module, chunk, device, dataloader_idx)
    return batch_transfer(module, dataloader_idx)


def collated(batch: Any) -> Any:
    """The collated batch the hooks see: a PreSplitBatch's kept batch, its ME tensors built on the CPU (where the
    collate function built them), else ``batch`` itself (a PreSplitBatch that kept none, from a
    ``PreSplitCollate(keep_batch=...)`` of the user's own, stays as it is)."""
    if isinstance(batch, PreSplitBatch) and batch.batch is not None:
        return apply_to_collection(batch.batch, SparseSpec, build_sparse, device=torch.device("cpu"))
    return batch


def prepare_batch(
    batch: Any,
    module: Any,
    devices: Sequence[torch.device],
    dataloader_idx: int,
    split: Callable[[Any], tuple[list[Callable[[], Any]], SplitPlan]],
    one_device: bool,
) -> PreparedBatch:
    """``batch`` prepared for the hooks and the step (the module's docstring).

    Args:
        batch: what ``on_before_batch_transfer`` returned (a collated batch or a PreSplitBatch).
        module: the LightningModule whose hooks run.
        devices: the replicas' devices (root first).
        dataloader_idx: the batch's DataLoader index, passed to the hooks.
        split: ``split(batch) -> (cutters, plan)``, the strategy's split (its ``step_cutters``).
        one_device: one device and nothing to split (no ``split_fn``): the module's own step runs.

    Raises:
        ValueError / BatchLayoutError: from ``split`` (a batch it cannot read; more chunks than devices).
    """
    if type(batch) in (dict, list, tuple) and any(
        isinstance(v, PreSplitBatch) for v in (batch.values() if isinstance(batch, dict) else batch)
    ):  # a CombinedLoader's batch of several loaders' ("max_size_cycle"), each split in its workers: split as one
        batch = apply_to_collection(batch, PreSplitBatch, collated)
    hooks_batch = collated(batch) if isinstance(batch, PreSplitBatch) else batch
    if one_device and not isinstance(batch, PreSplitBatch) and not me_tensors_elsewhere(batch, devices[0]):
        whole = lightning_transfer(module, dataloader_idx)(batch, devices[0])  # plain Lightning's batch_to_device
        return PreparedBatch(batch=whole, source=None, whole=whole)
    if not transfer_hooks_overridden(module):  # cut and placed in the step (in the replicas' threads)
        kept = isinstance(batch, PreSplitBatch) and hooks_batch is not batch
        return PreparedBatch(batch=hooks_batch, source=batch, marks=_tensor_marks(hooks_batch) if kept else None)
    _cache.info(  # what the hooks' batch is, once per process (WarningCache): the transfer hooks' changes are the chunks'
        "sparse_dp: the module's (or its datamodule's) own batch-transfer hooks (transfer_batch_to_device, "
        "on_after_batch_transfer) run on each replica's chunk, as on each DDP rank's batch; the hooks and callbacks "
        "that receive the batch (on_*_batch_start / _end, a BasePredictionWriter) get the collated batch before "
        "them, as the DataLoader returned it, so what on_after_batch_transfer adds or changes is in the step's "
        "chunks only. Return it from the step (the outputs reach those hooks in the batch's order), or do it in "
        "on_before_batch_transfer, which runs on the whole batch."
    )
    cutters, plan = split(batch)
    chunks = place_chunks([cut() for cut in cutters], devices, lightning_transfer(module, dataloader_idx))
    return PreparedBatch(batch=hooks_batch, source=PlacedChunks(chunks, plan, _tensor_marks(hooks_batch)))


__all__ = ["PlacedChunks", "PreparedBatch", "collated", "lightning_transfer", "prepare_batch", "say_changed_after_cut"]
