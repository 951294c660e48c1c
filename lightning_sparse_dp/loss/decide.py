"""Decide: each captured loss of each replica (rank) weighted by its own share of the batch.

Replica ``i``'s step calls torch's mean-reduced losses ``L_ik`` with denominators ``D_ik``
(:mod:`lightning_sparse_dp.loss.capture`) and returns ``loss_i = sum_k c_ik L_ik + r``. Which of its terms
are one criterion of the whole batch is read from where the user's code called them (the call site,
:func:`lightning_sparse_dp.loss.sites.call_site`):

- **Matched terms** (a loss called once per step, the levels of a decoder, heads): the ``j``-th call of
  a site in every replica is one criterion; its whole-batch value is ``T = sum_i D_ij L_ij / D_j`` with
  ``D_j = sum_i D_ij`` (torch's mean, computed in parts: docs/exactness.md), so its gradient reaches
  replica ``i``'s call with weight ``c_j D_ij / D_j``. A ``reduction="sum"`` call is ``T = sum_i L_ij``
  (each replica's sum counts once).
- **Per-sample terms** (a loop over the chunk's samples, ``[F.cross_entropy(out_s, y_s) for s in
  ...]``): a site called once per sample of the chunk in every replica, whose inputs' rows are each
  sample's points (or one row each), or whose number of calls follows the chunks' samples. Every call
  is its own criterion; the one-device step calls it ``B`` times with one coefficient ``c``: ``C / B``
  when each replica's ``c_i b_i`` is one ``C`` (``sum(losses) / len(losses)``,
  ``torch.stack(losses).mean()``), or ``c_i`` itself when that is the same in every replica (a sum, or a
  division by the whole batch's size).

The remainder ``r`` (a constant, a penalty on the parameters) must be one value in every replica, to
rounding. A loss that is not such a combination, whose replicas called different sequences of losses,
or one of whose terms is a statistic of the chunk (its input a reduction over the chunk's rows, as autograd
recorded it: ``F.mse_loss(out.F.mean(0), target)``, :func:`~lightning_sparse_dp.loss.sites.reduces_rows`) is weighted
per replica as
``"auto"`` does, and the reason is said once. Readings of ambiguous steps (chunks of equal sizes) are
said once too, and the reading of a site seen once without ambiguity is kept for later steps
(:class:`SiteMemory`).

``sparse_dp`` decides on its replicas' :class:`Summary` objects in its process; ``sparse_ddp`` gathers the
ranks' summaries (``all_gather_object``) and every rank decides alike.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_sparse_dp.loss.capture import TermCapture
from lightning_sparse_dp.loss.sites import unweighable
from lightning_sparse_dp.split import SplitPlan

_SAME = 1e-12  # relative difference of two coefficients still taken as one (they come from the same Python numbers)


@dataclass(frozen=True)
class ChunkShape:
    """What one replica's (rank's) share of the batch holds, as a loss's rows are read against it.

    Attributes:
        samples: ``b_i``, samples in the chunk.
        sample_points: per coordinate source, the points of each of the chunk's samples, in order.
    """

    samples: int
    sample_points: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, plan: SplitPlan, chunk: int) -> ChunkShape:
        """Chunk ``chunk`` of ``plan``."""
        ids = plan.chunk_samples[chunk]
        points = tuple(tuple(counts[ids].tolist()) for counts in plan.sample_points)
        return cls(int(ids.numel()), points)

    def per_sample(self, rows: Sequence[int]) -> bool:
        """Whether a site's calls, with inputs of ``rows`` rows, are one per sample of a chunk of several:
        one row each, or each sample's points (of some coordinate source, in any order)."""
        if len(rows) != self.samples or self.samples < 2:
            return False
        if all(r == 1 for r in rows):
            return True
        ordered = sorted(rows)
        return any(sorted(points) == ordered for points in self.sample_points)

    def some_samples(self, rows: Sequence[int]) -> bool:
        """Whether a site's calls, with inputs of ``rows`` rows, are one per sample for some of a chunk's samples (a
        loop over the samples that skips those with nothing to average: ``if (y[s == k] != ignore).any()``): each
        call's rows are a different sample's points (of one coordinate source), or one row each (pooled per sample)."""
        if not rows or len(rows) > self.samples:
            return False
        if all(r == 1 for r in rows):  # one row per sample (pooled): the rows cannot name the samples
            return True
        for points in self.sample_points:
            left = list(points)
            for r in rows:
                if r not in left:
                    break
                left.remove(r)
            else:
                return True
        return False


@dataclass
class SiteTerms:
    """The calls of one call site in one replica's step, in call order (what :func:`decide` reads of them)."""

    key: int
    where: str
    name: str
    in_loop: bool
    sums: list[bool]  # reduction="sum"
    coeffs: list[float]
    denominators: list[float]
    values: list[float]
    rows: list[int]
    per_sample: bool  # the rows are one per sample of the chunk (ChunkShape.per_sample)
    statistic: list[bool]  # each call's input is a reduction over rows (terms.reduces_rows)
    shared: list[int] = field(default_factory=list)  # each call's arguments for all its rows alike, fingerprinted
    some_samples: bool = False  # the rows are some of the chunk's samples' points, one call each (ChunkShape.some_samples)


@dataclass
class Summary:
    """One replica's (rank's) value as a combination of its terms, or ``reason`` it is not one.

    ``order[t]`` is ``(site position, call index)`` of the capture's term ``t``; ``tolerance`` is the
    rounding within which two replicas' remainders are one value.
    """

    reason: str | None
    samples: int
    n: float = 0.0
    sites: list[SiteTerms] = field(default_factory=list)
    order: list[tuple[int, int]] = field(default_factory=list)
    remainder: float = 0.0
    tolerance: float = 0.0
    collectives: list[str] = field(default_factory=list)  # torch.distributed calls of the user's code in the step


def summarize(
    capture: TermCapture | None, value: Any, shape: ChunkShape, n: float = 0.0, collectives: Sequence[str] = ()
) -> Summary:
    """The :class:`Summary` of one replica's ``value`` (its loss, or a logged value) on a chunk of ``shape``.

    ``n`` rides along: the replica's ``"auto"`` count (summed by :func:`decide` for the fallback), and
    ``collectives``: where the step's own code called ``torch.distributed`` (:mod:`lightning_sparse_dp.loss.collectives`).
    """
    comb = capture.combination(value) if capture is not None else "nothing was captured"
    if isinstance(comb, str):
        return Summary(comb, shape.samples, n, collectives=list(collectives))
    coeffs, r, scale = comb
    assert capture is not None
    # terms whose gradient the strategy cannot weight: only a value that carries a gradient (the loss) is refused
    why = unweighable([t for t, c in zip(capture.terms, coeffs) if c != 0.0]) if value.requires_grad else None
    if why is not None:
        return Summary(why, shape.samples, n, collectives=list(collectives))
    capture.read_numbers()
    out = Summary(
        None, shape.samples, n, remainder=r, tolerance=64 * torch.finfo(value.dtype).eps * scale, collectives=list(collectives)
    )
    position: dict[int, int] = {}
    for term, c in zip(capture.terms, coeffs):
        p = position.setdefault(term.site, len(out.sites))
        if p == len(out.sites):
            out.sites.append(SiteTerms(term.site, term.where, term.name, term.in_loop, [], [], [], [], [], False, []))
        site = out.sites[p]
        d, v = term.numbers()
        out.order.append((p, len(site.coeffs)))
        site.sums.append(term.is_sum)
        site.coeffs.append(c)
        site.denominators.append(d)
        site.values.append(v)
        site.rows.append(term.rows)
        site.statistic.append(term.statistic)
        site.shared.append(_fingerprint(term.shared))
        site.in_loop = site.in_loop or term.in_loop
    for site in out.sites:
        site.per_sample = shape.per_sample(site.rows)
        site.some_samples = site.in_loop and shape.some_samples(site.rows)
    return out


def _fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """A checksum of ``tensors``' shapes and values (float64 on the host; 0 for none), the same in every process."""
    if not tensors:
        return 0
    out = 0
    for t in tensors:
        values = t.detach().to("cpu", torch.float64).contiguous()
        out = zlib.crc32(values.numpy().tobytes(), zlib.crc32(repr(tuple(t.shape)).encode(), out))
    return out


class SiteMemory(dict):
    """Per call site (its key), how it was read where the step left no doubt: ``("samples", "mean" | "sum" |
    None)`` or ``("matched", None)``; kept by the strategy for the run, so that a later step of equal chunks reads
    the site as before. Every rank of ``sparse_ddp`` builds the same memory from the same summaries.

    ``loops``: per call site inside a loop of the user's code whose calls are matched by position, how many times each
    replica's step called it (``-1`` once that changed from step to step: a loop over what the chunk holds).
    ``sums``: per site of ``reduction="sum"`` calls, ``"divided"`` (by their inputs' rows) or ``"constant"`` (one
    coefficient), where a step of unequal chunks told which (:func:`_divided_sums`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loops: dict[int, int] = {}
        self.sums: dict[int, str] = {}


@dataclass
class Decision:
    """What the replicas' summaries say: ``value`` (the whole batch's), or ``reason`` it is not a combination.

    ``scales[i][t]``: the gradient scale of replica ``i``'s term ``t``, its share ``s_it`` of the whole batch's term
    (:meth:`~lightning_sparse_dp.loss.reweight.PartWeight.scale_terms` divides it by the replica's weight in the
    reduction; ``None``: the term's gradient is the replica's weight, as the remainder's, for a full sum that has one
    value in every replica); ``empty`` names the terms
    the value uses with nothing to average over in the whole batch (the value is then NaN, as on one
    device); ``notes``: readings of an ambiguous step, each to be said once.
    """

    value: float | None
    reason: str | None = None
    scales: list[list[float | None]] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    count: float = 0.0  # replicas or ranks
    n: float = 0.0  # sum of the n_i (the "auto" counts)


class _NotExact(Exception):
    """A reason the value is not a combination of the whole batch's terms (the message is the reason)."""


def decide(summaries: Sequence[Summary], memory: SiteMemory | None = None, who: str = "replica") -> Decision:
    """The whole batch's value of one value per replica (rank), from their :class:`Summary` objects.

    Args:
        summaries: one per replica (rank), in order.
        memory: readings of call sites kept across steps (updated here); ``None``: none kept.
        who: ``"replica"`` or ``"rank"``, for the reasons and notes.
    """
    memory = SiteMemory() if memory is None else memory
    out = Decision(None, count=float(len(summaries)), n=sum(s.n for s in summaries))
    reason = next((s.reason for s in summaries if s.reason is not None), None)
    calls = sorted({c for s in summaries for c in s.collectives})
    if reason is None and calls:  # a value the step normalized across ranks itself: its terms are not the batch's
        reason = f"the step's own code calls {', '.join(calls)}, so its values are not the chunks' own"
    if reason is not None:
        out.reason = reason
        return out
    try:
        _decide(summaries, memory, who, out)
    except _NotExact as err:
        out.reason, out.value, out.scales, out.empty = str(err), None, [], []
    return out


def _decide(summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision) -> None:
    if len({tuple(site.key for site in s.sites) for s in summaries}) > 1:
        raise _NotExact(
            f"the {who}s' steps called different sequences of mean-reduced losses (e.g. a loss computed only when the "
            "chunk has something for it)"
        )
    rs = [s.remainder for s in summaries]
    if max(rs) - min(rs) > max(s.tolerance for s in summaries) or not all(map(math.isfinite, rs)):
        raise _NotExact(
            f"a part of it differs from {who} to {who} and is not one of torch's mean-reduced losses (e.g. a "
            "hand-written masked mean such as (loss * mask).sum() / mask.sum())"
        )
    value = rs[0]
    site_scales: list[list[list[float | None]]] = [[[] for _ in s.sites] for s in summaries]
    for p in range(len(summaries[0].sites)):
        sites = [s.sites[p] for s in summaries]
        if _per_sample(sites, summaries, memory, who, out.notes):
            part, per_replica = _samples_part(sites, summaries, memory, who, out)
        else:
            part, per_replica = _matched_part(sites, summaries, memory, who, out)
        value += part
        for i, site_scale in enumerate(per_replica):
            site_scales[i][p] = site_scale
    out.value = value
    out.scales = [[site_scales[i][p][j] for p, j in s.order] for i, s in enumerate(summaries)]


def _per_sample(sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, notes: list[str]) -> bool:
    """Whether a site's calls are one per sample (each its own criterion), else matched by position."""
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


def _samples_part(
    sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision
) -> tuple[float, list[list[float]]]:
    """A per-sample site: its whole-batch part of the value and each call's gradient scale."""
    site = sites[0]
    for s in sites:
        if any(not math.isclose(c, s.coeffs[0], rel_tol=_SAME, abs_tol=0.0) for c in s.coeffs):
            raise _NotExact(f"the per-sample losses {site.name} at {site.where} are combined with different coefficients")
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
            if not math.isclose(means[0], 1.0, rel_tol=1e-9) and len(sites) > 1:
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
        raise _NotExact(
            f"the per-sample losses {site.name} at {site.where} have coefficients that are neither one number in every "
            f"{who} (a sum) nor one number over the chunk's samples (a mean)"
        )
    if any(s.per_sample for s in sites) or len({len(s.coeffs) for s in sites}) > 1:
        memory.setdefault(site.key, ("samples", None))
    c = means[0] / total if reading == "mean" else cs[0]
    part, per_replica = 0.0, []
    for s, ci in zip(sites, cs):
        for d, v, is_sum in zip(s.denominators, s.values, s.sums):
            if d == 0 and not is_sum and c != 0.0:
                part, out.empty = math.nan, out.empty + [site.name]
            part += c * v
        per_replica.append([c / ci if ci != 0.0 else None] * len(s.coeffs))  # None: not in the value (see below)
    return part, per_replica


def _matched_part(
    sites: Sequence[SiteTerms], summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision
) -> tuple[float, list[list[float]]]:
    """A site whose j-th call is one loss in every replica: its whole-batch part and each call's gradient scale."""
    site = sites[0]
    if len({len(s.coeffs) for s in sites}) > 1:
        raise _NotExact(
            f"the {who}s' steps called {site.name} at {site.where} different numbers of times (e.g. once per sample, "
            "with a sample that has no loss)"
        )
    divided = _divided_sums(sites, memory, who, out.notes)
    if any(s.coeffs != site.coeffs or s.sums != site.sums for s in sites) and not divided:
        if site.name.startswith("torch."):
            raise _NotExact(
                f"the {who}s' steps divided {site.name} at {site.where} by different numbers: a hand-written masked "
                "mean such as (loss * mask).sum() / mask.sum(), or a sum over a count of the chunk"
            )
        raise _NotExact(
            f"the {who}s' steps combined {site.name} at {site.where} with different coefficients (e.g. divided by a "
            "count of the chunk)"
        )
    if any(len(s.coeffs) != sm.samples for s, sm in zip(sites, summaries)):
        memory.setdefault(site.key, ("matched", None))
    _check_loop(site, memory, who)
    per_replica: list[list[float | None]] = [[] for _ in sites]
    part = 0.0
    if divided:  # sum-reduced calls, each divided by its own input's rows: the whole batch's sum over all rows
        total = [sum(s.rows[j] for s in sites) for j in range(len(site.coeffs))]
        for j, k in enumerate(_divisors(sites)):
            part += k * sum(s.values[j] for s in sites) / total[j]
            for s, scale in zip(sites, per_replica):
                scale.append(s.rows[j] / total[j])  # (k / total) over the replica's own k / rows
        return part, per_replica
    for j, c in enumerate(site.coeffs):
        if c == 0.0:  # not in the value: a gradient reaches it only through other terms, already weighted there
            for scale in per_replica:
                scale.append(None)
            continue
        if len(sites) > 1 and any(s.shared[j] != site.shared[j] for s in sites):
            raise _NotExact(
                f"the weight given to {site.name} at {site.where} (a class weight, pos_weight) differs from {who} to "
                f"{who}: computed from the chunk (e.g. from its labels' class frequencies), where one device weights "
                "every row by the whole batch's, which no combination of the chunks' losses gives. Compute it from the "
                "dataset, or from the whole batch in on_before_batch_transfer and keep it on the module "
                "(self.class_weights), so that every replica is given the same"
            )
        if len(sites) > 1 and any(s.statistic[j] for s in sites):
            raise _NotExact(
                f"the input of {site.name} at {site.where} is a reduction over the chunk's rows: a statistic of the "
                "chunk (e.g. out.F.mean(0), or a top-k / sort of its rows' losses), which no split of the batch "
                "computes as one device does"
            )
        if site.sums[j] and site.name.startswith("torch.") and len(sites) > 1 and _one_value([s.values[j] for s in sites]):
            part += c * site.values[j]  # one value in every replica: of the parameters (a penalty), not of the chunks
            for scale in per_replica:
                scale.append(None)  # its gradient as the remainder's: the replica's weight
            continue
        if site.sums[j]:
            part += c * sum(s.values[j] for s in sites)
            for scale in per_replica:
                scale.append(1.0)
            continue
        total = sum(s.denominators[j] for s in sites)
        if total > 0:
            part += c * sum(s.denominators[j] * s.values[j] for s in sites) / total
        elif c != 0.0:
            part, out.empty = math.nan, out.empty + [site.name]
        for s, scale in zip(sites, per_replica):
            scale.append(s.denominators[j] / total if total > 0 else 0.0)
    return part, per_replica


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
        raise _NotExact(
            f"{site.name} at {site.where} is called in a loop a number of times that changes from step to step (a loop "
            f"over what the chunk holds: the classes present, its instances), so the j-th calls of the {who}s are not "
            "one loss; loop over a fixed list (every class, a fixed number of items) for an exact loss"
        )


def _divisors(sites: Sequence[SiteTerms]) -> list[float]:
    """Per call ``j`` of a site: ``c_ij * rows_ij`` of the first replica (the ``k`` of ``k * sum / rows``)."""
    return [c * r for c, r in zip(sites[0].coeffs, sites[0].rows)]


def _divided_sums(sites: Sequence[SiteTerms], memory: SiteMemory, who: str, notes: list[str]) -> bool:
    """Whether a site's calls are ``reduction="sum"`` losses each divided by its own input's rows in every replica
    (``F.cross_entropy(out, y, reduction="sum") / len(y)``): ``c_ij * rows_ij`` one number ``k_j`` over the replicas,
    so that one device's step, whose input holds every replica's rows, divides the whole sum by all of them.

    Where every replica's coefficients are one number too (chunks of equal rows), the division is the reading when
    ``k_j`` is 1 (``sum / len(y)``; else a constant coefficient, ``0.5 * sum``), said once, unless the site was read
    without doubt at an earlier step (``memory``)."""
    site = sites[0]
    if len(sites) < 2 or not all(site.sums) or any(s.sums != site.sums for s in sites):
        return False
    if any(r <= 0 for s in sites for r in s.rows):
        return False
    if site.name.startswith("torch.") and all(_one_value([s.values[j] for s in sites]) for j in range(len(site.coeffs))):
        return False  # one value in every replica: a penalty on the parameters (its own reading below)
    ks = _divisors(sites)
    divides = all(math.isclose(c * r, k, rel_tol=1e-9, abs_tol=0.0)
                  for s in sites for c, r, k in zip(s.coeffs, s.rows, ks))
    constant = all(s.coeffs == site.coeffs for s in sites)
    if divides and not constant:
        memory.sums[site.key] = "divided"
        return True
    if not (divides and constant):
        if constant:
            memory.sums[site.key] = "constant"
        return False
    if site.key in memory.sums:
        return memory.sums[site.key] == "divided"
    if all(math.isclose(k, 1.0, rel_tol=1e-9) for k in ks):
        notes.append(
            f"sparse_dp: {site.name} at {site.where} (reduction='sum') has one coefficient in every {who}, one over its "
            f"input's rows, which are as many in every {who}: read as its sum divided by its rows (sum / len(y)), so "
            "the whole batch's sum divided by all its rows, not a constant times the sum. If it is a constant (0.5 * "
            "sum), the first batch whose chunks differ in size settles it."
        )
        return True
    return False


def _one_value(values: Sequence[float]) -> bool:
    """Whether every replica's value is one number, to rounding (``_SAME``): a quantity of the parameters."""
    return all(math.isclose(v, values[0], rel_tol=_SAME, abs_tol=0.0) for v in values)


__all__ = ["ChunkShape", "Decision", "SiteMemory", "SiteTerms", "Summary", "decide", "summarize"]
