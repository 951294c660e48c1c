"""A step's terms: the captures of its replicas (ranks), the decision on them (:mod:`~lightning_sparse_dp.loss.decide`)
applied (each term's gradient scaled, the replicas' losses shifted to the whole batch's value) and said once
where the loss cannot be weighted term by term.

``sparse_dp`` holds one :class:`StepTerms` per step; ``sparse_ddp`` calls :func:`rank_scale` on the gathered
summaries of its ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lightning_sparse_dp.loss.capture import TermCapture
from lightning_sparse_dp.loss.decide import ChunkShape, Decision, Summary, decide, summarize
from lightning_sparse_dp.loss.means import scalar_values
from lightning_sparse_dp.loss.memory import SiteMemory
from lightning_sparse_dp.loss.readings import NO_WEIGHTING
from lightning_sparse_dp.loss.reweight import PartWeight, shifted
from lightning_sparse_dp.loss.values import is_loss_value, loss_of
from lightning_sparse_dp.loss.weights import counting_example, resolve_auto
from lightning_sparse_dp.split import SplitPlan

#: how every :func:`fallback_message` begins after the strategy's name (the exactness check finds its runs' own by it)
FALLBACK_START = "loss_weighting='terms' cannot weight the step's loss term by term"


def fallback_message(strategy: str, reason: str, plan: SplitPlan) -> str:
    """The one info line of a loss that is not a combination of terms: why, what is done, the exact alternative, its
    example written for the batch's own structure (:func:`~lightning_sparse_dp.loss.weights.counting_example`).

    ``sparse_dp`` weights each replica's loss as ``"auto"`` does; ``sparse_ddp`` weights ranks equally, as DDP
    averages gradients, so that it is never further from one device than the DDP a user moved from.
    """
    choice, why = resolve_auto(plan)
    example = counting_example(plan)
    mendable = NO_WEIGHTING not in reason  # else a weighting cannot mend it: the reason says what does
    if strategy == "sparse_ddp":
        return (
            f"sparse_ddp: {FALLBACK_START}: {reason}. Its ranks are "
            "weighted equally, as DDP averages gradients (exact for a loss the step normalizes across ranks itself, "
            "or for equal shares)." + (
                f" If the loss is one mean over each rank's {choice} ({why}), pass "
                "SparseDDPStrategy(loss_weighting='auto'); for a mean over a count of the batch (e.g. labeled points), "
                f"pass a callable counting it, e.g. SparseDDPStrategy(loss_weighting={example})." if mendable else ""
            )
        )
    who, cls = "replica", "SparseDataParallelStrategy"
    exact = (
        f" For an exact loss pass a callable counting what the loss is a mean over, e.g. {cls}(loss_weighting={example})."
    ) if mendable else ""
    return (
        f"{strategy}: {FALLBACK_START}: {reason}. Each {who}'s loss is "
        f"weighted as loss_weighting='auto' does instead, by its {choice} ({why}), which is exact only for a loss that "
        f"is one mean over those.{exact}"
    )


def empty_message(strategy: str, names: Sequence[str]) -> str:
    """The one warning of a term with nothing to average over in the whole batch."""
    return (
        f"{strategy}: {', '.join(sorted(set(names)))} has nothing to average over in the whole batch (denominator 0, "
        "e.g. every label is ignore_index): the step's loss is NaN, as on one device, unless the step skips the term "
        "when it is NaN (if not torch.isnan(l): ...): a term over nothing reads 0.0 on each replica, so the replicas "
        "add it where one device skips it. Test what the term averages over instead (if mask.sum() > 0, on a count "
        "taken on the whole batch in on_before_batch_transfer)."
    )


def log_fallback_message(strategy: str, name: str, reason: str) -> str:
    """The one info line of a logged value that is a combination of the step's losses in every replica (rank) but whose
    whole-batch value no combination of theirs gives (``reason``: the decision's, which names the fix)."""
    who = "rank" if strategy == "sparse_ddp" else "replica"
    return (
        f"{strategy}: self.log({name!r}, ...) is a combination of mean-reduced losses (or torch.mean / torch.sum) in "
        f"every {who}'s step, but no combination of the {who}s' calls of them gives its whole-batch value: {reason}. "
        f"It is logged as a mean of the {who}s' values instead (weighted by their batch_size or their share of the "
        "loss weighting), not one device's value."
    )


def collective_message(calls: Sequence[str]) -> str:
    """The one info line of a ``sparse_ddp`` step that reduces across ranks itself."""
    return (
        f"sparse_ddp: the training step calls {', '.join(calls)} itself (e.g. a loss normalized by a count "
        "all-reduced across ranks, as DETR-style criteria do): its ranks are weighted equally, as DDP averages "
        "gradients, which is exact for a loss written for DDP, and its losses are not re-weighted term by term. "
        "To weight ranks by their share of the batch instead, pass SparseDDPStrategy(loss_weighting='auto') or a "
        "callable counting what each rank's loss is a mean over; loss_weighting='equal' keeps this and says nothing."
    )


def say(decision: Decision, strategy: str, warning_cache: WarningCache) -> None:
    """Say a decision's notes (info) and its empty terms (warning), each once."""
    for note in decision.notes:
        warning_cache.info(note.replace("sparse_dp:", f"{strategy}:", 1))
    if decision.value is not None and decision.empty:
        warning_cache.warn(empty_message(strategy, decision.empty))


def rank_scale(
    summaries: Sequence[Summary],
    rank: int,
    capture: TermCapture,
    world_size: int,
    memory: SiteMemory,
    warning_cache: WarningCache,
    plan: Callable[[], SplitPlan],
) -> float:
    """``sparse_ddp`` after a rank's training step (or at its ``manual_backward``): its loss scale, and each
    term's gradient scale, from every rank's :class:`Summary` of the loss (``summaries``, gathered in rank order).

    When the loss is a combination of terms the loss scale is 1 (the terms are scaled, ``world_size`` times
    their share, DDP averaging gradients; ``plan()`` gives the rank's split, for the line said once). Where the
    loss is not such a combination, or the step's own code called a collective (a loss the user normalized across
    ranks, :mod:`lightning_sparse_dp.loss.collectives`), ranks are weighted as DDP does (loss scale 1, terms
    unscaled), said once: never further from one device than DDP.
    """
    calls = sorted({c for s in summaries for c in s.collectives})
    if calls:
        warning_cache.info(collective_message(calls))
        return 1.0
    decision = decide(summaries, memory, who="rank")
    memory.last_sites = decision.sites
    say(decision, "sparse_ddp", warning_cache)
    if decision.value is None:
        if decision.reason is not None and summaries[rank].reason != "nothing was captured":
            warning_cache.info(fallback_message("sparse_ddp", decision.reason, plan()))
        return 1.0
    part = PartWeight.rank(world_size, shares=decision.scales[rank])
    part.scale_terms(capture)
    return part.loss_factor


def refusal(decision: Decision) -> str | None:
    """Why ``decision`` gives no value where every summary it read was a combination of terms (its reason), else
    ``None``: a value that is no combination of terms at all (a hand-made ratio) is reduced by the logging rules."""
    return decision.reason if decision.value is None and decision.combined else None


class StepTerms:
    """The terms of one ``sparse_dp`` step: a :class:`TermCapture` per replica, the loss's decision, exact values.

    Args:
        count: replicas in the step.
        warning_cache: where the fallback info line, the notes and the empty-term warning go (each said once).
        memory: the strategy's readings of call sites, kept across steps.
        plan: the step's split (``plan.num_chunks >= count``), known before the step runs (the scatter stage made it):
            the chunks' shapes are read against it, in each replica's thread after its step, or inside it where a
            manual step decides at ``manual_backward``.
        with_loss: the step's output holds a loss to weigh (a one-element tensor, bare or under ``"loss"``); ``False``
            for a predict step, whose output is predictions (its means are still read: :meth:`output_value`).
    """

    def __init__(
        self, count: int, warning_cache: WarningCache, memory: SiteMemory | None, plan: SplitPlan, with_loss: bool = True,
    ) -> None:
        self.captures = [TermCapture() for _ in range(count)]
        self.with_loss = with_loss
        self.warning_cache = warning_cache
        self.memory = SiteMemory() if memory is None else memory
        self.decision: Decision | None = None
        self.plan = plan
        self._shapes: list[ChunkShape | None] = [None] * count  # chunk i's, made where first needed (replica i's thread)
        self._losses: list[Any] = []
        self._summaries: list[tuple[Any, Summary] | None] = [None] * count  # (loss, its summary), made in the replica

    @classmethod
    def for_step(
        cls, loss_weighting: Any, step_name: str, count: int, warning_cache: WarningCache, memory: SiteMemory | None,
        plan: SplitPlan,
    ) -> StepTerms | None:
        """The capture of a step's replicas on the chunks of ``plan``: for ``loss_weighting="terms"``, several
        replicas (a predict step's too, without a loss to weigh: its 0-dim means are read as a validation step's)."""
        if loss_weighting != "terms" or count < 2:
            return None
        return cls(count, warning_cache, memory, plan, with_loss=step_name != "predict_step")

    def wrap(self, steps: Sequence[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """Each replica's step run under its own capture (entered in the replica's thread); the summary of the step's
        loss is made there too, after the step, beside the other replicas' steps instead of after all of them on the
        calling thread (:meth:`decide` takes it)."""
        return [partial(self._run, i, step) for i, step in enumerate(steps)]

    def _run(self, i: int, step: Callable[[], Any]) -> Any:
        capture = self.captures[i]
        out = capture.run(step)
        loss = loss_of(out) if self.with_loss else None
        if isinstance(loss, Tensor) and loss.numel() == 1:  # the chunk's shape made here, in replica i's thread
            self._summaries[i] = (loss, summarize(capture, loss, self.shape(i)))
        return out

    def shape(self, i: int) -> ChunkShape:
        """Chunk ``i``'s :class:`ChunkShape` of the step's plan, made once."""
        shape = self._shapes[i]
        if shape is None:
            shape = self._shapes[i] = ChunkShape.of(self.plan, i)
        return shape

    def say_fallback(self, decision: Decision) -> None:
        """Say once why the loss is weighted per replica (as ``"auto"`` does for the step's batch) instead."""
        self.warning_cache.info(fallback_message("sparse_dp", decision.reason or "", self.plan))

    def decide(self, values: Sequence[Any], replicas: Sequence[int] | None = None) -> Decision:
        """The decision on one value per replica (of ``replicas``, default all), against the chunks' shapes."""
        replicas = range(len(self.captures)) if replicas is None else replicas
        made = self._summaries  # each replica's loss, summarized in its thread after its step
        summaries = [
            made[i][1] if made[i] is not None and made[i][0] is v else self._summary(i, v)  # type: ignore[index]
            for i, v in zip(replicas, values)
        ]
        return decide(summaries, self.memory)

    def _summary(self, i: int, value: Any) -> Summary:
        return summarize(self.captures[i], value, self.shape(i))

    def weigh(self, losses: Sequence[Tensor | None], weights: Sequence[float]) -> None:
        """Decide on the replicas' losses; when exact, scale every term's gradient; else say once why not.

        ``weights``: the replicas' weights in the gathered loss (``"auto"``'s: every chunk has a sample and a
        point, so none is 0).
        """
        if not self.with_loss or any(loss is None or loss.numel() != 1 for loss in losses):
            return  # no loss: predictions (a predict step's, an evaluation step's per-point logits)
        self.decision = self.scale_terms(losses, weights)
        self._losses = list(losses)

    def scale_terms(self, losses: Sequence[Tensor], weights: Sequence[float]) -> Decision:
        """The decision on the replicas' ``losses`` (its notes said); when exact, every term's gradient scaled by
        its share over its replica's weight in ``weights`` (0 for a weight of 0); else why not, said once. After the
        step (:meth:`weigh`), or at a ``manual_backward`` in it (:mod:`~lightning_sparse_dp.step.manual`)."""
        decision = self.decide(losses)
        say(decision, "sparse_dp", self.warning_cache)
        if decision.value is None:
            self.say_fallback(decision)
            return decision
        for capture, shares, w in zip(self.captures, decision.scales, weights):
            PartWeight.replica(w, shares).scale_terms(capture)
        return decision

    def exact_outputs(self, outputs: Sequence[Any], weights: Sequence[float]) -> list[Any]:
        """The replicas' outputs, their losses shifted so that their weighted sum is the whole batch's loss."""
        losses = [loss_of(o) for o in outputs]
        if self.decision is None or self.decision.value is None or any(loss is None for loss in losses):
            return list(outputs)
        exact = shifted(losses, weights, self.decision.value)  # type: ignore[arg-type]
        return [loss if isinstance(o, Tensor) else {**o, "loss": loss} for o, loss in zip(outputs, exact)]

    def output_value(self, values: Sequence[Any]) -> Tensor | None:
        """The whole batch's value of a 0-dim output every replica's step returned (replica order): a combination of
        terms (:meth:`log_value`), else a mean each replica computed with ``torch.mean`` / ``.mean()`` (an accuracy),
        weighted by its element count, as a logged mean is (:mod:`~lightning_sparse_dp.loss.means`); else ``None``."""
        value = self.log_value(range(len(values)), values)
        if value is not None:
            return value
        found = [capture.means.get(id(v)) for capture, v in zip(self.captures, values)]
        if len(found) != len(self.captures) or any(f is None or f[0] is not v for f, v in zip(found, values)):
            return None
        counts = [f[1] for f in found]  # type: ignore[index]
        total = sum(counts)
        if total == 0:
            return None
        means = scalar_values([f[0] for f in found])  # type: ignore[index]
        # a chunk with nothing to average (its mean NaN) adds nothing, as one device's mean over the batch's elements
        return torch.tensor(sum(n * m for n, m in zip(counts, means) if n) / total, dtype=values[0].dtype)

    def log_value(self, replicas: Sequence[int], values: Sequence[Any]) -> Tensor | None:
        """The whole batch's value of a name every replica logged, when it is a combination of terms; else ``None``."""
        value = self.log_reading(replicas, values)
        return value if isinstance(value, Tensor) else None

    def log_reading(self, replicas: Sequence[int], values: Sequence[Any]) -> Tensor | str | None:
        """As :meth:`log_value` (a 0-dim tensor, or ``None`` for a value that is no combination of terms), and the
        reason (a ``str``) where every replica's value is a combination of its terms but the decision refused them
        (e.g. replicas that called a loss different numbers of times: a loop that stops once its chunk has nothing
        left), which :func:`~lightning_sparse_dp.step.log.reduce_log_calls` says once (:func:`log_fallback_message`).
        The step's own loss, logged, is never such a reason: its fallback is said where it is weighted."""
        if len(replicas) != len(self.captures):
            return None
        dtype = values[0].dtype if isinstance(values[0], Tensor) else torch.float64
        if self.decision is not None and all(is_loss_value(v, loss) for v, loss in zip(values, self._losses)):
            value = self.decision.value  # the logged loss itself, or its .item(): decided already
        else:
            tensors = [v if isinstance(v, Tensor) else self.captures[i].tensor_of(v) for i, v in zip(replicas, values)]
            if any(t is None or not t.is_floating_point() for t in tensors):
                return None
            decision = self.decide(tensors, replicas)
            say(decision, "sparse_dp", self.warning_cache)  # an ambiguous reading said, as the loss's own is
            if decision.value is None:
                return refusal(decision)
            value = decision.value
        return None if value is None else torch.tensor(value, dtype=dtype)


__all__ = [
    "FALLBACK_START", "StepTerms", "collective_message", "empty_message", "fallback_message", "log_fallback_message",
    "rank_scale", "refusal", "say",
]
