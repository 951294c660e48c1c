"""Learning-rate schedulers stepped by hand inside a step (lightning_sparse_dp/replica/schedulers.py), against plain
Lightning on one device in float64, and the replicas' once-calls themselves."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from lightning_sparse_dp.replica.effects import StepEffects
from lightning_sparse_dp.replica.schedulers import call_once
from tests.support.exact import assert_same_states, same_start, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import ManualOptimization, PooledNet


class _WarmsUpInTheStep(PooledNet):
    """A warm-up stepped by hand in the training step (a closed form of the scheduler's count, so every extra step
    shows), its rate logged."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: (epoch + 1) / 10)]

    def step_scheduler(self):
        self.lr_schedulers().step()

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.head(self.features(batch)), batch["labels"])
        self.step_scheduler()
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss


class _ThroughTheTrainer(_WarmsUpInTheStep):
    def step_scheduler(self):
        self.trainer.lr_scheduler_configs[0].scheduler.step()


class _ManualThroughTheTrainer(ManualOptimization, _ThroughTheTrainer):
    def manual_loss(self, batch, batch_idx):
        return F.cross_entropy(self.head(self.features(batch)), batch["labels"])

    def after_step(self, loss):
        self.step_scheduler()
        self.log("lr", self.lr_schedulers().get_last_lr()[0])


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("cls", [_WarmsUpInTheStep, _ThroughTheTrainer, _ManualThroughTheTrainer],
                         ids=["lr_schedulers", "trainer", "manual-trainer"])
def test_a_scheduler_stepped_in_the_step_steps_once(cls, check):
    """Every replica stepped the shared scheduler: 3 steps a batch on 3 replicas where one device takes one (the
    parameters 0.14 off after 3 batches, silently; with the exactness check on, its runs stepped it too). The replicas'
    k-th calls are one call now, and the check gives the scheduler back."""
    from lightning_sparse_dp import SparseDataParallelStrategy

    batches = [collate_dict(random_samples(8, seed=s)) for s in (41, 42, 43)]
    ours, reference = same_start(cls, seed=0)
    t = trainer64(strategy=SparseDataParallelStrategy(check_exactness=check), devices=3, max_steps=3)
    t.fit(ours, loader(*batches))
    r = trainer64(max_steps=3)
    r.fit(reference, loader(*batches))
    ours_scheduler, reference_scheduler = t.lr_scheduler_configs[0].scheduler, r.lr_scheduler_configs[0].scheduler
    assert ours_scheduler.last_epoch == reference_scheduler.last_epoch >= 3
    assert type(ours_scheduler) is type(reference_scheduler)  # the trainer keeps its own scheduler, not a view
    assert float(t.callback_metrics["lr"]) == float(r.callback_metrics["lr"])
    assert_same_states(ours, reference)


def test_the_replicas_kth_calls_run_once_and_each_gets_the_result():
    effects, ran, barrier = StepEffects("training_step", 3), [], threading.Barrier(3)
    results: dict[int, list[int]] = {}

    def replica(index):
        effects.watch(index, lambda: None)
        barrier.wait()
        results[index] = [call_once(effects, index, 7, lambda k=k: ran.append(k) or len(ran)) for k in range(2)]

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ran) == 2
    assert results == {0: [1, 2], 1: [1, 2], 2: [1, 2]}


def test_a_failing_once_call_raises_in_every_replica_that_makes_it():
    effects = StepEffects("training_step", 2)

    def fail():
        raise ValueError("scheduler failed")

    with pytest.raises(ValueError, match="scheduler failed"):
        call_once(effects, 0, 1, fail)
    with pytest.raises(ValueError, match="scheduler failed"):
        call_once(effects, 1, 1, lambda: "not run")


class _ReadsThenSteps(_WarmsUpInTheStep):
    """The rate read through the trainer's optimizers (the replica's copies of the groups are made), then the
    scheduler stepped by hand: the scheduler's change must stay (the copies were only read)."""

    def step_scheduler(self):
        assert isinstance(self.trainer.optimizers[0], torch.optim.SGD)  # the replica's view is one for isinstance
        self.read_lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.lr_schedulers().step()


class _ManualReadsThenSteps(ManualOptimization, _ReadsThenSteps):
    def manual_loss(self, batch, batch_idx):
        loss = F.cross_entropy(self.head(self.features(batch)), batch["labels"])
        self.step_scheduler()  # before opt.step(): the optimizer steps with the scheduler's rate
        return loss

    def after_step(self, loss):
        self.log("lr", self.lr_schedulers().get_last_lr()[0])


@pytest.mark.parametrize("cls", [_ReadsThenSteps, _ManualReadsThenSteps], ids=["automatic", "manual"])
def test_a_rate_read_from_the_groups_does_not_undo_a_scheduler_stepped_after(cls):
    """The root replica's copies of the groups, made by the read, were written back whole after the step (automatic)
    or before opt.step() (manual), undoing the scheduler's change: the rate stayed, the parameters 0.27 / 0.49 off,
    silently. Only entries the replica changed are written back now."""
    batches = [collate_dict(random_samples(8, seed=s)) for s in (44, 45, 46)]
    ours, reference = same_start(cls, seed=0)
    t = trainer64(strategy="sparse_dp", devices=3, max_steps=3)
    t.fit(ours, loader(*batches))
    r = trainer64(max_steps=3)
    r.fit(reference, loader(*batches))
    assert t.optimizers[0].param_groups[0]["lr"] == r.optimizers[0].param_groups[0]["lr"]
    assert_same_states(ours, reference)
