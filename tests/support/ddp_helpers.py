"""What the sparse_ddp process tests share: data, models, the scenarios, and a one-device reference.

The scenarios run in worker processes (``tests/support/ddp_script.py``, launched by Lightning's popen launcher
or by torchrun) and, as the reference, in the test process on one device with the whole global batch
(``strategy="auto"``), both in float64.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset

import lightning_sparse_dp  # noqa: F401  (registers "sparse_dp" and "sparse_ddp")
from tests.support.helpers import IN_CHANNELS, NUM_CLASSES, SparseNet, random_samples
from tests.support.pairs import PairNet, PairScans, collate_pairs, pairs_in
from tests.support.scene_models import (
    ScenesDense,
    ScenesDetr,
    ScenesHeads,
    ScenesLogged,
    ScenesManual,
    ScenesMasked,
    ScenesPerClass,
    ScenesPerSample,
    ScenesRemainder,
    ScenesSomeViews,
    ScenesStatistic,
    ScenesSum,
    ScenesViews,
    ScenesWeights,
)
from tests.support.step_forms import FORMS, PooledNet
from tests.support.term_models import LevelCompletion, ScenesIgnoreSeg

SEED = 7  # initial weights
FORM_MODELS = {"PooledNet": PooledNet, **FORMS}


class Scenes(Dataset):
    """``(coordinates int32 [n, 3], features [n, 3], label, point labels int64 [n])``, uneven ``n``; declares
    ``point_counts``."""

    def __init__(self, num_samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 1000)
        self.items = [
            (c, f, y, torch.randint(0, NUM_CLASSES, (c.shape[0],), generator=g))
            for c, f, y in random_samples(num_samples, seed=seed, min_points=4, max_points=60)
        ]
        self.point_counts = [item[0].shape[0] for item in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def collate(items) -> dict[str, torch.Tensor]:
    coords, feats, labels, point_labels = zip(*items)
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    return {
        "coordinates": coordinates,
        "features": features,
        "labels": torch.tensor(labels),
        "point_labels": torch.cat(point_labels),
    }


class Capture(Logger):
    """Keeps every ``log_metrics`` call, on every rank: ``[(step, {name: float})]``."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))


class ClassNet(SparseNet):
    """Per-sample classification (mean over samples); ``sync_dist=True`` logs, on step and epoch; validation
    accuracy from torchmetrics (states synchronized across processes by torchmetrics, as under DDP)."""

    def __init__(self, batch_norm: bool = False, explicit_batch_size: bool = False) -> None:
        super().__init__(batch_norm=batch_norm, lr=0.2)
        self.explicit_batch_size = explicit_batch_size
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")

    def _size(self, batch) -> dict[str, int]:
        return {"batch_size": int(batch["labels"].shape[0])} if self.explicit_batch_size else {}

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, **self._size(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.val_acc(logits, batch["labels"])
        self.log("val_loss", F.cross_entropy(logits, batch["labels"]), sync_dist=True, batch_size=int(batch["labels"].shape[0]))
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True, batch_size=int(batch["labels"].shape[0]))

    def predict_step(self, batch, batch_idx):
        return self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))


class PointNet(L.LightningModule):
    """Per-point segmentation (mean over points): TensorField -> sparse -> conv (BN) ReLU conv -> slice -> linear."""

    def __init__(self, batch_norm: bool | str = False) -> None:
        super().__init__()
        layers = [ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3)]
        if batch_norm:  # "eval": without running statistics, so the batch's statistics in eval mode too
            layers.append(ME.MinkowskiBatchNorm(8, track_running_stats=batch_norm != "eval"))
        layers += [ME.MinkowskiReLU(), ME.MinkowskiConvolution(8, 8, kernel_size=3, dimension=3), ME.MinkowskiReLU()]
        self.net = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(8, NUM_CLASSES)

    def loss(self, batch):
        field_ = ME.TensorField(batch["features"], batch["coordinates"].to(batch["features"].dtype), device=self.device)
        logits = self.head(self.net(field_.sparse()).slice(field_).F)
        return F.cross_entropy(logits, batch["point_labels"])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)  # batch size: points, both ways
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):  # per-point logits: every rank's rows in the global batch's point order
        field_ = ME.TensorField(batch["features"], batch["coordinates"].to(batch["features"].dtype), device=self.device)
        return self.head(self.net(field_.sparse()).slice(field_).F)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


@dataclass
class Scenario:
    """One training run: model, ``loss_weighting``, per-rank batch size, epochs, Trainer options."""

    name: str
    model: str  # "class", "point" or "pair" (two scans per sample and correspondences: tests/support/pairs.py)
    loss_weighting: Any = "samples"
    batch_norm: bool | str = False  # "eval": the point model's batch norm without running statistics
    per_rank: int = 3
    epochs: int = 2
    trainer: dict[str, Any] = field(default_factory=dict)
    resume: bool = False  # resume from <out>/sparse_dp.ckpt (one epoch trained by sparse_dp)
    evaluate: bool = False  # after fit: trainer.test and trainer.predict on the validation data
    explicit_batch_size: bool = False  # the class model logs batch_size= its samples (else Lightning infers points)

    def build(self, reference: bool) -> L.LightningModule:
        torch.manual_seed(SEED)
        if self.model == "pair":
            return PairNet(self.batch_norm).double()
        if self.model in TERM_MODELS:
            return TERM_MODELS[self.model]().double()
        if self.model.startswith("form:"):
            return FORM_MODELS[self.model.removeprefix("form:")]().double()
        model = ClassNet(self.batch_norm, self.explicit_batch_size) if self.model == "class" else PointNet(self.batch_norm)
        # float64 from the start: Lightning loads a resumed checkpoint into the module *before* "64-true" converts
        # it, so a float32 module would round the checkpoint's float64 weights (seen: 2.7e-8 relative)
        return model.double()


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("samples", "class", evaluate=True),
        # 2 per rank: the point-balanced shares hold the validation batches' samples out of order (per-point predictions)
        Scenario("points", "point", loss_weighting="points", per_rank=2, evaluate=True),
        Scenario("syncbn", "point", loss_weighting="points", batch_norm=True, trainer={"sync_batchnorm": True}),
        # batch norm that keeps the batch's statistics in eval mode: test and predict synchronized too
        Scenario("eval_stats", "point", loss_weighting="points", batch_norm="eval", epochs=1,
                 trainer={"sync_batchnorm": True}, evaluate=True),
        Scenario("accumulate", "class", per_rank=2, epochs=1, trainer={"accumulate_grad_batches": 2},
                 explicit_batch_size=True),
        Scenario("resume", "class", batch_norm=True, resume=True, trainer={"sync_batchnorm": True}),
        Scenario("pairs", "pair", loss_weighting=pairs_in, batch_norm=True, epochs=1, trainer={"sync_batchnorm": True},
                 evaluate=True),
    ]
}

#: loss_weighting="terms" (the default) with losses as users write them; their own launch (tests/ddp/test_ddp.py)
TERM_MODELS = {
    "ignore": ScenesIgnoreSeg, "levels": LevelCompletion, "per_sample": ScenesPerSample, "manual": ScenesManual,
    "sum": ScenesSum, "remainder": ScenesRemainder, "statistic": ScenesStatistic, "weights": ScenesWeights,
    "heads": ScenesHeads, "detr": ScenesDetr, "masked": ScenesMasked, "logged": ScenesLogged, "views": ScenesViews,
    "some_views": ScenesSomeViews, "classes": ScenesPerClass, "dense": ScenesDense,
}
TERM_SCENARIOS = {
    s.name: s
    for s in [
        Scenario("terms_ignore", "ignore", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_levels", "levels", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_per_sample", "per_sample", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_manual", "manual", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_sum", "sum", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_weights", "weights", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_heads", "heads", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_detr", "detr", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        # a loop of 2 calls in training, 3 in validation: each reads the loop by its own steps
        Scenario("terms_views", "views", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        Scenario("terms_classes", "classes", loss_weighting="terms", trainer={"sync_batchnorm": True}),
    ]
}
#: losses no split computes as one device does: each rank must say so (tests/ddp/test_ddp.py reads the messages)
SAID_SCENARIOS = {
    s.name: s
    for s in [
        Scenario("said_remainder", "remainder", loss_weighting="terms", epochs=1, trainer={"sync_batchnorm": True}),
        Scenario("said_statistic", "statistic", loss_weighting="terms", epochs=1, trainer={"sync_batchnorm": True}),
        Scenario("said_masked", "masked", loss_weighting="terms", epochs=1, trainer={"sync_batchnorm": True}),
        Scenario("logged", "logged", loss_weighting="terms", epochs=1, trainer={"sync_batchnorm": True}),
        # a training loop whose count changes (said); validation's fixed loop read as validate() reads it
        Scenario("said_views", "some_views", loss_weighting="terms", trainer={"sync_batchnorm": True}),
        # a mean over x.dense() without shape=: each rank's grid sized by its share (said)
        Scenario("said_dense", "dense", loss_weighting="terms", epochs=1, trainer={"sync_batchnorm": True}),
    ]
}
#: step code the loss capture was never shown (tests/support/step_forms.py), for the exactness check on ranks
#: (tests/ddp/test_ddp_exactness_check.py); a backward inside the step and non-reentrant checkpointing are left out
#: (DDP's own reducer refuses a second backward pass through the wrapped module)
FORM_SCENARIOS = {
    f"form_{name}": Scenario(f"form_{name}", f"form:{name}", loss_weighting="terms", epochs=1)
    for name in ("PooledNet", "CustomFunctionLoss", "TeacherInPlace", "CoupledSamples", "HandMadeSum", "CheckpointedLoss")
}
#: a loss coupling the samples added after the first step: checked again where it starts
WARMUP_SCENARIO = Scenario("form_WarmedUpCoupling", "form:WarmedUpCoupling", loss_weighting="terms", epochs=1)
#: every scenario, by name
ALL_SCENARIOS = {**SCENARIOS, **TERM_SCENARIOS, **SAID_SCENARIOS, **FORM_SCENARIOS, WARMUP_SCENARIO.name: WARMUP_SCENARIO}

#: the loss shapes whose distance to one device sparse_ddp keeps at most plain DDP's (equal weights, same batches)
SIDE_BY_SIDE = (
    "terms_ignore", "terms_weights", "terms_heads", "terms_levels", "terms_per_sample", "terms_sum", "terms_detr",
    "said_masked",
)

TRAIN_SAMPLES, VAL_SAMPLES = 13, 7  # 13 = 6 + 7 with 2 ranks x 3: the last sample joins the batch before


def trainer_kwargs(**kwargs: Any) -> dict[str, Any]:
    defaults = dict(
        accelerator="cpu",
        precision="64-true",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return defaults


class ReferenceBatches:
    """The global batches of every epoch, written out independently of the sampler: ``torch.randperm``
    seeded with ``seed + epoch`` (DistributedSampler's order), cut every ``size`` samples, a remainder
    smaller than ``world_size`` joined to the batch before. Usable as a DataLoader ``batch_sampler``."""

    def __init__(self, num_samples: int, size: int, world_size: int, shuffle: bool, seed: int = 0) -> None:
        # seed 0: what Lightning gives the DistributedSampler it injects when PL_GLOBAL_SEED is not set
        self.num_samples, self.size, self.world_size, self.shuffle, self.seed = num_samples, size, world_size, shuffle, seed
        self.epoch = 0
        self.sampler = self  # Lightning calls batch_sampler.sampler.set_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.size] for i in range(0, len(order), self.size)]
        if len(batches) > 1 and len(batches[-1]) < self.world_size:
            tail = batches.pop()
            batches[-1] += tail
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def loaders(per_rank: int, world_size: int | None, model: str = "class") -> tuple[DataLoader, DataLoader]:
    """Train / val loaders: as a user writes them for DDP (``world_size=None``), or the one-device reference
    with the global batches of ``world_size`` ranks; of scan pairs for the ``"pair"`` model."""
    if model == "pair":
        train, val, collate_fn = PairScans(TRAIN_SAMPLES, seed=1), PairScans(VAL_SAMPLES, seed=2), collate_pairs
    else:
        train, val, collate_fn = Scenes(TRAIN_SAMPLES, seed=1), Scenes(VAL_SAMPLES, seed=2), collate
    if world_size is None:
        return (
            DataLoader(train, batch_size=per_rank, shuffle=True, collate_fn=collate_fn),
            DataLoader(val, batch_size=per_rank, collate_fn=collate_fn),
        )
    return (
        DataLoader(
            train,
            batch_sampler=ReferenceBatches(len(train), per_rank * world_size, world_size, True),
            collate_fn=collate_fn,
        ),
        DataLoader(
            val,
            batch_sampler=ReferenceBatches(len(val), per_rank * world_size, world_size, False),
            collate_fn=collate_fn,
        ),
    )


def evaluate(trainer: L.Trainer, model: L.LightningModule, val: DataLoader) -> dict[str, Any]:
    """``trainer.test`` (its logged ``test_loss``) and ``trainer.predict`` (what this rank predicted: per-sample lists,
    or the tensors of every batch concatenated)."""
    trainer.test(model, val, verbose=False)
    test_loss = float(trainer.callback_metrics["test_loss"])
    predictions = trainer.predict(model, val)
    if isinstance(predictions[0], list):  # per-sample outputs: every sample's, in dataset order, on every rank
        return {"test_loss": test_loss, "predictions": [x for batch in predictions for x in batch]}
    return {"test_loss": test_loss, "predicted": torch.cat([p.detach().cpu() for p in predictions])}


MESSAGES: list[str] = []  # what the strategy said (rank-zero info and warnings) in this process


class _Said(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "sparse_ddp:" in record.getMessage():
            MESSAGES.append(record.getMessage())


def listen() -> None:
    """Keep what the strategy says in :data:`MESSAGES` (the rank-zero logger is set to INFO; warnings, which the
    worker processes route to logging, too)."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Said())
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(_Said())


def result(trainer: L.Trainer, model: L.LightningModule, logger: Capture) -> dict[str, Any]:
    """What a run is compared by: the state dict, the logged values, the batch-norm layer types."""
    return {
        "messages": list(MESSAGES),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "history": logger.history,
        "bn_types": sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__}),
        "world_size": trainer.world_size,
    }
