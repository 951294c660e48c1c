"""A registration network's data and module (FCGF style), shared by the sparse_dp and sparse_ddp tests.

Two scans per sample, each a coordinate source, and correspondences ``[K, 2]``: rows of the collated
scans, each sample's own indices offset by the points of the samples before it, as FCGF's
``collate_pair_fn`` makes them (written here, not copied).
"""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


def scan(g: torch.Generator, n: int) -> torch.Tensor:
    """``n`` distinct voxels ``[n, 3]`` int32 of an 8^3 grid (distinct, so ME keeps their rows in order)."""
    cells = torch.randperm(8**3, generator=g)[:n]
    return torch.stack([cells // 64, (cells // 8) % 8, cells % 8], 1).int()


def pair_item(seed: int) -> dict[str, torch.Tensor]:
    """One sample: two scans and ``[k, 2]`` correspondences of their own rows."""
    g = torch.Generator().manual_seed(seed)
    n0, n1 = (int(v) for v in torch.randint(12, 40, (2,), generator=g))
    k = int(torch.randint(3, 10, (1,), generator=g))
    matches = torch.stack([torch.randperm(n0, generator=g)[:k], torch.randperm(n1, generator=g)[:k]], 1)
    return {"coords0": scan(g, n0), "coords1": scan(g, n1), "correspondences": matches}


class PairScans(Dataset):
    """Dataset of :func:`pair_item` samples (no ``point_counts``: sparse_ddp measures both scans' points)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.items = [pair_item(seed * 1000 + i) for i in range(num_samples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def collate_pairs(items) -> dict[str, torch.Tensor]:
    """FCGF's batch layout: collated scans ``sinput{0,1}_C`` with features, correspondences offset per sample."""
    rows, off0, off1 = [], 0, 0
    for item in items:
        rows.append(item["correspondences"] + torch.tensor([off0, off1]))
        off0, off1 = off0 + len(item["coords0"]), off1 + len(item["coords1"])
    c0 = ME.utils.batched_coordinates([item["coords0"] for item in items])
    c1 = ME.utils.batched_coordinates([item["coords1"] for item in items])
    return {
        "sinput0_C": c0, "sinput0_F": torch.ones(len(c0), 1),
        "sinput1_C": c1, "sinput1_F": torch.ones(len(c1), 1),
        "correspondences": torch.cat(rows).int(),
        "T_gt": torch.eye(4).repeat(len(items), 1, 1),
    }


def pair_batch(seeds) -> dict[str, torch.Tensor]:
    return collate_pairs([pair_item(s) for s in seeds])


def pairs_in(chunk) -> int:
    """``loss_weighting`` for a loss averaged over matched pairs: the pairs of the chunk."""
    return len(chunk["correspondences"])


class PairNet(L.LightningModule):
    """A fully convolutional feature network (FCGF style) with a hardest-negative contrastive loss: for every
    matched pair, the squared distance of the pair's features plus the squared hinge of the nearest
    non-matching point of the same sample's other scan; averaged over pairs."""

    margin = 1.4

    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        layers = [ME.MinkowskiConvolution(1, 8, kernel_size=3, dimension=3)]
        layers += [ME.MinkowskiBatchNorm(8)] if batch_norm else []
        layers += [ME.MinkowskiReLU(), ME.MinkowskiConvolution(8, 8, kernel_size=3, dimension=3)]
        self.net = torch.nn.Sequential(*layers)

    def features(self, batch, i):
        x = ME.SparseTensor(batch[f"sinput{i}_F"], batch[f"sinput{i}_C"])
        return F.normalize(self.net(x).F, dim=1)

    def loss(self, batch):
        f0, f1 = self.features(batch, 0), self.features(batch, 1)
        corr = batch["correspondences"].long()
        anchors, positives = f0[corr[:, 0]], f1[corr[:, 1]]
        pos = (anchors - positives).pow(2).sum(1)
        other = batch["sinput1_C"][:, 0][None, :] != batch["sinput0_C"][corr[:, 0], 0][:, None]
        other[torch.arange(len(corr)), corr[:, 1]] = True  # the match itself is no negative
        # distances elementwise: torch.cdist's matrix-product form rounds differently for other matrix sizes
        distances = (anchors[:, None, :] - f1[None, :, :]).pow(2).sum(-1).sqrt()
        neg = distances.masked_fill(other, float("inf")).min(dim=1).values
        return (pos + F.relu(self.margin - neg).pow(2)).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, batch_size=pairs_in(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True, batch_size=pairs_in(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True, batch_size=pairs_in(batch))

    def predict_step(self, batch, batch_idx):
        """One ``(features of scan 0 [n0_i, 8], features of scan 1 [n1_i, 8])`` per sample."""
        f0, f1 = self.features(batch, 0), self.features(batch, 1)
        b0, b1 = batch["sinput0_C"][:, 0], batch["sinput1_C"][:, 0]
        return [(f0[b0 == i], f1[b1 == i]) for i in range(int(b0.max()) + 1)]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)
