"""Train an FCGF-style feature network on pairs of scans with ``strategy="sparse_dp"``: the ``indices`` layout.

Each sample is two scans of one generated shape (the second shifted, with some points dropped) and its
correspondences, batched as FCGF's ``collate_pair_fn`` does: collated coordinates ``sinput0_C`` /
``sinput1_C`` (batch index in column 0), features, ``correspondences [K, 2]`` (rows of the two collated
scans) and ``negatives [K]`` (for each correspondence, a row of the second scan of the same sample that is not
its match). Row indices into point sets must be re-based to each chunk's rows: ``correspondences`` is found by
its key, ``negatives`` is named with ``layout={"negatives": "indices:sinput1_C"}``. The loss, a contrastive loss
over pairs, is a hand-written mean over the correspondences, so the strategy weights each replica by its pairs
(``loss_weighting=`` a callable counting them): exact against one device (``tests/project/test_examples.py``).

    .venv/bin/python examples/train_registration.py                  # 3 CPU replicas (3 GPUs where there are)
    .venv/bin/python examples/train_registration.py --devices 1      # the same on one device

The last line printed is ``val_loss=<float>``, the validation pairs' mean loss.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

from lightning_sparse_dp import SparseDataParallelStrategy

LAYOUT = {"negatives": "indices:sinput1_C"}  # row indices into the second scan, re-based per chunk


def pairs_in(chunk) -> int:
    """What the loss is a mean over: the chunk's correspondences (``loss_weighting=``)."""
    return len(chunk["correspondences"])


class ScanPairs(Dataset):
    """Two scans of a generated shape (voxels of a random blob in a 12^3 grid; the second shifted by up to 2 voxels
    with 20 % of the points dropped) with their correspondences and one negative per correspondence."""

    def __init__(self, num_samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(num_samples):
            n = int(torch.randint(30, 80, (1,), generator=g))
            cells = torch.randperm(12**3, generator=g)[:n]
            scan0 = torch.stack([cells // 144, (cells // 12) % 12, cells % 12], 1).int()
            keep = torch.nonzero(torch.rand(n, generator=g) > 0.2).flatten()
            scan1 = scan0[keep] + torch.randint(-2, 3, (1, 3), generator=g).int()
            corr = torch.stack([keep, torch.arange(len(keep))], 1)
            shift = torch.randint(1, len(keep), (len(keep),), generator=g)
            negatives = (torch.arange(len(keep)) + shift) % len(keep)  # another row of scan 1
            self.items.append({"coords0": scan0, "coords1": scan1, "correspondences": corr, "negatives": negatives})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate_pairs(items: list[dict]) -> dict[str, torch.Tensor]:
    """FCGF's pair collation: collated scans, and row indices offset by the points of the samples before."""
    corr, negatives, off0, off1 = [], [], 0, 0
    for item in items:
        corr.append(item["correspondences"] + torch.tensor([off0, off1]))
        negatives.append(item["negatives"] + off1)
        off0, off1 = off0 + len(item["coords0"]), off1 + len(item["coords1"])
    c0 = ME.utils.batched_coordinates([item["coords0"] for item in items])
    c1 = ME.utils.batched_coordinates([item["coords1"] for item in items])
    return {
        "sinput0_C": c0, "sinput0_F": torch.ones(len(c0), 1),
        "sinput1_C": c1, "sinput1_F": torch.ones(len(c1), 1),
        "correspondences": torch.cat(corr), "negatives": torch.cat(negatives),
    }


class FeatureNet(L.LightningModule):
    """A small fully convolutional network with unit-length point features; a contrastive loss over pairs:
    the squared distance of each match, plus the squared hinge of its negative's distance under ``margin``."""

    def __init__(self, lr: float = 0.2, margin: float = 1.4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            ME.MinkowskiConvolution(1, 16, kernel_size=3, dimension=3), ME.MinkowskiBatchNorm(16), ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(16, 16, kernel_size=3, dimension=3), ME.MinkowskiBatchNorm(16), ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(16, 16, kernel_size=1, dimension=3),
        )

    def features(self, batch, i: int) -> torch.Tensor:
        x = ME.SparseTensor(batch[f"sinput{i}_F"], batch[f"sinput{i}_C"], device=self.device)
        return F.normalize(self.net(x).F, dim=1)

    def loss(self, batch) -> torch.Tensor:
        f0, f1 = self.features(batch, 0), self.features(batch, 1)
        corr, negatives = batch["correspondences"].long(), batch["negatives"].long()
        anchors = f0[corr[:, 0]]
        pos = (anchors - f1[corr[:, 1]]).pow(2).sum(1)
        neg = (anchors - f1[negatives]).pow(2).sum(1).sqrt()
        return (pos + F.relu(self.hparams.margin - neg).pow(2)).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=pairs_in(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), batch_size=pairs_in(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (GPUs when at least --devices)")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--train-pairs", type=int, default=96)
    parser.add_argument("--val-pairs", type=int, default=24)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "runs"))
    args = parser.parse_args()
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.devices
    accelerator = ("gpu" if enough_gpus else "cpu") if args.accelerator == "auto" else args.accelerator
    L.seed_everything(0, workers=True)
    train = DataLoader(ScanPairs(args.train_pairs, seed=1), batch_size=8, shuffle=True, collate_fn=collate_pairs)
    val = DataLoader(ScanPairs(args.val_pairs, seed=2), batch_size=8, collate_fn=collate_pairs)
    strategy = SparseDataParallelStrategy(layout=LAYOUT, loss_weighting=pairs_in) if args.devices > 1 else "auto"
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=args.devices, max_epochs=args.max_epochs,
        logger=[CSVLogger(Path(args.out) / "csv", name="registration"),
                TensorBoardLogger(Path(args.out) / "tensorboard", name="registration")],
        enable_checkpointing=False, log_every_n_steps=5,
    )
    trainer.fit(FeatureNet(), train, val)
    print(f"val_loss={float(trainer.callback_metrics['val_loss']):.4f}")


if __name__ == "__main__":
    main()
