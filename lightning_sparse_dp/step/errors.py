"""Errors: errors raised in replicas, explained with what they mean for data parallelism and the fix.

A replica runs the user's step on a chunk of the batch, so some errors that the whole batch would not raise come from
the chunk being small, or from its own device. :func:`explain_replica_error` recognizes them and re-raises them with
what they mean and the fix (a new exception of the same type, whose ``__cause__`` is the original): batch norm over one
value per channel (the replica's chunk named, its samples and points, from the replica index in the note its thread
adds), torch's "Expected all tensors to be on the same device" (a tensor every replica shares, on the root device) and
MinkowskiEngine's assertion on a tensor whose every sample has a single point (a chunk of such samples).
Other errors are raised as they are, with the longer help as a note (their message keeps the cause and the fix): an
index out of range in a batch with tensors cut as one row per point gets a note naming them and the ``layout`` role
``"indices"``, which row indices into a point set need.
"""

from __future__ import annotations

import re

from lightning_sparse_dp.split import SplitPlan

#: torch's message for batch norm in training mode over a single value per channel
#: (``torch.nn.functional._verify_batch_size``).
_ONE_VALUE = "Expected more than 1 value per channel when training"


_SAME_DEVICE = "Expected all tensors to be on the same device"  # torch, on mixing devices in one op

#: MinkowskiEngine 0.5.4's origin map (``decomposed_features``, global pooling) on a tensor whose every sample has a
#: single point (``coordinate_map_cpu.hpp``: ``in_size > out_size``, where equal sizes are valid); the project's build
#: takes it (scripts/minkowski_patches/15-cpu-origin-map-one-point-samples.patch), a stock ME raises it
_ONE_POINT_SAMPLES = "assertion (in_size > out_size) failed"


def _replica_of(err: BaseException) -> int | None:
    """The replica index from the note :mod:`lightning_sparse_dp.runtime.executor` adds (``raised in replica i ...``)."""
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
    if isinstance(err, RuntimeError) and _ONE_POINT_SAMPLES in str(err):
        replica = _replica_of(err)
        chunk = (f"replica {replica}'s chunk has {plan.samples_per_chunk[replica]} sample(s) and "
                 f"{plan.points_per_chunk[replica]} point(s)" if replica is not None and replica < plan.num_chunks else
                 f"a replica's chunk holds only samples of one point (points per chunk: {plan.points_per_chunk})")
        return _with_cause(RuntimeError(
            f"{err} — {chunk}: MinkowskiEngine 0.5.4 as released builds no origin map (decomposed_features, global "
            "pooling) for a tensor whose every sample has a single point, which the whole batch, with more points "
            "than samples, is not. Fix: install the MinkowskiEngine build of lightning-sparse-dp (bash "
            "scripts/setup.sh; patch 15 takes such tensors), or drop samples of a single point (in the Dataset or the "
            "collate function), or train on fewer devices so that no chunk holds only such samples."
        ), err)
    if _is_index_error(err) and plan.point_targets:
        names = list(plan.point_targets)
        note = (
            f"sparse_dp: {', '.join(names)} {'was' if len(names) == 1 else 'were'} cut as one row per point (each "
            "chunk got its own points' rows). If one holds row indices into a point set, a chunk's rows are not the "
            f"batch's: give it the role 'indices' in the strategy's layout= (e.g. {{{names[0]!r}: 'indices'}}), which "
            "cuts it with its samples and re-bases it to the chunk's rows; if it holds each point's sample id (a batch "
            f"vector, coordinates[:, 0]), the role 'indices:batch' (e.g. {{{names[0]!r}: 'indices:batch'}}) renumbers "
            "it to the chunk's samples."
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


__all__ = ["explain_replica_error"]
