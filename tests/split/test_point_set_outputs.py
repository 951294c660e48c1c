"""Outputs of steps over several point sets and per-sample structures (issue 18), merged by the gather
(``step/gather.py``) against what one device returns for the whole batch."""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import pytest
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.loss.weights import chunk_weights
from lightning_sparse_dp.split import split_batch
from lightning_sparse_dp.step.gather import gather_outputs
from tests.support.helpers import grid_points

CPU = torch.device("cpu")


def _chunks(num_samples, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (num_samples,), generator=g).tolist()
    batch = {"coordinates": ME.utils.batched_coordinates([grid_points(g, n) for n in sizes]),
             "features": torch.randn(sum(sizes), 2, generator=g, dtype=torch.float64)}
    chunks, plan = split_batch(batch, k)
    return batch, chunks, plan


def _gather(outputs, plan, **kwargs):
    return gather_outputs(outputs, plan, chunk_weights(plan, "samples"), CPU, warning_cache=WarningCache(), **kwargs)


@pytest.mark.parametrize("num_samples", [7, 6, 2])
def test_decomposed_outputs_come_back_as_one_device_returns_them(num_samples):
    batch, chunks, plan = _chunks(num_samples, 3)

    def step(b):  # ME's idiom: a SparseTensor's per-sample rows, and (coordinates, features) pairs
        x = ME.SparseTensor(b["features"], b["coordinates"])
        y = ME.MinkowskiReLU()(x)
        coords, feats = y.decomposed_coordinates, y.decomposed_features
        return {"loss": y.F.sum() * 0, "feats": feats, "pairs": list(zip(coords, feats)),
                "dicts": [{"n": len(f), "mean": f.mean(0)} for f in feats], "both": (coords, feats)}

    def by_coordinates(coords, feats):  # ME's decomposition order inside a sample is not fixed: compare as sets
        key = ((coords[:, 0].long() * 64 + coords[:, 1]) * 64 + coords[:, 2]).argsort()
        return coords[key], feats[key]

    one = step(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # equal chunks warn that a tuple of alike entries is taken per sample
        ours = _gather([step(c) for c in chunks], plan)
    assert len(ours["feats"]) == len(ours["pairs"]) == len(ours["dicts"]) == num_samples
    for b in range(num_samples):
        for got in (ours["pairs"][b], (ours["both"][0][b], ours["both"][1][b]), (ours["pairs"][b][0], ours["feats"][b])):
            for x, y in zip(by_coordinates(*got), by_coordinates(*one["pairs"][b]), strict=True):
                assert torch.equal(x, y)
        assert ours["dicts"][b]["n"] == one["dicts"][b]["n"]
        torch.testing.assert_close(ours["dicts"][b]["mean"], one["dicts"][b]["mean"], rtol=1e-12, atol=0)
    assert isinstance(ours["both"], tuple) and len(ours["both"]) == 2  # a fixed (coordinates, features) tuple


def test_top_level_per_sample_list_and_fixed_tuples():
    batch, chunks, plan = _chunks(7, 3, seed=4)
    assert plan.samples_per_chunk != [plan.samples_per_chunk[0]] * 3

    def step(b):
        ids = b["coordinates"][:, 0].long()
        return [b["features"][ids == i] * 2 for i in range(int(ids.max()) + 1)]

    ours = _gather([step(c) for c in chunks], plan)
    assert [t.shape for t in ours] == [t.shape for t in step(batch)]
    assert all(torch.equal(a, b) for a, b in zip(ours, step(batch)))
    # (loss, logits): a fixed structure, never per-sample, even in chunks of two samples
    _, chunks, plan = _chunks(6, 3, seed=5)
    outs = [(c["features"].sum(), c["features"]) for c in chunks]
    loss, logits = _gather(outs, plan)
    assert loss.dim() == 0 and logits.shape[0] == sum(len(c["features"]) for c in chunks)


def test_ambiguous_sequences_warn_and_output_layout_decides():
    _, chunks, plan = _chunks(6, 3, seed=6)  # 2 samples per chunk
    outs = [(c["features"][:1], c["features"][1:2]) for c in chunks]  # two alike tensors: per sample or two heads?
    with pytest.warns(UserWarning, match=r"output_layout=\{'output': 'fixed'\}"):
        merged = _gather(outs, plan)
    assert len(merged) == 6
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fixed = _gather(outs, plan, output_layout={"output": "fixed"})
        assert len(fixed) == 2 and fixed[0].shape[0] == 3
        assert len(_gather(outs, plan, output_layout={"output": "samples"})) == 6
    assert not [w for w in seen if "alike entries" in str(w.message)]
    with pytest.raises(ValueError, match="role 'samples' but its lengths"):
        _gather([[c["features"]] for c in chunks], plan, output_layout={"output": "samples"})


def test_outputs_of_the_second_point_set_come_back_in_its_order():
    """Two scans whose samples' sizes differ ((2, 4), (5, 5), (4, 2)) but add up alike in every chunk: outputs of the
    second came back in the first's row order (coordinates 1.0, features 1.4 relative off one device, silently). Its
    coordinates and SparseTensors now find their set by their batch column; features alone are said."""
    g = torch.Generator().manual_seed(27)
    sets = [[grid_points(g, n) for n in sizes] for sizes in ((2, 5, 4), (4, 5, 2))]
    batch = {"coords0": ME.utils.batched_coordinates(sets[0]), "coords1": ME.utils.batched_coordinates(sets[1])}
    batch["feats1"] = torch.randn(len(batch["coords1"]), 3, generator=g, dtype=torch.float64)
    chunks, plan = split_batch(batch, 2, assignment=lambda points, k: [torch.tensor([1]), torch.tensor([0, 2])])

    def step(b):
        x = ME.SparseTensor(b["feats1"], b["coords1"])
        return {"c1": b["coords1"], "sparse": x, "f1": b["feats1"]}

    with pytest.warns(UserWarning, match=r"output\['f1'\] has as many rows in every chunk as the points of several"):
        ours = _gather([step(c) for c in chunks], plan)
    assert torch.equal(ours["c1"], batch["coords1"])
    one = step(batch)["sparse"]
    assert torch.equal(ours["sparse"].C, one.C) and torch.equal(ours["sparse"].F, one.F)
