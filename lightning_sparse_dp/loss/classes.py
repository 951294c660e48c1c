"""Classes: per-class losses in a loop, paired across replicas by the class each call computes, not by position.

A loss summed (or averaged) over the classes a chunk holds::

    for c in y.unique():
        m = y == c
        loss = loss + F.cross_entropy(logits[m], y[m])
    loss = loss / len(y.unique())

makes one call per class present. Chunks that lack different classes make as many calls each (3 of 4 classes), so
the ``j``-th calls of the replicas are over different classes and pairing them by position
(:func:`~lightning_sparse_dp.loss.readings.read_site`) adds class 2's points of one chunk to class 3's of another:
wrong, and with nothing in the step's structure to show it. Each such call's targets are read
(:func:`~lightning_sparse_dp.loss.denominators.class_bounds`, :func:`one_class`): where every call of a site in a loop
is over one class, the calls of one class are one criterion
across the replicas, whatever their positions, and the whole batch's calls are one per class of the union of the
chunks' classes (the classes one device's batch holds). Its value is ``sum_c k_c T_c`` with ``T_c = sum_i D_ic L_ic /
sum_i D_ic`` (torch's mean in parts), and ``k_c``:

- ``"sum"``: the coefficient of class ``c``'s calls, one number in every replica that called it (a sum, class weights
  given by the class);
- ``"mean"``: ``M / K`` where every replica's calls share one coefficient ``c_i`` with ``c_i n_i = M`` over its
  ``n_i`` calls (a mean over the classes the chunk holds) and ``K`` is the union's classes.

Where both fit (one coefficient everywhere, as many calls in every replica) ``c n = 1`` is read as the mean
(``/ len(y.unique())``) and ``c = 1`` as the sum, any other (or one call each, where the two are one) as the mean if
``c n = 1``, else the sum, said once; nothing is said where the two agree (the chunks hold the same classes) or an
earlier step told them apart
(:attr:`~lightning_sparse_dp.loss.memory.SiteMemory.classes`). Calls whose positions hold different classes but cannot
be paired so (a call over several classes or none, a class called twice by one replica, ``reduction="sum"``) are
refused: :class:`Unpaired`, which the reading turns into the fallback's reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sparse_dp.loss.decide import SiteTerms
    from lightning_sparse_dp.loss.memory import SiteMemory

#: one class's whole-batch criterion: its coefficient ``k_c`` and its calls, ``(replica, call index)`` in replica order
Group = tuple[float, tuple[tuple[int, int], ...]]

_SAME = 1e-9  # relative difference of two coefficients taken as one (as the per-sample reading's)


class Unpaired(Exception):
    """The ``j``-th calls of a site hold different classes and cannot be paired by class (the message says why)."""


def one_class(lo: float, hi: float) -> int | None:
    """The class of a call whose targets' bounds (:func:`~lightning_sparse_dp.loss.denominators.class_bounds`, read as
    floats: class indices are small integers) are one, else ``None`` (several classes, or none)."""
    return int(lo) if lo == hi else None


def _positions_differ(sites: Sequence[SiteTerms]) -> bool:
    """Whether some position ``j`` holds calls of two different known classes in two replicas."""
    for j in range(min(len(s.classes) for s in sites)):
        known = {s.classes[j] for s in sites if s.classes[j] is not None}
        if len(known) > 1:
            return True
    return False


def _known(sites: Sequence[SiteTerms]) -> bool:
    """Whether every call of the site is over one known class (a loop over classes calls each over one, ``y[y == c]``;
    a call over several, or none, is no such loop: decoder levels, a call per view)."""
    return all(len(s.classes) == len(s.coeffs) and all(k is not None for k in s.classes) for s in sites)


def _why_not(sites: Sequence[SiteTerms]) -> str | None:
    """Why the site's calls cannot be paired by their class, or ``None`` when they can."""
    for s in sites:
        if any(s.sums):
            return "its calls reduce by reduction='sum'"
        if any(c == 0.0 for c in s.coeffs):
            return "a call does not enter the loss (coefficient 0)"
        if any(s.statistic):
            return "a call's input is a statistic of the chunk"
        if len(set(s.classes)) != len(s.classes):
            return "a replica's step called it twice for one class"
    return None


def read_per_sample(
    sites: Sequence[SiteTerms], summaries: Sequence[Any], memory: SiteMemory, who: str, notes: list[str]
) -> bool | None:
    """For a site whose calls may be a loop over classes (each over one class, none twice in one replica's step):
    whether they are read one per sample (``True``) or paired by class (``False``); ``None`` for any other site.

    Calls over one class each are one per sample too where each of a chunk's samples holds one class of its own (rows
    that are the samples' points, or one row each): then a class in two replicas' chunks is one loss per class, two
    per sample. Rows that are not one per sample settle it for the site (``memory``: ``("classes", None)``); a step
    whose classes are each in one chunk reads alike both ways; else it is read per sample, said once.
    """
    site = sites[0]
    if len(sites) < 2 or not all(s.in_loop for s in sites) or not _known(sites) or _why_not(sites) is not None:
        return None
    calls = [len(s.coeffs) for s in sites]
    if any(n != sm.samples for n, sm in zip(calls, summaries)):
        fits = all(s.some_samples for s in sites)  # some of the samples, one call each
    else:
        fits = len(set(calls)) > 1 or any(s.per_sample for s in sites) or calls[0] == 1
    if not fits:
        memory[site.key] = ("classes", None)
        return False
    learned = memory.get(site.key, (None, None))[0]
    held = [set(s.classes) for s in sites]
    if len(set().union(*held)) == sum(map(len, held)) or learned == "classes":
        return False  # no class in two chunks: one loss per class is one per sample
    if learned != "samples":
        notes.append(
            f"sparse_dp: {site.name} at {site.where} is called in a loop once per sample of each {who}'s chunk, each call "
            f"over one class of its own, and a class is in several {who}s' chunks: taken as one loss per sample (each "
            "its own mean). If it is one loss per class (for c in y.unique()), it is not one device's until a batch "
            "whose chunks hold a class over several samples, which settles it."
        )
    return True


def pair_by_class(sites: Sequence[SiteTerms], memory: SiteMemory, who: str, notes: list[str]) -> tuple[Group, ...] | None:
    """A site's per-class calls grouped by their class, each group's coefficient in the whole batch's value; ``None``
    where the site is no such loop (its calls matched by position as before: a loss called once, decoder levels, a
    loop whose calls' classes are not all known and agree by position).

    Args:
        sites: the site's :class:`~lightning_sparse_dp.loss.decide.SiteTerms` of every replica (rank), in order.
        memory: what earlier steps told of the site's coefficients (read, and updated where this step tells).
        who: ``"replica"`` or ``"rank"``, for the reasons and notes.
        notes: where an ambiguous reading is said (the decision's notes).

    Raises:
        Unpaired: the ``j``-th calls hold different classes and cannot be paired by class, or their coefficients are
            neither one per class nor a mean over the classes each chunk holds.
    """
    site = sites[0]
    if len(sites) < 2 or not site.in_loop or not _known(sites):  # decoder levels whose coarse levels may happen
        return None  # to hold one class each, another in each replica: matched by position
    differ = _positions_differ(sites)
    why = _why_not(sites)
    if why is not None:
        if differ:
            raise Unpaired(
                f"the calls of {site.name} at {site.where}, in a loop, are over different classes at the same position "
                f"from {who} to {who} (a loop over the classes each chunk holds, such as for c in y.unique()), and they "
                f"cannot be paired by class: {why}"
            )
        return None  # the positions agree where the classes are known: matched by position, as before
    classes = sorted({k for s in sites for k in s.classes})  # type: ignore[type-var]
    members = {k: tuple((i, j) for i, s in enumerate(sites) for j, c in enumerate(s.classes) if c == k) for k in classes}
    for k, calls in members.items():
        if len({sites[i].shared[j] for i, j in calls}) > 1:
            raise Unpaired(
                f"the weight given to {site.name} at {site.where} (a class weight) differs from {who} to {who} for class "
                f"{k}: computed from the chunk, where one device weights every row by the whole batch's"
            )
    constant = all(_same([sites[i].coeffs[j] for i, j in calls]) for calls in members.values())
    means = [s.coeffs[0] * len(s.coeffs) for s in sites]
    mean = all(_same(s.coeffs) for s in sites) and _same(means)
    reading = _reading(site.key, constant, mean, means[0], len(classes), sites, memory, who, notes)
    if reading == "mean":
        return tuple((means[0] / len(classes), members[k]) for k in classes)
    return tuple((sites[calls[0][0]].coeffs[calls[0][1]], calls) for calls in members.values())


def _reading(
    key: int, constant: bool, mean: bool, m: float, union: int, sites: Sequence[SiteTerms], memory: SiteMemory, who: str,
    notes: list[str],
) -> str:
    """``"sum"`` (one coefficient per class) or ``"mean"`` (``m`` over the classes each chunk holds); refused where
    neither fits (:class:`Unpaired`)."""
    site = sites[0]
    if constant and mean:
        if all(len(s.coeffs) == union for s in sites):  # the chunks hold the batch's classes: the readings agree
            return "mean"
        learned = memory.classes.get(key)
        if learned is not None:
            return learned
        c, calls = site.coeffs[0], len(site.coeffs)
        if calls > 1 and (math.isclose(m, 1.0, rel_tol=_SAME) or math.isclose(c, 1.0, rel_tol=_SAME)):
            return "mean" if math.isclose(m, 1.0, rel_tol=_SAME) else "sum"  # / len(y.unique()), or a plain sum
        reading = "mean" if math.isclose(m, 1.0, rel_tol=_SAME) else "sum"
        taken = (f"{m:g} times their mean over the batch's {union} classes, not {c:g} times their sum" if reading == "mean"
                 else f"{c:g} times their sum over the batch's {union} classes, not {m:g} times their mean")
        notes.append(
            f"sparse_dp: the per-class losses {site.name} at {site.where} have the coefficient {c:g} in every {who}, each "
            f"{who} calling it for {calls} class(es): read as {taken}. The first batch whose chunks hold different "
            "numbers of classes settles it."
        )
        return reading
    if constant or mean:
        memory.classes[key] = "sum" if constant else "mean"
        return memory.classes[key]
    raise Unpaired(
        f"the per-class losses {site.name} at {site.where} have coefficients that are neither one number per class in "
        f"every {who} (a sum, class weights) nor one number over the classes each {who}'s chunk holds (a mean over them)"
    )


def _same(values: Sequence[float]) -> bool:
    return all(math.isclose(v, values[0], rel_tol=_SAME, abs_tol=0.0) for v in values)


def class_part(reading: Any, sites: Sequence[SiteTerms], out: Any) -> tuple[float, list[list[float | None]]]:
    """One per-class site's whole-batch part of the value and each call's gradient scale, replica by replica:
    ``reading.groups`` (:data:`Group` per class). Call ``(i, j)`` of class ``c`` gets ``(k_c / c_ij) D_ij / D_c``: its
    share of the class's mean over the replica's own coefficient. A class with nothing to average over in the whole
    batch (its weights 0) makes the part NaN and adds the site's name to ``out.empty``."""
    part = 0.0
    scales: list[list[float | None]] = [[0.0] * len(s.coeffs) for s in sites]
    for k, calls in reading.groups:
        total = sum(sites[i].denominators[j] for i, j in calls)
        if total > 0:
            part += k * sum(sites[i].denominators[j] * sites[i].values[j] for i, j in calls) / total
        else:
            part, out.empty = math.nan, out.empty + [sites[0].name]
        for i, j in calls:
            scales[i][j] = k / sites[i].coeffs[j] * sites[i].denominators[j] / total if total > 0 else 0.0
    return part, scales


__all__ = ["Group", "Unpaired", "class_part", "one_class", "pair_by_class", "read_per_sample"]
