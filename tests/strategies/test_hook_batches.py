"""What every hook and callback that receives ``batch`` gets under sparse_dp, against plain Lightning on one device
(issue 66): the user's collated batch, with and without DataLoader workers (where the split runs in the workers), in
every stage, and a prediction writer's batch indices and batches."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from tests.support.exact import same_start
from tests.support.helpers import SparseNet, random_samples, sample_loader, trainer

HOOKS = [f"on_{stage}_batch_{when}" for stage in ("train", "validation", "test", "predict") for when in ("start", "end")]


class BatchReader(L.Callback):
    """Records, for each hook that receives ``batch``, the batch's type, keys and labels."""

    def __init__(self):
        self.seen: list[tuple[str, str, list[str], list[int]]] = []

    def _read(self, hook, batch):
        self.seen.append((hook, type(batch).__name__, sorted(batch), batch["labels"].tolist()))


for _hook in HOOKS:
    def _recorder(self, trainer, module, *args, _hook=_hook):
        batch = args[0] if _hook.endswith("start") else args[1]  # (batch, idx) / (outputs, batch, idx)
        self._read(_hook, batch)

    setattr(BatchReader, _hook, _recorder)


class Writer(BasePredictionWriter):
    def __init__(self):
        super().__init__(write_interval="batch")
        self.written: list[tuple[list[int], list[int]]] = []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append((list(batch_indices), batch["labels"].tolist()))


class Predicting(SparseNet):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), batch_size=batch["labels"].shape[0])

    def predict_step(self, batch, batch_idx):
        return self(__import__("MinkowskiEngine").SparseTensor(batch["features"], batch["coordinates"]))


def run_all_stages(module, workers: int, **kwargs):
    reader, writer = BatchReader(), Writer()
    samples = random_samples(16, seed=3)
    loaders = [sample_loader(samples, num_workers=workers) for _ in range(4)]
    t = trainer(max_steps=-1, max_epochs=1, limit_train_batches=2, limit_val_batches=2, callbacks=[reader, writer], **kwargs)
    t.fit(module, loaders[0], loaders[1])
    t.test(module, loaders[2], verbose=False)
    t.predict(module, loaders[3], return_predictions=False)
    return reader.seen, writer.written


@pytest.mark.parametrize("workers", [0, 2], ids=["main-process", "workers"])
def test_every_batch_hook_gets_the_collated_batch_as_on_one_device(workers):
    ours, reference = same_start(Predicting)
    seen, written = run_all_stages(ours, workers, strategy="sparse_dp", devices=2)
    want_seen, want_written = run_all_stages(reference, 0, devices=1)
    assert {hook for hook, *_ in want_seen} == set(HOOKS)
    assert seen == want_seen  # hook order, type (dict), keys and each batch's labels in batch order
    assert written == want_written and written  # BasePredictionWriter: the batch's indices and the batch


def test_a_batch_split_in_workers_keeps_its_tensors_for_the_hooks():
    """The hooks' batch from a worker is the collated batch itself: every entry equal to one device's."""
    tensors = []

    class Reader(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            tensors.append(batch)

    samples = random_samples(14, seed=5)
    trainer(strategy="sparse_dp", devices=2, max_steps=1, callbacks=[Reader()]).fit(
        SparseNet(), sample_loader(samples, num_workers=1)
    )
    trainer(devices=1, max_steps=1, callbacks=[Reader()]).fit(SparseNet(), sample_loader(samples, num_workers=0))
    ours, plain = tensors
    assert ours.keys() == plain.keys()
    for key in plain:
        assert torch.equal(ours[key], plain[key]), key
