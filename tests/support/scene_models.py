"""The loss shapes of tests/support/term_models.py on ScanNet-like scenes with ignored labels (``ScenesIgnoreSeg``), as the
two-rank scenarios of tests/support/ddp_helpers.py run them, and modules that log as users do."""

from __future__ import annotations

import MinkowskiEngine as ME
import torch
import torch.nn.functional as F

from tests.support.helpers import NUM_CLASSES
from tests.support.step_forms import ManualOptimization
from tests.support.term_models import OffsetHead, ScanNetSeg, ScenesIgnoreSeg, _per_sample, _remainder, _statistic


class ScenesPerSample(ScenesIgnoreSeg):
    """:class:`PerSampleLoop` on ``tests.support.ddp_helpers.Scenes`` batches (per-point labels, none ignored)."""

    def loss(self, batch):
        losses = _per_sample(self.logits(batch), batch["point_labels"], batch["coordinates"][:, 0], self.criterion)
        return sum(losses) / len(losses)


class ScenesPerClass(ScenesIgnoreSeg):
    """A cross entropy per class a share holds (``for c in y.unique()``), their mean; a point's class is its scene's
    label or the next one, so that ranks whose shares hold different scenes call it for different classes
    (``loss/classes.py``)."""

    def loss(self, batch):
        scene = batch["labels"][batch["coordinates"][:, 0].long()]
        logits, y = self.logits(batch), (scene + batch["point_labels"] % 2) % NUM_CLASSES
        return sum(F.cross_entropy(logits[y == c], y[y == c]) for c in y.unique()) / len(y.unique())


class ScenesManual(ManualOptimization, ScenesIgnoreSeg):
    """:class:`ScenesIgnoreSeg` under manual optimization: ``manual_backward`` inside the step."""

    def after_step(self, loss):
        self.log("train_loss", loss, sync_dist=True)


class ScenesSum(ScenesIgnoreSeg):
    """:class:`SumReduction` on ``tests.support.ddp_helpers.Scenes`` batches."""

    def loss(self, batch):
        labels = batch["point_labels"].masked_fill(batch["point_labels"] == 0, 255)
        return F.cross_entropy(self.logits(batch), labels, ignore_index=255, reduction="sum") / 100.0


class ScenesRemainder(ScenesIgnoreSeg):
    """:class:`SmallRemainder` on ``tests.support.ddp_helpers.Scenes`` batches (said, not exact)."""

    def loss(self, batch):
        logits, mask = self.logits(batch), batch["point_labels"] != 0
        return F.cross_entropy(logits, batch["point_labels"]) + _remainder(logits, mask)


class ScenesStatistic(ScenesIgnoreSeg):
    """:class:`ChunkStatistic` on ``tests.support.ddp_helpers.Scenes`` batches (said, not exact)."""

    def loss(self, batch):
        logits = self.logits(batch)
        return F.cross_entropy(logits, batch["point_labels"]) + _statistic(logits)


class ScenesWeights(ScenesIgnoreSeg):
    """Class weights and label smoothing with an ignore label, on ``Scenes`` batches."""

    def __init__(self) -> None:
        super().__init__(
            weight=torch.tensor([0.5, 2.0, 1.0, 0.25][:NUM_CLASSES], dtype=torch.float64), label_smoothing=0.1
        )


class ScenesHeads(OffsetHead, ScenesIgnoreSeg):
    """A sum of criteria over different masks: a cross entropy plus 0.3 times an L1 over the points labeled 1."""

    def loss(self, batch):
        logits = self.logits(batch)
        mask = batch["point_labels"] == 1
        return F.cross_entropy(logits, batch["point_labels"]) + 0.3 * F.l1_loss(
            self.offset(logits)[mask], batch["features"][mask]
        )


class ScenesDetr(ScenesIgnoreSeg):
    """DETR-style (Mask3D, set-prediction criteria): a BCE summed over points and classes, over the number of
    positives all-reduced across ranks and divided by the world size; on one device, the batch's count."""

    def loss(self, batch):
        logits = self.logits(batch)
        target = F.one_hot(batch["point_labels"], NUM_CLASSES).to(logits.dtype)
        num = (batch["point_labels"] == 1).sum().to(logits.dtype)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(num)
            num = num / torch.distributed.get_world_size()
        num = num.clamp(min=1)
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum() / num


class ScenesMasked(ScenesIgnoreSeg):
    """The hand-written masked mean (:class:`MaskedMean`) on ``Scenes`` batches: said, weighted as "auto"."""

    def loss(self, batch):
        per_point = F.cross_entropy(self.logits(batch), batch["point_labels"], reduction="none")
        mask = batch["point_labels"] != 0
        return (per_point * mask).sum() / mask.sum()


class LoggedAsUsersDo(ScanNetSeg):
    """Logs as published ME modules do (FastPointTransformer's): ``loss.item()`` with ``batch_size=`` an int of the
    batch dict, ``float(loss)``, accuracy over labeled points as a masked ``.float().mean()`` and ``torch.mean``,
    and the labeled share as a mean over all points."""

    def __init__(self, labels_key: str = "labels", sync_dist: bool = False) -> None:
        super().__init__()
        self.labels_key, self.sync_dist = labels_key, sync_dist

    def training_step(self, batch, batch_idx):
        labels = batch[self.labels_key].masked_fill(batch[self.labels_key] == 0, 255)
        logits = self.logits(batch)
        loss = self.criterion(logits, labels)
        mask = labels != 255
        pred = logits.argmax(1)
        sync = {"sync_dist": True} if self.sync_dist else {}
        size = int(batch["batch_size"]) if "batch_size" in batch else int(batch["labels"].shape[0])
        self.log("loss_item", loss.item(), batch_size=size, **sync)
        self.log("loss_float", float(loss), **sync)
        self.log("acc", (pred[mask] == labels[mask]).float().mean(), **sync)
        self.log("acc_fn", torch.mean((pred[mask] == labels[mask]).double()), **sync)
        self.log("labeled", mask.double().mean(), **sync)
        return loss


class ScenesLogged(LoggedAsUsersDo):
    """:class:`LoggedAsUsersDo` on ``tests.support.ddp_helpers.Scenes`` batches, ``sync_dist=True``."""

    def __init__(self) -> None:
        super().__init__(labels_key="point_labels", sync_dist=True)

    def validation_step(self, batch, batch_idx):
        pass


class ScenesViews(ScenesIgnoreSeg):
    """A loss averaged over views of the scene (its features scaled), the criterion called once per view in a loop of
    the step: the two views of :attr:`train_views` in training, three in validation. Each step calls it a fixed number
    of times, so each is read as one device's: a validation inside the fit too, which reads its own steps only."""

    train_views: tuple[float, ...] = (1.0, -1.0)
    val_views: tuple[float, ...] = (1.0, -1.0, 0.5)

    def views_loss(self, batch, views):
        return sum(self.loss({**batch, "features": batch["features"] * v}) for v in views) / len(views)

    def training_views(self, batch_idx: int) -> tuple[float, ...]:
        return self.train_views

    def training_step(self, batch, batch_idx):
        loss = self.views_loss(batch, self.training_views(batch_idx))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.views_loss(batch, self.val_views), sync_dist=True)


class ScenesSomeViews(ScenesViews):
    """:class:`ScenesViews` with the second training view at every other step only: a loop whose count changes from
    training step to training step (said: the training is not one device's), beside validation's fixed three views."""

    def training_views(self, batch_idx: int) -> tuple[float, ...]:
        return self.train_views[: 1 + batch_idx % 2]


class ScenesDense(ScenesIgnoreSeg):
    """:class:`ScenesIgnoreSeg` plus a penalty averaged over ``x.dense()`` without ``shape=``: each rank's grid is sized
    by its share's largest coordinates (said)."""

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"].double())
        grid = self.net(field.sparse()).dense()[0]
        return super().loss(batch) + 0.1 * grid.pow(2).mean()
