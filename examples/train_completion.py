"""Shape completion with a generative sparse network (as ME's ``examples/completion.py``) and ``sparse_dp``.

Each sample is a shape made in code, voxelized on a small grid: the surface of a box, a sphere or a
cylinder of random size and position. Its partial view is the shape with the voxels beyond a random
plane removed. The network sees the partial voxels and generates the complete shape:

- an encoder of strided sparse convolutions (tensor stride 1 -> 2 -> 4);
- a decoder of ``MinkowskiGenerativeConvolutionTranspose`` levels (stride 4 -> 2 -> 1), each
  generating new coordinates, scoring them with a 1x1 convolution and removing those scored
  negative with ``MinkowskiPruning`` (for the loss, voxels of the target are kept too, as in ME's example);
- each level's target comes from the coordinate manager: the complete shape is inserted with
  ``insert_and_map``, strided to the level's tensor stride, and a kernel map of size 1 says which
  generated voxels are in it.

The batch holds two coordinate tensors, ``coordinates`` (partial) and ``target_coordinates``
(complete); ``sparse_dp`` finds both and cuts each by its own batch column. The loss is ME's: the
binary cross-entropy of every level, each a mean over its generated voxels, averaged over levels.
Validation logs ``val_loss`` (that loss on the validation shapes, target voxels kept as in training, so
that every level is reached) and ``val_iou`` (voxel IoU of the shapes the network completes alone, pruning
by its own scores, averaged over samples); ``predict_step`` returns one ``(coordinates [n_i, 3], logits
[n_i, 1])`` pair per sample.

Why ``val_loss`` keeps the target voxels: pruned by its own scores alone, the decoder stops at a level
where nothing is left, and under ``sparse_dp`` each replica stops on its own chunk where one device goes on
with the other samples, so the replicas' losses would hold fewer levels than one device's (said once, and
weighted per replica instead). With the target kept, every chunk reaches every level, and ``val_loss`` is
one device's.

    .venv/bin/python examples/train_completion.py                 # 3 CPU replicas
    .venv/bin/python examples/train_completion.py --devices 1
    .venv/bin/python examples/train_completion.py --strategy sparse_ddp --devices 2   # 2 processes

The last line printed, once (by rank zero), is ``val_iou=<float>``: the mean over every validation
shape under either strategy (a torchmetrics ``MeanMetric``, merged across replicas or synced across ranks).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MeanMetric

import lightning_sparse_dp  # noqa: F401  (registers strategy="sparse_dp" and "sparse_ddp")

# --- shapes --------------------------------------------------------------------------------------

def shape(seed: int, grid: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """One generated shape: ``(partial, complete)`` int32 voxel coordinates ``[n, 3]`` in ``[0, grid)``."""
    g = torch.Generator().manual_seed(seed)
    axes = torch.stack(torch.meshgrid(*[torch.arange(grid)] * 3, indexing="ij"), -1).reshape(-1, 3).double()
    center = grid / 2 + (torch.rand(3, generator=g, dtype=torch.float64) - 0.5) * grid / 4
    size = grid / 6 + torch.rand(3, generator=g, dtype=torch.float64) * grid / 6
    d = (axes - center) / size
    kind = seed % 3
    if kind == 0:  # box: max-norm shell
        level = d.abs().max(dim=1).values
    elif kind == 1:  # sphere (ellipsoid) shell
        level = d.norm(dim=1)
    else:  # cylinder along z: radial shell, capped
        level = torch.maximum(d[:, :2].norm(dim=1), d[:, 2].abs())
    complete = axes[(level - 1).abs() < 0.5 / size.min()]
    direction = torch.randn(3, generator=g, dtype=torch.float64)
    side = (complete - center) @ direction
    partial = complete[side <= torch.quantile(side, 0.7)]  # about 30 % of the shape cut away
    return partial.int(), complete.int()


class Shapes(Dataset):
    def __init__(self, num: int, seed: int, grid: int = 16):
        self.items = [shape(seed * 100_003 + i, grid) for i in range(num)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def collate(samples) -> dict:
    """Two coordinate tensors ``[N, 4]`` / ``[M, 4]`` (batch index in column 0) and ones as features ``[N, 1]``."""
    partial, complete = zip(*samples)
    coordinates = ME.utils.batched_coordinates(list(partial))
    return {
        "coordinates": coordinates,
        "features": torch.ones(len(coordinates), 1),
        "target_coordinates": ME.utils.batched_coordinates(list(complete)),
    }


# --- network -------------------------------------------------------------------------------------

def block(cin: int, cout: int, kernel_size: int = 3, stride: int = 1, generative: bool = False) -> nn.Sequential:
    conv = ME.MinkowskiGenerativeConvolutionTranspose if generative else ME.MinkowskiConvolution
    return nn.Sequential(
        conv(cin, cout, kernel_size=kernel_size, stride=stride, dimension=3), ME.MinkowskiBatchNorm(cout), ME.MinkowskiELU()
    )


class CompletionNet(nn.Module):
    """Encoder to tensor stride 4; generative decoder back to 1, scoring and pruning at every level."""

    def __init__(self, channels: tuple[int, int, int] = (8, 16, 32)):
        super().__init__()
        c0, c1, c2 = channels
        self.encoder = nn.Sequential(
            block(1, c0), block(c0, c1, 2, 2), block(c1, c1), block(c1, c2, 2, 2), block(c2, c2)
        )
        self.up = nn.ModuleList([block(c2, c1, 2, 2, generative=True), block(c1, c0, 2, 2, generative=True)])
        self.refine = nn.ModuleList([block(c1, c1), block(c0, c0)])
        self.score = nn.ModuleList([ME.MinkowskiConvolution(c, 1, kernel_size=1, bias=True, dimension=3) for c in (c1, c0)])
        self.prune = ME.MinkowskiPruning()

    @staticmethod
    def occupancy(out: ME.SparseTensor, target_key: ME.CoordinateMapKey) -> torch.Tensor:
        """bool ``[n]``: which of ``out``'s voxels are in the target shape at ``out``'s tensor stride."""
        manager = out.coordinate_manager
        strided = manager.stride(target_key, out.tensor_stride)
        kernel_map = manager.kernel_map(out.coordinate_map_key, strided, kernel_size=1)
        target = torch.zeros(len(out), dtype=torch.bool, device=out.device)
        for in_rows, _ in kernel_map.values():
            target[in_rows.long()] = True
        return target

    def forward(self, x: ME.SparseTensor, target_key: ME.CoordinateMapKey | None = None, keep_target: bool | None = None):
        """``(scores, targets, out)``: every level's scores and targets (targets only with ``target_key``),
        and the last level's scores after pruning (the completed shape; None when every voxel was pruned).
        ``keep_target`` (default: in training): target voxels are kept at every level, whatever their scores."""
        keep_target = self.training if keep_target is None else keep_target
        y = self.encoder(x)
        scores, targets = [], []
        for up, refine, score in zip(self.up, self.refine, self.score):
            y = refine(up(y))
            s = score(y)
            keep = s.F[:, 0] > 0
            if target_key is not None:
                target = self.occupancy(y, target_key)
                targets.append(target)
                if keep_target:
                    keep = keep | target
            scores.append(s)
            if not bool(keep.any()):  # nothing left to generate from (ME cannot prune to an empty tensor)
                return scores, targets, None
            y, last = self.prune(y, keep), self.prune(s, keep)
        return scores, targets, last


class Completion(L.LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.net = CompletionNet()
        self.lr = lr
        self.val_iou = MeanMetric()  # over shapes: each sample's IoU weighs the same

    def step(self, batch):
        """``(loss, out)``: the loss, target voxels kept at every level (in training and validation alike)."""
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        target_key, _ = x.coordinate_manager.insert_and_map(batch["target_coordinates"], string_id="target")
        scores, targets, out = self.net(x, target_key, keep_target=True)
        loss = sum(F.binary_cross_entropy_with_logits(s.F[:, 0], t.to(s.F.dtype)) for s, t in zip(scores, targets))
        return loss / len(scores), out

    def training_step(self, batch, batch_idx):
        loss, _ = self.step(batch)
        self.log("train_loss", loss, batch_size=num_samples(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        b = num_samples(batch)
        self.log("val_loss", self.step(batch)[0], batch_size=b, sync_dist=True)
        _, _, out = self.net(ME.SparseTensor(batch["features"], batch["coordinates"]))  # completed by the network alone
        self.val_iou.update(voxel_iou(out, batch["target_coordinates"], b))
        self.log("val_iou", self.val_iou)

    def predict_step(self, batch, batch_idx):
        """One ``(coordinates int [n_i, 3], logits [n_i, 1])`` per sample, in batch order."""
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        _, _, out = self.net(x)
        return per_sample(out, num_samples(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def num_samples(batch) -> int:
    return int(batch["coordinates"][:, 0].max()) + 1


def per_sample(out: ME.SparseTensor | None, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(coordinates, features)`` of every sample ``0..b-1`` (empty for a sample with no voxel left)."""
    if out is None:
        return [(torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, 1)) for _ in range(b)]
    batch_index = out.C[:, 0].long()
    return [(out.C[batch_index == i, 1:], out.F[batch_index == i]) for i in range(b)]


def voxel_iou(out: ME.SparseTensor | None, target: torch.Tensor, b: int) -> torch.Tensor:
    """``[b]`` intersection over union of each sample's generated voxels and its complete shape."""
    if out is None:
        return torch.zeros(b, dtype=torch.float64)
    def keys(c: torch.Tensor) -> torch.Tensor:
        c = c.long()
        return ((c[:, 0] * 1024 + c[:, 1]) * 1024 + c[:, 2]) * 1024 + c[:, 3]

    pred, true = keys(out.C), keys(target.to(out.C.device))
    hit = torch.isin(pred, true).double()
    inter = torch.zeros(b, dtype=torch.float64).index_add_(0, out.C[:, 0].long().cpu(), hit.cpu())
    sizes = torch.bincount(out.C[:, 0].long().cpu(), minlength=b) + torch.bincount(target[:, 0].long().cpu(), minlength=b)
    return inter / (sizes - inter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options = [  # flag, type, default
        ("--devices", int, 3), ("--accelerator", str, "cpu"), ("--max-epochs", int, 15), ("--train-shapes", int, 96),
        ("--val-shapes", int, 24), ("--batch-size", int, 8), ("--grid", int, 16),
        ("--out", str, str(Path(__file__).resolve().parent / "runs")),
    ]
    for flag, kind, default in options:
        parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--strategy", default="sparse_dp", choices=["sparse_dp", "sparse_ddp"],
                        help="sparse_dp (replicas in one process) or sparse_ddp (one process per device; also under torchrun)")
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    train, val = Shapes(args.train_shapes, 1, args.grid), Shapes(args.val_shapes, 2, args.grid)
    kinds = ((CSVLogger, "csv"), (TensorBoardLogger, "tensorboard"))
    loggers = [cls(Path(args.out) / folder, name="completion") for cls, folder in kinds]
    trainer = L.Trainer(
        strategy=args.strategy, devices=args.devices, accelerator=args.accelerator, max_epochs=args.max_epochs,
        logger=loggers, enable_checkpointing=False, log_every_n_steps=5,
    )
    model = Completion()
    start = time.perf_counter()
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate),
        DataLoader(val, batch_size=args.batch_size, collate_fn=collate),
    )
    wall = time.perf_counter() - start
    iou = float(trainer.callback_metrics["val_iou"])  # the mean over every validation shape, on every rank
    shapes = trainer.predict(model, DataLoader(val, batch_size=args.batch_size, collate_fn=collate))
    voxels = [len(c) for batch in shapes for c, _ in batch]  # every rank gets all shapes (sparse_ddp merges them)
    if trainer.is_global_zero:
        print(f"trained {args.max_epochs} epochs with {args.strategy} on {args.devices} {args.accelerator} device(s) "
              f"in {wall:.1f} s; logs in {trainer.loggers[0].log_dir}")
        print(f"predicted {len(voxels)} shapes, {sum(voxels) / len(voxels):.0f} voxels each on average")
        print(f"val_iou={iou:.4f}")


if __name__ == "__main__":
    main()
