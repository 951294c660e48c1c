"""Published ME + Lightning module forms, unchanged: a batch that is one collated tensor ``[N, 1 + D + k]`` (batch
index, coordinates, per-point values), steps that return ``None`` in some chunks, batch norm left per replica.
Each against plain Lightning on one CPU device with the whole batch, float64."""

from __future__ import annotations

import logging

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.split import BatchLayoutError, split_batch
from tests.support.exact import assert_same_states, relative_difference, same_start
from tests.support.helpers import trainer

NUM_SCANS = 6


def scans(num: int = 12, seed: int = 0, moving_every: int = 1) -> list[torch.Tensor]:
    """Scans as a moving-object module's dataset gives them: float ``[n, 5]`` rows of x, y, z, t, label (1 moving);
    every ``moving_every``-th scan has moving points, the others none (``moving_every=0``: no scan)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(num):
        n = int(torch.randint(20, 60, (1,), generator=g))
        xyz = torch.randint(0, 10, (n * 3, 3), generator=g).unique(dim=0)[:n].double()
        t = torch.randint(0, 2, (xyz.shape[0], 1), generator=g).double()
        label = (torch.rand(xyz.shape[0], 1, generator=g) < 0.3).double() * float(moving_every > 0 and k % moving_every == 0)
        out.append(torch.cat([xyz, t, label], dim=1))
    return out


def collate_points(items: list[torch.Tensor]) -> torch.Tensor:
    """The module's own collate_fn: one tensor ``[N, 6]``: batch index (float), x, y, z, t, label."""
    return torch.cat([torch.cat([torch.full((x.shape[0], 1), float(b), dtype=x.dtype), x], 1) for b, x in enumerate(items)])


def collate_scene(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Without the time and label columns: points ``[N, 4]`` (batch index, x, y, z) and a per-scan label ``[B]``."""
    points = collate_points([x[:, :3] for x in items])
    return points, torch.tensor([int(x[:, 4].sum() > 5) for x in items])


class MovingObjects(L.LightningModule):
    """A 4-D MinkUNet-like module, shrunk: its batch is one float tensor; it builds its TensorField in the step;
    with ``skip_static`` it returns None when the batch has no moving point (as the published module does)."""

    def __init__(self, skip_static: bool = False, batch_norm: bool = True):
        super().__init__()
        layers = [ME.MinkowskiConvolution(1, 8, kernel_size=3, dimension=4)]
        layers += [ME.MinkowskiBatchNorm(8)] if batch_norm else []
        layers += [ME.MinkowskiReLU(), ME.MinkowskiConvolution(8, 2, kernel_size=1, dimension=4)]
        self.net = torch.nn.Sequential(*layers)
        self.skip_static = skip_static

    def loss(self, batch: torch.Tensor) -> torch.Tensor | None:
        labels = batch[:, 5].long()
        if self.skip_static and not labels.any():
            return None
        coordinates = batch[:, :5]
        field = ME.TensorField(torch.ones(batch.shape[0], 1, dtype=batch.dtype, device=self.device), coordinates,
                               device=self.device)
        logits = self.net(field.sparse()).slice(field).F
        return F.cross_entropy(logits, labels)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if loss is not None:
            self.log("val_loss", loss, batch_size=int(batch[-1, 0]) + 1)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SceneClassifier(L.LightningModule):
    """Points ``[N, 4]`` and per-scan labels ``[B]``; global pooling, ``.F`` as per-sample rows."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            ME.MinkowskiConvolution(1, 8, kernel_size=3, dimension=3), ME.MinkowskiReLU(),
            ME.MinkowskiGlobalAvgPooling(), ME.MinkowskiLinear(8, 2),
        )

    def training_step(self, batch, batch_idx):
        points, labels = batch
        x = ME.SparseTensor(torch.ones(points.shape[0], 1, dtype=points.dtype, device=self.device), points,
                            device=self.device)
        return F.cross_entropy(self.net(x).F, labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model, data, collate, strategy="auto", devices=1, batch_size=NUM_SCANS, **kwargs):
    t = trainer(strategy=strategy, devices=devices, precision="64-true", max_steps=2, **kwargs)
    t.fit(model, DataLoader(data, batch_size=batch_size, collate_fn=collate))
    return t


def test_one_collated_tensor_is_split_by_its_batch_column():
    batch = collate_points(scans(NUM_SCANS))
    chunks, plan = split_batch(batch, 3, batch_sizes={NUM_SCANS})
    assert plan.num_samples == NUM_SCANS and len(chunks) == 3
    for chunk, samples in zip(chunks, plan.chunk_samples):
        assert int(chunk[:, 0].max()) + 1 == len(samples)  # the chunk's samples, renumbered 0..b-1
        want = torch.cat([batch[batch[:, 0] == s][:, 1:] for s in samples.tolist()])
        assert torch.equal(chunk[:, 1:], want)  # whole scans, rows and every other column as they were


@pytest.mark.parametrize("sync_batchnorm", [False, True])
def test_collated_points_module_is_exact_without_a_layout(sync_batchnorm):
    ours, reference = same_start(MovingObjects, batch_norm=sync_batchnorm)
    data = scans(2 * NUM_SCANS)
    fit(reference, data, collate_points)
    fit(ours, data, collate_points, "sparse_dp", 3, sync_batchnorm=sync_batchnorm)
    assert_same_states(ours, reference)


def test_collated_points_without_label_columns_are_exact():
    ours, reference = same_start(SceneClassifier)
    data = scans(2 * NUM_SCANS)
    fit(reference, data, collate_scene)
    fit(ours, data, collate_scene, "sparse_dp", 3)
    assert_same_states(ours, reference)


def test_collated_points_are_exact_on_sparse_ddp_split():
    """sparse_ddp reads each rank's batch with the same rule: its plan counts scans, not rows."""
    from lightning_sparse_dp.split import plan_split

    batch = collate_points(scans(NUM_SCANS))
    _, plan = plan_split(batch, 1)
    assert plan.num_samples == NUM_SCANS


def test_a_tensor_that_may_be_either_is_refused_naming_the_layout():
    batch = collate_points(scans(3))
    batch = batch[:10]  # 10 rows, column 0 numbering fewer samples
    with pytest.raises(BatchLayoutError, match=r"\{'batch': 'coordinates'\}.*\{'batch': 'samples'\}"):
        split_batch(batch, 2, batch_sizes={10})
    chunks, plan = split_batch(batch, 2, layout={"batch": "samples"})
    assert plan.num_samples == 10
    _, plan = split_batch(batch, 2, layout={"batch": "coordinates"}, batch_sizes={10})
    assert plan.num_samples == int(batch[-1, 0]) + 1


def test_a_dense_tensor_of_one_row_per_sample_stays_dense():
    x = torch.stack([torch.arange(8.0), torch.randn(8)], 1)  # column 0 reads 0..7: one row per sample
    _, plan = split_batch(x, 2, batch_sizes={8})
    assert plan.num_samples == 8


def test_training_step_none_in_some_chunks_is_refused_naming_the_step():
    model = MovingObjects(skip_static=True)
    data = scans(NUM_SCANS, moving_every=3)  # scans 0 and 3 move: a chunk of the others has nothing moving
    with pytest.raises(ValueError, match=r"training_step returned None in replica\(s\) \[\d.*batch's samples"):
        fit(model, data, collate_points, SparseDataParallelStrategy(split="contiguous"), 3)


def test_training_step_none_in_every_chunk_skips_the_step_as_on_one_device():
    ours, reference = same_start(MovingObjects, skip_static=True, batch_norm=False)
    data = scans(NUM_SCANS, moving_every=0) + scans(NUM_SCANS, seed=1)  # a batch with nothing moving, then one
    fit(reference, data, collate_points)
    fit(ours, data, collate_points, "sparse_dp", 3)
    assert_same_states(ours, reference)


def test_validation_none_in_some_chunks_that_nothing_reads_is_refused_when_their_samples_were_not_logged():
    model = MovingObjects(skip_static=True)
    strategy = SparseDataParallelStrategy(split="contiguous")
    t = trainer(strategy=strategy, devices=3, precision="64-true", limit_val_batches=1)
    loader = DataLoader(scans(NUM_SCANS, moving_every=3), batch_size=NUM_SCANS, collate_fn=collate_points)
    with pytest.raises(ValueError, match=r"validation_step returned None.*'val_loss'"):
        t.validate(model, loader, verbose=False)


class LogsEverywhere(MovingObjects):
    """A validation step that logs what it counted in every chunk, then returns None where nothing moved."""

    def validation_step(self, batch, batch_idx):
        moving = batch[:, 5].sum()
        self.log("moving", moving, reduce_fx="sum", batch_size=int(batch[-1, 0]) + 1)
        return None if moving == 0 else moving


class ReadsOutputs(L.Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen = outputs


def test_validation_none_in_some_chunks_is_one_devices_when_nothing_reads_it():
    data = scans(NUM_SCANS, moving_every=3)
    loader = DataLoader(data, batch_size=NUM_SCANS, collate_fn=collate_points)
    contiguous = SparseDataParallelStrategy(split="contiguous")  # chunk {4, 5} has nothing moving: None there
    ours = trainer(strategy=contiguous, devices=3, precision="64-true", limit_val_batches=1).validate(
        LogsEverywhere(), loader, verbose=False
    )
    one = trainer(precision="64-true", limit_val_batches=1).validate(LogsEverywhere(), loader, verbose=False)
    assert relative_difference(ours[0]["moving"], one[0]["moving"]) <= 1e-10
    with pytest.raises(ValueError, match=r"ReadsOutputs\.on_validation_batch_end"):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, precision="64-true",
                callbacks=[ReadsOutputs()], limit_val_batches=1).validate(
            LogsEverywhere(), loader, verbose=False
        )


@pytest.mark.parametrize("strategy", ["sparse_dp", "sparse_ddp"])
def test_batch_norm_per_replica_is_said_once_at_setup(strategy, monkeypatch):
    said = []
    monkeypatch.setattr("lightning_sparse_dp.strategies.checks.rank_zero_info", lambda msg, *a, **k: said.append(msg))
    from lightning_sparse_dp.strategies.checks import warn_unsynchronized_batchnorm

    warn_unsynchronized_batchnorm(MovingObjects(), 3, strategy)
    warn_unsynchronized_batchnorm(MovingObjects(), 1, strategy)  # one replica: nothing to say
    warn_unsynchronized_batchnorm(MovingObjects(batch_norm=False), 3, strategy)
    assert len(said) == 1 and "1 batch-norm layer" in said[0] and "Trainer(sync_batchnorm=True)" in said[0]


def test_batch_norm_per_replica_is_said_by_a_fit_and_not_with_sync(caplog):
    data = scans(NUM_SCANS)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        fit(MovingObjects(), data, collate_points, "sparse_dp", 3)
    said = [r.getMessage() for r in caplog.records if "batch-norm layer" in r.getMessage()]
    assert len(said) == 1, said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        fit(MovingObjects(), data, collate_points, "sparse_dp", 3, sync_batchnorm=True)
    assert not [r for r in caplog.records if "batch-norm layer" in r.getMessage()]
