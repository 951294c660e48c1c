"""Readings: how a step's call site enters the whole batch's value, read in full from every replica's calls of it.

:func:`read_site` reads one site of a decision (:func:`~lightning_sparse_dp.loss.decide.decide`): one loss per sample
of the chunk (each its own criterion, the coefficient of each call), else the ``j``-th call of every replica one
criterion (a mean, a sum, sums each divided by their rows, one value in every replica), or :class:`NotExact` with the
reason no combination of the replicas' calls is the whole batch's. On the way it says what an ambiguous step was read
as (the decision's notes) and keeps in :class:`~lightning_sparse_dp.loss.memory.SiteMemory` what a step told without
doubt. A decision of a structure read before takes its :class:`Reading` objects as they were
(:func:`~lightning_sparse_dp.loss.decide.structure`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_sparse_dp.loss.classes import Group, Unpaired, pair_by_class, read_per_sample

if TYPE_CHECKING:
    from lightning_sparse_dp.loss.decide import Decision, SiteTerms, Summary
    from lightning_sparse_dp.loss.memory import SiteMemory

_SAME = 1e-12  # relative difference of two coefficients still taken as one (they come from the same Python numbers)


class NotExact(Exception):
    """A reason the value is not a combination of the whole batch's terms (the message is the reason)."""


@dataclass(frozen=True)
class Reading:
    """How one site's calls enter the whole batch's value, apart from their values.

    Attributes:
        kind: ``"samples"`` (each call its own criterion, of coefficient ``c``), ``"divided"`` (``reduction="sum"``
            calls each divided by their input's rows: ``calls[j] = ("k", k_j)``) or ``"matched"`` (the ``j``-th call
            of every replica one criterion: ``calls[j]`` is its use, ``"skip"`` (coefficient 0), ``"one"`` (one value
            in every replica), ``"sum"`` or ``"mean"``, and its coefficient) or ``"classes"`` (per-class calls paired by
            their class: ``groups``, :mod:`~lightning_sparse_dp.loss.classes`).
        steady: read without the calls' values, so that a step of the same structure reads it alike.
    """

    kind: str
    calls: tuple[tuple[str, float], ...] = ()
    c: float = 0.0
    steady: bool = True
    groups: tuple[Group, ...] = ()


#: how a reason no loss weighting can mend says so (the fallback line then names no weighting: loss/step.py)
NO_WEIGHTING = "No loss weighting makes that exact"


def chunk_condition(who: str) -> str:
    """Why the replicas' steps called their losses differently, and what makes it exact (no loss weighting does)."""
    return (
        f"a call under a condition on the chunk (if t.sum() > 0: ...) or in a loop over what it holds, which each {who} "
        f"decides on its own chunk where one device decides once for the whole batch. {NO_WEIGHTING}: decide the "
        "condition on the whole batch in on_before_batch_transfer (batch['has_t'] = bool(batch['t'].any()): a Python "
        f"bool or number in the batch reaches every {who} as the whole batch's), loop over a fixed list, or call the "
        "loss unconditionally (a loop that stops once the chunk has nothing left, such as a decoder's levels pruned "
        "empty: call the loss at every level, on no rows where the chunk has none, which adds nothing)"
    )


def read_site(sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision) -> Reading:
    """How one call site's calls enter the whole batch's value: one per sample, else matched by position.

    Args:
        sites: the site's :class:`~lightning_sparse_dp.loss.decide.SiteTerms` of every replica (rank), in order.
        summaries: the replicas' summaries (their chunks' samples).
        memory: what earlier steps told of the site (read, and updated where this step tells without doubt).
        who: ``"replica"`` or ``"rank"``, for the reasons and notes.
        out: the decision whose ``notes`` get what an ambiguous step was read as.

    Raises:
        NotExact: no combination of the replicas' calls is the whole batch's (the message says why: different call
            counts or coefficients, a class weight or input computed from the chunk, a loop over what the chunk holds).
    """
    if _per_sample(sites, summaries, memory, who, out.notes):
        return _samples_reading(sites, summaries, memory, who, out)
    return _matched_reading(sites, summaries, memory, who, out)


def _per_sample(sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, notes: list[str]) -> bool:
    """Whether a site's calls are one per sample (each its own criterion), else matched by position (or by class:
    :func:`~lightning_sparse_dp.loss.classes.read_per_sample`)."""
    by_class = read_per_sample(sites, summaries, memory, who, notes)
    if by_class is not None:
        return by_class
    calls = [len(site.coeffs) for site in sites]
    if any(n != s.samples for n, s in zip(calls, summaries)):  # a loop over the samples that skips some: per sample
        return len(sites) > 1 and all(site.some_samples for site in sites)
    learned = memory.get(sites[0].key, (None, None))[0]
    if len(set(calls)) > 1 or any(site.per_sample for site in sites) or learned == "samples":
        return True
    if learned is not None or len(sites) < 2:
        return False
    site = sites[0]
    if calls[0] == 1 and all(s.in_loop for s in sites):
        notes.append(
            f"sparse_dp: {site.name} at {site.where} is called in a loop, once in each {who}'s step, and each {who}'s "
            "chunk holds one sample: taken as one loss per sample (each its own mean). If it is one loss over the chunk, "
            "batches of more samples than devices make the difference plain."
        )
        return True
    if calls[0] > 1:
        notes.append(
            f"sparse_dp: {site.name} at {site.where} is called {calls[0]} times in each {who}'s step, as many as its "
            "samples, on inputs that are not one per sample (their rows are not the samples' points): taken as "
            f"{calls[0]} distinct losses, the j-th of every {who} one loss (decoder levels, heads). If they are one "
            "loss per sample, pass loss_weighting='samples' (exact for sum(losses) / len(losses))."
        )
    return False


def _samples_reading(
    sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision
) -> Reading:
    """A per-sample site: the coefficient of each of its calls in the whole batch's value. Refused where a call in the
    value has nothing to average over (a sample whose every label is ``ignore_index``): one device's gives NaN, which a
    step that drops NaN losses leaves out, while a replica's gives 0 and stays (a chunk's call over nothing must not
    make the loss NaN), so the replicas' value averages over another number of samples than one device's."""
    site = sites[0]
    if any(d == 0 and not is_sum and c != 0.0 for t in sites for d, c, is_sum in zip(t.denominators, t.coeffs, t.sums)):
        raise NotExact(
            f"the per-sample losses {site.name} at {site.where} include a sample with nothing to average over (every "
            "label ignore_index): one device's call gives NaN there, which a step that drops NaN losses (torch.isnan) "
            f"leaves out, while a {who}'s gives 0 (a chunk's call over nothing must not make the loss NaN) and the step "
            f"keeps it. {NO_WEIGHTING}: skip the call for such a sample, if (y_s != ignore_index).any(): ..., which is "
            "exact"
        )
    for s in sites:
        if any(not math.isclose(c, s.coeffs[0], rel_tol=_SAME, abs_tol=0.0) for c in s.coeffs):
            raise NotExact(f"the per-sample losses {site.name} at {site.where} are combined with different coefficients")
    total = sum(len(s.coeffs) for s in sites)  # the calls: the samples, or those a loop did not skip
    cs = [s.coeffs[0] for s in sites]
    means = [c * len(s.coeffs) for c, s in zip(cs, sites)]
    mean_ok = all(math.isclose(m, means[0], rel_tol=1e-9, abs_tol=0.0) for m in means)
    sum_ok = all(math.isclose(c, cs[0], rel_tol=1e-9, abs_tol=0.0) for c in cs)
    learned = memory.get(site.key, (None, None))[1]
    if mean_ok and sum_ok:
        if learned is not None:
            reading = learned
        elif math.isclose(means[0], 1.0, rel_tol=1e-9) or not math.isclose(cs[0] * total, 1.0, rel_tol=1e-9):
            reading = "mean"
            if not math.isclose(means[0], 1.0, rel_tol=1e-9) and len(sites) > 1 and cs[0] != 0.0:  # 0: not in it
                out.notes.append(
                    f"sparse_dp: the per-sample losses {site.name} at {site.where} have the coefficient {cs[0]:g} in every "
                    f"{who}, whose chunks hold {summaries[0].samples} samples each: read as {means[0]:g} times their mean "
                    f"over the batch's samples, not {cs[0]:g} times their sum."
                )
        else:
            reading = "sum"  # divided by the whole batch's number of samples
    elif mean_ok or sum_ok:
        reading = "mean" if mean_ok else "sum"
        memory[site.key] = ("samples", reading)
    else:
        raise NotExact(
            f"the per-sample losses {site.name} at {site.where} have coefficients that are neither one number in every "
            f"{who} (a sum) nor one number over the chunk's samples (a mean)"
        )
    if any(s.per_sample for s in sites) or len({len(s.coeffs) for s in sites}) > 1:
        memory.setdefault(site.key, ("samples", None))
    return Reading("samples", c=means[0] / total if reading == "mean" else cs[0])


def _matched_reading(
    sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision
) -> Reading:
    """A site whose j-th call is one loss in every replica: how each call enters the value (refused where the
    replicas' calls are no one loss). A full ``torch.sum`` of ``reduction="sum"`` calls is read from its values (one
    value in every replica: a penalty on the parameters), not :attr:`~lightning_sparse_dp.loss.recall.Reading.steady`.
    Per-class losses in a loop are paired by their class instead (:func:`~lightning_sparse_dp.loss.classes.pair_by_class`).
    """
    site = sites[0]
    try:
        groups = pair_by_class(sites, memory, who, out.notes)
    except Unpaired as err:
        raise NotExact(
            f"{err}. {NO_WEIGHTING}: loop over a fixed list of classes (for c in range(num_classes)), skipping a class "
            "on a count of the whole batch (batch['present'] = torch.bincount(y, minlength=num_classes) > 0 in "
            f"on_before_batch_transfer, which every {who} gets alike): exact"
        ) from None
    if groups is not None:
        if any(len(s.coeffs) != sm.samples for s, sm in zip(sites, summaries)):
            memory.setdefault(site.key, ("matched", None))
        return Reading("classes", groups=groups)
    if len({len(s.coeffs) for s in sites}) > 1:
        raise NotExact(f"the {who}s' steps called {site.name} at {site.where} different numbers of times: {chunk_condition(who)}")
    for j in range(len(site.coeffs)):
        if len(sites) > 1 and site.coeffs[j] != 0.0 and any(s.statistic[j] for s in sites):
            raise NotExact(
                f"the input of {site.name} at {site.where} (or a target or weight it was given) comes from a "
                "reduction over the chunk's rows: a statistic of the chunk (e.g. out.F.mean(0), a top-k / sort of "
                "its rows' losses, an OHEM threshold or class counts computed under torch.no_grad), which no split "
                "of the batch computes as one device does"
            )
    divided = _divided_sums(sites, summaries, memory, who, out.notes)
    differ = any(s.coeffs != site.coeffs or s.sums != site.sums for s in sites)
    if site.name.startswith("torch.") and not divided and (differ or memory.sums.get(site.key) == "counted"):
        # a count of the chunk, which chunks of equal counts (one positive each) hide: read so from then on
        memory.sums[site.key] = "counted"
        raise NotExact(
            f"the {who}s' steps divided {site.name} at {site.where} by different numbers"
            f"{'' if differ else ' at an earlier step (by equal ones at this step)'}: a hand-written masked mean such "
            "as (loss * mask).sum() / mask.sum(), or a sum over a count of the chunk (count on the whole batch in "
            "on_before_batch_transfer, which every replica gets alike, and divide by that: exact)"
        )
    if not divided and len(sites) > 1 and any(any(s.counted) for s in sites):
        raise NotExact(
            f"the {who}s' steps divided {site.name} at {site.where} by a count of their chunk (e.g. loss.sum() / "
            "mask.sum(), or / max(int(num_pos), 1)), where one device divides by the whole batch's count (equal counts "
            "in every chunk hide it, and a count clamped to 1 is none). Count on the whole batch in "
            "on_before_batch_transfer (batch['num_pos'] = (labels == 1).sum()), which every replica gets alike, and "
            "divide by that: exact"
        )
    if not differ and not divided and memory.sums.get(site.key) == "counted":
        raise NotExact(
            f"the {who}s' steps combined {site.name} at {site.where} with different coefficients at an earlier step "
            f"(with equal ones at this step, whose chunks are alike): a coefficient that follows the chunk (e.g. "
            "reduction='sum' divided by the chunk's number of samples), which chunks of equal sizes hide; divide by "
            "the whole batch's count, put in the batch in on_before_batch_transfer, which every replica gets alike: exact"
        )
    if differ and not divided:
        memory.sums[site.key] = "counted"  # a coefficient of the chunk, which later chunks of equal sizes hide
        raise NotExact(
            f"the {who}s' steps combined {site.name} at {site.where} with different coefficients (e.g. divided by a "
            f"count of the chunk, or a random number each {who} draws: mixup's lam = torch.rand(()), which one device "
            "draws once for the batch; draw it in on_before_batch_transfer and put it in the batch, where every "
            f"{who} gets the same)"
        )
    if any(len(s.coeffs) != sm.samples for s, sm in zip(sites, summaries)):
        memory.setdefault(site.key, ("matched", None))
    _check_loop(site, memory, who)
    steady = not (site.name.startswith("torch.") and len(sites) > 1 and any(site.sums))  # _one_value reads the values
    if divided:  # sum-reduced calls, each divided by its own input's rows: the whole batch's sum over all rows
        return Reading("divided", tuple(("k", k) for k in _divisors(sites)), steady=steady)
    calls: list[tuple[str, float]] = []
    for j, c in enumerate(site.coeffs):
        if c == 0.0:  # not in the value: a gradient reaches it only through other terms, already weighted there
            calls.append(("skip", c))
            continue
        if len(sites) > 1 and any(s.shared[j] != site.shared[j] for s in sites):
            raise NotExact(
                f"the weight given to {site.name} at {site.where} (a class weight, pos_weight) differs from {who} to "
                f"{who}: computed from the chunk (e.g. from its labels' class frequencies), where one device weights "
                "every row by the whole batch's, which no combination of the chunks' losses gives. Compute it from the "
                "dataset, or from the whole batch in on_before_batch_transfer and keep it on the module "
                "(self.class_weights), so that every replica is given the same"
            )
        if site.sums[j] and site.name.startswith("torch.") and len(sites) > 1 and _penalty(sites, j):
            calls.append(("one", c))  # one value in every replica: of the parameters (a penalty), not of the chunks
        elif site.name == "F.kl_div" and not site.sums[j] and _undivided(sites, summaries, j):
            calls.append(("sum", c))  # divided by its input's one row in every replica: the chunks' values add up
        else:
            calls.append(("sum" if site.sums[j] else "mean", c))
    return Reading("matched", tuple(calls), steady=steady)


def _check_loop(site: SiteTerms, memory: SiteMemory, who: str) -> None:
    """A site called several times in a loop, its calls matched by position (the j-th of every replica one loss: decoder
    levels, heads): refused once the number of calls changed from one step to another, for good, since the loop runs
    over what the chunk holds (the classes present, its instances), whose j-th items differ between replicas."""
    calls = len(site.coeffs)
    if not site.in_loop or (calls < 2 and site.key not in memory.loops):
        return
    seen = memory.loops.setdefault(site.key, calls)
    if seen != calls:
        memory.loops[site.key] = -1
    if memory.loops[site.key] == -1:
        raise NotExact(
            f"{site.name} at {site.where} is called in a loop a number of times that changes from step to step (a loop "
            f"over what the chunk holds: the classes present, its instances), so the j-th calls of the {who}s are not "
            "one loss; loop over a fixed list (every class, a fixed number of items) for an exact loss"
        )


def _divisors(sites: Sequence[SiteTerms]) -> list[float]:
    """Per call ``j`` of a site: ``c_ij * rows_ij`` of the first replica (the ``k`` of ``k * sum / rows``)."""
    return [c * r for c, r in zip(sites[0].coeffs, sites[0].rows)]


def _divided_sums(
    sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, notes: list[str]
) -> bool:
    """Whether a site's calls are ``reduction="sum"`` losses each divided by its own input's rows in every replica
    (``F.cross_entropy(out, y, reduction="sum") / len(y)``): ``c_ij * rows_ij`` one number ``k_j`` over the replicas,
    so that one device's step, whose input holds every replica's rows, divides the whole sum by all of them.

    Where every replica's coefficients are one number too (chunks of equal rows), the division is the reading when
    ``k_j`` is 1 (``sum / len(y)``; else a constant coefficient, ``0.5 * sum``), said once, unless the site was read
    without doubt at an earlier step (``memory``). Inputs of one row in every replica whose chunks are not all one
    sample (a batch of one holding the chunk's rows in another dimension: ``F.cross_entropy(o.T[None], y[None],
    reduction="sum")``) are not divided by their rows: dividing by 1 is no division, and one row is neither a chunk's
    samples nor its points."""
    site = sites[0]
    if len(sites) < 2 or not all(site.sums) or any(s.sums != site.sums for s in sites):
        return False
    if any(r <= 0 for s in sites for r in s.rows):
        return False
    if site.name.startswith("torch.") and all(_penalty(sites, j) for j in range(len(site.coeffs))):
        return False  # one value in every replica: a penalty on the parameters (its own reading below)
    ks = _divisors(sites)
    divides = all(math.isclose(c * r, k, rel_tol=1e-9, abs_tol=0.0)
                  for s in sites for c, r, k in zip(s.coeffs, s.rows, ks))
    constant = all(s.coeffs == site.coeffs for s in sites)
    if divides and not constant:
        memory.sums[site.key] = "divided"
        return True
    if not (divides and constant):
        if constant and memory.sums.get(site.key) != "counted":
            memory.sums[site.key] = "constant"
        return False
    if site.key in memory.sums:
        return memory.sums[site.key] == "divided"
    if all(r == 1 for s in sites for r in s.rows):  # one row in every replica: a division by it is none
        memory.sums[site.key] = "constant"
        if all(sm.samples == 1 for sm in summaries):
            notes.append(
                f"sparse_dp: {site.name} at {site.where} (reduction='sum') is over one row in every {who} (one sample "
                "each): read as its sum. If the step divides it by its rows (sum / len(y)), which one row cannot show, "
                "write reduction='mean' instead, which is that and exact."
            )
        return False
    if all(math.isclose(k, 1.0, rel_tol=1e-9) for k in ks):
        notes.append(
            f"sparse_dp: {site.name} at {site.where} (reduction='sum') has one coefficient in every {who}, one over its "
            f"input's rows, which are as many in every {who}: read as its sum divided by its rows (sum / len(y)), so "
            "the whole batch's sum divided by all its rows, not a constant times the sum. If it is a constant (0.5 * "
            "sum), the first batch whose chunks differ in size settles it."
        )
        return True
    return False


def _undivided(sites: Sequence[SiteTerms], summaries: Sequence[Summary], j: int) -> bool:
    """Whether call ``j`` is ``F.kl_div(..., reduction="batchmean")`` on a batch of one holding the chunk's rows in
    another dimension (``F.kl_div(logp[None], q[None], reduction="batchmean")``): torch divides by ``input.size(0)``,
    1 in every replica and in the whole batch, so the call is its sum, and the chunks' sums add up to one device's;
    their shares of a mean over that one row would average them instead. One row is neither a chunk's samples nor
    its points where some chunk holds several samples."""
    return (
        len(sites) > 1 and any(sm.samples != 1 for sm in summaries)
        and all(s.rows[j] == 1 and s.denominators[j] == 1.0 for s in sites)
    )


def _penalty(sites: Sequence[SiteTerms], j: int) -> bool:
    """Whether call ``j`` of a full ``torch.sum`` site is one quantity of the parameters (a penalty,
    ``w.pow(2).sum()``): one value over one number of rows in every replica. A sum over rows of each chunk's own (as
    many as its samples or points) that happens to give one value in every replica (a count of something the chunks
    hold alike) is the chunks' sum, as a sum over other rows is."""
    return _one_value([s.values[j] for s in sites]) and len({s.rows[j] for s in sites}) == 1


def _one_value(values: Sequence[float]) -> bool:
    """Whether every replica's value is one number, to rounding (``_SAME``): a quantity of the parameters."""
    return all(math.isclose(v, values[0], rel_tol=_SAME, abs_tol=0.0) for v in values)


__all__ = ["NO_WEIGHTING", "NotExact", "Reading", "chunk_condition", "read_site"]
