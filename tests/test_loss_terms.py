"""loss_weighting="terms" (the default): the losses users write, exact on 2 and 3 replicas.

Every test fits the same module on one device with the whole batch (plain Lightning) as the
reference, in float64, and compares every parameter and buffer at 1e-10 relative per tensor, and the
logged values. Chunks are given 0 %, 5-40 % and 100 % ignored labels by the split the strategy makes.
"""

from __future__ import annotations

import logging
from functools import partial

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from tests.clients import conv_bn_relu, fresh_loader
from tests.helpers import IN_CHANNELS, NUM_CLASSES, random_samples, relative_difference, state_differences
from tests.helpers import trainer as _trainer

trainer = partial(_trainer, precision="64-true")
REL = 1e-10


def seg_batch(num_samples: int, seed: int, ignore: int = 255, fractions=(0.0, 0.3, 1.0), chunks: int = 3) -> dict:
    """Per-point labels; chunk ``j`` of the default split into ``chunks`` has a share ``fractions[j]`` ignored."""
    samples = random_samples(num_samples, seed=seed, min_points=8, max_points=40)
    coords, feats, _ = zip(*samples)
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (coordinates.shape[0],), generator=g)
    batch = {"coordinates": coordinates, "features": features.double(), "labels": labels}
    _, plan = split_batch(batch, chunks)
    for j, rows in enumerate(plan.point_rows[0]):
        drop = torch.rand(rows.numel(), generator=g) < fractions[j] if 0 < fractions[j] < 1 else torch.full((rows.numel(),), fractions[j] == 1)
        labels[rows[drop]] = ignore
    return batch


class ScanNetSeg(L.LightningModule):
    """ScanNet / S3DIS style: TensorField -> UNet-ish -> slice -> per-point logits; nn.CrossEntropyLoss(ignore_index)."""

    def __init__(self, ignore_index: int = 255, weight=None, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(conv_bn_relu(IN_CHANNELS, 8), conv_bn_relu(8, 8, kernel_size=2, stride=2))
        self.up = ME.MinkowskiConvolutionTranspose(8, 8, kernel_size=2, stride=2, dimension=3)
        self.head = nn.Linear(8, NUM_CLASSES)
        self.criterion = nn.CrossEntropyLoss(ignore_index=ignore_index, weight=weight, label_smoothing=label_smoothing)

    def logits(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"].double())
        return self.head(self.up(self.net(field.sparse())).slice(field).F)

    def loss(self, batch):
        return self.criterion(self.logits(batch), batch["labels"])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), batch_size=batch["labels"].shape[0])  # epoch mean weighted by points

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


class MultiHead(ScanNetSeg):
    """A segmentation CE over labeled points plus a scheduled L1 regression over another mask (functional form)."""

    def __init__(self) -> None:
        super().__init__(ignore_index=-100)
        self.offset = nn.Linear(8, 3)

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"].double())
        y = self.up(self.net(field.sparse())).slice(field).F
        ce = F.cross_entropy(self.head(y), batch["labels"])
        mask = batch["labels"] % 2 == 1  # "instance" points only
        l1 = F.l1_loss(self.offset(y)[mask], batch["features"][mask])
        self.log("ce", ce)
        self.log("l1", l1)
        return ce + (0.5 + self.global_step) * l1  # a scheduled coefficient


class LevelCompletion(L.LightningModule):
    """ME's completion example in small: generative decoder levels, each with a BCE mean over that level's voxels."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(conv_bn_relu(IN_CHANNELS, 8, 2, 2), conv_bn_relu(8, 8, 2, 2))
        self.dec = nn.ModuleList(
            nn.Sequential(ME.MinkowskiGenerativeConvolutionTranspose(8, 8, kernel_size=2, stride=2, dimension=3),
                          ME.MinkowskiBatchNorm(8), ME.MinkowskiReLU())
            for _ in range(2)
        )
        self.cls = nn.ModuleList(ME.MinkowskiConvolution(8, 1, kernel_size=1, dimension=3) for _ in range(2))
        self.prune = ME.MinkowskiPruning()
        self.crit = nn.BCEWithLogitsLoss()

    def loss(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        y, loss = self.enc(x), 0
        for level, (dec, cls) in enumerate(zip(self.dec, self.cls)):
            y = dec(y)
            score = cls(y)
            target = _occupied(score, x, stride=2 ** (1 - level))
            loss += self.crit(score.F.squeeze(1), target) / len(self.dec)
            y = self.prune(y, (score.F[:, 0] > 0) | target.bool()) if level == 0 else y
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _occupied(pred: ME.SparseTensor, x: ME.SparseTensor, stride: int) -> torch.Tensor:
    def keys(c):
        c = c.long()
        return ((c[:, 0] * 4096 + c[:, 1] + 1024) * 4096 + c[:, 2] + 1024) * 4096 + c[:, 3] + 1024

    target = x.C.clone()
    target[:, 1:] = torch.div(target[:, 1:], stride, rounding_mode="floor") * stride
    return torch.isin(keys(pred.C), keys(target)).to(pred.F.dtype)


class MaskedMean(ScanNetSeg):
    """The negative control: a hand-written masked mean, which no capture can weight."""

    def loss(self, batch):
        per_point = F.cross_entropy(self.logits(batch), batch["labels"].clamp(max=NUM_CLASSES - 1), reduction="none")
        mask = batch["labels"] != 255
        return (per_point * mask).sum() / mask.sum()


def _same(cls, *args, **kwargs):
    torch.manual_seed(0)
    a = cls(*args, **kwargs)
    b = cls(*args, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def _fit(model, batches, strategy="auto", devices=1, steps=2, **kwargs):
    t = trainer(strategy=strategy, devices=devices, max_steps=steps, sync_batchnorm=True, **kwargs)
    t.fit(model, fresh_loader(batches))
    return t


def _worst(ours, reference) -> float:
    return max(state_differences(ours, reference).values())


def _compare(cls, batches, devices=3, *args, **kwargs):
    ours, reference = _same(cls, *args, **kwargs)
    t = _fit(ours, batches, "sparse_dp", devices)
    r = _fit(reference, batches)
    return _worst(ours, reference), t, r


@pytest.mark.parametrize("ignore", [255, -100])
@pytest.mark.parametrize("devices", [2, 3])
def test_ignore_index_with_ignored_chunks_is_exact(ignore, devices):
    fractions = [(0.0, 0.3, 1.0), (0.05, 0.4, 0.0)]
    batches = [seg_batch(7, seed=s, ignore=ignore, fractions=f, chunks=devices) for s, f in zip((1, 2), fractions)]
    worst, t, r = _compare(ScanNetSeg, batches, devices, ignore_index=ignore)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


def test_the_old_default_is_not_exact_with_ignored_labels():  # the comparison above can fail
    batches = [seg_batch(7, seed=1)]
    ours, reference = _same(ScanNetSeg)
    _fit(ours, batches, SparseDataParallelStrategy(loss_weighting="auto"), 3)
    _fit(reference, batches)
    assert _worst(ours, reference) > 1e-3


@pytest.mark.parametrize("kwargs", [
    {"weight": torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64)},
    {"label_smoothing": 0.1},
    {"weight": torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64), "label_smoothing": 0.2},
])
def test_class_weights_and_label_smoothing_are_exact(kwargs):
    worst, t, r = _compare(ScanNetSeg, [seg_batch(7, seed=3, fractions=(0.1, 0.0, 0.35))], 3, **kwargs)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


@pytest.mark.parametrize("devices", [2, 3])
def test_multi_head_sum_over_different_masks_with_a_scheduled_coefficient(devices):
    batches = [seg_batch(8, seed=s, ignore=-100, fractions=(0.2, 0.0, 0.5), chunks=devices) for s in (4, 5)]
    worst, t, r = _compare(MultiHead, batches, devices)
    assert worst <= REL
    for name in ("ce", "l1"):
        assert relative_difference(t.logged_metrics[name], r.logged_metrics[name]) <= REL


@pytest.mark.parametrize("devices", [2, 3])
def test_sum_over_decoder_levels_is_exact(devices):
    batches = [{k: v for k, v in seg_batch(7, seed=s).items() if k != "labels"} for s in (6, 7)]
    worst, t, r = _compare(LevelCompletion, batches, devices)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL
    ours, reference = _same(LevelCompletion)  # the same step weighted per replica is not exact
    _fit(ours, batches, SparseDataParallelStrategy(loss_weighting="samples"), devices)
    _fit(reference, batches)
    assert _worst(ours, reference) > 1e-6


def test_a_hand_written_masked_mean_falls_back_and_says_so_once(caplog):
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.1)) for s in (1, 2)]
    with caplog.at_level(logging.INFO):
        worst, _, _ = _compare(MaskedMean, batches, 3)
    lines = [r.getMessage() for r in caplog.records if "loss_weighting='terms' cannot" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "hand-written masked mean" in lines[0] or "not computed from torch's mean-reduced losses" in lines[0]
    assert "loss_weighting=lambda chunk" in lines[0] and "'auto'" in lines[0]
    assert worst > 1e-3  # weighted per replica by points: not exact, and said


def test_an_explicit_loss_weighting_wins(caplog):
    batches = [seg_batch(7, seed=1)]
    ours, reference = _same(ScanNetSeg)
    valid = lambda chunk: (chunk["labels"] != 255).sum()  # noqa: E731
    with caplog.at_level(logging.INFO):
        _fit(ours, batches, SparseDataParallelStrategy(loss_weighting=valid), 3)
    _fit(reference, batches)
    assert _worst(ours, reference) <= REL
    assert "loss_weighting='terms'" not in caplog.text


def test_validation_logs_of_terms_are_whole_batch_values():
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.25, 1.0)) for s in (8, 9)]
    ours, reference = _same(ScanNetSeg)
    kwargs = dict(max_steps=-1, max_epochs=1, limit_val_batches=2, sync_batchnorm=True)
    t = trainer(strategy="sparse_dp", devices=3, **kwargs)
    t.fit(ours, fresh_loader(batches), fresh_loader(batches))
    r = trainer(devices=1, **kwargs)
    r.fit(reference, fresh_loader(batches), fresh_loader(batches))
    assert relative_difference(t.callback_metrics["val_loss"], r.callback_metrics["val_loss"]) <= REL


def test_a_term_empty_in_the_whole_batch_is_nan_as_on_one_device(caplog):
    batch = seg_batch(7, seed=1, fractions=(1.0, 1.0, 1.0))
    ours, reference = _same(ScanNetSeg)
    t = _fit(ours, [batch], "sparse_dp", 3, steps=1)
    r = _fit(reference, [batch], steps=1)
    assert torch.isnan(r.logged_metrics["train_loss"]) and torch.isnan(t.logged_metrics["train_loss"])
    assert _worst(ours, reference) <= REL
