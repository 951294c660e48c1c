"""Edges where sparse_dp used to be silently wrong, each against one device with the whole batch.

Exactness in float64 (``precision="64-true"``) at 1e-10 relative per tensor (max |difference| /
max |value|). Issue 10 (metadata, outputs, logged values, short chunks, ignore labels, print,
messages) and, from issue 7, float coordinates and the loss weighting.
"""

from __future__ import annotations

import logging

import MinkowskiEngine as ME
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse_dp import BatchLayoutError, SparseDataParallelStrategy, split_batch
from lightning_sparse_dp.weighting import chunk_counts, chunk_weights, resolve_auto
from lightning_sparse_dp.outputs import gather_outputs
from lightning_sparse_dp.split import merge_batch
from tests.helpers import (
    IN_CHANNELS, NUM_CLASSES, SparseNet, assert_same_states, collate_dict, loader, random_samples,
    relative_difference, same_start, trainer
)

IGNORE = -100  # torch's default ignore_index


def _fit(model, batch, strategy="auto", devices=1, **kwargs):
    t = trainer(strategy=strategy, devices=devices, precision="64-true", **kwargs)
    t.fit(model, loader(batch))
    return t


# --- issue 7: float coordinates in the split -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["dict", "tuple", "layout"])
def test_float_coordinates_split_by_their_batch_column_keeping_values_and_dtype(dtype, form):
    base = collate_dict(random_samples(7, seed=1))
    coords = base["coordinates"].to(dtype)
    coords[:, 1:] += 0.25  # continuous coordinates: kept as they are
    if form == "dict":
        batch = {"coordinates": coords, "features": base["features"], "labels": base["labels"]}
    elif form == "tuple":  # ME.utils.sparse_collate(..., dtype=torch.float32) order
        batch = (coords, base["features"], base["labels"])
    else:
        batch = {"pts": coords, "features": base["features"], "labels": base["labels"]}
    layout = {"pts": "coordinates"} if form == "layout" else None
    chunks, plan = split_batch(batch, 3, layout=layout, assignment="balanced")
    key = 0 if form == "tuple" else ("pts" if form == "layout" else "coordinates")
    for chunk, ids, rows in zip(chunks, plan.chunk_samples, plan.point_rows[0]):
        c = chunk[key]
        assert c.dtype == dtype
        assert torch.equal(c[:, 1:], coords[rows, 1:])
        assert sorted(c[:, 0].unique().tolist()) == list(range(len(ids)))
    merged = merge_batch(chunks, plan)
    assert torch.equal(merged[key], coords)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.__setitem__((2, 0), 0.5), r"not a whole number \(0.5 in row 2\)"),
        (lambda c: c.__setitem__((c[:, 0] == 1, 0), 4.0), r"gaps in its batch indices"),
        (lambda c: c.__setitem__((0, 0), -1.0), r"negative batch index"),
        (lambda c: c.__setitem__((0, 0), float("nan")), r"not a whole number"),
    ],
)
def test_float_batch_column_that_is_not_a_batch_index_is_refused(change, message):
    base = collate_dict(random_samples(4, seed=2))
    coords = base["coordinates"].float()
    change(coords)
    with pytest.raises(BatchLayoutError, match=message):
        split_batch({**base, "coordinates": coords}, 2)


class FloatCoordinateNet(SparseNet):
    """ME's multigpu_lightning way: the SparseTensor is built in the step from float coordinates, no device=."""

    def loss(self, batch):
        coords, feats, labels = batch
        return F.cross_entropy(self(ME.SparseTensor(feats, coords)), labels)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss


class FieldNet(SparseNet):
    """A TensorField from continuous float coordinates, quantized in the step (ModelNet-style)."""

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"])
        return F.cross_entropy(self(field.sparse()), batch["labels"])


def test_float32_sparse_collate_batch_trains_like_one_device():
    coords, feats, labels = zip(*random_samples(7, seed=3))
    c, f = ME.utils.sparse_collate(list(coords), list(feats), dtype=torch.float32)
    batch = (c, f, torch.tensor(labels))
    assert batch[0].dtype == torch.float32
    ours, reference = same_start(FloatCoordinateNet)
    t = _fit(ours, batch, strategy="sparse_dp", devices=3)
    r = _fit(reference, batch)
    assert_same_states(ours, reference)
    assert relative_difference(t.callback_metrics["train_loss"], r.callback_metrics["train_loss"]) <= 1e-10


def test_continuous_coordinates_reach_each_tensor_field_unchanged():
    base = collate_dict(random_samples(7, seed=4))
    coords = base["coordinates"].float()
    coords[:, 1:] = coords[:, 1:] * 0.7 + 0.1  # several points per voxel, not whole numbers
    batch = {**base, "coordinates": coords}
    seen = []

    class Spy(FieldNet):
        def loss(self, batch):
            seen.append(batch["coordinates"])
            return super().loss(batch)

    ours, reference = same_start(Spy)
    _fit(ours, batch, strategy="sparse_dp", devices=3)
    assert all(c.dtype == torch.float64 for c in seen)  # precision="64-true" turns them into float64
    assert sum(c.shape[0] for c in seen) == coords.shape[0]
    assert any(not torch.equal(c[:, 1:], c[:, 1:].floor()) for c in seen)
    reference.loss = FieldNet.loss.__get__(reference)
    _fit(reference, batch)
    assert_same_states(ours, reference)


# --- issue 7: loss weighting that is right by default --------------------------------------------


class PointNet(SparseNet):
    """Per-point segmentation without batch norm: TensorField -> conv, ReLU, conv -> slice -> linear.

    The loss is a cross-entropy averaged over the points whose label is not ``IGNORE``.
    """

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3),
            ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(8, 8, kernel_size=3, dimension=3),
        )
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, field):
        return self.head(self.net(field.sparse()).slice(field).F)

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"])
        return F.cross_entropy(self(field), batch["labels"], ignore_index=IGNORE)


def _point_batch(num_samples, seed, ignore=None):
    """Per-point labels [N]; ``ignore``: sample ids whose every label is IGNORE, or "some" for a share."""
    base = collate_dict(random_samples(num_samples, seed=seed))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (base["coordinates"].shape[0],), generator=g)
    if ignore == "some":
        labels[torch.rand(labels.shape[0], generator=g) < 0.3] = IGNORE
    elif ignore:
        labels[torch.isin(base["coordinates"][:, 0], torch.tensor(ignore, dtype=torch.int32))] = IGNORE
    return {"coordinates": base["coordinates"], "features": base["features"], "labels": labels}


def test_auto_weighting_is_exact_for_a_per_point_loss_and_says_its_choice(caplog):
    batch = _point_batch(7, seed=5)
    ours, reference = same_start(PointNet)
    with caplog.at_level(logging.INFO):
        t = _fit(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="auto"), devices=3)
    assert "loss_weighting='auto' weights each replica's loss by its points" in caplog.text
    assert "batch['labels']" in caplog.text
    r = _fit(reference, batch)
    assert_same_states(ours, reference)
    assert relative_difference(t.callback_metrics["train_loss"], r.callback_metrics["train_loss"]) <= 1e-10


def test_samples_weighting_of_a_per_point_loss_is_not_exact():  # the comparison above can fail
    batch = _point_batch(7, seed=5)
    ours, reference = same_start(PointNet)
    _fit(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="samples"), devices=3)
    _fit(reference, batch)
    assert max(relative_difference(v, reference.state_dict()[k]) for k, v in ours.state_dict().items()) > 1e-6


def test_auto_rule():
    cls = collate_dict(random_samples(5))
    assert resolve_auto(split_batch(cls, 2)[1])[0] == "samples"
    seg = _point_batch(5, seed=6)
    choice, reason = resolve_auto(split_batch(seg, 2)[1])
    assert choice == "points" and "batch['labels']" in reason
    assert resolve_auto(split_batch(seg, 1)[1])[0] == "points"  # the one-chunk split (sparse_ddp) knows too
    both = {**seg, "scene": torch.arange(5)}
    assert resolve_auto(split_batch(both, 2)[1])[0] == "samples"
    unlabeled = {"coordinates": seg["coordinates"], "features": seg["features"]}
    assert resolve_auto(split_batch(unlabeled, 2)[1])[0] == "samples"
    names = {**seg, "names": [f"s{i}" for i in range(5)]}  # per-sample metadata is not a per-sample tensor
    assert resolve_auto(split_batch(names, 2)[1])[0] == "points"
    field = {"x": ME.TensorField(seg["features"], seg["coordinates"].float()), "labels": seg["labels"]}
    assert resolve_auto(split_batch(field, 2)[1])[0] == "points"


def test_chunk_counts_for_every_weighting():
    batch = _point_batch(7, seed=7, ignore="some")
    chunks, plan = split_batch(batch, 3, assignment="contiguous")
    assert chunk_counts(plan, chunks, "samples") == [3.0, 2.0, 2.0]
    assert chunk_counts(plan, chunks, "points") == [float(c["labels"].numel()) for c in chunks]
    assert chunk_counts(plan, chunks, "auto") == chunk_counts(plan, chunks, "points")
    assert chunk_counts(plan, chunks, "equal") == [1.0, 1.0, 1.0]
    counted = chunk_counts(plan, chunks, lambda c: (c["labels"] != IGNORE).sum())
    assert counted == [float((c["labels"] != IGNORE).sum()) for c in chunks]
    weights = chunk_weights(plan, lambda c: (c["labels"] != IGNORE).sum(), chunks)
    assert sum(weights) == pytest.approx(1.0) and weights == [n / sum(counted) for n in counted]
    one_chunks, one_plan = split_batch(batch, 1)  # what sparse_ddp all-reduces
    assert chunk_counts(one_plan, one_chunks, "points") == [float(batch["labels"].numel())]
    with pytest.raises(ValueError, match="count must be finite and >= 0"):
        chunk_counts(plan, chunks, lambda c: -1)
    with pytest.raises(TypeError, match="must return a number"):
        chunk_counts(plan, chunks, lambda c: "many")
    with pytest.raises(ValueError, match="loss_weighting='voxels'"):
        chunk_counts(plan, chunks, "voxels")


def _valid_labels(chunk):
    return (chunk["labels"] != IGNORE).sum()


@pytest.mark.parametrize("ignore", ["some", [0, 1, 2]])
def test_callable_weighting_is_exact_with_ignored_labels(ignore):
    # contiguous split: chunks of samples 0-2, 3-4, 5-6; with [0, 1, 2] the first chunk has nothing to count
    batch = _point_batch(7, seed=8, ignore=ignore)
    ours, reference = same_start(PointNet)
    strategy = SparseDataParallelStrategy(loss_weighting=_valid_labels, split="contiguous")
    t = _fit(ours, batch, strategy=strategy, devices=3)
    r = _fit(reference, batch)
    loss = t.callback_metrics["train_loss"]
    assert torch.isfinite(loss)
    assert relative_difference(loss, r.callback_metrics["train_loss"]) <= 1e-10
    assert_same_states(ours, reference)


def test_points_weighting_with_ignored_labels_is_not_exact():  # the comparison above can fail
    batch = _point_batch(7, seed=8, ignore="some")
    ours, reference = same_start(PointNet)
    _fit(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="points", split="contiguous"), devices=3)
    _fit(reference, batch)
    assert max(relative_difference(v, reference.state_dict()[k]) for k, v in ours.state_dict().items()) > 1e-6


def test_a_batch_with_nothing_to_count_gives_zero_loss_not_nan():
    batch = _point_batch(4, seed=9, ignore=[0, 1, 2, 3])
    model = PointNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="no chunk of a batch has anything to count"):
        t = _fit(model, batch, strategy=SparseDataParallelStrategy(loss_weighting=_valid_labels), devices=3)
    assert t.callback_metrics["train_loss"].item() == 0.0
    for k, v in model.state_dict().items():  # SGD with zero gradients: nothing moves, nothing is NaN
        assert torch.equal(v, before[k].to(v.dtype)), k


# --- issue 10, 1: per-sample metadata that is not a tensor ---------------------------------------


def _named_batch(num_samples, seed=10):
    batch = collate_dict(random_samples(num_samples, seed=seed, min_points=2))
    batch["names"] = [f"scene{i}-label{int(y)}" for i, y in enumerate(batch["labels"])]
    batch["paths"] = tuple(f"/data/{i}.ply" for i in range(num_samples))
    batch["ids"] = np.arange(num_samples) * 10
    return batch


@pytest.mark.parametrize("assignment", ["balanced", "contiguous"])
def test_per_sample_lists_tuples_and_arrays_are_split_with_their_samples(assignment):
    batch = _named_batch(9)
    chunks, plan = split_batch(batch, 3, assignment=assignment)
    for chunk, ids in zip(chunks, plan.chunk_samples):
        assert chunk["names"] == [f"scene{i}-label{int(batch['labels'][i])}" for i in ids.tolist()]
        assert chunk["names"] == [f"scene{i}-label{int(y)}" for i, y in zip(ids.tolist(), chunk["labels"])]
        assert isinstance(chunk["paths"], tuple) and chunk["paths"] == tuple(batch["paths"][i] for i in ids.tolist())
        assert np.array_equal(chunk["ids"], batch["ids"][ids.numpy()])
    merged = merge_batch(chunks, plan)
    assert merged["names"] == batch["names"] and merged["paths"] == batch["paths"]
    assert np.array_equal(merged["ids"], batch["ids"])


def test_names_pair_with_their_predictions_through_the_trainer():
    class Named(SparseNet):
        def predict_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            assert all(n.endswith(f"label{int(y)}") for n, y in zip(batch["names"], batch["labels"]))
            return {"names": batch["names"], "logits": self(x)}

    batch = _named_batch(9)
    ours, reference = same_start(Named)
    [out] = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(ours, loader(batch))
    [ref] = trainer(devices=1, precision="64-true").predict(reference, loader(batch))
    assert out["names"] == batch["names"] == ref["names"]
    assert relative_difference(out["logits"], ref["logits"]) <= 1e-10


def test_layout_names_a_list_and_an_unknown_layout_key_is_an_error():
    batch = _named_batch(4)
    batch["names"] = batch["names"][:3] + ["extra", "more"]  # 5 names for 4 samples: passed whole ...
    chunks, _ = split_batch(batch, 2)
    assert chunks[0]["names"] == batch["names"]
    with pytest.raises(BatchLayoutError, match="role 'samples' but it has no length|length"):
        split_batch({**batch, "names": None}, 2, layout={"names": "samples"})
    with pytest.raises(BatchLayoutError, match=r"layout names 'nmes', which matches nothing.*'names'"):
        split_batch(batch, 2, layout={"nmes": "samples"})
    chunks, _ = split_batch(_named_batch(4), 2, layout={"names": "replicate"})
    assert len(chunks[0]["names"]) == 4


# --- issue 10, 2: step outputs of a fixed size -----------------------------------------------------


class Histogram(SparseNet):
    def predict_step(self, batch, batch_idx):
        labels = batch["labels"]
        return {"hist": torch.bincount(labels, minlength=NUM_CLASSES), "n": labels.shape[0]}


def _hist_batch(num_samples=9):
    return collate_dict(random_samples(num_samples, seed=11))


def test_fixed_size_output_with_output_layout_is_the_one_device_value():
    batch = _hist_batch()
    strategy = SparseDataParallelStrategy(output_layout={"hist": "sum", "n": "sum"}, split="contiguous")
    [out] = trainer(strategy=strategy, devices=3).predict(Histogram(), loader(batch))
    [ref] = trainer(devices=1).predict(Histogram(), loader(batch))
    assert out["hist"].tolist() == ref["hist"].tolist() == torch.bincount(batch["labels"], minlength=NUM_CLASSES).tolist()
    assert out["n"] == ref["n"] == 9


def test_ambiguous_unnamed_output_warns():
    batch = _hist_batch(12)  # chunks of 3 samples; a [NUM_CLASSES] = [4] output per chunk: not per-sample
    with pytest.warns(UserWarning, match=r"output\['hist'\] has the same length \(4\) in every chunk.*output_layout"):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3).predict(Histogram(), loader(batch))
    batch = _hist_batch(9)  # chunks of 3 samples, a [4] output: matches nothing, concatenated, with a warning
    with pytest.warns(UserWarning, match=r"output\['hist'\] has the same length \(4\).*concatenated"):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3).predict(Histogram(), loader(batch))


def test_output_roles_directly():
    batch = _hist_batch(7)
    chunks, plan = split_batch(batch, 3, assignment="balanced")
    outs = [{"p": c["labels"].double(), "h": torch.ones(2), "m": torch.tensor([1.0, 3.0]) * (j + 1), "l": j}
            for j, c in enumerate(chunks)]
    layout = {"p": "samples", "h": "sum", "m": "mean", "l": "list"}
    weights = chunk_weights(plan, "samples")
    got = gather_outputs(outs, plan, weights, torch.device("cpu"), layout)
    assert got["p"].tolist() == batch["labels"].double().tolist()
    assert got["h"].tolist() == [3.0, 3.0]
    expected = sum(w * (j + 1) for j, w in enumerate(weights))
    assert got["m"].tolist() == pytest.approx([expected, 3 * expected])
    assert got["l"] == [0, 1, 2]
    with pytest.raises(ValueError, match="use one of"):
        gather_outputs(outs, plan, weights, torch.device("cpu"), {"h": "stack"})


# --- issue 10, 3: logged values that are not means ----------------------------------------------------


class Logs(SparseNet):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("n", batch["labels"].shape[0])
        self.log("points", batch["coordinates"].shape[0], reduce_fx="sum")
        self.log("loss_max", loss, reduce_fx="max")
        self.log("train_loss", loss)
        return loss


def test_logged_counts_and_the_loss_under_max_are_the_one_device_values():
    batch = collate_dict(random_samples(5, seed=12))
    ours, reference = same_start(Logs)
    with pytest.warns(UserWarning, match=r"self.log\('n', <integer>\).*sum over the replicas"):
        t = _fit(ours, batch, strategy="sparse_dp", devices=3)
    r = _fit(reference, batch)
    assert t.callback_metrics["n"].item() == r.callback_metrics["n"].item() == 5
    assert t.callback_metrics["points"].item() == r.callback_metrics["points"].item() == batch["coordinates"].shape[0]
    for name in ("loss_max", "train_loss"):
        assert relative_difference(t.callback_metrics[name], r.callback_metrics[name]) <= 1e-10, name


def test_max_of_a_value_that_is_not_the_loss_warns():
    class MaxOfMeans(SparseNet):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("mean_feature", batch["features"].mean(), reduce_fx="max")
            return loss

    with pytest.warns(UserWarning, match=r"reduce_fx='max'\) takes the max / min over the replicas"):
        _fit(MaxOfMeans(), collate_dict(random_samples(5, seed=13)), strategy="sparse_dp", devices=3)


# --- issue 10, 4: short chunks with per-replica batch norm ---------------------------------------------


def _short_batch(last):
    """Three samples; the last is ``last`` (coordinates [n, 3]), one point or two that one stride-2 voxel holds."""
    samples = random_samples(3, seed=14, min_points=8, max_points=12)
    n = last.shape[0]
    samples[2] = (last.int(), torch.randn(n, IN_CHANNELS), samples[2][2])
    return collate_dict(samples)


def test_single_point_sample_is_not_left_alone_with_per_replica_batch_norm():
    batch = _short_batch(torch.tensor([[0, 0, 0]]))
    seen = []

    class Spy(SparseNet):
        def training_step(self, batch, batch_idx):
            seen.append(batch["coordinates"].shape[0])
            return super().training_step(batch, batch_idx)

    _fit(SparseNet(batch_norm=True), batch)  # one device trains
    _fit(Spy(batch_norm=True), batch, strategy="sparse_dp", devices=3)  # two replicas, no chunk of one point
    assert len(seen) == 2 and min(seen) > 1 and sum(seen) == batch["coordinates"].shape[0]
    chunks, plan = split_batch(batch, 3, assignment="balanced", min_points=2)
    assert plan.num_chunks == 2 and min(plan.points_per_chunk) >= 2


def test_chunk_that_batch_norm_sees_as_one_value_names_the_fix():
    batch = _short_batch(torch.tensor([[0, 0, 0], [1, 0, 0]]))  # two points, one voxel after the stride-2 conv
    _fit(SparseNet(batch_norm=True), batch)  # one device trains
    with pytest.raises(ValueError, match=r"replica 2's chunk has 1 sample\(s\) and 2 point\(s\).*sync_batchnorm=True"):
        _fit(SparseNet(batch_norm=True), batch, strategy=SparseDataParallelStrategy(split="contiguous"), devices=3)
    _fit(SparseNet(batch_norm=True), batch, strategy="sparse_dp", devices=3, sync_batchnorm=True)  # the fix trains


# --- issue 10, 6: self.print ---------------------------------------------------------------------------


def test_print_once_per_step(capsys):
    class Prints(SparseNet):
        def training_step(self, batch, batch_idx):
            self.print(f"step {batch_idx}")
            return super().training_step(batch, batch_idx)

    batches = [collate_dict(random_samples(7, seed=s)) for s in range(4)]
    trainer(strategy="sparse_dp", devices=3, max_steps=4).fit(Prints(), loader(*batches))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines == ["step 0", "step 1", "step 2", "step 3"]


# --- issue 10, 7: messages that point the right way -------------------------------------------------


def test_none_from_some_replicas_names_them_and_says_what_skipping_means():
    class SkipsSmall(SparseNet):
        def training_step(self, batch, batch_idx):
            if batch["labels"].shape[0] < 3:
                return None
            return super().training_step(batch, batch_idx)

    batch = collate_dict(random_samples(7, seed=15))  # contiguous chunks of 3, 2, 2 samples
    with pytest.raises(ValueError, match=r"replica\(s\) \[1, 2\] returned None.*skips the whole step"):
        _fit(SkipsSmall(), batch, strategy=SparseDataParallelStrategy(split="contiguous"), devices=3)


def test_empty_last_sample_is_named():
    batch = collate_dict(random_samples(6, seed=16))
    batch["labels"] = torch.cat([batch["labels"], torch.tensor([1])])  # a 7th sample that has no points
    with pytest.raises(BatchLayoutError, match=r"the last 1 of them has no points.*Drop empty samples"):
        split_batch(batch, 3)


def test_numpy_coordinates_point_to_as_tensor():
    batch = collate_dict(random_samples(5, seed=17))
    with pytest.raises(BatchLayoutError, match=r"batch\['coordinates'\].*numpy.*torch.as_tensor"):
        split_batch({**batch, "coordinates": batch["coordinates"].numpy()}, 2)
    with pytest.raises(BatchLayoutError, match=r"torch.as_tensor"):
        split_batch({**batch, "features": batch["features"].numpy()}, 2)
    with pytest.raises(BatchLayoutError, match=r"batch\[0\] looks like collated coordinates.*numpy.*torch.as_tensor"):
        split_batch((batch["coordinates"].numpy(), batch["features"].numpy(), batch["labels"]), 2)


def test_uncollated_list_of_samples_points_to_sparse_collate():
    coords = [c for c, _, _ in random_samples(3, seed=18)]
    with pytest.raises(BatchLayoutError, match=r"not collated.*ME.utils.sparse_collate"):
        split_batch(coords, 2)
    with pytest.raises(BatchLayoutError, match=r"not collated.*ME.utils.sparse_collate"):
        split_batch({"coordinates_list": coords, "labels": torch.arange(3)}, 2)
