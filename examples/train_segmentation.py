"""3-D semantic segmentation of generated indoor scenes with a MinkUNet-style network and ``sparse_dp``.

Each scene is a room made in code: a floor, walls, and boxes, cylinders and spheres of random sizes,
sampled as surface points with a little noise, so point counts vary from scene to scene. Every point
is labelled with its primitive: floor, wall, box, cylinder, sphere. A batch holds an
``ME.TensorField`` (continuous coordinates in voxels, batch index in column 0) and per-point labels;
the network quantizes it (``field.sparse()``), runs a U-Net of sparse convolutions with batch norm,
and maps the voxel features back to the points (``.slice(field)``).

Training uses the options that make several replicas exact for this task: batch norm synchronized
across replicas (``sync_batchnorm=True``) and the loss weighted by points (``loss_weighting="points"``,
the cross-entropy is a mean over points). Mean IoU comes from torchmetrics and goes to the CSV and
TensorBoard loggers.

    .venv/bin/python examples/train_segmentation.py               # 3 CPU replicas
    .venv/bin/python examples/train_segmentation.py --devices 1
    .venv/bin/python examples/train_segmentation.py --strategy sparse_ddp --devices 2   # 2 processes

The last line printed, once (by rank zero), is ``val_miou=<float>``: the whole validation set's under
either strategy (torchmetrics merges the replicas' states, or syncs the ranks').
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassJaccardIndex

from lightning_sparse_dp import SparseDataParallelStrategy, SparseDDPStrategy

CLASSES = ("floor", "wall", "box", "cylinder", "sphere")


# --- scenes ----------------------------------------------------------------------------------------

def _plane(rng, origin, u, v, density):
    """Points on the parallelogram origin + s*u + t*v, s, t in [0, 1]."""
    area = np.linalg.norm(np.cross(u, v))
    n = max(8, int(area * density))
    s, t = rng.random((2, n, 1))
    return origin + s * u + t * v


def _box(rng, center, size, density):
    (sx, sy, sz), c = size, center - size / 2
    ex, ey, ez = np.diag(size)
    faces = [  # 5 faces: the bottom one rests on the floor and is not seen
        (c + [0, 0, sz], ex, ey), (c, ex, ez), (c + [0, sy, 0], ex, ez), (c, ey, ez), (c + [sx, 0, 0], ey, ez),
    ]
    return np.concatenate([_plane(rng, o, u, v, density) for o, u, v in faces])


def _cylinder(rng, center, radius, height, density):
    n_side = max(8, int(2 * np.pi * radius * height * density))
    phi, h = rng.random(n_side) * 2 * np.pi, rng.random(n_side) * height
    side = np.stack([center[0] + radius * np.cos(phi), center[1] + radius * np.sin(phi), h], 1)
    n_top = max(4, int(np.pi * radius**2 * density))
    r, phi = radius * np.sqrt(rng.random(n_top)), rng.random(n_top) * 2 * np.pi
    top = np.stack([center[0] + r * np.cos(phi), center[1] + r * np.sin(phi), np.full(n_top, height)], 1)
    return np.concatenate([side, top])


def _sphere(rng, center, radius, density):
    n = max(8, int(4 * np.pi * radius**2 * density))
    d = rng.normal(size=(n, 3))
    points = center + radius * d / np.linalg.norm(d, axis=1, keepdims=True)
    return points[points[:, 2] >= 0]


def make_scene(rng: np.random.Generator, density: float = 60.0):
    """One room: points ``[n, 3]`` (metres) and labels ``[n]`` (indices into CLASSES)."""
    width, depth, height = rng.uniform(3, 6), rng.uniform(3, 6), rng.uniform(2.2, 2.8)
    parts = [(_plane(rng, np.zeros(3), np.array([width, 0, 0]), np.array([0, depth, 0]), density), 0)]
    for origin, u in (([0, 0, 0], [width, 0, 0]), ([0, 0, 0], [0, depth, 0]), ([width, 0, 0], [0, depth, 0])):
        parts.append((_plane(rng, np.array(origin, float), np.array(u, float), np.array([0, 0, height]), density), 1))
    for _ in range(rng.integers(1, 4)):
        size = rng.uniform([0.3, 0.3, 0.3], [1.2, 1.2, 1.0])
        center = np.array([rng.uniform(0.8, width - 0.8), rng.uniform(0.8, depth - 0.8), size[2] / 2])
        parts.append((_box(rng, center, size, density), 2))
    for _ in range(rng.integers(1, 3)):
        radius, h = rng.uniform(0.15, 0.4), rng.uniform(0.4, 1.5)
        parts.append((_cylinder(rng, [rng.uniform(0.8, width - 0.8), rng.uniform(0.8, depth - 0.8)], radius, h, density), 3))
    for _ in range(rng.integers(1, 3)):
        radius = rng.uniform(0.2, 0.5)
        center = np.array([rng.uniform(0.8, width - 0.8), rng.uniform(0.8, depth - 0.8), radius])
        parts.append((_sphere(rng, center, radius, density), 4))
    points = np.concatenate([p for p, _ in parts]) + rng.normal(scale=0.01, size=(sum(len(p) for p, _ in parts), 3))
    labels = np.concatenate([np.full(len(p), c) for p, c in parts])
    return points.astype(np.float32), labels.astype(np.int64)


def make_scenes(n: int, seed: int, voxel_size: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``n`` generated scenes (fixed by ``seed``), a list a DataLoader reads as its dataset: voxel coordinates
    ``[n_i, 3]`` (float, in voxels), features ``[n_i, 2]`` (a constant and the height), per-point labels ``[n_i]``."""
    rng = np.random.default_rng(seed)
    scenes = []
    for _ in range(n):
        points, labels = make_scene(rng)
        features = np.stack([np.ones(len(points)), points[:, 2] / 2.5], 1).astype(np.float32)
        scenes.append((torch.from_numpy(points / voxel_size), torch.from_numpy(features), torch.from_numpy(labels)))
    return scenes


def collate(scenes):
    """A TensorField of every point (batch index in column 0) and the per-point labels ``[N]``."""
    coords, feats, labels = zip(*scenes)
    coordinates = ME.utils.batched_coordinates(list(coords), dtype=torch.float32)
    return {"x": ME.TensorField(torch.cat(feats), coordinates), "labels": torch.cat(labels)}


# --- network ---------------------------------------------------------------------------------------

def block(cin: int, cout: int, kernel_size: int = 3, stride: int = 1, transpose: bool = False) -> torch.nn.Sequential:
    conv = ME.MinkowskiConvolutionTranspose if transpose else ME.MinkowskiConvolution
    return torch.nn.Sequential(
        conv(cin, cout, kernel_size=kernel_size, stride=stride, dimension=3), ME.MinkowskiBatchNorm(cout), ME.MinkowskiReLU()
    )


class MinkUNetSmall(torch.nn.Module):
    """A three-level sparse U-Net: strided convolutions down, transposed convolutions up, skip concatenation."""

    def __init__(self, in_channels: int, num_classes: int, widths=(16, 32, 64, 96)) -> None:
        super().__init__()
        w0, w1, w2, w3 = widths
        self.stem = block(in_channels, w0, kernel_size=5)
        self.down1 = torch.nn.Sequential(block(w0, w1, 2, 2), block(w1, w1))
        self.down2 = torch.nn.Sequential(block(w1, w2, 2, 2), block(w2, w2))
        self.down3 = torch.nn.Sequential(block(w2, w3, 2, 2), block(w3, w3))
        self.up3 = block(w3, w2, 2, 2, transpose=True)
        self.fuse2 = block(2 * w2, w2)
        self.up2 = block(w2, w1, 2, 2, transpose=True)
        self.fuse1 = block(2 * w1, w1)
        self.up1 = block(w1, w0, 2, 2, transpose=True)
        self.fuse0 = block(2 * w0, w0)
        self.head = ME.MinkowskiLinear(w0, num_classes)

    def forward(self, x: ME.SparseTensor) -> ME.SparseTensor:
        s0 = self.stem(x)
        s1 = self.down1(s0)
        s2 = self.down2(s1)
        s3 = self.down3(s2)
        y = self.fuse2(ME.cat(self.up3(s3), s2))
        y = self.fuse1(ME.cat(self.up2(y), s1))
        y = self.fuse0(ME.cat(self.up1(y), s0))
        return self.head(y)


class Segmenter(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = MinkUNetSmall(2, len(CLASSES))
        self.val_miou = MulticlassJaccardIndex(len(CLASSES), average="macro")

    def forward(self, field: ME.TensorField) -> torch.Tensor:
        """Per-point logits ``[N, classes]``, in the field's point order."""
        return self.net(field.sparse()).slice(field).F

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["labels"])  # a mean over points
        self.log("train_loss", loss, prog_bar=True, batch_size=int(batch["labels"].numel()))
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["x"])
        loss = F.cross_entropy(logits, batch["labels"])
        self.log("val_loss", loss, batch_size=int(batch["labels"].numel()), sync_dist=True)
        self.val_miou.update(logits.argmax(1), batch["labels"])
        self.log("val_miou", self.val_miou, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--strategy",
        default="sparse_dp",
        choices=["sparse_dp", "sparse_ddp"],
        help="sparse_dp (replicas in one process) or sparse_ddp (one process per device; also under torchrun)",
    )
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--train-scenes", type=int, default=120)
    parser.add_argument("--val-scenes", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--voxel-size", type=float, default=0.1, help="metres")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "runs"))
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    train = make_scenes(args.train_scenes, seed=1, voxel_size=args.voxel_size)
    val = make_scenes(args.val_scenes, seed=2, voxel_size=args.voxel_size)
    points = [len(s[2]) for s in train]
    strategy = {"sparse_dp": SparseDataParallelStrategy, "sparse_ddp": SparseDDPStrategy}[args.strategy]
    trainer = L.Trainer(
        strategy=strategy(loss_weighting="points"),
        sync_batchnorm=True,
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.max_epochs,
        logger=[kind(Path(args.out) / folder, name="segmentation")
                for kind, folder in ((CSVLogger, "csv"), (TensorBoardLogger, "tensorboard"))],
        enable_checkpointing=False,
        log_every_n_steps=5,
    )
    if trainer.is_global_zero:
        print(
            f"{len(train)} training scenes, {np.mean(points):.0f} points on average (min {min(points)}, "
            f"max {max(points)})"
        )
    start = time.perf_counter()
    trainer.fit(
        Segmenter(),
        DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate),
        DataLoader(val, batch_size=args.batch_size, collate_fn=collate),
    )
    # val_miou: the whole validation set's, on every rank
    wall, miou = time.perf_counter() - start, float(trainer.callback_metrics["val_miou"])
    if trainer.is_global_zero:  # the result on the last line
        print(f"trained {args.max_epochs} epochs with {args.strategy} on {args.devices} {args.accelerator} device(s) "
              f"in {wall:.1f} s; logs in {trainer.loggers[0].log_dir}\nval_miou={miou:.4f}")


if __name__ == "__main__":
    main()
