"""sparse_dp's batch hooks and presplit batches, against plain Lightning: ``on_before_batch_transfer`` once per
batch (a module's or a datamodule's), the hooks a split batch skips said, batches split in DataLoader workers, the
stage clock."""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch

import lightning_sparse_dp
from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import assert_same_states, same_start
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, sample_loader, trainer

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


class Moved:
    """A batch entry of the user's own type that only the user's transfer hook can move."""

    def __init__(self, scale, device=None):
        self.scale, self.device = scale, device


class TransferHooks(SparseNet):
    """The batch-transfer hooks overridden (issue 58): the step needs what they did to the batch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append(("transfer", threading.current_thread().name, str(device), int(batch["labels"].numel())))
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        return {**batch, "extra": Moved(batch["extra"].scale, device)}

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("after", threading.current_thread().name))
        return {**batch, "features": batch["features"] * batch["extra"].scale}

    def training_step(self, batch, batch_idx):
        assert isinstance(batch["extra"], Moved) and batch["extra"].device == self.device
        return super().training_step({k: v for k, v in batch.items() if k != "extra"}, batch_idx)


def test_batch_transfer_hooks_run_on_each_chunk_where_lightning_runs_them_as_ddp_ranks_run_them(both_preparations):
    """Each chunk's transfer hooks with its device, on Lightning's thread before on_train_batch_start (issue 66), as
    each DDP rank runs them on its batch; the step exact."""
    batches = [{**collate_dict(random_samples(9, seed=s)), "extra": Moved(2.0)} for s in (1, 2)]
    batches = [{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in b.items()}
               for b in batches]

    class Recorded(TransferHooks):
        def on_train_batch_start(self, batch, batch_idx):
            self.calls.append(("start", threading.current_thread().name))

    ours, reference = same_start(Recorded)
    trainer(strategy="sparse_dp", devices=3, max_steps=2, precision="64-true").fit(ours, loader(*batches))
    trainer(devices=1, max_steps=2, precision="64-true").fit(reference, loader(*batches))
    assert_same_states(ours, reference)
    assert [c[0] for c in reference.calls] == ["transfer", "after", "start"] * 2  # plain Lightning: once per batch
    assert [c[0] for c in ours.calls] == (["transfer", "after"] * 3 + ["start"]) * 2  # once per chunk, then the hook
    transfers = [c for c in ours.calls if c[0] == "transfer"]
    assert sum(c[3] for c in transfers) == 18  # 3 chunks of 9 samples a step
    assert {c[1] for c in ours.calls} == {threading.main_thread().name}  # Lightning's thread, where its loop calls them


def test_before_transfer_hook_runs_once_per_batch_as_under_plain_lightning():
    """A normalization in on_before_batch_transfer (features * 2) reaches the step once, in training and
    validation: the same calls and the same parameters as plain Lightning (float64, 2 steps)."""

    class Doubles(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.calls = []

        def on_before_batch_transfer(self, batch, dataloader_idx):
            self.calls.append(self.trainer.state.stage)
            return {**batch, "features": batch["features"] * 2}

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.loss(batch), batch_size=int(batch["labels"].shape[0]))

    batches = [collate_dict(random_samples(6, seed=s)) for s in (31, 32)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    models = same_start(Doubles)
    for model, kwargs in zip(models, ({"strategy": "sparse_dp", "devices": 3}, {})):
        model.double()
        t = L.Trainer(accelerator="cpu", precision="64-true", max_steps=2, limit_val_batches=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, val_check_interval=2, **kwargs)
        t.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), torch.utils.data.DataLoader(batches, batch_size=None))
    ours, reference = models
    assert [str(c) for c in ours.calls] == [str(c) for c in reference.calls]
    assert len(reference.calls) == 3  # 2 training batches, 1 validation batch
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


class _SeesBatches(SparseDataParallelStrategy):
    """Records the type of every batch the step gets, before the split (no exactness check: it would add its run's)."""

    def __init__(self, **kwargs):
        super().__init__(check_exactness=False, **kwargs)
        self.batch_types = []

    def scatter(self, batch, step=None):
        self.batch_types.append(type(batch))
        return super().scatter(batch, step)


def test_presplit_in_worker_processes_equals_one_device(both_preparations):
    samples = random_samples(14, seed=13)
    ours, reference = same_start()
    strategy = _SeesBatches(record_stage_times=True)
    t = trainer(strategy=strategy, devices=3, max_steps=2)
    train = sample_loader(samples, num_workers=2)
    t.fit(ours, train)
    assert train.collate_fn is collate_dict  # the user's DataLoader is as it was: the strategy used a copy
    assert isinstance(next(iter(train)), dict)
    assert strategy.batch_types == [lightning_sparse_dp.PreSplitBatch] * 2  # the split ran in the workers
    trainer(devices=1, max_steps=2).fit(reference, sample_loader(samples))
    for p, q in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    steps = list(strategy.stage_times.steps)
    assert len(steps) == 2
    assert {"split", "replicate", "apply", "replica0", "replica2", "gather", "log", "backward"} <= set(steps[0])
    # the override hands the step on: placed in each replica's thread when they prepare (scatter<i>), else here
    placing = {"scatter0", "scatter2"} if both_preparations else {"place"}
    assert placing <= set(steps[0]) and not ({"place", "scatter0"} - placing) & set(steps[0])


def test_presplit_batches_go_through_lightnings_precision_conversion():
    # "64-true" converts each batch with apply_to_collection before the step; a PreSplitBatch's frozen plan
    # made that raise (FrozenInstanceError) until the plan became a field it passes on untouched
    samples = random_samples(14, seed=15)
    ours, reference = same_start()
    strategy = _SeesBatches()
    trainer(strategy=strategy, devices=3, max_steps=2, precision="64-true").fit(ours, sample_loader(samples, num_workers=1))
    assert strategy.batch_types == [lightning_sparse_dp.PreSplitBatch] * 2
    trainer(devices=1, max_steps=2, precision="64-true").fit(reference, sample_loader(samples))
    assert_same_states(ours, reference)  # float64: 1e-10 relative, as the other exactness tests


def test_presplit_chunks_train_as_one_device():
    # the workers' chunks reach the replicas through the step's own placing: on the main thread, or each replica's
    # in its thread (both_preparations); no scatter override here, so the default path runs
    samples = random_samples(14, seed=16)
    ours, reference = same_start()
    trainer(strategy="sparse_dp", devices=3, max_steps=2, precision="64-true").fit(ours, sample_loader(samples, num_workers=1))
    trainer(devices=1, max_steps=2, precision="64-true").fit(reference, sample_loader(samples))
    assert_same_states(ours, reference)


DELAY = 1.0  # seconds; far above what any stage of this tiny step takes, even on a loaded machine


class _SlowReplica(SparseNet):
    """Replica 1's training step waits ``DELAY`` seconds; the others do not."""

    def training_step(self, batch, batch_idx):
        if threading.current_thread().name.startswith("sparse_dp-replica1"):
            time.sleep(DELAY)
        return super().training_step(batch, batch_idx)


def test_stage_times_measure_what_they_name(both_preparations):
    strategy = SparseDataParallelStrategy(record_stage_times=True)
    trainer(strategy=strategy, devices=3).fit(_SlowReplica(), loader(collate_dict(random_samples(7, seed=14))))
    (step,) = strategy.stage_times.steps
    assert step["replica1"] >= DELAY  # replica 1's own timer holds its wait
    assert step["apply"] >= DELAY  # the apply stage waits for every replica
    assert step["replica0"] < DELAY and step["replica2"] < DELAY  # the others run beside it, not after it
    placing = ("scatter0", "scatter1", "scatter2") if both_preparations else ("place",)  # in replica i's thread / here
    for stage in ("split", *placing, "replicate", "weigh", "gather", "log", "backward", "backward0", "backward1", "reduce"):
        assert step[stage] < DELAY, stage
    assert ("place" in step) != both_preparations


def test_presplit_batch_with_more_chunks_than_devices_is_refused():
    collate = lightning_sparse_dp.PreSplitCollate(collate_dict, num_chunks=3)
    batch = collate(random_samples(6))
    with pytest.raises(ValueError, match="split into 3 chunks in the DataLoader but the strategy has 2"):
        trainer(strategy="sparse_dp", devices=2).fit(SparseNet(), loader(batch))


def test_a_datamodules_before_transfer_hook_sees_the_batch_as_under_plain_lightning():
    """With DataLoader workers (where presplit would split), a LightningDataModule's on_before_batch_transfer gets the
    collated dict batch, once per batch, as under plain Lightning: presplit stays off for it."""
    seen = []

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return sample_loader(random_samples(14, seed=151), num_workers=2)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            seen.append(type(batch).__name__)
            return batch

    trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(SparseNet(), datamodule=Data())
    assert seen == ["dict", "dict"]


class _TwoLoaders(SparseNet):
    """A step over a CombinedLoader's batch of two loaders' batches."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch["a"]) + 0.5 * self.loss(batch["b"])


def test_a_combined_loaders_batches_split_in_workers_train_as_one_device():
    """Each inner loader's batches were split in its workers, and the step got a dict of two split batches, which it
    could not read ("the batch has no tensor to split"). They are split as one batch now, as one device's."""
    from lightning.pytorch.utilities import CombinedLoader

    def loaders(workers):
        return CombinedLoader({"a": sample_loader(random_samples(14, seed=29), num_workers=workers),
                               "b": sample_loader(random_samples(14, seed=30), num_workers=workers)}, "max_size_cycle")

    ours, reference = same_start(_TwoLoaders)
    trainer(strategy="sparse_dp", devices=3, max_steps=2, precision="64-true").fit(ours, loaders(2))
    trainer(max_steps=2, precision="64-true").fit(reference, loaders(0))
    assert_same_states(ours, reference)


class _AddsAKey(SparseNet):
    """on_after_batch_transfer adds a key that on_train_batch_end reads."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "points": len(batch["coordinates"])}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen = "points" in batch


def test_what_the_hooks_batch_is_where_the_transfer_hooks_are_the_modules_own_is_said_once(caplog):
    """The hooks get the collated batch from before the transfer hooks, which run on each chunk: a key the transfer
    hook adds is missing there (a KeyError on a callback that reads it), silently. It is said once."""
    import logging

    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "own batch-transfer hooks" in m})
    model = _AddsAKey()
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(model, loader(*[collate_dict(random_samples(6, seed=s))
                                                                                     for s in (31, 32)]))
    said = [r.getMessage() for r in caplog.records if "own batch-transfer hooks" in r.getMessage()]
    assert len(said) == 1 and "on_before_batch_transfer" in said[0] and model.seen is False


class _ScalesAtBatchStart(SparseNet):
    """Features scaled in ``on_train_batch_start``, beside a transfer hook of the module's own (an identity)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch

    def on_train_batch_start(self, batch, batch_idx):
        batch["features"] = batch["features"] * 2


def test_a_batch_changed_at_batch_start_after_the_transfer_hooks_cut_it_is_said():
    """With the module's own transfer hooks the chunks are cut before ``on_train_batch_start``, so a change made there
    never reached the step (parameters 4.3e-3 off after 2 steps, and the check said 'equals'). It is said now."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "was changed after the module's own batch-transfer" in m})
    batches = [collate_dict(random_samples(7, seed=s)) for s in (33, 34)]
    with pytest.warns(UserWarning, match=r"given to training_step was changed after .* in on_train_batch_start"):
        trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(_ScalesAtBatchStart(), loader(*batches))


class _OwnAfterTransfer(SparseNet):
    """A transfer hook of the module's own that changes nothing."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


def test_evaluation_in_float64_with_the_modules_own_transfer_hook_runs():
    """In float64 the converted batch is made under Lightning's inference mode, whose tensors have no version counter:
    the marks taken to see a hook change the batch raised 'Inference tensors do not track version counter'."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (61, 62)]
    ours, reference = same_start(_OwnAfterTransfer, seed=0)
    kwargs = dict(precision="64-true", limit_val_batches=None)
    got = trainer(strategy="sparse_dp", devices=3, **kwargs).validate(ours, loader(*batches), verbose=False)
    want = trainer(**kwargs).validate(reference, loader(*batches), verbose=False)
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], rel=1e-10)


class _ChangesTheBatch(L.Callback):
    """An augmentation callback: the features scaled and the labels remapped in ``on_train_batch_start``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["features"] = batch["features"] * 3.0 + 1.0
        batch["labels"].fill_(2)


def test_a_batch_changed_at_batch_start_reaches_the_step_when_workers_split_it():
    """With DataLoader workers the chunks are cut in the workers (presplit); a callback changing the batch in
    on_train_batch_start changed the hooks' batch only, and the replicas trained on the workers' chunks without it (0.5
    off one device after an epoch, the check saying 'equals'). A batch the hooks changed is split in the step now, as
    without workers."""
    from tests.support.exact import state_differences, trainer64

    samples = random_samples(14, seed=5)
    ours, reference = same_start()
    trainer64(strategy="sparse_dp", devices=3, max_steps=2, callbacks=[_ChangesTheBatch()]).fit(
        ours, sample_loader(samples, num_workers=2))
    trainer64(max_steps=2, callbacks=[_ChangesTheBatch()]).fit(reference, sample_loader(samples))
    assert max(state_differences(ours, reference).values()) <= 1e-10
