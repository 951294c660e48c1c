"""A decision's readings kept for later steps of the same structure (``loss/decide.py``: ``structure``, ``SiteMemory.
recalled``): reused on steady steps, and never a decision the full derivation would not make, whatever the sequence of
steps (call counts, chunks' samples, coefficients, memory learned on the way)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sparse_dp.loss.decide as decide_module
from lightning_sparse_dp.loss.decide import SiteTerms, Summary, decide
from lightning_sparse_dp.loss.memory import SiteMemory
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer, unchecked


def _summary(samples: int, sites: list[tuple], remainder: float = 0.0) -> Summary:
    """``sites``: per site ``(key, name, in_loop, per_sample, some_samples, calls)``, each call ``(coefficient, sum,
    denominator, value, rows, statistic[, class])`` (the one class of its targets, ``None`` where not one)."""
    out = Summary(None, samples, remainder=remainder, tolerance=1e-12)
    for p, (key, name, in_loop, per_sample, some, calls) in enumerate(sites):
        site = SiteTerms(key, f"step.py:{key}", name, in_loop, [], [], [], [], [], per_sample, [], [], some)
        for j, (c, is_sum, d, v, rows, statistic, *one) in enumerate(calls):
            site.coeffs.append(c)
            site.sums.append(is_sum)
            site.denominators.append(1.0 if is_sum else d)
            site.values.append(v)
            site.rows.append(rows)
            site.statistic.append(statistic)
            site.shared.append(0)
            site.classes.append(one[0] if one else None)
            out.order.append((p, j))
        out.sites.append(site)
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _decisions(steps, recall: bool) -> list[tuple]:
    """Every step's decision (and the memory after it) through one memory, with or without recalled readings."""
    memory, out = SiteMemory(), []
    for summaries in steps:
        if not recall:
            memory.recalled.clear()
        d = decide(summaries, memory)
        out.append((d.value, d.reason, d.scales, d.empty, d.notes, dict(memory), dict(memory.loops), dict(memory.sums)))
    return out


def _check(steps) -> None:
    full, recalled = _decisions(steps, recall=False), _decisions(steps, recall=True)
    for i, (a, b) in enumerate(zip(full, recalled)):
        assert all(_same(x, y) for x, y in zip(a, b)), (i, a, b)


def _loop_step(calls: int, values: float) -> list[Summary]:
    return [_summary(4, [(7, "F.cross_entropy", True, False, False, [(1.0, False, 3.0 + i, values, 9, False)] * calls)])
            for i in range(2)]


def test_a_steady_step_reads_no_site_again(monkeypatch):
    calls = []
    read_site = decide_module.read_site
    monkeypatch.setattr(decide_module, "read_site", lambda *a: calls.append(1) or read_site(*a))
    memory = SiteMemory()
    for step in range(4):
        d = decide(_loop_step(2, 0.5 + step), memory)
        assert d.value == pytest.approx(2 * (0.5 + step)) and d.reason is None
    assert len(calls) == 2  # the first step (the loop's count learned), the second (read as the first left it), no more
    assert len(memory.recalled) == 1


def test_a_loop_whose_count_changes_is_refused_as_without_the_recall():
    steps = [_loop_step(n, 0.25 * i) for i, n in enumerate((2, 2, 2, 3, 2, 2))]
    _check(steps)
    decisions = _decisions(steps, recall=True)
    assert [d[1] is None for d in decisions] == [True, True, True, False, False, False]  # refused for good


def test_an_ambiguous_first_step_settled_later_reads_the_settled_way_on_equal_chunks_again():
    def step(samples: list[int], c: float) -> list[Summary]:  # a per-sample loop: c * sum(losses)
        return [_summary(b, [(3, "F.mse_loss", True, True, True, [(c, False, 2.0, 0.1 * k, 2, False) for k in range(b)])])
                for b in samples]

    steps = [step([2, 2], 0.125), step([3, 1], 0.125), step([2, 2], 0.125), step([2, 2], 0.5), step([1, 3], 0.125)]
    _check(steps)
    notes = [d[4] for d in _decisions(steps, recall=True)]
    assert notes[0] and not notes[2]  # the first step said how it read the site; the settled one says nothing


def test_a_full_sum_read_from_its_values_is_never_recalled():
    def step(values: list[float]) -> list[Summary]:  # one value in every replica: a penalty on the parameters
        return [_summary(2, [(5, "torch.sum", False, False, False, [(1.0, True, 1.0, v, 3, False)])]) for v in values]

    steps = [step([0.5, 0.5]), step([0.5, 0.7]), step([0.5, 0.5]), step([0.25, 0.75])]
    _check(steps)
    assert [d[0] for d in _decisions(steps, recall=True)] == pytest.approx([0.5, 1.2, 0.5, 1.0])


def test_a_full_sum_of_one_value_over_rows_of_each_chunks_own_is_their_sum():
    """One value in every replica over one number of rows is a penalty on the parameters, counted once; over rows of
    each chunk's own (a count the chunks happen to hold alike) it is the chunks' sum, as one device sums the batch
    (it was counted once, silently: one chunk's count logged as the batch's)."""
    def step(values: list[float], rows: list[int]) -> list[Summary]:
        return [_summary(2, [(6, "torch.sum", False, False, False, [(1.0, True, 1.0, v, r, False)])])
                for v, r in zip(values, rows)]

    steps = [step([5.0, 5.0], [7, 9]), step([5.0, 5.0], [8, 8]), step([5.0, 5.0, 5.0], [4, 6, 6])]
    _check(steps)
    assert [d[0] for d in _decisions(steps, recall=True)] == pytest.approx([10.0, 5.0, 15.0])


_CALL = st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 0.25]), st.booleans(), st.sampled_from([0.0, 1.0, 2.0, 5.0]),
    st.floats(-2, 2, allow_nan=False), st.sampled_from([1, 2, 3]), st.just(False), st.sampled_from([None, 0, 1, 2]),
)
_SITE = st.tuples(
    st.sampled_from([1, 2]), st.sampled_from(["F.cross_entropy", "torch.sum"]), st.booleans(), st.booleans(),
    st.booleans(), st.lists(_CALL, min_size=1, max_size=3),
)


@st.composite
def _steps(draw) -> list[list[Summary]]:
    """Steps drawn from a few structures (so that some repeat), each with its own values and remainders."""
    replicas = draw(st.sampled_from([2, 3]))
    shapes = draw(st.lists(
        st.tuples(st.lists(st.sampled_from([1, 2, 3]), min_size=replicas, max_size=replicas),
                  st.lists(st.lists(_SITE, min_size=1, max_size=2), min_size=replicas, max_size=replicas)),
        min_size=1, max_size=3,
    ))
    steps = []
    for _ in range(draw(st.integers(2, 7))):
        samples, sites = shapes[draw(st.integers(0, len(shapes) - 1))]
        scale = draw(st.sampled_from([1.0, 0.5, 2.0]))
        remainder = draw(st.sampled_from([0.0, 0.0, 1.0]))
        if draw(st.booleans()):  # every replica's calls of one value (a penalty), where their structures allow
            sites = [[(k, n, loop, per, some, [(c, s, d, 0.5 * (j + 1), *rest) for j, (c, s, d, _, *rest) in enumerate(calls)])
                      for k, n, loop, per, some, calls in replica_sites] for replica_sites in sites]
        steps.append([
            _summary(b, [(k, n, loop, per, some, [(c, s, d, v * scale, r, t, o) for c, s, d, v, r, t, o in calls])
                         for k, n, loop, per, some, calls in replica_sites], remainder if i == 0 else 0.0)
            for i, (b, replica_sites) in enumerate(zip(samples, sites))
        ])
    return steps


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_any_sequence_of_steps_decides_as_the_full_derivation(steps):
    _check(steps)


def test_a_fit_decides_its_steady_steps_from_the_recalled_readings(monkeypatch):
    """The strategy's steps: the loss's site read in full on the first steps only."""
    calls = []
    read_site = decide_module.read_site
    monkeypatch.setattr(decide_module, "read_site", lambda *a: calls.append(1) or read_site(*a))
    samples = random_samples(24, seed=3)
    batches = [collate_dict(samples[i:i + 6]) for i in range(0, 24, 6)]
    t = trainer(strategy=unchecked(), devices=3, max_steps=4)
    t.fit(SparseNet(), loader(*batches))
    assert 0 < len(calls) <= 2
