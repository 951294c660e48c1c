"""Loss weighting that is right by default: ``"auto"``'s rule, every weighting's counts, a callable for
ignored labels, and a batch with nothing to count; each against one device with the whole batch
(float64, 1e-10 relative per tensor).
"""

from __future__ import annotations

import logging

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from lightning_sparse_dp.loss.weights import chunk_counts, chunk_weights, resolve_auto
from tests.support.exact import assert_same_states, fit_float64, relative_difference, same_start
from tests.support.helpers import IN_CHANNELS, NUM_CLASSES, SparseNet, collate_dict, random_samples

IGNORE = -100  # torch's default ignore_index


# --- loss weighting that is right by default ---------------------------------------------------------


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
        t = fit_float64(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="auto"), devices=3)
    assert "loss_weighting='auto' weights each replica's loss by its points" in caplog.text
    assert "batch['labels']" in caplog.text
    r = fit_float64(reference, batch)
    assert_same_states(ours, reference)
    assert relative_difference(t.callback_metrics["train_loss"], r.callback_metrics["train_loss"]) <= 1e-10


def test_samples_weighting_of_a_per_point_loss_is_not_exact():  # the comparison above can fail
    batch = _point_batch(7, seed=5)
    ours, reference = same_start(PointNet)
    fit_float64(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="samples"), devices=3)
    fit_float64(reference, batch)
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
    t = fit_float64(ours, batch, strategy=strategy, devices=3)
    r = fit_float64(reference, batch)
    loss = t.callback_metrics["train_loss"]
    assert torch.isfinite(loss)
    assert relative_difference(loss, r.callback_metrics["train_loss"]) <= 1e-10
    assert_same_states(ours, reference)


def test_points_weighting_with_ignored_labels_is_not_exact():  # the comparison above can fail
    batch = _point_batch(7, seed=8, ignore="some")
    ours, reference = same_start(PointNet)
    fit_float64(ours, batch, strategy=SparseDataParallelStrategy(loss_weighting="points", split="contiguous"), devices=3)
    fit_float64(reference, batch)
    assert max(relative_difference(v, reference.state_dict()[k]) for k, v in ours.state_dict().items()) > 1e-6


def test_a_batch_with_nothing_to_count_gives_zero_loss_not_nan():
    batch = _point_batch(4, seed=9, ignore=[0, 1, 2, 3])
    model = PointNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="no chunk of a batch has anything to count"):
        t = fit_float64(model, batch, strategy=SparseDataParallelStrategy(loss_weighting=_valid_labels), devices=3)
    assert t.callback_metrics["train_loss"].item() == 0.0
    for k, v in model.state_dict().items():  # SGD with zero gradients: nothing moves, nothing is NaN
        assert torch.equal(v, before[k].to(v.dtype)), k


def test_the_suggested_counting_callable_fits_the_batchs_own_structure():
    """The fallback line's example reaches the labels as the chunk holds them (issue 59: it said chunk['labels'] to a
    tuple batch), and runs on a chunk of that batch."""
    import MinkowskiEngine as ME

    from lightning_sparse_dp.loss.weights import counting_example
    from lightning_sparse_dp.split import split_batch
    from tests.support.helpers import random_samples

    coords, feats, _ = zip(*random_samples(4))
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    labels = torch.randint(0, 3, (coordinates.shape[0],))
    for batch, want in (((coordinates, features, labels), "chunk[2]"),
                        ({"coordinates": coordinates, "features": features, "seg": labels}, "chunk['seg']")):
        chunks, plan = split_batch(batch, 2)
        example = counting_example(plan)
        assert example == f"lambda chunk: ({want} != 255).sum()"
        assert int(eval(example)(chunks[0])) == len(chunks[0][2] if isinstance(batch, tuple) else chunks[0]["seg"])


class _Predicts(SparseNet):
    def predict_step(self, batch, batch_idx):
        return self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))


def test_a_weighting_callable_for_labelled_chunks_does_not_stop_predict(caplog):
    """The documented ``loss_weighting=lambda chunk: (chunk["labels"] != 255).sum()`` raised a bare KeyError on a
    predict loader without labels, where one device runs: predict has no loss to weigh. It runs, said once."""
    from tests.support.helpers import loader, trainer

    batch = collate_dict(random_samples(7, seed=29))
    del batch["labels"]
    strategy = SparseDataParallelStrategy(loss_weighting=lambda chunk: (chunk["labels"] != 255).sum())
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO):
        [ours] = trainer(strategy=strategy, devices=3).predict(_Predicts(), loader(batch))
    torch.manual_seed(0)
    [one] = trainer(devices=1).predict(_Predicts(), loader(batch))
    torch.testing.assert_close(ours, one, rtol=1e-5, atol=0)
    assert "loss_weighting callable failed on a predict step's chunk (KeyError" in caplog.text
