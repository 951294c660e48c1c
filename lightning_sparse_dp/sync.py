"""Sync: batch norm whose statistics are reduced across the replicas of one step.

``torch.nn.SyncBatchNorm`` (and ``ME.MinkowskiSyncBatchNorm``, which wraps it) synchronizes only
through a ``torch.distributed`` process group; in one process it silently runs plain batch norm. Here
the replicas are threads of one process, so they exchange statistics through a :class:`SyncGroup`:

Forward (training mode). Replica ``r`` computes, per channel, its count ``n_r``, mean ``m_r`` and
sum of squared deviations ``M2_r`` over every dimension but the channel one; once every replica
has given them, replica 0 combines them, for all, with Chan et al.'s parallel formula
(``N = sum n_r``, ``mean = sum n_r m_r / N``, ``M2 = sum M2_r + n_r (m_r - mean)^2``; T. F. Chan,
G. H. Golub, R. J. LeVeque, "Updating formulae and a pairwise algorithm for computing sample
variances", 1979), normalizes with the biased variance ``M2 / N`` as ``torch.nn.functional.batch_norm``
does, and the root replica updates the running statistics once, with the global mean and the
unbiased variance ``M2 / (N - 1)``, by the layer's momentum (or the cumulative average when
``momentum=None``), as ``torch.nn.modules.batchnorm._BatchNorm`` does.

Backward. The combination is one autograd node over every replica's statistics, so the single
backward pass of the gathered loss carries the gradient terms of the global mean and variance back
into every replica (the ``sum(dy)`` and ``sum(dy * x_hat)`` terms that ``SyncBatchNorm``
all-reduces), adding the replicas' gradients in replica order; no synchronization is needed in
backward.

Failure. A replica that raises aborts the group, so replicas waiting in a batch-norm layer stop at
once with :class:`ReplicaAborted`; a replica that finishes its step while others wait in a later
batch-norm call (data-dependent control flow) aborts it with an error naming the call counts.
Eval mode uses the running statistics and never synchronizes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.apply import ReplicaAborted

T = TypeVar("T")


class SyncGroup:
    """The replicas of one step, exchanging batch-norm statistics.

    Args:
        world_size: the number of replicas taking part (ranks ``0..world_size-1``).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._cond = threading.Condition()
        self._slots: dict[int, list[Any]] = {}
        self._results: dict[int, Any] = {}
        self._arrived: dict[int, int] = {}
        self._calls = [0] * world_size
        self._finished: dict[int, int] = {}
        self._error: str | None = None

    def exchange(self, rank: int, value: Any, combine: Callable[[list[Any]], Any], tag: Any = None) -> Any:
        """Give ``value`` for this rank's next collective call and get ``combine(values of every rank)``.

        Blocks until every rank has made the same call; rank 0 then calls ``combine`` once, with the
        values in rank order, and every rank gets its result. ``tag`` (e.g. the layer) must be the
        same on every rank for the same call.

        Raises:
            ReplicaAborted: another replica raised, finished its step before making this call, or
                made this call from another layer (``tag`` differs).
        """
        with self._cond:
            call = self._calls[rank]
            self._calls[rank] += 1
            slots = self._slots.setdefault(call, [None] * self.world_size)
            slots[rank] = (tag, value)
            self._arrived[call] = self._arrived.get(call, 0) + 1
            self._check_finished()
            complete = self._arrived[call] == self.world_size
            if complete and self._error is None and len({id(t) for t, _ in slots}) > 1:
                self._error = (
                    f"the replicas reached batch-norm call #{call} in different layers; sync batch norm needs every "
                    "replica to run the same batch-norm layers in the same order"
                )
            self._cond.notify_all()
            if rank == 0:  # always rank 0: the autograd node it creates comes from the same thread every run
                while self._error is None and self._arrived[call] < self.world_size:
                    self._cond.wait()
                if self._error is None:
                    try:
                        self._results[call] = combine([v for _, v in slots])
                    except BaseException as err:
                        self._error = f"combining the statistics of call #{call} failed: {type(err).__name__}: {err}"
                        raise
                    finally:
                        self._cond.notify_all()
            while self._error is None and call not in self._results:
                self._cond.wait()
            if self._error is not None:
                raise ReplicaAborted(f"sync batch norm stopped: {self._error}.")
            return self._results[call]

    def _check_finished(self) -> None:
        for rank, calls in self._finished.items():
            waiting = [c for c, n in self._arrived.items() if c >= calls and n < self.world_size]
            if waiting and self._error is None:
                self._error = (
                    f"replica {rank} finished its step after {calls} batch-norm call(s) while other replicas wait in call "
                    f"#{min(waiting)}; the replicas reach different numbers of batch-norm calls (data-dependent control "
                    "flow), which sync batch norm cannot pair up. Make every replica run the same batch-norm layers, or "
                    "train without sync_batchnorm"
                )
                self._cond.notify_all()

    def finish(self, rank: int) -> None:
        """Mark ``rank``'s step as done (normally or not); wakes replicas that wait for it in vain."""
        with self._cond:
            self._finished[rank] = self._calls[rank]
            self._check_finished()

    def abort(self, rank: int, error: BaseException) -> None:
        """Stop every waiting and future call: replica ``rank`` raised ``error``."""
        with self._cond:
            if self._error is None:
                self._error = f"replica {rank} raised {type(error).__name__}: {error}"
            self._cond.notify_all()

    def run(self, rank: int, fn: Callable[[], T]) -> T:
        """Call ``fn()`` as replica ``rank``: abort the group if it raises, finish it either way."""
        try:
            return fn()
        except BaseException as err:
            if not isinstance(err, ReplicaAborted):
                self.abort(rank, err)
            raise
        finally:
            self.finish(rank)


@dataclass
class _Membership:
    group: SyncGroup
    rank: int
    root: ReplicaSyncBatchNorm  # the root module's layer, whose running statistics are updated


class ReplicaSyncBatchNorm(_BatchNorm):
    """Batch norm synchronized across the replicas of a ``sparse_dp`` step (see the module docstring).

    Input ``[N, C]`` or ``[N, C, *]`` (ME's batch norm passes the features ``[N, C]``). Outside a
    step with several replicas it is ``torch.nn.BatchNorm`` exactly. Made by :func:`convert_sync_batchnorm`,
    sharing the parameters and buffers of the layer it replaces, so state-dict keys and values stay.
    """

    _membership: _Membership | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input [N, C] or [N, C, *], got shape {tuple(input.shape)}")

    def forward(self, input: Tensor) -> Tensor:
        membership = self._membership
        if membership is None or not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        group, rank = membership.group, membership.rank
        x = input if input.dtype == torch.float64 else input.float()  # float64 stays float64
        count = x.numel() // x.shape[1]
        local_mean, local_m2 = _LocalStats.apply(x)
        mean, m2, total = group.exchange(rank, (count, local_mean, local_m2), _combine, tag=membership.root)[rank]
        var = m2 / total
        if rank == 0 and self.track_running_stats:
            membership.root._update_running_stats(mean.detach(), (m2 / (total - 1)).detach())
        y = (x - _expand(mean, x)) * _expand(torch.rsqrt(var + self.eps), x)
        if self.affine:
            y = y * _expand(self.weight, x) + _expand(self.bias, x)
        return y.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, unbiased_var: Tensor) -> None:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var), alpha=factor)


def _combine(stats: list[tuple[int, Tensor, Tensor]]) -> list[tuple[Tensor, Tensor, int]]:
    """Every replica's ``(count, mean, M2)`` -> for each replica, ``(global mean, global M2, N)`` on its device.

    Raises:
        ValueError: fewer than 2 values per channel in all (as ``torch.nn.functional.batch_norm``).
    """
    counts = tuple(n for n, _, _ in stats)
    total = sum(counts)
    if total < 2:
        raise ValueError(f"expected more than 1 value per channel across all replicas when training, got {total}")
    devices = tuple(m.device for _, m, _ in stats)
    tensors = [m for _, m, _ in stats] + [q for _, _, q in stats]
    out = _CombineStats.apply(counts, devices, *tensors)
    return [(out[2 * r], out[2 * r + 1], total) for r in range(len(stats))]


class _LocalStats(torch.autograd.Function):
    """Per-channel mean and M2 (sum of squared deviations) of ``x`` ``[n, C, *]``, as one autograd node.

    Backward: ``dx = g_mean / n + 2 * g_M2 * (x - mean)`` (the term through the mean vanishes
    because deviations sum to zero). One node keeps ``x`` to two users in the layer (this and the
    normalization), and a sum of two gradients does not depend on their order.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor):
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        mean = x.mean(dim=dims)
        m2 = ((x - _expand(mean, x)) ** 2).sum(dim=dims)
        ctx.save_for_backward(x, mean)
        ctx.n = n
        return mean, m2

    @staticmethod
    def backward(ctx: Any, g_mean: Tensor | None, g_m2: Tensor | None):
        x, mean = ctx.saved_tensors
        grad = torch.zeros_like(x)
        if g_mean is not None:
            grad = grad + _expand(g_mean, x) / ctx.n
        if g_m2 is not None:
            grad = grad + 2 * _expand(g_m2, x) * (x - _expand(mean, x))
        return grad


def _chan(counts: tuple[int, ...], means: list[Tensor], m2s: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """Chan et al.'s parallel mean and M2 over the replicas, in replica order, on ``device``."""
    total = sum(counts)
    mean = sum(n * m.to(device) for n, m in zip(counts, means)) / total
    m2 = sum(q.to(device) + n * (m.to(device) - mean) ** 2 for n, m, q in zip(counts, means, m2s))
    return mean, m2


class _CombineStats(torch.autograd.Function):
    """Global ``(mean, M2)`` from the replicas' local ones, one copy per replica.

    One node for all replicas: its backward gets every replica's gradient at once and adds them in
    replica order, so the result does not depend on the order of the backward pass (a tensor used
    by several replicas would collect their gradients in whatever order autograd runs them). The
    backward is written out (no reentrant autograd), for the same reason.
    """

    @staticmethod
    def forward(ctx: Any, counts: tuple[int, ...], devices: tuple[torch.device, ...], *tensors: Tensor):
        ctx.counts, ctx.devices = counts, devices
        k = len(counts)
        mean, m2 = _chan(counts, list(tensors[:k]), list(tensors[k:]), devices[0])
        ctx.save_for_backward(*tensors[:k], mean)  # the local means and the global mean
        # a distinct tensor per replica (``.to`` to the same device would return the same one), so each
        # output has one user and its gradient slot is that replica's alone
        return tuple(t for d in devices for t in (mean.to(d, copy=True), m2.to(d, copy=True)))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None):
        # mean = sum n_r m_r / N and M2 = sum q_r + n_r (m_r - mean)^2, so (as sum n_r (m_r - mean) = 0)
        # dmean/dm_r = n_r / N, dM2/dm_r = 2 n_r (m_r - mean), dM2/dq_r = 1
        home = ctx.devices[0]
        *local_means, mean = ctx.saved_tensors
        total = sum(ctx.counts)

        def added(start: int) -> Tensor | None:
            parts = [g.to(home) for g in grads[start::2] if g is not None]
            return sum(parts[1:], parts[0]) if parts else None

        g_mean, g_m2 = added(0), added(1)
        grad_means, grad_m2s = [], []
        for n, original in zip(ctx.counts, local_means):
            m = original.to(home)
            g = torch.zeros_like(m)
            if g_mean is not None:
                g = g + g_mean * (n / total)
            if g_m2 is not None:
                g = g + g_m2 * (2 * n) * (m - mean)
            grad_means.append(g.to(original.device))
            grad_m2s.append(None if g_m2 is None else g_m2.to(original.device))
        return (None, None, *grad_means, *grad_m2s)


def _expand(v: Tensor, like: Tensor) -> Tensor:
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


#: The layers :func:`convert_sync_batchnorm` swaps: torch's BatchNorm1d/2d/3d and SyncBatchNorm, which
#: includes the ``bn`` inside ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``.
SWAPPED_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def convert_sync_batchnorm(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap every batch-norm layer in ``module`` for a :class:`ReplicaSyncBatchNorm`, in place.

    The new layer shares the old one's ``weight``, ``bias`` and running-statistic buffers (same
    tensors), so the state dict keeps its keys and values and the optimizer its parameters.

    Returns:
        ``(parent, name, original)`` for every swap, for :func:`revert_sync_batchnorm`.
    """
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, SWAPPED_TYPES) and not isinstance(child, ReplicaSyncBatchNorm):
                new = ReplicaSyncBatchNorm.__new__(ReplicaSyncBatchNorm)
                nn.Module.__init__(new)
                for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
                    setattr(new, attr, getattr(child, attr))
                new._parameters = child._parameters  # the same Parameter objects
                new._buffers = child._buffers  # the same running-statistic tensors
                new.train(child.training)
                parent._modules[name] = new
                swaps.append((parent, name, child))
    return swaps


def revert_sync_batchnorm(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put the original layers back (they share every tensor, so they hold the trained values)."""
    for parent, name, original in reversed(swaps):
        current = parent._modules[name]
        original.train(current.training)
        parent._modules[name] = original


def join_replicas(root: nn.Module, replicas: list[nn.Module]) -> SyncGroup | None:
    """Make the :class:`ReplicaSyncBatchNorm` layers of ``replicas`` one group for this step.

    Returns:
        the group, or ``None`` when there is one replica or no such layer (plain batch norm is exact then).
    """
    layers = [m for m in root.modules() if isinstance(m, ReplicaSyncBatchNorm)]
    if len(replicas) < 2 or not layers:
        return None
    group = SyncGroup(len(replicas))
    for rank, replica in enumerate(replicas):
        for root_layer, layer in zip(root.modules(), replica.modules(), strict=True):
            if isinstance(root_layer, ReplicaSyncBatchNorm):
                layer._membership = _Membership(group, rank, root_layer)
    return group


__all__ = [
    "ReplicaSyncBatchNorm",
    "SWAPPED_TYPES",
    "SyncGroup",
    "convert_sync_batchnorm",
    "join_replicas",
    "revert_sync_batchnorm",
]
