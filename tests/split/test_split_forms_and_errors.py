"""split / merge: the batch forms the split reads (tuples, named tuples, dense tensors, ME tensors, one-level
batches of another structure), and every bad input, each with a clear error naming the problem."""

from __future__ import annotations

from collections import namedtuple

import MinkowskiEngine as ME
import pytest
import torch

from lightning_sparse_dp.split import (
    BatchLayoutError,
    SparseSpec,
    merge_batch,
    merge_chunks,
    split_batch,
)
from tests.support.helpers import collate_dict, random_samples


def test_split_plan_is_immutable_and_built_by_keyword():
    _, plan = split_batch(_batch(), 2)
    with pytest.raises(AttributeError):
        plan.num_samples = 0
    with pytest.raises(TypeError):
        type(plan)(plan.num_samples, plan.chunk_samples)


def test_unknown_assignment():
    with pytest.raises(ValueError, match="assignment='random'"):
        split_batch(_batch(), 2, assignment="random")


def test_uneven_split_sizes_follow_tensor_split():
    chunks, plan = split_batch(collate_dict(random_samples(7)), 3, assignment="contiguous")
    assert plan.samples_per_chunk == [3, 2, 2]
    assert [c["labels"].shape[0] for c in chunks] == [3, 2, 2]


def test_fewer_samples_than_devices_gives_one_chunk_per_sample():
    chunks, plan = split_batch(collate_dict(random_samples(2)), 3)
    assert len(chunks) == 2 and plan.samples_per_chunk == [1, 1]


def test_sparse_collate_tuple_is_recognised():
    coords, feats, labels = zip(*random_samples(5))
    c, f = ME.utils.sparse_collate(list(coords), list(feats))
    batch = (c, f, torch.tensor(labels))
    chunks, plan = split_batch(batch, 2, assignment="contiguous")
    assert plan.roles == ("coordinates", "points", "samples")
    assert isinstance(chunks[0], tuple) and chunks[0][2].shape[0] == 3


def test_nested_namedtuple_and_non_tensor_leaves():
    Item = namedtuple("Item", "coordinates features")
    base = collate_dict(random_samples(4))
    batch = {"x": Item(base["coordinates"], base["features"]), "y": base["labels"], "tag": "scenes", "scale": torch.tensor(2.0)}
    chunks, plan = split_batch(batch, 2, assignment="contiguous")
    assert isinstance(chunks[1]["x"], Item)
    assert chunks[1]["tag"] == "scenes" and chunks[1]["scale"] is batch["scale"]
    assert merge_batch(chunks, plan)["y"].tolist() == base["labels"].tolist()


def test_dense_batch_splits_along_dim_zero():
    x = torch.arange(7 * 3).reshape(7, 3).float()
    y = torch.arange(7)
    chunks, plan = split_batch((x, y), 3, assignment="contiguous")
    assert [c[0].shape[0] for c in chunks] == [3, 2, 2]
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    assert torch.equal(merge_chunks([c[1] for c in chunks], plan.chunk_samples), y)


@pytest.mark.parametrize("cls", [ME.SparseTensor, ME.TensorField])
def test_sparse_tensor_in_batch_becomes_a_spec_with_same_settings(cls):
    base = collate_dict(random_samples(5))
    kwargs = dict(quantization_mode=ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE)
    coords = base["coordinates"] if cls is ME.SparseTensor else base["coordinates"].float() + 0.25 * (
        torch.arange(base["coordinates"].shape[0])[:, None] % 2)
    if cls is ME.TensorField:
        coords[:, 0] = base["coordinates"][:, 0].float()
    x = cls(base["features"], coords, **kwargs)
    chunks, plan = split_batch({"x": x, "labels": base["labels"]}, 2)
    spec = chunks[0]["x"]
    assert isinstance(spec, SparseSpec) and spec.cls is cls
    assert spec.kwargs["quantization_mode"] == x.quantization_mode
    key = x.coordinate_field_map_key if cls is ME.TensorField else x.coordinate_map_key
    assert spec.kwargs["tensor_stride"] == key.get_tensor_stride()
    assert sorted(spec.coordinates[:, 0].unique().tolist()) == list(range(plan.samples_per_chunk[0]))
    feats, merged_coords = merge_batch(chunks, plan)["x"]
    assert torch.equal(feats, x.F) and torch.equal(merged_coords, x.C)


# --- bad input: a clear error naming the problem ------------------------------------------------

def _batch(n=4):
    return collate_dict(random_samples(n))


def test_empty_batch():
    b = _batch()
    b = {"coordinates": b["coordinates"][:0], "features": b["features"][:0], "labels": b["labels"][:0]}
    with pytest.raises(BatchLayoutError, match="empty"):
        split_batch(b, 2)


def test_coordinates_without_batch_column():
    b = _batch()
    with pytest.raises(BatchLayoutError, match=r"\[N, D\+1\].*batch index"):
        split_batch({**b, "coordinates": b["coordinates"][:, 0]}, 2)


def test_gaps_in_batch_indices():
    b = _batch()
    coords = b["coordinates"].clone()
    coords[coords[:, 0] == 1, 0] = 5
    with pytest.raises(BatchLayoutError, match=r"gaps in its batch indices.*sample\(s\) 1, 4 of 0..5.*keeps its index "
                                               r"under ME.utils.sparse_collate.*drop such samples"):
        split_batch({**b, "coordinates": coords}, 2)


def test_negative_batch_index():
    b = _batch()
    coords = b["coordinates"].clone()
    coords[0, 0] = -1
    with pytest.raises(BatchLayoutError, match="negative batch index"):
        split_batch({**b, "coordinates": coords}, 2)


def test_lengths_that_disagree():
    b = _batch()
    with pytest.raises(BatchLayoutError, match=r"batch\['features'\] has length .* matches neither"):
        split_batch({**b, "features": b["features"][:-1]}, 2)


def test_batch_column_of_float_coordinates_must_be_whole_numbers():
    b = _batch()
    coords = b["coordinates"].float()
    coords[3, 0] = 0.5
    said = r"dtype torch.float32 and a batch index \(column 0\) that is not a whole number \(0.5 in row 3\)"
    with pytest.raises(BatchLayoutError, match=said):
        split_batch({**b, "coordinates": coords}, 2)


def test_ambiguous_per_point_or_per_sample_and_its_fix():
    # 3 samples with one point each: N == B, so a [3] tensor could be either
    samples = [(torch.tensor([[i, 0, 0]], dtype=torch.int32), torch.randn(1, 3), i) for i in range(3)]
    b = collate_dict(samples)
    with pytest.raises(BatchLayoutError, match=r"both the number of points.*layout=\{'features': 'points'\}"):
        split_batch(b, 2)
    chunks, plan = split_batch(b, 2, assignment="contiguous", layout={"features": "points", "labels": "samples"})
    assert plan.roles == ("coordinates", "points", "samples")


def test_dense_tensors_that_disagree():
    with pytest.raises(BatchLayoutError, match="disagree on the batch size"):
        split_batch((torch.zeros(4, 2), torch.zeros(5)), 2)


def test_no_tensor_at_all():
    with pytest.raises(BatchLayoutError, match="no tensor to split"):
        split_batch({"a": 1, "b": "x"}, 2)


def test_unknown_layout_role():
    with pytest.raises(BatchLayoutError, match="use one of"):
        split_batch(_batch(), 2, layout={"labels": "pixels"})


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([[0, 1], [1, 2]], "more than one chunk"),
        ([[0, 0, 1, 2]], "more than one chunk"),
        ([[0], [2]], "leaves samples out"),
        ([[0, 1, 2, 3]], "outside 0..2"),
    ],
    ids=["two-chunks", "twice-in-one", "left-out", "out-of-range"],
)
def test_an_assignment_that_does_not_cover_every_sample_once_is_refused(chunks, message):
    from lightning_sparse_dp.split.assign import assign

    with pytest.raises(BatchLayoutError, match=message):
        assign(torch.tensor([3, 4, 5]), 2, lambda sizes, k: [torch.tensor(c) for c in chunks])


def test_assignment_gives_each_sample_its_chunk_and_position():
    from lightning_sparse_dp.split.assign import assign

    chunks, chunk_of, position = assign(
        torch.tensor([5, 1, 1, 4, 2]), 2, lambda sizes, k: [torch.tensor([1, 3]), torch.tensor([0, 2, 4])]
    )
    assert [c.tolist() for c in chunks] == [[1, 3], [0, 2, 4]]
    assert chunk_of.tolist() == [1, 0, 1, 0, 1] and position.tolist() == [0, 0, 1, 1, 2]


def test_every_role_has_one_cut_and_one_merge_handler():
    """A role is one member of ``Role`` plus its handlers: a role without a cut or merge handler fails here."""
    from lightning_sparse_dp.split.cut import CUTS
    from lightning_sparse_dp.split.merge import MERGES
    from lightning_sparse_dp.split.records import ROLES, Role

    assert set(CUTS) == set(Role) == set(MERGES)
    assert ROLES == tuple(r.value for r in Role) and Role("points") is Role.POINTS == "points"


def test_a_one_level_batch_of_another_structure_is_split_by_its_own():
    """The spec and names of a one-level batch are kept per structure (keys in order, or the length of a tuple):
    a batch whose keys come in another order, or a shorter tuple, is split by its own structure."""
    batch = collate_dict(random_samples(6, seed=33))
    reordered = {k: batch[k] for k in reversed(list(batch))}
    for b in (batch, reordered, batch):
        chunks, plan = split_batch(b, 2)
        assert [list(c) for c in chunks] == [list(b)] * 2
        rows = plan.point_rows[0]
        for c, r in zip(chunks, rows):
            assert torch.equal(c["features"], b["features"][r])
    triple = (batch["coordinates"], batch["features"], batch["labels"])
    for t in (triple, triple[:2], triple):
        chunks, plan = split_batch(t, 2)
        assert all(type(c) is tuple and len(c) == len(t) for c in chunks)
        assert torch.equal(torch.cat([c[1] for c in chunks])[torch.argsort(torch.cat(list(plan.point_rows[0])))], t[1])


def test_a_dataclass_batch_names_the_containers_the_split_opens():
    """A dataclass batch raised 'no tensor to split' without saying why: the split does not open dataclasses."""
    import dataclasses

    @dataclasses.dataclass
    class Scans:
        coordinates: torch.Tensor
        features: torch.Tensor

    batch = collate_dict(random_samples(4, seed=25))
    with pytest.raises(BatchLayoutError, match=r"batch is a dataclass \(Scans\), which the split does not open.*NamedTuple"):
        split_batch(Scans(batch["coordinates"], batch["features"]), 2)


def test_a_list_of_uncollated_samples_each_with_its_coordinates_is_refused():
    """``collate_fn=lambda x: x``: each sample's coordinates [n_i, 3] (sorted by x, as torch.unique returns them) were
    read as collated coordinates with x as the batch index, cutting every sample into slabs, silently. Refused."""
    samples = [(c[:, 1:], f, torch.tensor(y)) for c, f, y in
               ((torch.cat([torch.zeros(len(c), 1, dtype=torch.int32), c], 1), f, y) for c, f, y in random_samples(4))]
    for c, _, _ in samples:
        c[:, 0] = torch.arange(len(c), dtype=c.dtype) % 3  # x spans 0..2, sorted as a batch column would be
        c[:] = c[c[:, 0].argsort(stable=True)]
    with pytest.raises(BatchLayoutError, match=r"batch looks like a list of samples that were not collated"):
        split_batch(samples, 2)


def test_a_list_of_each_samples_own_maps_is_named_with_the_samples_role():
    """Per-sample inverse maps kept as a list (each in its sample's own rows) were refused with advice about empty
    samples and a role for the list's position; the error names the list and the role that splits it exactly."""
    batch = collate_dict(random_samples(5, seed=8))
    counts = torch.bincount(batch["coordinates"][:, 0].long()).tolist()
    maps = [torch.arange(3 * n) % n for n in counts]  # more original points than voxels: no source's length
    with pytest.raises(BatchLayoutError, match=r"entry 0 of the list under 'maps'.*layout=\{'maps': 'samples'\}") as err:
        split_batch({**batch, "maps": maps}, 2)
    assert "no points" not in str(err.value)
    chunks, plan = split_batch({**batch, "maps": maps}, 2, layout={"maps": "samples"})
    assert [m for c in chunks for m in c["maps"]] == [maps[int(b)] for s in plan.chunk_samples for b in s]


def test_labels_of_a_point_set_whose_coordinates_are_in_the_batch_name_those_coordinates():
    """Labels of the original points beside their float coordinates under a key naming no coordinates were refused with
    advice to put those coordinates in the batch, which they were; the error names them and the role that splits
    both exactly."""
    batch = collate_dict(random_samples(5, seed=9))
    originals = torch.cat([batch["coordinates"], batch["coordinates"][:7]])[torch.argsort(
        torch.cat([batch["coordinates"][:, 0], batch["coordinates"][:7, 0]]), stable=True)]
    originals = originals.double()
    originals[:, 1:] *= 0.5  # float coordinates of another set, taken for none without layout
    labels = torch.arange(len(originals))
    with pytest.raises(BatchLayoutError, match=r"batch\['original_points'\] has as many rows.*'original_points': "
                                               r"'coordinates'"):
        split_batch({**batch, "point_labels": labels, "original_points": originals}, 2)
    chunks, plan = split_batch({**batch, "original_points": originals, "point_labels": labels}, 2,
                               layout={"original_points": "coordinates"})
    assert sum(len(c["point_labels"]) for c in chunks) == len(labels)


def test_a_batch_vector_given_the_indices_role_is_refused_naming_indices_batch():
    """Each point's sample id given the role 'indices' was read as rows of the point set (all of the first samples),
    giving chunks empty pieces and a bare error inside a replica; it is refused, naming 'indices:batch'."""
    batch = collate_dict(random_samples(5, seed=10))
    vector = batch["coordinates"][:, 0].long()
    with pytest.raises(BatchLayoutError, match=r"each point's sample.*layout=\{'point_sample': 'indices:batch'\}"):
        split_batch({**batch, "point_sample": vector}, 2, layout={"point_sample": "indices"})
