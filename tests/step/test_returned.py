"""Batch entries a step returns as it got them (lightning_sparse_dp/step/returned.py) come back as the whole batch's,
against plain Lightning on one device in float64."""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import torch

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import trainer64
from tests.support.helpers import loader, voxelized_batch


class _VoxelsToPoints(L.LightningModule):
    """Voxel logits and the batch's inverse map returned from ``predict_step``; ``on_predict_batch_end`` maps the
    voxels' logits back to the original points with it, as ME's examples do after ``sparse_quantize``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = ME.MinkowskiConvolution(3, 4, kernel_size=3, dimension=3)
        self.per_point: list[torch.Tensor] = []

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return {"voxel_logits": self.net(x).F, "inverse": batch["inverse"], "labels": batch["point_labels"]}

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.per_point.append(outputs["voxel_logits"][outputs["inverse"]])


def test_an_index_map_returned_as_the_step_got_it_is_the_whole_batchs():
    """Each replica returned its chunk's inverse map, re-based to the chunk's voxels; merged as rows, the map kept the
    chunks' numbers (0.6 off) and the points' logits picked with it were others' (0.3 off), silently. An entry a step
    returns as it got it comes back as the whole batch's."""
    batch = voxelized_batch(9, seed=5)
    layout = {"inverse": "indices:coordinates", "point_labels": "points:original_coordinates"}
    ours, reference = _VoxelsToPoints(), _VoxelsToPoints()
    got = trainer64(strategy=SparseDataParallelStrategy(layout=layout), devices=3).predict(ours, loader(batch))[0]
    want = trainer64().predict(reference, loader(batch))[0]
    assert torch.equal(got["inverse"], want["inverse"]) and torch.equal(got["labels"], want["labels"])
    assert torch.allclose(ours.per_point[0], reference.per_point[0], rtol=1e-10, atol=0)


class _ChangedEntries(_VoxelsToPoints):
    """Entries changed before they are returned: labels remapped in place in the step, features replaced at their key,
    labels shifted by the module's own ``on_after_batch_transfer`` (which runs on each replica's chunk)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        batch["point_labels"] = (batch["point_labels"] + 1) % 4
        return batch

    def predict_step(self, batch, batch_idx):
        labels = batch["point_labels"]
        labels[labels == 3] = -100
        batch["features"] = batch["features"] * 2
        return {"labels": labels, "features": batch["features"], "inverse": batch["inverse"]}

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        pass


def test_entries_changed_before_they_are_returned_come_back_as_changed():
    """What the step changed in a batch entry it returns (in place, at its key, in the module's transfer hook) is what
    comes back, in the batch's order, as one device returns it."""
    batch = voxelized_batch(9, seed=6)
    layout = {"inverse": "indices:coordinates", "point_labels": "points:original_coordinates"}
    got = trainer64(strategy=SparseDataParallelStrategy(layout=layout), devices=3).predict(_ChangedEntries(),
                                                                                           loader(batch))[0]
    want = trainer64().predict(_ChangedEntries(), loader(voxelized_batch(9, seed=6)))[0]
    for key in ("labels", "features", "inverse"):
        assert torch.equal(got[key], want[key]), key
