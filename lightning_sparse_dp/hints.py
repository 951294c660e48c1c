"""Hints: errors raised in replicas, re-raised with what they mean for data parallelism and the fix;
and the longer help that other errors carry as a note (their message keeps the cause and the fix).

A replica runs the user's step on a chunk of the batch, so some errors that the whole batch would
not raise come from the chunk being small. :func:`explain_replica_error` recognizes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.base import dataloader_iter_steps
from lightning_sparse_dp.split import SplitPlan

#: torch's message for batch norm in training mode over a single value per channel
#: (``torch.nn.functional._verify_batch_size``).
_ONE_VALUE = "Expected more than 1 value per channel when training"
_SAME_DEVICE = "Expected all tensors to be on the same device"  # torch, on mixing devices in one op


def _replica_of(err: BaseException) -> int | None:
    """The replica index from the note :mod:`lightning_sparse_dp.apply` adds (``raised in replica i ...``)."""
    for note in getattr(err, "__notes__", ()):
        found = re.search(r"replica (\d+)", note)
        if found:
            return int(found.group(1))
    return None


def explain_replica_error(err: BaseException, plan: SplitPlan) -> BaseException:
    """``err``, or a new exception of the same type that says what it means and how to fix it.

    Recognized: batch norm over one value per channel in training mode (a chunk of one sample with
    one point, or fewer points than the network's strides leave more than one of). The new
    exception names the replica's chunk (samples and points) and the fixes: ``sync_batchnorm=True``
    (normalizes over the whole batch, as one device does), fewer devices, or ``drop_last=True`` /
    no tiny samples; its ``__cause__`` is ``err``. Also torch's "Expected all tensors to be on the same
    device" in a replica (GPUs): most often a tensor kept as a plain attribute of the module, which every
    replica shares as it is, on the root device (as ``nn.DataParallel``'s replicas do); the new exception says
    so and names the fixes. An index out of range (:func:`_is_index_error`) in a batch with tensors cut as one row per
    point gets a note naming them and the ``layout`` role ``"indices"``, which row indices into a point set need.
    """
    if isinstance(err, RuntimeError) and _SAME_DEVICE in str(err):
        return _with_cause(RuntimeError(
            f"{err} — in a sparse_dp replica, whose module and chunk are on its own device. A tensor kept as a plain "
            "attribute (self.x = tensor) is shared by every replica as it is, on the root device: register it as a "
            "buffer (self.register_buffer('x', tensor), copied to each replica's device), or make it in the step "
            "on the input's device."
        ), err)
    if _is_index_error(err) and plan.point_targets:
        names = list(plan.point_targets)
        note = (
            f"sparse_dp: {', '.join(names)} {'was' if len(names) == 1 else 'were'} cut as one row per point (each "
            "chunk got its own points' rows). If one holds row indices into a point set, a chunk's rows are not the "
            f"batch's: give it the role 'indices' in the strategy's layout= (e.g. {{{names[0]!r}: 'indices'}}), which "
            "cuts it with its samples and re-bases it to the chunk's rows."
        )
        if note not in getattr(err, "__notes__", ()):
            err.add_note(note)
        return err
    if not (isinstance(err, ValueError) and _ONE_VALUE in str(err)):
        return err
    replica = _replica_of(err)
    if replica is not None and replica < plan.num_chunks:
        where = (
            f"replica {replica}'s chunk has {plan.samples_per_chunk[replica]} sample(s) and "
            f"{plan.points_per_chunk[replica]} point(s)"
        )
    else:
        where = f"a replica's chunk is too small (points per chunk: {plan.points_per_chunk})"
    new = ValueError(
        f"{err} — {where} of the batch's {plan.num_samples} samples: batch norm without sync_batchnorm normalizes "
        "each replica's chunk alone, and this chunk leaves one value per channel. The whole batch would train on "
        "one device. Fix: Trainer(sync_batchnorm=True) (batch norm over the whole batch, as on one device), fewer "
        "devices, or drop_last=True / a batch size that does not leave a short last batch, or no samples of a "
        "single point."
    )
    return _with_cause(new, err)


def _is_index_error(err: BaseException) -> bool:
    """An index out of range in the step (Python's ``IndexError``, torch's "index ... is out of bounds")."""
    return isinstance(err, IndexError) or (isinstance(err, RuntimeError) and "out of bounds" in str(err))


def _with_cause(new: BaseException, err: BaseException) -> BaseException:
    new.__cause__ = err
    for note in getattr(err, "__notes__", ()):
        new.add_note(note)
    return new


def min_points_per_chunk(module: nn.Module, synchronized: bool, batch_norm: bool | None = None) -> int:
    """The fewest points a replica's chunk should get: 2 when ``module`` has batch norm that each
    replica runs on its own chunk (``synchronized`` False), else 1. ``batch_norm``: whether it has, when known
    already (the strategy's replicas note it when they are built), else ``module``'s submodules are looked through.

    Batch norm in training mode needs more than one value per channel (torch raises otherwise), so a
    chunk of one point, e.g. the short last batch holding a one-point sample, is avoided when the
    batch allows (:func:`~lightning_sparse_dp.split.split_batch`'s ``min_points``). Strided layers
    can still leave a chunk one value; :func:`explain_replica_error` names the fix then.
    """
    if synchronized:
        return 1
    return 2 if (has_batch_norm(module.modules()) if batch_norm is None else batch_norm) else 1


def has_batch_norm(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` is a batch-norm layer (``torch.nn.modules.batchnorm._BatchNorm``: torch's and ME's,
    whose ``MinkowskiBatchNorm`` holds one)."""
    return any(isinstance(m, _BatchNorm) for m in modules)


def refuse_dataloader_iter(module: nn.Module) -> None:
    """``sparse_dp`` at setup: a step written as ``step(self, dataloader_iter)`` cannot be split before it runs.

    Raises:
        MisconfigurationException: naming the steps, how to write them, and ``sparse_ddp``, which runs them.
    """
    iterating = dataloader_iter_steps(module)
    if iterating:
        raise MisconfigurationException(
            f"sparse_dp does not support {', '.join(iterating)}(self, dataloader_iter): it splits each batch before the "
            "step runs, and such a step fetches its batches itself. Write the step as step(self, batch, batch_idx), or "
            "use strategy='sparse_ddp', which runs such steps as DDP does."
        )


def warn_unsynchronized_batchnorm(module: nn.Module, replicas: int = 2, strategy: str = "sparse_dp") -> None:
    """At setup without ``sync_batchnorm``, with ``replicas`` replicas (``sparse_dp``) or ranks (``sparse_ddp``) of two
    or more: say once that batch norm runs per chunk. SyncBatchNorm layers (``ME.MinkowskiSyncBatchNorm``), which
    the user meant to synchronize, as a warning, from ``sparse_dp`` only (``sparse_ddp`` says its own); plain batch
    norm (torch's ``BatchNorm1d/2d/3d``, so ``ME.MinkowskiBatchNorm``'s inner ``bn``; the kinds both strategies
    synchronize) as one info line naming the layers' count and the fix, as its statistics are each chunk's, not the
    whole batch's one device computes."""
    if replicas < 2:
        return
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    if strategy == "sparse_dp" and any(isinstance(m, nn.SyncBatchNorm) for m in layers):
        rank_zero_warn(
            "sparse_dp: the model has SyncBatchNorm layers (e.g. ME.MinkowskiSyncBatchNorm) but sync_batchnorm is off: "
            "in one process they run as plain batch norm on each replica's chunk. Pass Trainer(sync_batchnorm=True) to "
            "synchronize them across sparse_dp replicas."
        )
        return
    plain = [m for m in layers if not isinstance(m, nn.SyncBatchNorm)]
    if plain:
        what = "replica" if strategy == "sparse_dp" else "rank"
        rank_zero_info(
            f"{strategy}: {len(plain)} batch-norm layer{'s' if len(plain) > 1 else ''} (e.g. ME.MinkowskiBatchNorm) "
            f"normalize each {what}'s chunk with its own statistics, not the whole batch's as on one device; pass "
            "Trainer(sync_batchnorm=True) to synchronize them."
        )


__all__ = [
    "explain_replica_error", "has_batch_norm", "min_points_per_chunk", "refuse_dataloader_iter",
    "warn_unsynchronized_batchnorm",
]
