"""split/held.py: a batch structure's decisions held and reused, never giving what the full derivation would not.

Sequences of batches whose structure, lengths or dtypes change step after step are split with one HeldLayouts and
without any (split_batch's full derivation), and must give the same chunks and plan, or the same error; a steady
sequence must not derive again (the derivation's functions counted)."""

from __future__ import annotations

import dataclasses

import MinkowskiEngine as ME
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_sparse_dp.split as split
from lightning_sparse_dp.split import BatchLayoutError, HeldLayouts, SparseSpec, plan_split, split_batch
from tests.support.helpers import collate_dict, random_samples


def _held_split(batch, k, layouts, **kwargs):
    cutters, plan = plan_split(batch, k, layouts=layouts, **kwargs)
    return [cut() for cut in cutters], dataclasses.replace(plan, point_rows=tuple(tuple(r) for r in plan.point_rows))


def _same(a, b):
    """Equal values, dtypes and structure: tensors, SparseSpecs, containers and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, SparseSpec):
        assert isinstance(b, SparseSpec) and a.cls is b.cls and a.kwargs == b.kwargs
        _same(a.features, b.features)
        _same(a.coordinates, b.coordinates)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _outcome(fn):
    try:
        return fn()
    except BatchLayoutError as err:
        return ("error", str(err))


def _check_sequence(batches, k, **kwargs):
    """Each batch split with one HeldLayouts equals split_batch's full derivation (chunks and plan, or the error)."""
    layouts = HeldLayouts()
    for batch in batches:
        expected = _outcome(lambda: split_batch(batch, k, **kwargs))
        got = _outcome(lambda: _held_split(batch, k, layouts, **kwargs))
        if expected[0] == "error" or got[0] == "error":
            assert got == expected
        else:
            _same(got, expected)
    return layouts


def _batch(b, seed, form, n_points=None):
    """One of several forms of a batch of ``b`` samples (``form`` names it)."""
    batch = collate_dict(random_samples(b, seed=seed, min_points=1, max_points=6))
    n = batch["coordinates"].shape[0]
    if form == "point_labels":
        batch["labels"] = torch.arange(n) % 3
    elif form == "names":
        batch["names"] = [f"s{i}" for i in range(b)]
    elif form == "float64":
        batch["features"] = batch["features"].double()
    elif form == "sparse":
        return {"x": ME.SparseTensor(batch["features"], batch["coordinates"]), "labels": batch["labels"]}
    elif form == "nested":
        return {"inputs": {"coordinates": batch["coordinates"], "features": batch["features"]}, "labels": batch["labels"]}
    elif form == "short_labels":
        batch["labels"] = batch["labels"][:-1]
    elif form == "extra_key":
        batch["weights"] = torch.ones(b)
    elif form.startswith("tuple"):  # sparse_collate's tuple: coordinates found by their look
        features, labels = batch["features"], batch["labels"]
        if form == "tuple_lookalike_features":  # a float tensor that looks like coordinates too: refused
            features = torch.cat([torch.zeros(n, 1), features], 1)
        elif form == "tuple_matrix_labels":  # an integer [B, 2] that may look like coordinates
            labels = torch.stack([torch.arange(b) % 2 * seed % 3, labels], 1)
        return (batch["coordinates"], features, labels)
    elif form in ("values_float", "values_int"):  # the one per-point tensor: features if float, else a target
        values = torch.arange(n) % 3
        return {"coordinates": batch["coordinates"], "values": values.float() if form == "values_float" else values,
                "labels": batch["labels"]}
    return batch


forms = st.sampled_from(
    ["plain", "point_labels", "names", "float64", "sparse", "nested", "short_labels", "extra_key", "values_float",
     "values_int", "tuple", "tuple_lookalike_features", "tuple_matrix_labels"]
)
steps = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 1000), forms), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(steps, st.integers(1, 4))
def test_held_layouts_give_what_the_full_derivation_gives(sequence, k):
    _check_sequence([_batch(b, seed, form) for b, seed, form in sequence], k)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 1000)), min_size=2, max_size=6), st.integers(2, 4))
def test_held_layouts_with_a_layout_and_min_points(sequence, k):
    layout = {"labels": "samples"}
    _check_sequence([_batch(b, seed, "plain") for b, seed in sequence], k, layout=layout, min_points=2)


def test_a_new_n_equals_b_ambiguity_falls_back_to_the_error():
    """Per-point labels held; then a batch of one point per sample makes N == B: the full derivation's error."""
    steady = _batch(4, 0, "point_labels")
    ambiguous = collate_dict(random_samples(3, seed=1, min_points=1, max_points=1))
    ambiguous["labels"] = torch.arange(3)
    layouts = _check_sequence([steady, steady, ambiguous, steady], 2)
    with pytest.raises(BatchLayoutError, match="cannot be told whether it is per-point"):
        _held_split(ambiguous, 2, layouts)


def test_a_length_that_no_longer_matches_falls_back_to_the_error():
    layouts = _check_sequence([_batch(4, 0, "plain"), _batch(5, 1, "short_labels")], 2)
    with pytest.raises(BatchLayoutError, match="matches neither the number of samples"):
        _held_split(_batch(5, 1, "short_labels"), 2, layouts)


def test_bad_batch_indices_fall_back_to_the_error():
    good, bad = _batch(4, 0, "plain"), _batch(4, 0, "plain")
    bad["coordinates"] = bad["coordinates"].clone()
    bad["coordinates"][bad["coordinates"][:, 0] == 1, 0] = 7  # a gap: samples 1..6 have no points
    _check_sequence([good, bad, good], 2)


def _counting(monkeypatch, name):
    calls = []
    original = getattr(split, name)
    monkeypatch.setattr(split, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("form", ["plain", "names", "sparse", "nested", "tuple"])
def test_a_steady_structure_is_derived_once(monkeypatch, form):
    """Batches of one structure (other values, other sample counts): flatten, find_sources and resolve_roles run
    for the first only."""
    counts = {name: _counting(monkeypatch, name) for name in ("flatten", "find_sources", "resolve_roles")}
    layouts = HeldLayouts()
    for seed in range(5):
        _held_split(_batch(3 + seed % 3, seed, form), 3, layouts)
    assert {name: len(c) for name, c in counts.items()} == {"flatten": 1, "find_sources": 1, "resolve_roles": 1}
    assert layouts.derived == 1


def test_a_changed_structure_is_derived_again_and_held_beside():
    layouts = HeldLayouts()
    for form in ("plain", "float64", "plain", "float64", "extra_key"):
        _held_split(_batch(4, 1, form), 2, layouts)
    assert layouts.derived == 3  # plain, float64 (another dtype), extra_key (another key): each once


def test_a_layout_change_drops_what_was_held():
    layouts = HeldLayouts()
    batch = _batch(4, 1, "plain")
    _held_split(batch, 2, layouts)
    _held_split(batch, 2, layouts, layout={"labels": "samples"})
    _held_split(batch, 2, layouts)
    assert layouts.derived == 3


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(lambda: _batch(4, 0, "tuple_lookalike_features"), id="float-look-alike"),
        pytest.param(lambda: {**_batch(4, 0, "plain"), "correspondences": torch.zeros(2, 2, dtype=torch.long)}, id="indices"),
        pytest.param(lambda: {**_batch(4, 0, "plain"), "target_coords": _batch(4, 0, "plain")["coordinates"]}, id="rule-2"),
    ],
)
def test_decisions_read_off_values_are_not_held(batch):
    layouts = HeldLayouts()
    for _ in range(2):
        _outcome(lambda: _held_split(batch(), 2, layouts))
    assert layouts.derived == 0


def test_one_chunk_derivations_are_not_held():
    layouts = HeldLayouts()
    _held_split(_batch(4, 0, "plain"), 1, layouts)
    assert layouts.derived == 0
    _check_sequence([_batch(4, 0, "plain"), _batch(1, 2, "plain"), _batch(3, 3, "plain")], 2)


def test_the_held_spec_is_the_batchs():
    layouts = HeldLayouts()
    for b in (3, 4):
        chunks, _ = _held_split(_batch(b, b, "nested"), 2, layouts)
        assert pytree.tree_structure(chunks[0]) == pytree.tree_structure(_batch(b, b, "nested"))


def test_sources_found_by_their_look_are_read_again():
    """sparse_collate's tuple held; a batch of as many rows as a loader's batch_size is refused as the derivation
    refuses it (it could be one row per sample), and a features tensor that looks like coordinates too as well."""
    batch = _batch(4, 0, "tuple")
    rows = batch[0].shape[0]
    layouts = _check_sequence([batch, _batch(5, 1, "tuple_lookalike_features"), batch], 2, batch_sizes={rows})
    assert layouts.derived == 0  # refused at its first batch: nothing held
    layouts = _check_sequence([_batch(5, 1, "tuple"), batch, _batch(5, 2, "tuple_lookalike_features")], 2,
                              batch_sizes={rows})
    assert layouts.derived == 1
    with pytest.raises(BatchLayoutError, match="could be collated points"):
        _held_split(batch, 2, layouts, batch_sizes={rows})


def test_a_list_passed_whole_stays_whole_when_a_batch_has_as_many_samples(caplog):
    """Class names (4) beside batches of 7 samples are passed whole; a short last batch of 4 samples made them
    per-sample, each chunk getting one or two names where one device's step gets all 4 (8e-2 off in a batch norm's
    bias after the step, silently). The strategy's held layouts remember the list went whole: it goes whole again,
    said once; a list that always numbers the samples (file names) is still cut."""
    import logging

    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "batch['class_names']" in m})
    names = ["chair", "table", "sofa", "bed"]
    batches = []
    for b, seed in ((7, 1), (4, 2)):
        batch = collate_dict(random_samples(b, seed=seed))
        batch["class_names"], batch["files"] = names, [f"scene{i}" for i in range(b)]
        batches.append(batch)
    layouts = HeldLayouts()
    with caplog.at_level(logging.INFO):
        _held_split(batches[0], 3, layouts)
        chunks, _ = _held_split(batches[1], 3, layouts)
    assert [c["class_names"] for c in chunks] == [names] * 3
    assert sorted(sum((c["files"] for c in chunks), [])) == batches[1]["files"]  # per-sample: cut among the chunks
    said = [r.getMessage() for r in caplog.records if "batch['class_names'] has as many entries" in r.getMessage()]
    assert len(said) == 1 and "it had 4 where a batch had 7" in said[0], said
    cut, _ = split_batch(batches[1], 3)  # the batch alone (no earlier batch): its samples' entries, as before
    assert [len(c["class_names"]) for c in cut] != [4, 4, 4]
