"""Shared test helpers: random sparse samples, small ME networks, one-batch loaders, Trainers, isolated runs (the
exactness pairs and their measure: tests/support/exact.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_sparse_dp  # noqa: F401  (registers "sparse_dp" / "sparse_ddp", the names tests pass to trainer())
from lightning_sparse_dp.syncbn.collective import ThreadGroup

ROOT = Path(__file__).resolve().parents[2]

NUM_CLASSES = 4
IN_CHANNELS = 3


def load_file(path: str):
    """The Python file at ``path`` (relative to the repository's root, e.g. ``"examples/train_completion.py"``)
    imported as a module named after the file (registered in ``sys.modules``); for scripts outside the package."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def random_samples(num_samples: int, seed: int = 0, dim: int = 3, min_points: int = 5, max_points: int = 40):
    """``num_samples`` samples of unique int32 coordinates ``[n_i, dim]``, features ``[n_i, 3]`` and a label."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        n = int(torch.randint(min_points, max_points + 1, (1,), generator=g))
        coords = torch.randint(0, 8, (n * 2, dim), generator=g, dtype=torch.int32).unique(dim=0)[:n]
        feats = torch.randn(coords.shape[0], IN_CHANNELS, generator=g)
        label = int(torch.randint(0, NUM_CLASSES, (1,), generator=g))
        samples.append((coords, feats, label))
    return samples


def grid_points(g: torch.Generator, n: int) -> torch.Tensor:
    """``n`` integer points of a 12^3 grid, int32 ``[n, 3]`` (repeats allowed), drawn from ``g``."""
    return torch.randint(0, 12, (n, 3), generator=g, dtype=torch.int32)


def collate_dict(samples):
    """ME's Lightning-example batch: coordinates [N, D+1] (batch index in column 0), features [N, C], labels [B]."""
    coords, feats, labels = zip(*samples)
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    return {"coordinates": coordinates, "features": features, "labels": torch.tensor(labels)}


class OneBatch(Dataset):
    """A dataset whose single item is an already collated batch (use with ``batch_size=None``)."""

    def __init__(self, *batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def loader(*batches) -> DataLoader:
    return DataLoader(OneBatch(*batches), batch_size=None, shuffle=False)


def sample_loader(samples, **kwargs) -> DataLoader:
    """A DataLoader of ``samples`` in batches of 7, collated by :func:`collate_dict`."""
    return DataLoader(samples, batch_size=7, collate_fn=collate_dict, **kwargs)


class SparseNet(L.LightningModule):
    """Convolution, ReLU, strided convolution, (batch norm), global pooling, linear; SGD."""

    def __init__(self, batch_norm: bool = False, lr: float = 0.1, fail_on_replica_with: int | None = None):
        super().__init__()
        layers = [
            ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3),
            ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(8, 16, kernel_size=2, stride=2, dimension=3),
        ]
        if batch_norm:
            layers.append(ME.MinkowskiBatchNorm(16))
        layers += [
            ME.MinkowskiReLU(),
            ME.MinkowskiGlobalAvgPooling(mode=ME.PoolingMode.GLOBAL_AVG_POOLING_KERNEL),
            ME.MinkowskiLinear(16, NUM_CLASSES),
        ]
        self.net = torch.nn.Sequential(*layers)
        self.lr = lr
        self.fail_on_replica_with = fail_on_replica_with
        self.step_losses: list[float] = []

    def forward(self, x):
        return self.net(x).F  # row b is sample b: our ME build's global pooling keeps batch order (patch 01)

    def loss(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return F.cross_entropy(self(x), batch["labels"])

    def training_step(self, batch, batch_idx):
        if self.fail_on_replica_with is not None and batch["labels"].shape[0] == self.fail_on_replica_with:
            raise RuntimeError(f"boom in the chunk of {self.fail_on_replica_with} samples")
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        # Lightning would infer the batch size from the first tensor (the coordinates: points, not samples)
        self.log("val_loss", loss, batch_size=batch["labels"].shape[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def unchecked(**kwargs) -> lightning_sparse_dp.SparseDataParallelStrategy:
    """``sparse_dp`` without its exactness check, for tests that count what the user's step does outside the module
    (the threads it ran on, calls it made, tensors it saw): the check runs the step twice more, on copies."""
    return lightning_sparse_dp.SparseDataParallelStrategy(check_exactness=False, **kwargs)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


class SegNet(L.LightningModule):
    """Per-point segmentation: TensorField -> sparse -> (conv, batch norm, ReLU) x 2 -> slice -> linear.

    ``loss`` is the cross-entropy averaged over every point of the batch.
    """

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.net = torch.nn.Sequential(
            ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3),
            ME.MinkowskiBatchNorm(8),
            ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(8, 8, kernel_size=3, dimension=3),
            ME.MinkowskiBatchNorm(8),
            ME.MinkowskiReLU(),
        )
        self.head = torch.nn.Linear(8, NUM_CLASSES)
        self.lr = lr

    def forward(self, field):
        return self.head(self.net(field.sparse()).slice(field).F)

    def loss(self, batch):
        return F.cross_entropy(self(batch["x"]), batch["labels"])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch["x"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def field_batch(num_samples: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A TensorField batch with continuous coordinates (several points per voxel) and per-point labels [N].

    ``dtype``: of the field's features and coordinates (``precision="64-true"`` converts the batch's
    tensors, not the ME objects in it, so a float64 run needs a float64 field).
    """
    samples = random_samples(num_samples, seed=seed)
    coords, feats, _ = zip(*samples)
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    g = torch.Generator().manual_seed(seed)
    continuous = coordinates.float()
    continuous[:, 1:] = (continuous[:, 1:] * 0.5).floor() + torch.rand(continuous.shape[0], 3, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (coordinates.shape[0],), generator=g)
    return {"x": ME.TensorField(features.to(dtype), continuous.to(dtype)), "labels": labels}


def run_isolated(code: str, tmp_path: Path, timeout: float = 300, env: dict[str, str] | None = None) -> None:
    """Run ``code`` (dedented) in a fresh interpreter with this checkout first on the path.

    Fails when it exits non-zero, and when it runs past ``timeout`` seconds: the child is killed, so
    a hang (e.g. replicas waiting for each other forever) fails here instead of stopping the suite.
    """
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"still running after {timeout:g} s (a hang?): {str(err.stderr)[-2000:]}") from None
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def run_ranks(group: ThreadGroup, fn, phase: bool = True) -> list:
    """``fn(rank, member)`` on one plain thread per rank; returns results or the exceptions raised, in rank order."""
    results: list = [None] * group.world_size

    def target(rank: int) -> None:
        member = group.member(rank)
        try:
            results[rank] = group.run(rank, lambda: fn(rank, member)) if phase else fn(rank, member)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            results[rank] = err

    threads = [threading.Thread(target=target, args=(r,)) for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def voxelized_batch(num_samples: int = 9, seed: int = 3) -> dict:
    """ME's voxelization with an inverse map (``sparse_quantize(..., return_inverse=True)``): voxels' coordinates and
    features, the original points' coordinates, each original point's voxel (offset by the voxels of the samples
    before) and its label, float64."""
    g = torch.Generator().manual_seed(seed)
    voxels, features, originals, inverse, labels, before = [], [], [], [], [], 0
    for _ in range(num_samples):
        n = int(torch.randint(10, 40, (1,), generator=g))
        points = torch.rand(n, 3, generator=g, dtype=torch.float64) * 6
        c, f, _, inv = ME.utils.sparse_quantize(points, torch.randn(n, 3, generator=g, dtype=torch.float64),
                                                quantization_size=2.0, return_index=True, return_inverse=True)
        voxels.append(c), features.append(f), originals.append(points.float()), inverse.append(inv + before)
        labels.append(torch.randint(0, 4, (n,), generator=g))
        before += c.shape[0]
    coordinates, features = ME.utils.sparse_collate(voxels, features)
    return {"coordinates": coordinates, "features": features.double(), "inverse": torch.cat(inverse).long(),
            "point_labels": torch.cat(labels), "original_coordinates": ME.utils.batched_coordinates(originals)}
