"""Modules whose losses are written as users write them, for the loss_weighting="terms" tests (sparse_dp and
sparse_ddp): ScanNet-style segmentation with ``nn.CrossEntropyLoss(ignore_index)``, a multi-head sum over
different masks with a scheduled coefficient, a completion-style decoder with a BCE per level, and the
negative control, a hand-written masked mean."""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from lightning_sparse_dp import split_batch
from tests.support.clients import conv_bn_relu
from tests.support.helpers import IN_CHANNELS, NUM_CLASSES, random_samples


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
        drop = (
            torch.rand(rows.numel(), generator=g) < fractions[j]
            if 0 < fractions[j] < 1
            else torch.full((rows.numel(),), fractions[j] == 1)
        )
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
        self.log("train_loss", loss, sync_dist=True)  # sync_dist: the whole batch's value in sparse_ddp too
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
            nn.Sequential(
                ME.MinkowskiGenerativeConvolutionTranspose(8, 8, kernel_size=2, stride=2, dimension=3),
                ME.MinkowskiBatchNorm(8),
                ME.MinkowskiReLU(),
            )
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
        self.log("train_loss", loss, sync_dist=True)  # sync_dist: the whole batch's value in sparse_ddp too
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


class ScenesIgnoreSeg(ScanNetSeg):
    """ScanNetSeg on ``tests.support.ddp_helpers.Scenes`` batches: points labeled 0, and every point of a scene labeled 0,
    carry the ignore label (so a rank's share may be all ignored)."""

    def loss(self, batch):
        labels = batch["point_labels"].clone()
        labels[labels == 0] = 255
        labels[batch["labels"][batch["coordinates"][:, 0].long()] == 0] = 255
        return self.criterion(self.logits(batch), labels)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # epoch level only: a mean over labeled points weighted by the points Lightning infers, and by a constant
        self.log("train_loss_epoch_only", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_loss_constant", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=4)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)


class WithPenalty(ScanNetSeg):
    """A cross-entropy with an ignore label plus an L2 penalty on the parameters (the same in every replica)."""

    def loss(self, batch):
        return super().loss(batch) + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())


class HandSum(ScanNetSeg):
    """The loss returned as a plain sum over the batch's points (``reduction="sum"`` written by hand), plus an L2
    penalty on the parameters summed tensor by tensor (one value in every replica, whatever a tensor's rows)."""

    def loss(self, batch):
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        return 1e-3 * self.logits(batch).pow(2).sum() + 1e-2 * penalty


class HandMean(ScanNetSeg):
    """A per-point cross entropy (``reduction="none"``) averaged by hand: ``.mean()`` over the batch's points."""

    def loss(self, batch):
        labels = batch["labels"].clamp(max=NUM_CLASSES - 1)
        return F.cross_entropy(self.logits(batch), labels, reduction="none").mean()


class SometimesL1(MultiHead):
    """An L1 term only when the chunk has 3 samples or more: replicas may call different sequences of losses."""

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"].double())
        y = self.up(self.net(field.sparse())).slice(field).F
        loss = F.cross_entropy(self.head(y), batch["labels"])
        mask = batch["labels"] == 3
        if batch["coordinates"][:, 0].max() >= 2:
            loss = loss + F.l1_loss(self.offset(y)[mask], batch["features"][mask])
        return loss


class LoggedOnly(ScanNetSeg):
    """Logs a loss computed only to be logged (under no_grad, over a mask) and a sum that is not the loss."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        mask = batch["labels"] == 1
        with torch.no_grad():
            aux = F.l1_loss(batch["features"][mask], torch.zeros_like(batch["features"][mask]))
        self.log("aux", aux)
        self.log("total", (loss + 0.5 * aux).detach())
        return loss


#: ``torch._C._len_torch_function_stack()`` seen by every :class:`ModeDepth` update (all replicas, in call order)
MODE_DEPTHS: list[int] = []


class ModeDepth(Metric):
    """A running mean cross entropy (torch's own mean-reduced loss, inside ``update``) that records how many torch
    function modes its update runs under (:data:`MODE_DEPTHS`)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        MODE_DEPTHS.append(torch._C._len_torch_function_stack())
        keep = labels != 255
        self.total += F.cross_entropy(logits.detach()[keep], labels[keep]) * keep.sum()
        self.count += keep.sum()

    def compute(self) -> torch.Tensor:
        return self.total / self.count


class WithMetrics(ScanNetSeg):
    """Updates a metric after the loss (:class:`ModeDepth`, logged per epoch) and calls an accuracy's ``forward``
    before it (logged per step), as Lightning's documentation writes metrics into a step."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_ce = ModeDepth()
        self.acc = MulticlassAccuracy(num_classes=NUM_CLASSES, ignore_index=255)

    def training_step(self, batch, batch_idx):
        logits = self.logits(batch)
        self.acc(logits, batch["labels"])
        self.log("acc", self.acc)  # the metric: its forward value on step, the whole batch's
        loss = self.criterion(logits, batch["labels"])
        self.mean_ce.update(logits, batch["labels"])
        self.log("train_loss", loss)
        self.log("mean_ce", self.mean_ce, on_step=False, on_epoch=True)
        return loss


def _per_sample(logits, labels, index, criterion):
    """One loss per sample of the chunk, in sample order (instance segmentation, registration, completion code)."""
    return [criterion(logits[index == s], labels[index == s]) for s in range(int(index.max()) + 1)]


class PerSampleLoop(ScanNetSeg):
    """A loss per sample, then their mean as users write it: ``sum(losses) / len(losses)`` ("len"),
    ``torch.stack(losses).mean()`` ("stack"), or their sum over a fixed number ("sum": ``sum(losses) / 8``)."""

    def __init__(self, form: str = "len") -> None:
        super().__init__()
        self.form = form

    def loss(self, batch):
        losses = _per_sample(self.logits(batch), batch["labels"], batch["coordinates"][:, 0], self.criterion)
        if self.form == "stack":
            return torch.stack(losses).mean()
        if self.form == "sum":
            return sum(losses) / 8.0
        return sum(losses) / len(losses)


class OffsetHead:
    """Mixin, first among the bases of a :class:`ScanNetSeg`: an ``offset`` head after its own layers, mapping the
    logits to the input features' width (an L1 regression's, beside the cross entropy)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.offset = nn.Linear(NUM_CLASSES, IN_CHANNELS)


class PerSampleBeside(OffsetHead, ScanNetSeg):
    """A whole-chunk cross entropy plus 0.5 times the mean of per-sample L1 losses (two call sites, one loop)."""

    def loss(self, batch):
        logits = self.logits(batch)
        index = batch["coordinates"][:, 0]
        l1 = [
            F.l1_loss(self.offset(logits[index == s]), batch["features"][index == s])
            for s in range(int(index.max()) + 1)
        ]
        return self.criterion(logits, batch["labels"]) + 0.5 * sum(l1) / len(l1)


class SumReduction(ScanNetSeg):
    """``F.cross_entropy(..., reduction="sum")`` over a constant: each replica's sum counts once."""

    def loss(self, batch):
        return F.cross_entropy(self.logits(batch), batch["labels"], ignore_index=255, reduction="sum") / 100.0


def _remainder(logits, mask):
    """``1e-6`` times a hand-written masked mean (of the logits' squared norms over ``mask``)."""
    return 1e-6 * (logits.pow(2).sum(1) * mask).sum() / mask.sum()


def _statistic(logits):
    """An MSE on the mean logits of the chunk: a torch loss on a statistic of the chunk."""
    return F.mse_loss(logits.mean(0), torch.zeros_like(logits[0]))


class SmallRemainder(ScanNetSeg):
    """A cross entropy plus ``1e-6`` times a hand-written masked mean: a remainder that differs between replicas."""

    def loss(self, batch):
        logits = self.logits(batch)
        mask = batch["labels"] != 255
        return self.criterion(logits, batch["labels"]) + _remainder(logits, mask)


class ChunkClassWeights(ScanNetSeg):
    """A cross entropy with class weights computed from the chunk's labels (inverse class frequencies): each replica
    weights its rows by its own chunk's frequencies, one device by the whole batch's."""

    def loss(self, batch):
        labels = batch["labels"]
        counts = torch.bincount(labels[labels != 255], minlength=NUM_CLASSES).to(torch.float64)
        return F.cross_entropy(self.logits(batch), labels, weight=1.0 / (counts + 1.0), ignore_index=255)


class BatchClassWeights(ScanNetSeg):
    """The same class weights computed from the whole batch before the split (``on_before_batch_transfer``) and kept
    on the module: every replica is given the same, as the documented fix says."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        labels = batch["labels"]
        counts = torch.bincount(labels[labels != 255], minlength=NUM_CLASSES).to(torch.float64)
        self.class_weights = 1.0 / (counts + 1.0)
        return batch

    def loss(self, batch):
        return F.cross_entropy(self.logits(batch), batch["labels"], weight=self.class_weights, ignore_index=255)


class ChunkStatistic(ScanNetSeg):
    """A cross entropy plus an MSE on the mean feature of the chunk: a torch loss on a statistic of the chunk."""

    def loss(self, batch):
        logits = self.logits(batch)
        return self.criterion(logits, batch["labels"]) + _statistic(logits)




def class_batch(labels_per_sample, seed: int, num_samples: int = 6) -> dict:
    """``num_samples`` samples whose points take labels drawn from each sample's list (``random_samples`` coordinates
    and features, float64): ``labels_per_sample[s]`` are the classes sample ``s`` may hold."""
    g = torch.Generator().manual_seed(seed)
    samples = random_samples(num_samples, seed=seed, min_points=8, max_points=30)
    coordinates, features = ME.utils.sparse_collate([c for c, _, _ in samples], [f for _, f, _ in samples])
    counts = [len(c) for c, _, _ in samples]
    labels = torch.cat([torch.tensor(ls)[torch.randint(0, len(ls), (n,), generator=g)]
                        for n, ls in zip(counts, labels_per_sample)])
    return {"coordinates": coordinates, "features": features.double(), "labels": labels}


class PerClass(ScanNetSeg):
    """A cross entropy per class the chunk holds (``for c in y.unique()``), summed, divided by the classes held
    (``"mean"``, a class-balanced loss), or each weighted by its class (``"weighted"``); ``"single"``: one call over
    every point."""

    def __init__(self, form: str = "mean") -> None:
        super().__init__()
        self.form = form

    def loss(self, batch):
        logits, y = self.logits(batch), batch["labels"]
        if self.form == "single":
            return F.cross_entropy(logits, y)
        loss = 0
        for c in y.unique():
            m = y == c
            term = F.cross_entropy(logits[m], y[m])
            loss = loss + (0.5 + 0.25 * float(c)) * term if self.form == "weighted" else loss + term
        return loss / len(y.unique()) if self.form == "mean" else loss
