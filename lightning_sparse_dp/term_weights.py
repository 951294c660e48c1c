"""Term weights: each captured loss of each replica (rank) weighted by its own share of the batch.

Replica ``i``'s step calls torch's mean-reduced losses ``L_ik`` with denominators ``D_ik``
(:mod:`lightning_sparse_dp.terms`) and returns ``loss_i = sum_k c_k L_ik + r``. The whole batch's
term is ``T_k = sum_i D_ik L_ik / D_k`` with ``D_k = sum_j D_jk`` (research notes, "Losses as users
write them"), so the whole batch's loss is ``sum_k c_k T_k + r`` and its gradient reaches term ``k``
of replica ``i`` with weight ``c_k D_ik / D_k``: each term gets its own weight, which no single
weight per replica can give when the terms' denominators differ (an ignore label, levels of a
decoder, heads over different masks).

Each replica (rank) sums up its step in one vector (:func:`pack`): its terms' ``D_ik`` and
``D_ik L_ik``, its loss's remainder ``r``, and checks that every replica called the same losses in
the same order with the same coefficients. The vectors are added (in ``sparse_ddp`` by the one
all-reduce that already gave the loss weights), and :func:`decide` reads the sum: the whole batch's
value, or why the loss is not such a combination (then the strategy weights each replica's loss as
``"auto"`` does, and says so once). ``r`` may be a constant or a penalty on the parameters, the
same in every replica; a remainder that differs between replicas (a hand-written masked mean) is
not a combination of terms.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.backward import loss_of
from lightning_sparse_dp.split import SplitPlan
from lightning_sparse_dp.terms import TermCapture
from lightning_sparse_dp.weighting import resolve_auto

#: The most terms one step may capture (the summary vector has a fixed length, so that ranks agree on it).
CAPACITY = 64
_HEADER = 10  # count, n, K, K^2, signature, signature^2, not-a-combination, r, r^2, scale
_SPREAD = 1e-6  # relative spread of the replicas' remainders still taken as one value (rounding: ~1e-16)


@dataclass
class Decision:
    """What the summed vectors say: ``value`` (the whole batch's), or ``reason`` it is not a combination.

    ``totals[k]`` is ``D_k``; ``empty`` names the terms the value uses whose ``D_k`` is 0 in the whole batch.
    """

    value: float | None
    reason: str | None = None
    totals: list[float] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    count: float = 0.0  # replicas or ranks
    n: float = 0.0  # sum of the n_i packed (the "auto" counts)


def pack(capture: TermCapture | None, value: Any, n: float = 0.0, capacity: int = CAPACITY) -> tuple[list[float], str | None]:
    """The summary vector (``10 + 2 * capacity`` floats) of one replica's ``value``, and why it is not a combination.

    ``n`` rides along (the replica's ``"auto"`` count, summed by the same reduction). Ranks use the
    fixed :data:`CAPACITY`, so that their vectors agree in length whatever each captured.
    """
    head = [1.0, float(n)] + [0.0] * (_HEADER - 2)
    ds, dls = [0.0] * capacity, [0.0] * capacity
    comb = capture.combination(value) if capture is not None else "nothing was captured"
    if not isinstance(comb, str) and len(capture.terms) > capacity:  # type: ignore[union-attr]
        comb = f"it captures more than {capacity} mean-reduced losses in one step"
    if isinstance(comb, str):
        head[6] = 1.0
    else:
        coeffs, r, scale = comb
        k = len(coeffs)
        names = [t.name for t in capture.terms]  # type: ignore[union-attr]
        sig = float(zlib.crc32(repr((names, coeffs)).encode()) % (1 << 20))
        head[2:] = [k, k * k, sig, sig * sig, 0.0, r, r * r, scale]
        for j, term in enumerate(capture.terms):  # type: ignore[union-attr]
            d, v = term.numbers()
            ds[j], dls[j] = d, d * v
    return head + ds + dls, (comb if isinstance(comb, str) else None)


def decide(
    total: Sequence[float], capture: TermCapture | None, value: Any, reasons: Sequence[str | None], who: str = "replica"
) -> Decision:
    """Read the sum of every replica's :func:`pack` of ``value`` (``capture``: this replica's own).

    Args:
        total: the summed vectors (a list, or a tensor from an all-reduce).
        reasons: the reasons :func:`pack` gave here (every replica's in ``sparse_dp``, this rank's in ``sparse_ddp``).
        who: ``"replica"`` or ``"rank"``, for the reason.
    """
    t = total.tolist() if isinstance(total, Tensor) else list(total)
    capacity = (len(t) - _HEADER) // 2
    count, n = t[0], t[1]
    out = Decision(None, count=count, n=n)
    if t[6] > 0:
        local = next((r for r in reasons if r is not None), None)
        out.reason = local or f"another {who}'s loss is not such a combination"
        return out
    if t[3] * count != t[2] ** 2 or t[5] * count != t[4] ** 2:
        out.reason = (
            f"the {who}s' steps called different sequences of mean-reduced losses (or combined them with different "
            "coefficients), e.g. a loss computed only when the chunk has something for it"
        )
        return out
    s1, s2, scale = t[7], t[8], t[9] / count
    if s2 / count - (s1 / count) ** 2 > (_SPREAD * scale) ** 2 or not all(map(math.isfinite, (s1, s2, scale))):
        out.reason = (
            f"a part of it differs from {who} to {who} and is not one of torch's mean-reduced losses (e.g. a "
            "hand-written masked mean such as (loss * mask).sum() / mask.sum())"
        )
        return out
    assert capture is not None
    coeffs = capture.combination(value)[0]  # type: ignore[index]
    k = len(coeffs)
    out.totals = t[_HEADER : _HEADER + k]
    weighted = t[_HEADER + capacity : _HEADER + capacity + k]
    result = s1 / count
    for j, c in enumerate(coeffs):
        if c == 0.0:
            continue
        if out.totals[j] > 0:
            result += c * weighted[j] / out.totals[j]
        else:
            result, out.empty = math.nan, out.empty + [capture.terms[j].name]
    out.value = result
    return out


def set_scales(capture: TermCapture, totals: Sequence[float], factor: float) -> None:
    """Scale the gradient of this replica's term ``k`` by ``factor * D_ik / D_k`` (0 where ``D_k = 0``).

    ``factor`` undoes the weight the replica's loss gets as a whole: ``1 / w_i`` in ``sparse_dp`` (the
    gathered loss is ``sum_i w_i loss_i``), the world size in ``sparse_ddp`` (DDP averages gradients).
    """
    for term, d_total in zip(capture.terms, totals):
        term.scale = factor * term.numbers()[0] / d_total if d_total > 0 else 0.0


def combine(captures: Sequence[TermCapture], values: Sequence[Any], counts: Sequence[float] | None = None) -> Decision:
    """:func:`decide` over the replicas of one process (``sparse_dp``): their vectors added here."""
    capacity = max(len(c.terms) for c in captures)
    packed = [pack(c, v, n, capacity) for c, v, n in zip(captures, values, counts or [0.0] * len(values))]
    total = [sum(column) for column in zip(*(p[0] for p in packed))]
    return decide(total, captures[0], values[0], [p[1] for p in packed])


def exact_losses(losses: Sequence[Tensor], weights: Sequence[float], value: float) -> list[Tensor]:
    """The replicas' losses shifted by one constant so that ``sum_i weights[i] * loss_i`` is ``value``.

    The shift is detached: each replica's loss keeps its gradient ``w_i``, which :func:`set_scales`
    (``factor = 1 / w_i``) turns into ``c_k D_ik / D_k`` at term ``k``, and its remainder's gradient
    ``w_i`` adds up to the remainder's own. The gather (the strategy's, or an override) then
    combines them as any loss.
    """
    base = sum(w * float(loss.detach()) for w, loss in zip(weights, losses))
    return [loss + (value - base) for loss in losses]


def log_value(captures: Sequence[TermCapture], values: Sequence[Any]) -> float | None:
    """The whole batch's value of a logged value (one per replica) that is a combination of terms, else ``None``."""
    if any(not isinstance(v, Tensor) or not v.is_floating_point() for v in values):
        return None
    return combine(captures, values).value


def fallback_message(strategy: str, reason: str, choice: str, why: str) -> str:
    """The one info line of a loss that is not a combination of terms: why, what is done, the exact alternative."""
    who, cls = ("replica", "SparseDataParallelStrategy") if strategy == "sparse_dp" else ("rank", "SparseDDPStrategy")
    return (
        f"{strategy}: loss_weighting='terms' cannot weight the step's loss term by term: {reason}. Each {who}'s loss is "
        f"weighted as loss_weighting='auto' does instead, by its {choice} ({why}), which is exact only for a loss that "
        f"is one mean over those. For an exact loss pass a callable counting what the loss is a mean over, e.g. "
        f"{cls}(loss_weighting=lambda chunk: (chunk['labels'] != 255).sum())."
    )


def rank_scale(
    capture: TermCapture,
    loss: Any,
    n: float,
    world_size: int,
    all_reduce: Callable[[list[float]], Tensor],
    warning_cache: WarningCache,
    auto: Callable[[], tuple[str, str]],
) -> float:
    """``sparse_ddp`` after a rank's training step: its loss scale, and each term's gradient scale ``W D_rk / D_k``.

    One ``all_reduce`` (a sum over ranks) of :func:`pack`'s vector, which carries ``n_r`` too: when the
    loss is a combination of terms the loss scale is 1 (the terms are scaled); else it is ``"auto"``'s
    ``W n_r / N`` (``auto()`` gives its choice and reason for the line said once; 0 when ``N = 0``).
    """
    vector, reason = pack(capture, loss, n)
    decision = decide(all_reduce(vector), capture, loss, [reason], who="rank")
    if decision.value is None:
        if loss is not None:
            warning_cache.info(fallback_message("sparse_ddp", decision.reason or "", *auto()))
        return world_size * n / decision.n if decision.n > 0 else 0.0
    if decision.empty:
        warning_cache.warn(empty_message("sparse_ddp", decision.empty))
    set_scales(capture, decision.totals, world_size)
    return 1.0


def empty_message(strategy: str, names: Sequence[str]) -> str:
    """The one warning of a term with nothing to average over in the whole batch."""
    return (
        f"{strategy}: {', '.join(sorted(set(names)))} has nothing to average over in the whole batch (denominator 0, "
        "e.g. every label is ignore_index): the step's loss is NaN, as on one device."
    )


class StepTerms:
    """The terms of one ``sparse_dp`` step: a :class:`TermCapture` per replica, the loss's decision, exact values.

    Args:
        count: replicas in the step.
        warning_cache: where the fallback info line and the empty-term warning go (each said once).
    """

    def __init__(self, count: int, warning_cache: WarningCache) -> None:
        self.captures = [TermCapture() for _ in range(count)]
        self.warning_cache = warning_cache
        self.decision: Decision | None = None
        self._losses: list[Any] = []

    @classmethod
    def for_step(cls, loss_weighting: Any, step_name: str, count: int, warning_cache: WarningCache) -> StepTerms | None:
        """The capture of a step's replicas: for ``loss_weighting="terms"``, several replicas, not predict."""
        if loss_weighting != "terms" or count < 2 or step_name == "predict_step":
            return None
        return cls(count, warning_cache)

    def wrap(self, steps: Sequence[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """Each replica's step run under its own capture (entered in the replica's thread)."""
        return [partial(c.run, step) for c, step in zip(self.captures, steps)]

    def weigh(self, losses: Sequence[Tensor | None], plan: SplitPlan, weights: Sequence[float]) -> None:
        """Decide on the replicas' losses; when exact, scale every term's gradient; else say once why not.

        ``weights``: the replicas' weights in the gathered loss (``"auto"``'s: every chunk has a sample and a
        point, so none is 0).
        """
        if any(loss is None for loss in losses):
            return
        self.decision = combine(self.captures, losses)
        self._losses = list(losses)
        if self.decision.value is None:
            choice, why = resolve_auto(plan)
            self.warning_cache.info(fallback_message("sparse_dp", self.decision.reason or "", choice, why))
            return
        if self.decision.empty:
            self.warning_cache.warn(empty_message("sparse_dp", self.decision.empty))
        for capture, w in zip(self.captures, weights):
            set_scales(capture, self.decision.totals, 1.0 / w)

    def exact_outputs(self, outputs: Sequence[Any], weights: Sequence[float]) -> list[Any]:
        """The replicas' outputs, their losses shifted so that their weighted sum is the whole batch's loss."""
        losses = [loss_of(o) for o in outputs]
        if self.decision is None or self.decision.value is None or any(loss is None for loss in losses):
            return list(outputs)
        shifted = exact_losses(losses, weights, self.decision.value)  # type: ignore[arg-type]
        return [loss if isinstance(o, Tensor) else {**o, "loss": loss} for o, loss in zip(outputs, shifted)]

    def log_value(self, replicas: Sequence[int], values: Sequence[Any]) -> Tensor | None:
        """The whole batch's value of a name every replica logged, when it is a combination of terms; else ``None``."""
        if len(replicas) != len(self.captures):
            return None
        if self.decision is not None and all(v is loss for v, loss in zip(values, self._losses)):
            value = self.decision.value  # the logged loss itself: decided already
        else:
            value = log_value([self.captures[i] for i in replicas], values)
        return None if value is None else torch.tensor(value, dtype=values[0].dtype)


__all__ = [
    "CAPACITY",
    "Decision",
    "StepTerms",
    "combine",
    "decide",
    "empty_message",
    "exact_losses",
    "fallback_message",
    "log_value",
    "pack",
    "rank_scale",
    "set_scales",
]
