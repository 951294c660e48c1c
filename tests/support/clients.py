"""LightningModules written the way MinkowskiEngine's own examples write them (written here, not copied).

Each one does what a user's existing ME code does, so that ``Trainer(strategy="sparse_dp")`` is tested as
a drop-in for it:

- :class:`MultiGPUSegmentation`: the module of ME's ``examples/multigpu_lightning.py``: a dict batch from
  ``ME.utils.sparse_collate(..., dtype=torch.float32)``, the SparseTensor built in the step without
  ``device=``, per-point cross-entropy, and ``ME.MinkowskiSyncBatchNorm.convert_sync_batchnorm`` on the
  network.
- :class:`ModelNetClassifier`: the ``MinkowskiFCNN`` of ``examples/classification_modelnet40.py``: float
  coordinates divided by the voxel size in place, a TensorField, ``slice`` of strided tensors back to the
  field, ``ME.cat``, global max and average pooling, ``.F`` taken as is, label smoothing.
- :class:`DocsClassifier`: the docs' ``ExampleNetwork`` (default ``MinkowskiGlobalPooling``, ``.F`` as is),
  with an ``AveragedModel`` copy (SWA) that validation runs.
- :class:`FieldUNet`: a MinkUNet-style U-Net on TensorField input, sliced back to the points.
- :class:`Completion`: a generative decoder as in ``examples/completion.py``: transposed generative
  convolution, a learned occupancy score and ``MinkowskiPruning``, loss averaged per sample.

Every batch is generated here (no downloads): shapes sampled as point clouds with float coordinates.
"""

from __future__ import annotations

import copy

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, Dataset

NUM_CLASSES = 4
VOXEL_SIZE = 0.25


# --- data ----------------------------------------------------------------------------------------

def point_cloud(seed: int, min_points: int = 20, max_points: int = 90) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One generated shape: float32 coordinates ``[n, 3]`` in ``[0, 2)``, features ``[n, 3]`` and its class."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(min_points, max_points + 1, (1,), generator=g))
    label = seed % NUM_CLASSES
    direction = torch.randn(n, 3, generator=g)
    radius = 0.4 + 0.15 * label
    xyz = 1.0 + radius * direction / direction.norm(dim=1, keepdim=True)  # a sphere shell whose size is the class
    xyz = xyz + 0.05 * torch.randn(n, 3, generator=g)
    feats = torch.cat([xyz - 1.0, torch.ones(n, 1)], dim=1)[:, :3]
    return xyz.float(), feats.float(), label


def modelnet_batch(seeds, scale: float = 1.0) -> dict:
    """``pointnet.py``'s ``minkowski_collate_fn`` batch: float32 coordinates ``[N, 4]`` (batch index in column 0)
    times ``scale``, features ``[N, 3]``, labels ``[B]``."""
    clouds = [point_cloud(s) for s in seeds]
    coordinates, features = ME.utils.sparse_collate(
        [c * scale for c, _, _ in clouds], [f for _, f, _ in clouds], dtype=torch.float32
    )
    return {"coordinates": coordinates, "features": features, "labels": torch.tensor([lab for _, _, lab in clouds])}


def voxel_batch(seeds) -> dict:
    """``multigpu_lightning.py``'s batch: voxelized (unique) float32 coordinates ``[N, 4]``, features, labels ``[N]``."""
    coords, feats, labels = [], [], []
    for s in seeds:
        xyz, f, _ = point_cloud(s, 40, 160)
        voxels, index = ME.utils.sparse_quantize(xyz / 0.1, return_index=True)
        coords.append(voxels)
        feats.append(f[index])
        labels.append((f[index, 2] > 0).long() + 2 * (f[index, 0] > 0).long())  # 4 parts of the shape
    coordinates, features, point_labels = ME.utils.sparse_collate(coords, feats, labels, dtype=torch.float32)
    return {"coordinates": coordinates, "features": features, "labels": point_labels}


def field_batch(seeds) -> dict:
    """Continuous coordinates (several points per voxel) with per-point labels ``[N]``, as a dict of tensors."""
    clouds = [point_cloud(s, 40, 160) for s in seeds]
    coordinates, features = ME.utils.sparse_collate(
        [c / VOXEL_SIZE for c, _, _ in clouds], [f for _, f, _ in clouds], dtype=torch.float32
    )
    labels = (features[:, 2] > 0).long() + 2 * (features[:, 0] > 0).long()
    return {"coordinates": coordinates, "features": features, "labels": labels}


class _Batches(Dataset):
    """Already collated batches, a fresh copy on every fetch (clients modify their batch in place)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return copy.deepcopy(self.batches[i])


def fresh_loader(batches) -> DataLoader:
    """A loader of ``batches`` (already collated) that hands out a copy of each, so in-place edits do not stick."""
    return DataLoader(_Batches(batches), batch_size=None, shuffle=False)


# --- building blocks -----------------------------------------------------------------------------

def conv_bn_relu(cin: int, cout: int, kernel_size: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        ME.MinkowskiConvolution(cin, cout, kernel_size=kernel_size, stride=stride, dimension=3),
        ME.MinkowskiBatchNorm(cout),
        ME.MinkowskiReLU(),
    )


class TinyUNet(ME.MinkowskiNetwork):
    """Two-level MinkUNet: encoder (stride 1, 2), transposed decoder with a skip concatenation."""

    def __init__(self, cin: int, cout: int, channels: int = 8):
        super().__init__(3)
        self.enc0 = conv_bn_relu(cin, channels)
        self.enc1 = conv_bn_relu(channels, 2 * channels, kernel_size=2, stride=2)
        self.mid = conv_bn_relu(2 * channels, 2 * channels)
        self.up = nn.Sequential(
            ME.MinkowskiConvolutionTranspose(2 * channels, channels, kernel_size=2, stride=2, dimension=3),
            ME.MinkowskiBatchNorm(channels),
            ME.MinkowskiReLU(),
        )
        self.dec0 = conv_bn_relu(2 * channels, channels)
        self.final = ME.MinkowskiConvolution(channels, cout, kernel_size=1, dimension=3)

    def forward(self, x: ME.SparseTensor) -> ME.SparseTensor:
        e0 = self.enc0(x)
        y = self.up(self.mid(self.enc1(e0)))
        return self.final(self.dec0(ME.cat(e0, y)))


class _Client(L.LightningModule):
    """SGD with momentum; logs ``train_loss`` each step and ``val_loss`` with the batch size in samples."""

    lr = 0.05

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), batch_size=int(batch["coordinates"][:, 0].max()) + 1)


# --- the clients -----------------------------------------------------------------------------------

class MultiGPUSegmentation(_Client):
    """ME's ``multigpu_lightning.py`` module: SparseTensor built in the step, per-point cross-entropy."""

    def __init__(self):
        super().__init__()
        self.model = ME.MinkowskiSyncBatchNorm.convert_sync_batchnorm(TinyUNet(3, NUM_CLASSES))
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x):
        return self.model(x)

    def loss(self, batch):
        stensor = ME.SparseTensor(coordinates=batch["coordinates"], features=batch["features"])
        return self.criterion(self(stensor).F, batch["labels"].long())


class MinkowskiFCNN(ME.MinkowskiNetwork):
    """``classification_modelnet40.py``'s network, with smaller channels."""

    def __init__(self, cin: int = 3, cout: int = NUM_CLASSES, channels=(8, 12, 16, 20, 24), embedding: int = 32,
                 dropout: float = 0.0):
        super().__init__(3)

        def mlp(i, o):
            return nn.Sequential(ME.MinkowskiLinear(i, o, bias=False), ME.MinkowskiBatchNorm(o), ME.MinkowskiLeakyReLU())

        def conv(i, o, k, s):
            return nn.Sequential(
                ME.MinkowskiConvolution(i, o, kernel_size=k, stride=s, dimension=3),
                ME.MinkowskiBatchNorm(o),
                ME.MinkowskiLeakyReLU(),
            )

        self.mlp1 = mlp(cin, channels[0])
        self.conv1 = conv(channels[0], channels[1], 3, 1)
        self.conv2 = conv(channels[1], channels[2], 3, 2)
        self.conv3 = conv(channels[2], channels[3], 3, 2)
        self.conv4 = conv(channels[3], channels[4], 3, 2)
        self.conv5 = nn.Sequential(
            conv(sum(channels[1:]), embedding // 2, 3, 2), conv(embedding // 2, embedding, 3, 2)
        )
        self.pool = ME.MinkowskiMaxPooling(kernel_size=3, stride=2, dimension=3)
        self.global_max_pool = ME.MinkowskiGlobalMaxPooling()
        self.global_avg_pool = ME.MinkowskiGlobalAvgPooling()
        self.final = nn.Sequential(mlp(2 * embedding, 16), ME.MinkowskiDropout(dropout), ME.MinkowskiLinear(16, cout))

    def forward(self, x: ME.TensorField) -> torch.Tensor:
        x = self.mlp1(x)
        y = x.sparse()
        y1 = self.pool(self.conv1(y))
        y2 = self.pool(self.conv2(y1))
        y3 = self.pool(self.conv3(y2))
        y4 = self.pool(self.conv4(y3))
        x = ME.cat(y1.slice(x), y2.slice(x), y3.slice(x), y4.slice(x))
        y = self.conv5(x.sparse())
        return self.final(ME.cat(self.global_max_pool(y), self.global_avg_pool(y))).F  # one row per sample, as is


class ModelNetClassifier(_Client):
    """The ModelNet40 training loop as a LightningModule: per-sample labels, label smoothing."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = MinkowskiFCNN(dropout=dropout)

    def loss(self, batch):
        coordinates = batch["coordinates"]
        coordinates[:, 1:] = coordinates[:, 1:] / VOXEL_SIZE  # in place, as create_input_batch does
        field = ME.TensorField(coordinates=coordinates, features=batch["features"])
        return F.cross_entropy(self.net(field), batch["labels"], label_smoothing=0.1)


class ExampleNetwork(ME.MinkowskiNetwork):
    """The docs' example classifier: two strided conv blocks, default global pooling, a linear head."""

    def __init__(self, cin: int = 3, cout: int = NUM_CLASSES):
        super().__init__(3)
        self.conv1 = nn.Sequential(
            ME.MinkowskiConvolution(cin, 8, kernel_size=3, stride=2, bias=False, dimension=3),
            ME.MinkowskiBatchNorm(8),
            ME.MinkowskiReLU(),
        )
        self.conv2 = conv_bn_relu(8, 16, 3, 2)
        self.pooling = ME.MinkowskiGlobalPooling()
        self.linear = ME.MinkowskiLinear(16, cout)

    def forward(self, x):
        return self.linear(self.pooling(self.conv2(self.conv1(x))))


class DocsClassifier(_Client):
    """``ExampleNetwork`` with ``.F`` taken as is; validation runs its ``AveragedModel`` (SWA) copy."""

    def __init__(self):
        super().__init__()
        self.net = ExampleNetwork()
        self.swa = AveragedModel(self.net)  # deep-copies the ME layers

    def loss(self, batch, net=None):
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        return F.cross_entropy((net or self.net)(x).F, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.swa.update_parameters(self.net)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch, self.swa), batch_size=batch["labels"].shape[0])


class FieldUNet(_Client):
    """A MinkUNet on TensorField input, sliced back to the points: per-point cross-entropy."""

    def __init__(self):
        super().__init__()
        self.net = TinyUNet(3, NUM_CLASSES)

    def loss(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"])
        return F.cross_entropy(self.net(field.sparse()).slice(field).F, batch["labels"])


class Completion(_Client):
    """A generative decoder (``completion.py``-style): encode at stride 2, generate stride-1 coordinates with a
    transposed generative convolution, score them, prune those scored negative; the loss is the binary
    cross-entropy of the scores against "this coordinate is in the input", averaged per sample, then over samples.
    """

    def __init__(self):
        super().__init__()
        self.enc = conv_bn_relu(3, 8, kernel_size=2, stride=2)
        self.gen = nn.Sequential(
            ME.MinkowskiGenerativeConvolutionTranspose(8, 8, kernel_size=2, stride=2, dimension=3),
            ME.MinkowskiBatchNorm(8),
            ME.MinkowskiReLU(),
        )
        self.score = ME.MinkowskiConvolution(8, 1, kernel_size=1, dimension=3)
        self.prune = ME.MinkowskiPruning()
        self.refine = ME.MinkowskiConvolution(8, 1, kernel_size=3, dimension=3)

    def loss(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        y = self.gen(self.enc(x))
        score = self.score(y)
        keep = (score.F[:, 0] > 0) | _occupied(score, x).bool()  # completion.py keeps the target too in training
        refined = self.refine(self.prune(y, keep))
        return _per_sample_bce(score, x) + 0.1 * _per_sample_bce(refined, x)


def _occupied(pred: ME.SparseTensor, target: ME.SparseTensor) -> torch.Tensor:
    """``[n]`` 1.0 where ``pred``'s coordinate (batch index included) is one of ``target``'s, else 0.0."""
    def keys(c):
        c = c.long()
        return ((c[:, 0] * 4096 + c[:, 1] + 1024) * 4096 + c[:, 2] + 1024) * 4096 + c[:, 3] + 1024

    return torch.isin(keys(pred.C), keys(target.C)).to(pred.F.dtype)


def _per_sample_bce(pred: ME.SparseTensor, target: ME.SparseTensor) -> torch.Tensor:
    """Mean over samples of the mean binary cross-entropy of ``pred``'s rows against occupancy in ``target``."""
    occupied = _occupied(pred, target)
    bce = F.binary_cross_entropy_with_logits(pred.F[:, 0], occupied, reduction="none")
    batch_index = pred.C[:, 0].long()
    num_samples = int(batch_index.max()) + 1
    sums = torch.zeros(num_samples, dtype=bce.dtype, device=bce.device).index_add(0, batch_index, bce)
    counts = torch.bincount(batch_index, minlength=num_samples).to(bce.dtype)
    return (sums / counts).mean()


def _without_labels(batch: dict) -> dict:
    """A completion batch: coordinates and features only (the target is the input's own occupancy)."""
    return {k: v for k, v in batch.items() if k != "labels"}


CLIENTS = {
    "multigpu_lightning": (MultiGPUSegmentation, voxel_batch),
    "modelnet40_fcnn": (ModelNetClassifier, modelnet_batch),
    "docs_example_network": (DocsClassifier, lambda seeds: modelnet_batch(seeds, scale=10.0)),
    "minkunet_tensorfield": (FieldUNet, field_batch),
    "completion": (Completion, lambda seeds: _without_labels(voxel_batch(seeds))),
}
