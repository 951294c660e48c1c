"""split / merge: property tests against the unsplit batch, the balanced assignment against Graham's rule written
out, the cut in every coordinate dtype, and the split's parts against what they stand for (dataclasses.replace,
pytree's walk, split_batch)."""

from __future__ import annotations

import itertools
import pickle
from concurrent.futures import ThreadPoolExecutor

import MinkowskiEngine as ME
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse_dp.split import (
    balanced_assignment,
    merge_batch,
    plan_split,
    split_batch,
)
from tests.support.helpers import collate_dict, random_samples


def _layout(batch):
    """Roles only where they cannot be told apart (N == B, e.g. one sample of one point)."""
    n, b = batch["coordinates"].shape[0], batch["labels"].shape[0]
    return {"features": "points", "labels": "samples"} if n == b else None


batches = st.builds(
    lambda b, seed, k, how: (collate_dict(random_samples(b, seed=seed, min_points=1, max_points=12)), k, how),
    st.integers(1, 9),
    st.integers(0, 10_000),
    st.integers(1, 5),
    st.sampled_from(["contiguous", "balanced"]),
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_split_then_merge_is_the_identity(case):
    batch, k, how = case
    chunks, plan = split_batch(batch, k, layout=_layout(batch), assignment=how)
    merged = merge_batch(chunks, plan)
    assert merged.keys() == batch.keys()
    for key in batch:
        assert torch.equal(merged[key], batch[key]), key


@settings(max_examples=60, deadline=None)
@given(batches)
def test_every_point_and_sample_lands_in_exactly_one_chunk(case):
    batch, k, how = case
    num_samples = len(batch["labels"])
    chunks, plan = split_batch(batch, k, layout=_layout(batch), assignment=how)
    assert len(chunks) == min(k, num_samples)
    samples = torch.cat(plan.chunk_samples)
    assert sorted(samples.tolist()) == list(range(num_samples))
    rows = torch.cat(plan.point_rows[0])
    assert sorted(rows.tolist()) == list(range(batch["coordinates"].shape[0]))
    # the points of a chunk are exactly the points of its samples, in their original order
    for chunk, ids, r in zip(chunks, plan.chunk_samples, plan.point_rows[0]):
        expected = torch.isin(batch["coordinates"][:, 0].long(), ids).nonzero().flatten()
        assert torch.equal(r, expected)
        assert torch.equal(chunk["features"], batch["features"][expected])
        assert torch.equal(chunk["coordinates"][:, 1:], batch["coordinates"][expected, 1:])
        assert torch.equal(chunk["labels"], batch["labels"][ids])


@settings(max_examples=60, deadline=None)
@given(batches)
def test_renumbered_batch_indices_are_contiguous(case):
    batch, k, how = case
    chunks, plan = split_batch(batch, k, layout=_layout(batch), assignment=how)
    for chunk, ids in zip(chunks, plan.chunk_samples):
        col = chunk["coordinates"][:, 0]
        assert chunk["coordinates"].dtype == batch["coordinates"].dtype
        assert sorted(col.unique().tolist()) == list(range(len(ids)))
        assert bool((col[1:] >= col[:-1]).all())  # sample order kept inside the chunk


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=8), st.integers(1, 3))
def test_balanced_assignment_covers_every_sample_once_within_grahams_bound(sizes, k):
    chunks = balanced_assignment(torch.tensor(sizes), k)
    assert len(chunks) == min(k, len(sizes)) and all(c.numel() > 0 for c in chunks)
    assert sorted(torch.cat(chunks).tolist()) == list(range(len(sizes)))
    assert all(bool((c[1:] > c[:-1]).all()) for c in chunks)  # sample order kept inside a chunk
    largest = max(sum(sizes[i] for i in c.tolist()) for c in chunks)
    # the optimum by brute force over every assignment; LPT is within 4/3 - 1/(3k) of it (Graham 1969)
    m = len(chunks)
    optimum = min(
        max(sum(s for s, c in zip(sizes, labels) if c == j) for j in range(m))
        for labels in itertools.product(range(m), repeat=len(sizes))
    )
    assert largest <= (4 / 3 - 1 / (3 * m)) * optimum


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=40), st.integers(1, 5))
def test_balanced_assignment_is_grahams_rule_with_ties_to_the_lower_sample_and_chunk(sizes, k):
    # the rule written out plainly: samples by decreasing size (the lower id first on ties), each to the chunk
    # with the fewest points so far (the lower index on ties); sizes from 1..4, so ties are everywhere
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    m = min(k, len(sizes))
    loads, members = [0] * m, [[] for _ in range(m)]
    for i in order:
        j = min(range(m), key=lambda c: (loads[c], c))
        loads[j] += sizes[i]
        members[j].append(i)
    assert [c.tolist() for c in balanced_assignment(torch.tensor(sizes), k)] == [sorted(c) for c in members]


_DTYPES = [torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16]


@pytest.mark.parametrize(
    "dtype, form",
    [(d, f) for d in _DTYPES for f in ("contiguous", "column view")]
    + [(d, "requires grad") for d in _DTYPES if d.is_floating_point],
)
def test_chunk_coordinates_are_their_samples_rows_renumbered_in_every_dtype_and_layout(dtype, form):
    # the cut takes a fast path for plain CPU tensors of numpy's dtypes and torch ops otherwise (bfloat16, a tensor
    # that requires grad); both must give each chunk its samples' rows, column 0 the sample's place in the chunk
    g = torch.Generator().manual_seed(3)
    sizes = [5, 1, 7, 3, 4, 6, 2]
    batch_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    wide = torch.cat([batch_index[:, None], torch.randint(-50, 50, (len(batch_index), 4), generator=g)], 1).to(dtype)
    coordinates = wide[:, :4] if form == "column view" else wide.contiguous()
    if form == "requires grad":
        coordinates = coordinates.requires_grad_()
    features = torch.randn(len(batch_index), 2, generator=g)
    chunks, plan = split_batch({"coordinates": coordinates, "features": features}, 3)
    for chunk, ids in zip(chunks, plan.chunk_samples):
        rows = [r for s in ids.tolist() for r in range(len(batch_index)) if int(batch_index[r]) == s]
        expected = coordinates.detach()[rows].clone()
        expected[:, 0] = torch.tensor([ids.tolist().index(int(batch_index[r])) for r in rows], dtype=dtype)
        got = chunk["coordinates"]
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got.detach(), expected)
        assert torch.equal(chunk["features"], features[rows])


def test_balanced_split_evens_points_better_than_contiguous():
    sizes = [400, 390, 380, 10, 10, 10, 10, 10, 10]  # contiguous chunks: 1170 / 30 / 30 points
    samples = [
        (torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], 1).int(),
         (1000 * i + torch.arange(n, dtype=torch.float32)).unsqueeze(1),  # a feature that names sample and point
         i)
        for i, n in enumerate(sizes)
    ]
    batch = collate_dict(samples)
    chunks, balanced = split_batch(batch, 3, assignment="balanced")
    _, contiguous = split_batch(batch, 3, assignment="contiguous")
    assert max(balanced.points_per_chunk) < max(contiguous.points_per_chunk)
    assert max(balanced.points_per_chunk) / (sum(sizes) / 3) <= 1.05
    for chunk, ids in zip(chunks, balanced.chunk_samples):  # each chunk holds whole samples, in order
        assert torch.equal(chunk["labels"], batch["labels"][ids])
        assert torch.equal(chunk["features"][:, 0].div(1000).floor().long().unique(), ids)
    merged = merge_batch(chunks, balanced)
    for key in batch:
        assert torch.equal(merged[key], batch[key]), key
    # the default assignment is the strategies' default, "balanced"
    default_chunks, default = split_batch(batch, 3)
    assert [c.tolist() for c in default.chunk_samples] == [c.tolist() for c in balanced.chunk_samples]


def test_record_replace_matches_dataclasses_replace_and_refuses_unknown_fields():
    import dataclasses

    from lightning_sparse_dp.split.records import Leaf, Source, replace

    leaf = Leaf(("k",), "batch['k']", torch.zeros(2), role="points", source=0)
    assert replace(leaf, role="samples", source=-1) == dataclasses.replace(leaf, role="samples", source=-1)
    assert leaf.role == "points"  # the record itself is unchanged
    source = Source("batch['c']", 0, torch.zeros(3, dtype=torch.long))
    copy = replace(source, counts=torch.tensor([3]))
    assert copy.counts.tolist() == [3] and source.counts is None and type(copy) is Source
    with pytest.raises(TypeError, match="Source has no field 'count'"):
        replace(source, count=torch.tensor([3]))


@pytest.mark.parametrize("form", ["dict", "tuple", "list", "dict with a TensorField", "nested"])
def test_flattened_leaves_are_pytrees_key_paths_for_every_batch_form(form):
    # flatten takes a shortcut for one level of tensors; its leaves, paths and spec must be pytree's own walk's
    import torch.utils._pytree as pytree

    from lightning_sparse_dp.split.leaves import flatten, tensor_lists

    batch = collate_dict(random_samples(4))
    if form == "tuple":
        batch = (batch["coordinates"], batch["features"], batch["labels"])
    elif form == "list":
        batch = [batch["coordinates"], batch["features"], batch["labels"]]
    elif form == "dict with a TensorField":
        batch = {"x": ME.TensorField(batch["features"], batch["coordinates"].float()), "labels": batch["labels"]}
    elif form == "nested":
        batch = {
            "inputs": {"coordinates": batch["coordinates"], "features": batch["features"]},
            "labels": batch["labels"],
        }
    leaves, spec = flatten(batch, None)
    walked, walked_spec = pytree.tree_flatten_with_path(batch, is_leaf=tensor_lists(None))
    assert spec == walked_spec
    assert [leaf.path for leaf in leaves] == [tuple(p) for p, _ in walked]
    assert all(leaf.value is x for leaf, (_, x) in zip(leaves, walked))
    assert [leaf.name for leaf in leaves] == [str("batch" + "".join(str(k) for k in p)) for p, _ in walked]


def test_plan_split_rows_are_made_by_each_chunks_cut_and_equal_split_batchs():
    """``plan_split``'s rows per chunk (a ``ChunkRows`` per source) are made where the chunk is cut, here in threads
    at once as the strategies' replicas cut, and equal ``split_batch``'s tuples; pickled (a DataLoader worker's
    plan) they are that tuple."""
    batch = collate_dict(random_samples(11, seed=31))
    chunks, plan = split_batch(batch, 3)
    cutters, lazy = plan_split(batch, 3)
    with ThreadPoolExecutor(3) as pool:
        cut = list(pool.map(lambda c: c(), cutters))
    assert type(plan.point_rows[0]) is tuple and len(lazy.point_rows[0]) == 3
    assert all(torch.equal(a, b) for a, b in zip(plan.point_rows[0], lazy.point_rows[0], strict=True))
    assert all(torch.equal(a["features"], b["features"]) for a, b in zip(chunks, cut, strict=True))
    assert [r.tolist() for r in lazy.point_rows[0][1:]] == [r.tolist() for r in plan.point_rows[0][1:]]
    again = pickle.loads(pickle.dumps(lazy))
    assert type(again.point_rows[0]) is tuple
    assert [r.tolist() for r in again.point_rows[0]] == [r.tolist() for r in plan.point_rows[0]]
    rows = torch.cat(list(lazy.point_rows[0]))
    assert sorted(rows.tolist()) == list(range(batch["coordinates"].shape[0]))  # every point in one chunk
