"""Several point sets per batch (issue 18): coordinate sources found, index tensors re-based, errors that name the fix.

Tests check every chunk against the whole batch (the points of each source that belong to the chunk's samples,
correspondences picking the same points); the merged outputs are tests/split/test_point_set_outputs.py's.
"""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse_dp.split import BatchLayoutError, balanced_assignment, merge_batch, split_batch
from tests.support.helpers import collate_dict, grid_points, random_samples, voxelized_batch


def pair_batch(sizes0, sizes1, pairs, seed=0, batch_column=False) -> dict:
    """A registration batch as FCGF's collate_pair_fn makes it: two scans per sample, each collated with
    its batch index, and correspondences ``[K, 2]`` (``[K, 3]`` with a batch column) of rows of the collated
    scans (each sample's indices offset by the points of the samples before it)."""
    g = torch.Generator().manual_seed(seed)
    rows, off0, off1 = [], 0, 0
    for b, (n0, n1, k) in enumerate(zip(sizes0, sizes1, pairs)):
        i = torch.randint(0, n0, (k,), generator=g) + off0
        j = torch.randint(0, n1, (k,), generator=g) + off1
        rows.append(torch.stack([torch.full_like(i, b), i, j], 1) if batch_column else torch.stack([i, j], 1))
        off0, off1 = off0 + n0, off1 + n1
    return {
        "coords0": ME.utils.batched_coordinates([grid_points(g, n) for n in sizes0]),
        "feats0": torch.randn(sum(sizes0), 2, generator=g),
        "coords1": ME.utils.batched_coordinates([grid_points(g, n) for n in sizes1]),
        "feats1": torch.randn(sum(sizes1), 2, generator=g),
        "correspondences": torch.cat(rows).int(),
        "transform": torch.randn(len(sizes0), 4, 4, generator=g),
    }


pair_cases = st.builds(
    lambda b, seed, k, column: (
        [int(x) for x in torch.randint(2, 9, (b,), generator=torch.Generator().manual_seed(seed))],
        [int(x) for x in torch.randint(2, 9, (b,), generator=torch.Generator().manual_seed(seed + 1))],
        [int(x) for x in torch.randint(0, 5, (b,), generator=torch.Generator().manual_seed(seed + 2))],
        seed, k, column,
    ),
    st.integers(1, 7), st.integers(0, 10_000), st.integers(1, 4), st.booleans(),
)


@settings(max_examples=50, deadline=None)
@given(pair_cases)
def test_correspondences_go_with_their_samples_and_pick_the_same_points(case):
    sizes0, sizes1, pairs, seed, k, column = case
    batch = pair_batch(sizes0, sizes1, pairs, seed, column)
    chunks, plan = split_batch(batch, k)
    assert len(plan.point_rows) == 2  # both scans are coordinate sources
    merged = merge_batch(chunks, plan)
    for key in batch:
        assert torch.equal(merged[key], batch[key]), key
    whole = batch["correspondences"].long()
    c0 = 1 if column else 0
    seen = 0
    for chunk, ids, rows0, rows1 in zip(chunks, plan.chunk_samples, *plan.point_rows):
        corr = chunk["correspondences"].long()
        assert corr.dtype == torch.long and chunk["correspondences"].dtype == batch["correspondences"].dtype
        mine = torch.isin(batch["coords0"][whole[:, c0], 0].long(), ids)
        expected = whole[mine]
        seen += len(corr)
        # the chunk's indices pick, in the chunk, the points the batch's indices pick in the batch
        assert torch.equal(chunk["coords0"][corr[:, c0], 1:], batch["coords0"][expected[:, c0], 1:])
        assert torch.equal(chunk["feats1"][corr[:, c0 + 1]], batch["feats1"][expected[:, c0 + 1]])
        assert torch.equal(chunk["coords0"][corr[:, c0], 0], chunk["coords1"][corr[:, c0 + 1], 0])
        if column:
            assert torch.equal(corr[:, 0], chunk["coords0"][corr[:, 1], 0].long())
        assert torch.equal(chunk["transform"], batch["transform"][ids])
    assert seen == len(whole)


def test_completion_batch_splits_each_point_set_by_its_own_batch_column():
    g = torch.Generator().manual_seed(1)
    partial = [grid_points(g, n) for n in (7, 4, 6, 9, 8)]
    complete = [grid_points(g, n) for n in (12, 4, 4, 6, 13)]
    batch = {
        "coordinates": ME.utils.batched_coordinates(partial),
        "features": torch.randn(34, 1, generator=g),
        "target_coordinates": ME.utils.batched_coordinates(complete),
    }
    chunks, plan = split_batch(batch, 3)
    assert [len(r) for r in plan.point_rows] == [3, 3]
    for chunk, ids in zip(chunks, plan.chunk_samples):
        assert [int(c.shape[0]) for c in chunk["target_coordinates"][:, 0].unique(return_counts=True)[1:]] == [len(ids)]
        for rank, sample in enumerate(ids.tolist()):
            mine = chunk["target_coordinates"][chunk["target_coordinates"][:, 0] == rank, 1:]
            assert torch.equal(mine, complete[sample])
            assert torch.equal(chunk["coordinates"][chunk["coordinates"][:, 0] == rank, 1:], partial[sample])
    # balanced by the points of both sets (19, 8, 10, 15, 21), not by the partial views' alone (7, 4, 6, 9, 8)
    assert [c.tolist() for c in plan.chunk_samples] == [[4], [0, 1], [2, 3]]
    assert [c.tolist() for c in balanced_assignment(torch.tensor([7, 4, 6, 9, 8]), 3)] == [[3], [1, 4], [0, 2]]


def test_coordinate_names_and_look_alikes():
    g = torch.Generator().manual_seed(2)
    a = ME.utils.batched_coordinates([grid_points(g, n) for n in (4, 6, 5)])
    b = ME.utils.batched_coordinates([grid_points(g, n) for n in (7, 3, 2)])
    for key in ("coords1", "xyz1", "target_coordinates", "complete"):  # named, or an integer look-alike with B samples
        _, plan = split_batch({"coordinates": a, key: b, "labels": torch.arange(3)}, 2)
        assert len(plan.point_rows) == 2, key
    # a float tensor under a plain name is not taken for coordinates: the error names the role that fits
    with pytest.raises(BatchLayoutError, match=r"layout=\{'target': 'coordinates'\}") as err:
        split_batch({"coordinates": a, "target": b.double(), "labels": torch.arange(3)}, 2)
    assert "'replicate'" not in str(err.value).split("coordinates'}")[0]
    # a float [M, 3] named xyz without a batch column is per-point data, not coordinates
    chunks, plan = split_batch({"coordinates": a, "xyz": torch.randn(15, 3), "labels": torch.arange(3)}, 2)
    assert len(plan.point_rows) == 1 and plan.roles[1] == "points"


def test_errors_name_the_fix():
    g = torch.Generator().manual_seed(3)
    a = ME.utils.batched_coordinates([grid_points(g, n) for n in (4, 6, 5)])
    other = ME.utils.batched_coordinates([grid_points(g, n) for n in (7, 3)])  # 2 samples, the batch has 3
    with pytest.raises(BatchLayoutError, match="disagree on the number of samples.*'points'.*'indices'"):
        split_batch({"coordinates": a, "coords1": other}, 2)
    with pytest.raises(BatchLayoutError, match="role 'indices'"):
        split_batch({"coordinates": a, "ids": torch.tensor([[3, 1], [0, 2], [7, 7], [1, 0]])}, 2)
    # two loaders' batches of different sizes in one (a CombinedLoader's): named as such, not a layout to give
    with pytest.raises(BatchLayoutError, match=r"batches of different numbers of samples under batch\['a'\] and "
                       r"batch\['b'\].*CombinedLoader.*one batch_size"):
        split_batch({"a": {"coordinates": a, "labels": torch.arange(3)}, "b": {"coordinates": other}}, 2)
    # a per-point tensor of the same length as two point sets: layout names the set
    b = ME.utils.batched_coordinates([grid_points(g, n) for n in (5, 5, 5)])
    with pytest.raises(BatchLayoutError, match=r"'normals': 'points:coordinates'"):
        split_batch({"coordinates": a, "coords1": b, "normals": torch.randn(15, 3)}, 2)
    chunks, plan = split_batch({"coordinates": a, "coords1": b, "normals": torch.randn(15, 3)}, 2,
                               layout={"normals": "points:coords1"})
    assert plan.leaf_sources[2] == 1
    batch = pair_batch([3, 4], [2, 5], [2, 2])
    with pytest.raises(BatchLayoutError, match=r"correspondences'\]\[\d+, 1\] = 7 is not a row of batch\['coords1'\]"):
        split_batch(dict(batch, correspondences=torch.tensor([[0, 0], [1, 7]])), 2)
    with pytest.raises(BatchLayoutError, match="pairs a point of sample 0 .* with a point of sample 1"):
        split_batch(dict(batch, correspondences=torch.tensor([[0, 3]])), 2)
    with pytest.raises(BatchLayoutError, match="says sample 1 in its batch column"):
        split_batch(dict(batch, correspondences=torch.tensor([[1, 0, 0]])), 2)
    with pytest.raises(BatchLayoutError, match="'indices:coords0,coords1'"):
        three = dict(batch, coords2=batch["coords1"].clone(), feats2=batch["feats1"].clone(),
                     correspondences=torch.tensor([[0, 0]]))
        split_batch(three, 2)
    chunks, _ = split_batch(dict(batch, correspondences=torch.tensor([[0, 1], [5, 6]])), 2,
                            layout={"correspondences": "indices:coords1,coords1"})
    assert sorted(c["correspondences"].tolist() for c in chunks) == [[[0, 1]], [[3, 4]]]


def test_per_sample_lists_of_index_tensors_travel_with_their_samples():
    batch = pair_batch([3, 4, 2], [2, 5, 3], [0, 0, 0])
    own = [torch.tensor([[0, 1]]), torch.tensor([[3, 4], [1, 0]]), torch.tensor([[1, 2]])]
    chunks, plan = split_batch(dict(batch, correspondences=own), 2)
    for chunk, ids in zip(chunks, plan.chunk_samples):
        assert [t.tolist() for t in chunk["correspondences"]] == [own[i].tolist() for i in ids.tolist()]
    with pytest.raises(BatchLayoutError, match="per-sample list of 2 tensors, but the batch has 3 samples"):
        split_batch(dict(batch, correspondences=own[:2]), 2)
    # sample 2 has 2 points in coords0 (rows 0..1): its own row 2 does not exist
    with pytest.raises(BatchLayoutError, match=r"correspondences'\]\[2\]\[0, 0\] = 2 is not a row of sample 2"):
        split_batch(dict(batch, correspondences=[*own[:2], torch.tensor([[2, 0]])]), 2)


def test_a_per_sample_integer_table_is_not_taken_for_coordinates():
    g = torch.Generator().manual_seed(9)
    a = ME.utils.batched_coordinates([grid_points(g, n) for n in (4, 6, 5)])
    boxes = torch.tensor([[0, 3, 4, 5], [1, 2, 2, 2], [2, 7, 1, 0]])  # column 0 reads 0, 1, 2 by chance
    chunks, plan = split_batch({"coordinates": a, "boxes": boxes}, 2)
    assert len(plan.point_rows) == 1 and plan.roles[1] == "samples"
    for chunk, ids in zip(chunks, plan.chunk_samples):
        assert torch.equal(chunk["boxes"], boxes[ids])  # untouched, not renumbered


def test_an_index_tensor_left_to_its_length_is_named_with_the_indices_role():
    """FCGF's hardest-negative sampling: `negatives` holds, for each point of the second scan, the row of another
    point of its sample, so it has that scan's length. Taken by its length it would be cut as per-point values and
    not re-based (the pairs would be wrong): a warning names the 'indices' role, and with it each chunk's indices
    pick the same points as the whole batch's."""
    from tests.support.pairs import pair_batch

    batch = pair_batch(range(5))
    index = batch["sinput1_C"][:, 0].long()
    assert batch["sinput0_C"].shape[0] != batch["sinput1_C"].shape[0]
    negatives = torch.empty_like(index)
    for s in range(int(index.max()) + 1):
        rows = torch.nonzero(index == s).flatten()
        negatives[rows] = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(s))]
    batch["negatives"] = negatives
    with pytest.warns(UserWarning, match=r"batch\['negatives'\] is an integer tensor under a key that names indices.*"
                                         r"layout=\{'negatives': 'indices:sinput1_C'\}"):
        split_batch(batch, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunks, plan = split_batch(batch, 3, layout={"negatives": "indices:sinput1_C"})
    rows_of = plan.index_rows[max(plan.index_rows)]  # the negatives' rows that went to each chunk
    for chunk, rows in zip(chunks, rows_of):
        whole = batch["sinput1_C"][batch["negatives"][rows]][:, 1:]
        assert torch.equal(chunk["sinput1_C"][chunk["negatives"]][:, 1:], whole)


def test_labels_of_the_original_points_split_with_their_coordinates_as_one_device():
    """Labels of the original points an inverse map sends to voxels match neither the samples nor the voxels: the
    error names the fix, the original points' coordinates in the batch; with them, and the inverse map as indices
    into the voxels, a fit is one device's (float64)."""
    import lightning as L
    import torch.nn.functional as F

    from lightning_sparse_dp import SparseDataParallelStrategy
    from tests.support.exact import assert_same_states, same_start
    from tests.support.helpers import loader, trainer

    batch = voxelized_batch()
    bare = {k: v for k, v in batch.items() if k != "original_coordinates"}
    with pytest.raises(BatchLayoutError, match=r"put that set's coordinates in the batch"):
        split_batch(bare, 3, layout={"inverse": "indices:coordinates"})

    class OnOriginalPoints(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(ME.MinkowskiConvolution(3, 8, kernel_size=3, dimension=3), ME.MinkowskiReLU())
            self.head = torch.nn.Linear(8, 4)

        def training_step(self, b, batch_idx):
            voxels = self.net(ME.SparseTensor(b["features"], b["coordinates"], device=self.device)).F
            return F.cross_entropy(self.head(voxels)[b["inverse"]], b["point_labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ours, reference = same_start(OnOriginalPoints, seed=0)
    strategy = SparseDataParallelStrategy(layout={"inverse": "indices:coordinates"})
    trainer(strategy=strategy, devices=3, precision="64-true").fit(ours, loader(batch))
    trainer(precision="64-true").fit(reference, loader(batch))
    assert_same_states(ours, reference)


def test_a_float_copy_of_the_coordinates_under_another_key_is_renumbered_with_them():
    """A target shape collated as float coordinates (``gt = coords.float()``, moved) under a key that names no
    coordinates kept the whole batch's sample ids in column 0 while its rows went with their samples: chunk 1's target
    numbered samples 2 and 3 beside its coordinates' 0 and 1 (0.07 relative off one device, silently in validation).
    Float features with as many rows, whose column 0 is not the batch index, are cut as they are."""
    batch = collate_dict(random_samples(6, seed=23))
    coords = batch["coordinates"]
    gt = coords.double()
    gt[:, 1:] += 1.25
    feats = torch.rand(len(coords), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    chunks, plan = split_batch({"coords": coords, "gt": gt, "feats": feats}, 3)
    for j, chunk in enumerate(chunks):
        moved = chunk["coords"].double()
        moved[:, 1:] += 1.25
        assert torch.equal(chunk["gt"], moved), j
        assert torch.equal(chunk["feats"], feats[plan.point_rows[0][j]]), j


@pytest.mark.parametrize("key,layout,column", [("original_batch", None, False), ("scene", {"scene": "indices:batch"}, False),
                                               ("batch", None, True)])
def test_a_batch_vector_is_renumbered_with_its_samples(key, layout, column):
    """Each point's sample kept as a vector (``x.C[:, 0].long()``, PyG's ``batch``) was cut as per-point values, so each
    chunk's held the whole batch's sample ids beside coordinates numbered 0..b-1: a per-sample mean over it 0.6 off,
    silently. Under a key naming a batch (or with ``"indices:batch"``) it is renumbered with its samples, and merged
    back to the whole batch's ids; an integer per-point label under another key is cut as it is."""
    batch = collate_dict(random_samples(7, seed=24))
    coords = batch["coordinates"]
    labels = torch.randint(0, 5, (len(coords),), generator=torch.Generator().manual_seed(4))
    vector = coords[:, :1].long() if column else coords[:, 0].long()  # [N, 1] (coords[:, :1]) or [N]
    chunks, plan = split_batch({"coords": coords, key: vector, "point_labels": labels}, 3, layout=layout)
    for j, chunk in enumerate(chunks):
        assert torch.equal(chunk[key].reshape(-1), chunk["coords"][:, 0].long()), j
        assert torch.equal(chunk["point_labels"], labels[plan.point_rows[0][j]]), j
    assert torch.equal(merge_batch(chunks, plan)[key], vector)


def test_an_unnamed_inverse_map_is_said_with_the_set_its_values_index():
    """sparse_quantize's inverse map under its own name was cut as per-point values of the original points, silently,
    and the step then failed with a bare IndexError. It is said now, naming the role and the set it indexes."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "inverse_map" in m})
    batch = voxelized_batch()
    batch["inverse_map"] = batch.pop("inverse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split_batch(batch, 3)
    said = [str(w.message) for w in caught if "batch['inverse_map'] is an integer tensor" in str(w.message)]
    assert len(said) == 1 and "'indices" in said[0] and "inverse map holds rows of the voxels" in said[0], said


def test_target_coordinates_with_an_unsorted_batch_column_are_named_coordinates_in_the_error():
    """A second point set whose rows are not sorted by sample was taken for a per-sample tensor of missing samples
    ("the last 21 of them have no points") and given the role 'indices', which fails; it is named as coordinates now,
    the role that splits it exactly."""
    g = torch.Generator().manual_seed(25)
    a = ME.utils.batched_coordinates([grid_points(g, n) for n in (4, 6, 5)])
    target = ME.utils.batched_coordinates([grid_points(g, n) for n in (7, 3, 2)])
    target = target[torch.randperm(len(target), generator=g)]
    with pytest.raises(BatchLayoutError, match=r"layout=\{'target': 'coordinates'\}") as err:
        split_batch({"coordinates": a, "target": target, "labels": torch.arange(3)}, 2)
    assert "have no points" not in str(err.value) and "has no points" not in str(err.value)
    chunks, plan = split_batch({"coordinates": a, "target": target, "labels": torch.arange(3)}, 2,
                               layout={"target": "coordinates"})
    assert sum(len(c["target"]) for c in chunks) == len(target)


def test_an_index_error_names_which_source_each_column_was_read_as():
    """Naming only the second scan in layout made it the first source, so correspondences' column 0 was checked
    against it; the error blamed the offsets alone. It names the sources the columns were read as, and the layout
    that orders them."""
    batch = pair_batch([8, 3, 6], [2, 5, 4], [3, 2, 3], seed=26)
    with pytest.raises(BatchLayoutError, match=r"columns were read as rows of 'coords1', 'coords0'.*"
                                               r"'indices:coords1,coords0'") as err:
        split_batch(batch, 2, layout={"coords1": "coordinates"})
    assert "with the sources in the columns' order" in str(err.value)
    chunks, _ = split_batch(batch, 2, layout={"coords1": "coordinates", "correspondences": "indices:coords0,coords1"})
    assert sum(len(c["correspondences"]) for c in chunks) == len(batch["correspondences"])
