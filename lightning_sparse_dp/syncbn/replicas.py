"""Replicas: the step's batch-norm group, which joins the replicas' synchronized layers for one ``sparse_dp`` step.

It holds :func:`sync_layers` (a replica's :class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm` layers)
and :func:`synchronized` (those layers of every replica made one
:class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` for the step).

The math is :mod:`lightning_sparse_dp.syncbn._functions` (forward statistics combined with Chan et al.'s
formula, backward gradient terms ``sum(dy)`` / ``sum(dy * (x - mean))`` exchanged as
``torch.nn.SyncBatchNorm`` all-reduces them); the transport is a
:class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` of the step's replica threads.
``torch.nn.SyncBatchNorm`` (and ``ME.MinkowskiSyncBatchNorm``, which wraps it) synchronizes only
through a ``torch.distributed`` process group and in one process silently runs plain batch norm,
hence this.

Every step with several replicas gets a new group: :func:`synchronized` gives replica ``r``'s
layers the group's rank-``r`` member, and lets only the root replica's layers (which share the
module's buffers) update the running statistics, once per step, with the global ones. The step's
forward is the group's first phase, the replicas' backward passes (run in their own threads by
:mod:`lightning_sparse_dp.step.backward`) its second. A replica that raises aborts the group, so the
others stop at once with :class:`~lightning_sparse_dp.syncbn.collective.ReplicaAborted`; a replica that
runs fewer batch-norm layers than another (data-dependent control flow) aborts it with an error
naming the call counts. Eval mode uses the running statistics and never synchronizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm
from lightning_sparse_dp.syncbn.collective import ThreadGroup


def sync_layers(module: nn.Module) -> list[SyncBatchNorm]:
    """The :class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm` layers of ``module``, in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, SyncBatchNorm)]


@contextmanager
def synchronized(layers: Sequence[Sequence[SyncBatchNorm]]) -> Iterator[ThreadGroup | None]:
    """For the ``with`` body (the replicas' step), the synchronized layers of the step's replicas are one group.

    Replica ``r``'s layers get the group's rank-``r`` member, and only the root replica's layers (which
    share the module's buffers) update the running statistics. The membership outlives a body that
    ends normally: the replicas' backward passes are the group's second phase (the group is handed to
    :mod:`lightning_sparse_dp.step.backward`, and activation checkpointing re-runs the forward then), and the
    next step's group replaces it. A body that raises detaches the layers (a replica that raised has
    already aborted the group: :meth:`~lightning_sparse_dp.syncbn.collective.ThreadGroup.run`).

    Args:
        layers: ``layers[r]``: replica ``r``'s synchronized layers (:func:`sync_layers`), one list per
            replica taking part in the step.

    Yields:
        the group, or ``None`` when there is one replica or no such layer (plain batch norm is exact then).
    """
    if len(layers) < 2 or not layers[0]:
        yield None
        return
    group = ThreadGroup(len(layers))
    for rank, replica_layers in enumerate(layers):
        member = group.member(rank)
        for layer in replica_layers:
            layer.collective = member
            layer.update_running_stats = rank == 0
    try:
        yield group
    except BaseException:
        for replica_layers in layers:
            for layer in replica_layers:
                layer.collective, layer.update_running_stats = None, True
        raise


__all__ = ["sync_layers", "synchronized"]
