"""Train a small MinkowskiEngine network on scikit-learn's handwritten digits with ``strategy="sparse_dp"``.

Each 8x8 digit image (1,797 of them, bundled with scikit-learn, no download) becomes a 2-D sparse
tensor: the non-zero pixels are the coordinates, their intensity (0..16, scaled to 0..1) the feature.
Batches are collated as ME's Lightning example does (a dict of ``coordinates`` [N, 3] int32 with the
batch index in column 0, ``features`` [N, 1], ``labels`` [B]) and the SparseTensor is built in the
step, on the replica's device.

    .venv/bin/python examples/train_digits.py                # 3 CPU replicas (3 GPUs where there are)
    .venv/bin/python examples/train_digits.py --devices 1    # the same on one device
    .venv/bin/python examples/train_digits.py --strategy sparse_ddp --devices 2   # 2 processes
    .venv/bin/torchrun --nproc_per_node=2 examples/train_digits.py --strategy sparse_ddp --devices 2

The accuracy is a torchmetrics metric, so it is the whole validation split's under every strategy
(``sparse_dp`` merges the replicas' states, ``sparse_ddp`` syncs the ranks'). The last line printed,
once (by rank zero), is ``val_acc=<float>``, the accuracy on the fixed validation split (20%).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_sparse_dp  # noqa: F401  (registers strategy="sparse_dp" and "sparse_ddp")


class SparseDigits(Dataset):
    """Digits as sparse 2-D samples: ``(coordinates int32 [n, 2], features float32 [n, 1], label int)``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.samples = []
        for image, label in zip(images, labels):
            rows, cols = np.nonzero(image)
            coords = np.stack([rows, cols], axis=1).astype(np.int32)
            feats = (image[rows, cols] / 16.0).astype(np.float32)[:, None]
            self.samples.append((torch.from_numpy(coords), torch.from_numpy(feats), int(label)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


def collate(samples):
    """ME's collation: coordinates get the batch index in column 0."""
    coords, feats, labels = zip(*samples)
    coordinates, features = ME.utils.sparse_collate(list(coords), list(feats))
    return {"coordinates": coordinates, "features": features, "labels": torch.tensor(labels, dtype=torch.long)}


def conv_block(cin: int, cout: int, kernel_size: int = 3, stride: int = 1) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        ME.MinkowskiConvolution(cin, cout, kernel_size=kernel_size, stride=stride, dimension=2),
        ME.MinkowskiBatchNorm(cout),
        ME.MinkowskiReLU(),
    )


class DigitNet(L.LightningModule):
    """Convolution, batch norm, ReLU, pooling, global pooling, linear; 10 classes."""

    def __init__(self, lr: float = 5e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = torch.nn.Sequential(
            conv_block(1, 32),
            conv_block(32, 64),
            ME.MinkowskiMaxPooling(kernel_size=2, stride=2, dimension=2),
            conv_block(64, 96),
            ME.MinkowskiMaxPooling(kernel_size=2, stride=2, dimension=2),
            conv_block(96, 128),
        )
        self.pool = ME.MinkowskiGlobalAvgPooling(mode=ME.PoolingMode.GLOBAL_AVG_POOLING_KERNEL)
        self.head = ME.MinkowskiLinear(128, 10)
        self.train_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: ME.SparseTensor) -> torch.Tensor:
        """Logits ``[B, 10]`` in batch-index order.

        Released ME 0.5.4's global pooling does not keep its rows in batch-index order, and its default average
        mode (``GLOBAL_AVG_POOLING_PYTORCH_INDEX``) gives wrong per-sample means on CPU for such batches; the ME this
        project builds fixes both (patches 01 and 02, docs/minkowskiengine.md). The network still uses
        ``GLOBAL_AVG_POOLING_KERNEL`` and sorts the rows by ``C[:, 0]``, so it is right on a stock ME too.
        """
        out = self.head(self.pool(self.features(x)))
        return out.F[out.C[:, 0].argsort()]

    def _step(self, batch, stage: str):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        loss = F.cross_entropy(logits, batch["labels"])
        acc = self.train_acc if stage == "train" else self.val_acc
        acc.update(logits, batch["labels"])
        batch_size = int(batch["labels"].numel())
        self.log(f"{stage}_loss", loss, prog_bar=True, on_step=stage == "train", on_epoch=True, sync_dist=True,
                 batch_size=batch_size)
        self.log(f"{stage}_acc", acc, prog_bar=stage == "val", on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--strategy", default="sparse_dp", choices=["sparse_dp", "sparse_ddp", "auto"],
                        help="sparse_dp (replicas in one process), sparse_ddp (one process per device; also under "
                        "torchrun), or auto for plain Lightning (one device)")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (GPUs when at least --devices)")
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "runs"))
    args = parser.parse_args()

    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() and torch.cuda.device_count() >= args.devices else "cpu"
    L.seed_everything(0, workers=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    train = DataLoader(SparseDigits(x_train, y_train), batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val = DataLoader(SparseDigits(x_val, y_val), batch_size=128, collate_fn=collate)

    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=accelerator,
        devices=args.devices,
        max_epochs=args.max_epochs,
        logger=[
            CSVLogger(Path(args.out) / "csv", name="digits"),
            TensorBoardLogger(Path(args.out) / "tensorboard", name="digits"),
        ],
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    trainer.fit(DigitNet(), train, val)
    wall = time.perf_counter() - start
    val_acc = float(trainer.callback_metrics["val_acc"])  # the whole validation split's, on every rank
    if trainer.is_global_zero:
        print(
            f"trained {args.max_epochs} epochs with strategy={args.strategy} on {args.devices} {accelerator} "
            f"device(s) in {wall:.1f} s; logs in {trainer.loggers[0].log_dir}"
        )
        print(f"val_acc={val_acc:.4f}")


if __name__ == "__main__":
    main()
