"""Fuzz the split over random batch layouts (hypothesis).

Layouts: dicts, tuples and nested dicts of tuples; per-point and per-sample tensors; per-sample
lists, tuples and numpy arrays; scalars and strings; ``ME.SparseTensor`` / ``ME.TensorField``
leaves; dense batches; integer or float coordinates; 1..8 samples, some empty or of a single
point, on 1..4 replicas. For each: either a ``BatchLayoutError`` that names the problem, or a
split whose merge is the identity and that puts every sample, with all its points, in one chunk.
"""

from __future__ import annotations

import MinkowskiEngine as ME
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sparse_dp import BatchLayoutError, SparseSpec, split_batch
from lightning_sparse_dp.split import merge_batch

FORMS = ("dict", "tuple", "nested", "sparse", "field", "dense")
EXTRAS = ("point_labels", "sample_labels", "names", "paths", "ids", "scalar", "string")


def _build(form, sizes, float_coords, extras, seed):
    g = torch.Generator().manual_seed(seed)
    b = len(sizes)
    rows = [
        torch.stack(
            [
                torch.full((n,), i),
                torch.arange(n),
                torch.randint(0, 4, (n,), generator=g) * 0 + i,
                torch.zeros(n, dtype=torch.long),
            ],
            1,
        )
        for i, n in enumerate(sizes)
    ]
    coords = torch.cat(rows).int() if rows else torch.zeros(0, 4, dtype=torch.int32)
    n = coords.shape[0]
    feats = torch.randn(n, 2, generator=g, dtype=torch.float64)
    if float_coords:
        coords = coords.float()
        if form == "field":
            coords[:, 1:] += torch.rand(n, 3, generator=g) * 0.5
    more = {
        "point_labels": torch.randint(0, 3, (n,), generator=g),
        "sample_labels": torch.randint(0, 3, (b,), generator=g),
        "names": [f"s{i}" for i in range(b)],
        "paths": tuple(f"/d/{i}.ply" for i in range(b)),
        "ids": np.arange(b) * 7,
        "scalar": torch.tensor(2.0),
        "string": "tag",
    }
    extra = {k: more[k] for k in EXTRAS if k in extras}
    if form == "dict":
        return {"coordinates": coords, "features": feats, **extra}
    if form == "tuple":
        return (coords, feats, *[v for k, v in extra.items() if isinstance(v, torch.Tensor)])
    if form == "nested":
        meta = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
        labels = tuple(v for v in extra.values() if isinstance(v, torch.Tensor))
        return {"x": (coords, feats), "meta": meta, "y": labels}
    if form == "sparse":
        return {"x": ME.SparseTensor(feats, coords.int()), **extra}
    if form == "field":
        return {"x": ME.TensorField(feats, coords.float()), **extra}
    dense = {k: v for k, v in extra.items() if k not in ("point_labels",)}
    return {"images": torch.randn(b, 3, generator=g), **dense}


@st.composite
def layouts(draw):
    num_samples = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5]), min_size=num_samples, max_size=num_samples))
    form = draw(st.sampled_from(FORMS))
    if form in ("sparse", "field") and sum(sizes) == 0:
        sizes[0] = 1  # ME cannot build a tensor of no points
    extras = draw(st.sets(st.sampled_from(EXTRAS)))
    return (
        form,
        sizes,
        draw(st.booleans()),
        extras,
        draw(st.integers(0, 2**31)),
        draw(st.integers(1, 4)),
        draw(st.integers(1, 3)),
    )


def _equal(merged, original) -> bool:
    if isinstance(original, (ME.SparseTensor, ME.TensorField)):
        feats, coords = merged
        return torch.equal(feats, original.F) and torch.equal(coords, original.C)
    if isinstance(original, torch.Tensor):
        return isinstance(merged, torch.Tensor) and merged.dtype == original.dtype and torch.equal(merged, original)
    if isinstance(original, np.ndarray):
        return isinstance(merged, np.ndarray) and np.array_equal(merged, original)
    if isinstance(original, dict):
        return (
            isinstance(merged, dict)
            and merged.keys() == original.keys()
            and all(_equal(merged[k], original[k]) for k in original)
        )
    if isinstance(original, (list, tuple)):
        return (
            type(merged) is type(original)
            and len(merged) == len(original)
            and all(_equal(m, o) for m, o in zip(merged, original))
        )
    return merged == original


def _coordinate_rows(batch, form):
    """The collated coordinates of the batch (batch index in column 0), for the per-sample point check."""
    if form in ("sparse", "field"):
        return batch["x"].C
    if form == "dict":
        return batch["coordinates"]
    if form == "tuple":
        return batch[0]
    if form == "nested":
        return batch["x"][0]
    return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_split_of_any_layout_is_an_identity_or_a_named_error(case):
    form, sizes, float_coords, extras, seed, k, min_points = case
    batch = _build(form, sizes, float_coords, extras, seed)
    gap = any(n == 0 for n in sizes[: max(i for i, n in enumerate(sizes) if n > 0) + 1]) if any(sizes) else True
    # what may be refused: a sample without points (its batch index missing from the coordinates), or as many
    # points as samples (a per-point and a per-sample entry look alike); a dense batch has no points to refuse
    refusable = form != "dense" and (0 in sizes or sum(sizes) == len(sizes))
    try:
        chunks, plan = split_batch(batch, k, assignment="balanced", min_points=min_points)
    except BatchLayoutError as err:
        message = str(err)
        assert refusable, f"a batch the split can read was refused: {message}"
        assert "batch" in message and len(message) > 40, message  # names what is wrong and where
        return
    # named coordinates (and ME tensors) with an empty sample before a non-empty one are always refused;
    # coordinates found only by their look (tuples) that start above 0 or skip a float index are not taken for
    # coordinates (the split is then a dense one, and must still be an identity)
    assert form not in ("dict", "sparse", "field") or not gap, "an empty sample must be refused"
    num_samples = plan.num_samples
    assert len(chunks) <= min(k, num_samples)
    assert len(chunks) == 1 or min(plan.points_per_chunk) >= min_points  # chunks merged only while one is short
    if min_points == 1:
        assert len(chunks) == min(k, num_samples)
    assert sorted(torch.cat(plan.chunk_samples).tolist()) == list(range(num_samples))
    assert _equal(merge_batch(chunks, plan), batch)
    coords = _coordinate_rows(batch, form)
    if coords is not None and plan.point_rows:  # (none when a tuple's coordinates were not recognized, see above)
        batch_index = coords[:, 0].long()
        for ids, rows in zip(plan.chunk_samples, plan.point_rows[0]):
            assert torch.equal(rows, torch.isin(batch_index, ids).nonzero().flatten())
    for chunk, ids in zip(chunks, plan.chunk_samples):
        meta = chunk["meta"] if form == "nested" else chunk
        if isinstance(meta, dict) and "names" in meta and len(batch_names := _names(batch, form)) == num_samples:
            assert meta["names"] == [batch_names[i] for i in ids.tolist()]
        for leaf in chunk.values() if isinstance(chunk, dict) else []:
            if isinstance(leaf, SparseSpec):
                assert sorted(leaf.coordinates[:, 0].long().unique().tolist()) == list(range(len(ids)))


def _names(batch, form):
    return (batch["meta"] if form == "nested" else batch)["names"]


@pytest.mark.parametrize("form", FORMS)
def test_each_form_splits_when_nothing_is_wrong(form):
    batch = _build(form, [3, 1, 5, 2], False, set(EXTRAS) - {"point_labels"} if form == "dense" else set(EXTRAS), 0)
    chunks, plan = split_batch(batch, 3, assignment="balanced")
    assert plan.num_chunks == 3 and _equal(merge_batch(chunks, plan), batch)
