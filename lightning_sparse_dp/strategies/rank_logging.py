"""Rank logging: ``sparse_ddp``'s reduction of the values a step logs with ``sync_dist=True``, as one device's.

A mixin of :class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy` (it reads the strategy's step
state: its capture, its share's count, its site memory, its warnings). Lightning reduces a ``sync_dist`` value with
``strategy.reduce``; here a mean is the global batch's value, every rank's part in one gather
(:mod:`~lightning_sparse_dp.ddp.logged_means`): a combination of captured losses exactly, a mean the step computed
weighted by its element counts, else weighted like the loss. Values held for the step's end (sums, maxima, means
whose weights are known after the step) are settled there (:meth:`RankLogging._settle`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_sparse_dp.ddp.logged_means import HeldMeans, Row, rank_row, settle, whole_value
from lightning_sparse_dp.loss.decide import ChunkShape
from lightning_sparse_dp.loss.means import MEAN_NAMES


class RankLogging:
    """``reduce`` of :class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy` and the settling of a step's
    held means (see the module docstring)."""

    _settling: bool
    _count: float | None
    _collectives: Any
    _capture: Any
    _memory: Any
    _warning_cache: Any
    _constant_sizes: Any
    loss_weighting: Any
    _gather: Any  # every rank's object, in rank order (one all-gather)
    _step_plan: Any  # this rank's share as a SplitPlan
    _summary: Any  # this rank's summary of a logged value

    @override
    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: Any = "mean") -> Tensor | Any:
        """As ``DDPStrategy.reduce``; inside a training / validation / test step a ``"mean"``
        (``self.log(..., sync_dist=True)`` uses it) is, from one gather of every rank's value
        (:func:`_rank_mean`): the whole batch's value of a combination of captured losses (or of its ``.item()``);
        else a mean the step computed (``x[mask].mean()``) weighted by its element counts; else the mean
        weighted like the loss, ``sum_r n_r x_r / sum_r n_r`` (equal weights in a step that reduces across ranks
        itself). A ``"mean"`` of an integer tensor is a float mean."""
        is_mean = isinstance(reduce_op, str) and reduce_op.lower() in MEAN_NAMES
        if is_mean and isinstance(tensor, Tensor) and not tensor.is_floating_point() and dist.is_initialized():
            # Lightning's gloo "mean" divides an integer tensor in place, truncating: the epoch-level batch-size
            # sum of 7 samples on 2 ranks becomes 3, and every epoch mean with an odd total is wrong. Mean in float.
            total = tensor.to(torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            return total / dist.get_world_size(group)
        if self._settling:
            return tensor
        if self._count is None or not is_mean or not isinstance(tensor, Tensor) or self.loss_weighting == "equal":
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if group is None:
            return self._rank_mean(tensor)
        # one all-reduce of (n_r * x_r, n_r): the weighted mean needs no N known in advance; a step that reduces
        # across ranks itself (a loss written for DDP) is averaged equally, as DDP would
        n, value = (1.0 if self._collectives else self._count), tensor.detach().to(torch.float64).reshape(-1)
        pair = torch.stack([value * n, torch.full_like(value, n)])
        dist.all_reduce(pair, op=dist.ReduceOp.SUM, group=group)
        return (pair[0] / pair[1]).reshape(tensor.shape).to(tensor.dtype)

    def _settle(self, means: HeldMeans) -> None:
        """The step's held ``sync_dist`` means (:mod:`~lightning_sparse_dp.ddp.logged_means`) logged as the global
        batch's values, every rank's part in one gather."""
        rows = {key: (call.row, call.batch_size, call.explicit) for key, call in means.calls.items()}
        plan = self._step_plan()
        points = [chunks[0] for chunks in plan.points_per_set]  # this rank's share (one chunk), per point set
        ranks = self._gather((ChunkShape.of(plan, 0).samples, rows, points))
        settled = settle(ranks, partial(whole_value, memory=self._memory, warnings=self._warning_cache), means.calls,
                         self._constant_sizes, self._warning_cache)
        self._settling = True  # each value is already the global one: Lightning's on-step sync leaves it as it is
        try:
            means.release(settled)
        finally:
            self._settling = False

    def _rank_mean(self, tensor: Tensor) -> Tensor:
        """The whole batch's value of a logged mean, every rank's part in one gather (see :meth:`reduce`)."""
        return whole_value(self._gather(self._log_row(tensor)), tensor, self._memory, warnings=self._warning_cache)

    def _log_row(self, tensor: Tensor) -> Row:
        """What this rank tells the others of a logged value (:func:`~lightning_sparse_dp.ddp.logged_means.rank_row`),
        with its ``n_r`` (1 in a step that reduces across ranks itself)."""
        return rank_row(tensor, self._capture, self._summary, 1.0 if self._collectives else float(self._count or 0.0))


__all__ = ["RankLogging"]
