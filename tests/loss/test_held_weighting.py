"""The strategy's held loss weighting (:class:`~lightning_sparse_dp.loss.weights.HeldWeighting`): reused while the
weighting and the batch's per-sample tensors / per-point targets hold (no check, no ``"auto"`` rule on a steady step),
derived again when they change, and always the weights, warnings and errors of :func:`step_weights`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.loss import weights as weights_module
from lightning_sparse_dp.loss.weights import HeldWeighting, step_weights
from lightning_sparse_dp.split import SplitPlan

_NAMES = {"sample": ("batch['label']",), "point": ("batch['labels']",), "none": ()}


def _plan(samples, points, structure):
    """A plan of chunks of ``samples[i]`` samples and ``points[i]`` points; ``structure``: which names the batch has."""
    starts = [sum(samples[:i]) for i in range(len(samples))]
    pstarts = [sum(points[:i]) for i in range(len(points))]
    return SplitPlan(
        num_samples=sum(samples),
        chunk_samples=tuple(torch.arange(s, s + n) for s, n in zip(starts, samples)),
        point_rows=(tuple(torch.arange(s, s + n) for s, n in zip(pstarts, points)),),
        sample_tensors=_NAMES["sample"] if structure == "sample" else (),
        point_targets=_NAMES["point"] if structure in ("sample", "point") else (),
    )


def _counting(monkeypatch):
    calls = {"check": 0, "resolve": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(weights_module, "check_loss_weighting", counted("check", weights_module.check_loss_weighting))
    monkeypatch.setattr(weights_module, "resolve_auto", counted("resolve", weights_module.resolve_auto))
    return calls


def test_a_steady_step_reuses_the_held_weighting(monkeypatch):
    calls = _counting(monkeypatch)
    held, cache = HeldWeighting(), WarningCache()
    plan = _plan([2, 3, 1], [20, 7, 9], "point")
    first = held.step_weights(plan, [None] * 3, "terms", cache)
    assert calls["resolve"] == 1
    for samples, points in (([1, 4, 1], [5, 30, 2]), ([3, 2, 1], [9, 9, 9])):  # other chunks, the same structure
        again = _plan(samples, points, "point")
        assert held.step_weights(again, [None] * 3, "terms", cache) == step_weights(again, [None] * 3, "terms", cache)
    assert calls["resolve"] == 1 + 2  # the two references above only: the held weighting derived nothing again
    assert first == pytest.approx([20 / 36, 7 / 36, 9 / 36])


def test_a_new_structure_or_weighting_is_derived_again(monkeypatch):
    calls = _counting(monkeypatch)
    held, cache = HeldWeighting(), WarningCache()
    held.step_weights(_plan([2, 3], [20, 7], "point"), [None] * 2, "terms", cache)
    plan = _plan([2, 3], [20, 7], "sample")  # a per-sample tensor now: "terms" means samples
    assert held.step_weights(plan, [None] * 2, "terms", cache) == pytest.approx([2 / 5, 3 / 5])
    assert calls["resolve"] == 2
    assert held.step_weights(plan, [None] * 2, "points", cache) == pytest.approx([20 / 27, 7 / 27])
    with pytest.raises(ValueError, match="loss_weighting='bogus'; use one of"):
        held.step_weights(plan, [None] * 2, "bogus", cache)
    assert held.step_weights(plan, [None] * 2, lambda chunk: 1, cache) == [0.5, 0.5]  # a callable: always derived
    assert calls["check"] >= 2


@pytest.mark.filterwarnings("ignore:sparse_dp. no chunk of a batch")
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["terms", "samples", "points", "equal", "auto"]),
    st.sampled_from(["sample", "point", "none"]),
    st.lists(st.integers(0, 5), min_size=2, max_size=2),
), min_size=1, max_size=6))
def test_held_weights_match_the_full_derivation(steps):
    held = HeldWeighting()
    for weighting, structure, points in steps:
        plan = _plan([1, 2], points, structure)
        ours, theirs = WarningCache(), WarningCache()
        assert held.step_weights(plan, [None] * 2, weighting, ours) == step_weights(plan, [None] * 2, weighting, theirs)
        assert set(ours) == set(theirs)  # the same one-time warnings
