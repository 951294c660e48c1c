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
(:class:`~lightning_sparse_dp.loss.memory.SiteMemory`).

How each site enters the value (:class:`~lightning_sparse_dp.loss.readings.Reading`, read in full by
:func:`~lightning_sparse_dp.loss.readings.read_site`) and the notes said on the way depend on the step's structure,
not on the calls' values: which sites each replica called how often, with which coefficients and reductions, the rows
of its sums, what the chunks hold and what :class:`~lightning_sparse_dp.loss.memory.SiteMemory` held for those sites
(:func:`structure`, a key). A decision that read every site without its values (not a full ``torch.sum`` of one value
in every replica) and left the memory of its sites as it found it is kept under its key; a later decision of the same
key takes those readings and notes and computes only what the values give (:func:`site_part`). Any other is derived in
full, with the same readings, notes, memory and refusals: a site whose calls, rows, coefficients or chunks' samples
changed has another key.

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
from lightning_sparse_dp.loss.classes import class_part
from lightning_sparse_dp.loss.memory import SiteMemory
from lightning_sparse_dp.loss.readings import NotExact, Reading, chunk_condition, read_site
from lightning_sparse_dp.loss.sites import unweighable
from lightning_sparse_dp.split import SplitPlan


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
    counted: list[bool] = field(default_factory=list)  # each call's coefficient divided by a count of the chunk (Form)
    classes: list[int | None] = field(default_factory=list)  # each call's one target class (Term.target_class), or None


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
    hindered = value.requires_grad and not capture.weighable  # a term checkpointed or unrecorded: is it in the value?
    why = unweighable([t for t, c in zip(capture.terms, coeffs) if c != 0.0]) if hindered else None
    if why is not None:
        return Summary(why, shape.samples, n, collectives=list(collectives))
    out = Summary(
        None, shape.samples, n, remainder=r, tolerance=64 * torch.finfo(value.dtype).eps * scale, collectives=list(collectives)
    )
    position: dict[int, int] = {}
    form = capture.forms.get(id(value))  # the terms divided by a count of the chunk (Form.counted)
    counted = frozenset() if form is None else form.counted
    for k, (term, c) in enumerate(zip(capture.terms, coeffs)):
        p = position.setdefault(term.site, len(out.sites))
        if p == len(out.sites):
            out.sites.append(SiteTerms(term.site, term.where, term.name, term.in_loop, [], [], [], [], [], False, []))
        site = out.sites[p]
        d, v = term._numbers or term.numbers()  # read by capture.combination above (TermCapture.read_numbers)
        out.order.append((p, len(site.coeffs)))
        site.sums.append(term.denominator is None)  # term.is_sum
        site.coeffs.append(c)
        site.denominators.append(d)
        site.values.append(v)
        site.rows.append(term.rows)
        site.statistic.append(term.statistic)
        site.shared.append(_fingerprint(term.shared) if term.shared else 0)
        site.counted.append(k in counted)
        site.classes.append(term.target_class() if term.bounds is not None else None)
        site.in_loop = site.in_loop or term.in_loop
    for site in out.sites:
        site.per_sample = len(site.rows) == shape.samples and shape.per_sample(site.rows)  # one call per sample first
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


@dataclass
class Decision:
    """What the replicas' summaries say: ``value`` (the whole batch's), or ``reason`` it is not a combination.

    ``scales[i][t]``: the gradient scale of replica ``i``'s term ``t``, its share ``s_it`` of the whole batch's term
    (:meth:`~lightning_sparse_dp.loss.reweight.PartWeight.scale_terms` divides it by the replica's weight in the
    reduction; ``None``: the term's gradient is the replica's weight, as the remainder's, for a full sum that has one
    value in every replica); ``empty`` names the terms
    the value uses with nothing to average over in the whole batch (the value is then NaN, as on one
    device); ``notes``: readings of an ambiguous step, each to be said once; ``combined``: every replica's value was a
    combination of its terms, so that a ``reason`` refuses how the replicas called them (different call counts,
    coefficients), not the value's form.
    """

    value: float | None
    reason: str | None = None
    scales: list[list[float | None]] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    count: float = 0.0  # replicas or ranks
    n: float = 0.0  # sum of the n_i (the "auto" counts)
    sites: frozenset = frozenset()  # the loss call sites the first replica's step called (their _signature)
    combined: bool = False  # every summary a combination of terms: a reason then refuses the replicas' calls of them


def _signature(site: SiteTerms) -> tuple:
    """A loss call site as the exactness check tells checked steps from others: its key, whether a call of it enters the
    value (a coefficient not 0: a term after a warm-up from 0) and how many times the step called it (a helper called
    from a second place; in a loop, once or more: a loop over the chunk's samples calls it as many times as they are)."""
    return site.key, any(c != 0.0 for c in site.coeffs), min(len(site.coeffs), 2) if site.in_loop else len(site.coeffs)


def decide(summaries: Sequence[Summary], memory: SiteMemory | None = None, who: str = "replica") -> Decision:
    """The whole batch's value of one value per replica (rank), from their :class:`Summary` objects.

    Args:
        summaries: one per replica (rank), in order.
        memory: readings of call sites kept across steps (updated here); ``None``: none kept.
        who: ``"replica"`` or ``"rank"``, for the reasons and notes.
    """
    memory = SiteMemory() if memory is None else memory
    out = Decision(None, count=float(len(summaries)), n=sum(s.n for s in summaries),
                   sites=frozenset(map(_signature, summaries[0].sites)) if summaries else frozenset())
    reason = next((s.reason for s in summaries if s.reason is not None), None)
    calls = sorted({c for s in summaries for c in s.collectives})
    if reason is None and calls:  # a value the step normalized across ranks itself: its terms are not the batch's
        reason = f"the step's own code calls {', '.join(calls)}, so its values are not the chunks' own"
    if reason is not None:
        out.reason = reason
        return out
    out.combined = bool(summaries)
    key = structure(summaries, memory, who) if summaries else None
    recalled = memory.recalled.get(key) if key is not None else None
    try:
        if recalled is not None:  # a step of the same structure was read before: its readings, its notes
            _decide(summaries, memory, who, out, recalled[0])
            out.notes = list(recalled[1])  # after: a remainder refused reads no site, says nothing
        else:
            readings = _decide(summaries, memory, who, out)
            if key is not None and all(r.steady for r in readings) and structure(summaries, memory, who) == key:
                memory.recall(key, readings, out.notes)  # read without the values, the memory left as it was
    except NotExact as err:
        out.reason, out.value, out.scales, out.empty = str(err), None, [], []
    return out


def _decide(
    summaries: Sequence[Summary], memory: SiteMemory, who: str, out: Decision, readings: list[Reading] | None = None
) -> list[Reading]:
    """The value and scales into ``out``; each site read in full (:func:`~lightning_sparse_dp.loss.readings.read_site`),
    or as ``readings`` recalled for the step's structure (:func:`structure`). Returns the readings."""
    if readings is None and len({tuple(site.key for site in s.sites) for s in summaries}) > 1:
        raise NotExact(f"the {who}s' steps called different sequences of mean-reduced losses: {chunk_condition(who)}")
    rs = [s.remainder for s in summaries]
    if max(rs) - min(rs) > max(s.tolerance for s in summaries) or not all(map(math.isfinite, rs)):
        raise NotExact(
            f"a part of it differs from {who} to {who} and is not one of torch's mean-reduced losses (e.g. a "
            "hand-written masked mean such as (loss * mask).sum() / mask.sum())"
        )
    value = rs[0]
    read = [] if readings is None else readings
    site_scales: list[list[list[float | None]]] = [[[] for _ in s.sites] for s in summaries]
    for p in range(len(summaries[0].sites)):
        sites = [s.sites[p] for s in summaries]
        if readings is None:
            read.append(read_site(sites, summaries, memory, who, out))
        part, per_replica = site_part(read[p], sites, out)
        value += part
        for i, site_scale in enumerate(per_replica):
            site_scales[i][p] = site_scale
    out.value = value
    out.scales = [[site_scales[i][p][j] for p, j in s.order] for i, s in enumerate(summaries)]
    return read


def structure(summaries: Sequence[Summary], memory: SiteMemory, who: str) -> tuple:
    """What a decision on ``summaries`` reads apart from the calls' values and denominators, as a key: per replica its
    chunk's samples and, per site, its place, name, calls (coefficients, reductions, rows of its sums, statistics, shared
    arguments' fingerprints, classes) and how its rows match the chunk's samples; and ``memory`` for the first's sites."""
    keys = tuple(site.key for site in summaries[0].sites)
    return (
        who,
        tuple(
            (s.samples, tuple(
                (site.key, site.where, site.name, site.in_loop, tuple(site.sums), tuple(site.coeffs),
                 tuple(site.rows) if any(site.sums) else None, site.per_sample, site.some_samples,
                 tuple(site.statistic), tuple(site.shared), tuple(site.counted), tuple(site.classes))
                for site in s.sites
            ))
            for s in summaries
        ),
        tuple((memory.get(k), memory.loops.get(k), memory.sums.get(k), memory.classes.get(k)) for k in keys),
    )


def site_part(reading: Reading, sites: Sequence[SiteTerms], out: Any) -> tuple[float, list[list[float | None]]]:
    """One site's whole-batch part of the value and each call's gradient scale, replica by replica, as ``reading``
    reads its calls (``sites``: the site's :class:`~lightning_sparse_dp.loss.decide.SiteTerms` of every replica). A
    mean over nothing in the whole batch makes the part NaN and adds the site's name to ``out.empty`` (a
    :class:`~lightning_sparse_dp.loss.decide.Decision`)."""
    site = sites[0]
    part = 0.0
    if reading.kind == "classes":
        return class_part(reading, sites, out)
    if reading.kind == "samples":
        c, scales = reading.c, []
        for s in sites:
            ci = s.coeffs[0]
            for d, v, is_sum in zip(s.denominators, s.values, s.sums):
                if d == 0 and not is_sum and c != 0.0:
                    part, out.empty = math.nan, out.empty + [site.name]
                part += c * v
            scales.append([c / ci if ci != 0.0 else None] * len(s.coeffs))  # None: not in the value
        return part, scales
    per_replica: list[list[float | None]] = [[] for _ in sites]
    for j, (use, c) in enumerate(reading.calls):
        if reading.kind == "divided":  # the whole batch's sum over all rows, divided by them
            rows = sum(s.rows[j] for s in sites)
            part += c * sum(s.values[j] for s in sites) / rows
            for s, scale in zip(sites, per_replica):
                scale.append(s.rows[j] / rows)  # (k / rows) over the replica's own k / its rows
        elif use == "skip" or use == "one":  # a gradient reaches it only through other terms, or as the remainder's
            if use == "one":
                part += c * site.values[j]  # one value in every replica: of the parameters, not of the chunks
            for scale in per_replica:
                scale.append(None)
        elif use == "sum":
            part += c * sum(s.values[j] for s in sites)
            for scale in per_replica:
                scale.append(1.0)
        else:
            total = sum(s.denominators[j] for s in sites)
            if total > 0:
                part += c * sum(s.denominators[j] * s.values[j] for s in sites) / total
            else:
                part, out.empty = math.nan, out.empty + [site.name]
            for s, scale in zip(sites, per_replica):
                scale.append(s.denominators[j] / total if total > 0 else 0.0)
    return part, per_replica


__all__ = [
    "ChunkShape", "Decision", "SiteTerms", "Summary", "decide", "site_part", "structure",
    "summarize",
]
