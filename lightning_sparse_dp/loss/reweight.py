"""Reweight: how each part of a step's loss is weighted so that the parts together give one device's loss.

A part is a ``sparse_dp`` replica or a ``sparse_ddp`` rank: it computes its loss ``L_i`` on its share of the batch.
One :class:`PartWeight` per part holds every number its re-weighting uses, for both strategies, automatic and manual
optimization:

- ``gather`` ``g_i``: what the strategy's reduction multiplies the part's loss (its gradient) by: ``sparse_dp``'s gather
  sums ``sum_i w_i L_i`` (``g_i = w_i``, :func:`~lightning_sparse_dp.loss.weights.weighted_sum`); DDP averages the
  ranks' gradients (``g_i = 1 / world_size``);
- ``weight`` ``w_i``: the part's share of one device's loss, ``n_i / N`` for a loss that is one mean over what
  ``loss_weighting`` counts (:func:`~lightning_sparse_dp.loss.weights.chunk_weights`);
- ``shares`` ``s_it``: when the loss is a combination of captured terms (``loss_weighting="terms"``,
  :mod:`~lightning_sparse_dp.loss.decide`), each term's own share of its whole-batch term (``D_it / D_t`` for a mean;
  ``None`` for the remainder, whose gradient passes as it is), else ``None``.

Before the reduction the part's loss is multiplied by :attr:`PartWeight.loss_factor` (``w_i / g_i``; 1 when the terms
carry the shares), each captured term's gradient by ``s_it / g_i`` (:meth:`PartWeight.scale_terms`; the capture's
factor in the graph, :class:`~lightning_sparse_dp.loss.term.Term`), and, where the gather's sum is the step's loss
(``sparse_dp``), every part's value shifted by one detached constant (:func:`shifted`). The invariant, tested in
``tests/loss/test_reweight.py``:

- gradient: ``d/dx [sum_i g_i * loss_factor_i * L_i] = sum_i w_i dL_i/dx`` without shares, and each term ``t`` of
  part ``i`` reaches ``x`` with ``s_it`` times its own gradient with them (the remainder with ``g_i``);
- value: ``sum_i g_i L_i' = V``, the whole batch's loss, where the parts' losses are shifted.

A part of weight 0 (nothing to count in its share: every label ignored) adds an exact 0 and a zero gradient, never the
NaN of a mean over nothing (:func:`scaled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_sparse_dp.loss.weights import zeroed


@dataclass(frozen=True)
class PartWeight:
    """One part's (replica's or rank's) re-weighting; see the module docstring for the numbers and the invariant.

    Attributes:
        gather: ``g_i``, what the reduction multiplies the part's loss by (>= 0).
        inverse: ``1 / g_i`` as the strategy has it exactly (``world_size`` under DDP), 0 for ``g_i = 0``.
        weight: ``w_i``, the part's share of one device's loss (>= 0).
        shares: ``s_it`` per captured term of the part, in call order (``None`` entries: the remainder), or ``None``
            when the loss is not weighted term by term.
    """

    gather: float
    inverse: float
    weight: float
    shares: Sequence[float | None] | None = None

    @classmethod
    def replica(cls, weight: float, shares: Sequence[float | None] | None = None) -> PartWeight:
        """A ``sparse_dp`` replica of weight ``w_i`` in the gather's sum (``g_i = w_i``)."""
        return cls(weight, 1.0 / weight if weight else 0.0, weight, shares)

    @classmethod
    def rank(cls, world_size: int, weight: float | None = None, shares: Sequence[float | None] | None = None) -> PartWeight:
        """A ``sparse_ddp`` rank, DDP averaging the gradients (``g_i = 1 / world_size``); ``weight`` ``None``: weighted
        as DDP weighs it (``1 / world_size``)."""
        gather = 1.0 / world_size
        return cls(gather, float(world_size), gather if weight is None else weight, shares)

    @property
    def loss_factor(self) -> float:
        """What the part's loss is multiplied by before the reduction: ``w_i / g_i`` (exactly 1 where the gather applies
        the weight itself, or the terms carry the shares)."""
        if self.shares is not None or self.weight == self.gather:
            return 1.0
        return self.weight * self.inverse

    def scale_terms(self, capture: Any) -> None:
        """Set the gradient scale of each captured term of the part (``capture``: a
        :class:`~lightning_sparse_dp.loss.capture.TermCapture`): ``s_it / g_i``, 1 for the remainder (``None``).
        Nothing without shares."""
        if self.shares is None:
            return
        for term, share in zip(capture.terms, self.shares):
            term.scale = 1.0 if share is None else self.inverse * share


def scaled(loss: Tensor, factor: float) -> Tensor:
    """``loss * factor``, as it is for 1, and exactly 0 with a zero gradient (no NaN of a mean over nothing) for 0."""
    if factor == 0.0:
        return zeroed(loss)
    return loss if factor == 1.0 else loss * factor


def shifted(losses: Sequence[Tensor], gathers: Sequence[float], value: float) -> list[Tensor]:
    """The parts' losses shifted by one detached constant so that ``sum_i gathers[i] * loss_i`` is ``value`` (the whole
    batch's loss), for ``gathers`` summing to 1 (``sparse_dp``'s replica weights). Each loss keeps its gradient: the
    shift is a Python float."""
    base = sum(g * loss.item() for g, loss in zip(gathers, losses))  # .item(): float(loss.detach()) without the alias
    return [loss + (value - base) for loss in losses]


__all__ = ["PartWeight", "scaled", "shifted"]
