"""What a step does to the optimizers it reaches through ``self.optimizers()`` (lightning_sparse_dp/replica/optimizers.py),
against plain Lightning on one device in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.exact import assert_same_states, same_start, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import ManualOptimization, PooledNet


class _DecaysInTheStep(PooledNet):
    """A decay of the learning rate written in the training step, in place in the optimizer's groups, then logged."""

    def groups(self):
        return self.optimizers().param_groups

    def training_step(self, batch, batch_idx):
        for group in self.groups():
            group["lr"] *= 0.5
        self.log("lr", self.groups()[0]["lr"])
        return F.cross_entropy(self.head(self.features(batch)), batch["labels"])


class _DecaysThroughTheTrainer(_DecaysInTheStep):
    """The same decay, on the optimizers the trainer holds (``self.trainer.optimizers``)."""

    def groups(self):
        return self.trainer.optimizers[0].param_groups


class _DecaysThroughTheStrategy(_DecaysInTheStep):
    """The same decay, on the strategy's optimizers (``self.trainer.strategy.optimizers``)."""

    def groups(self):
        return self.trainer.strategy.optimizers[0].param_groups


class _DecaysThroughTheTorchOptimizer(_DecaysInTheStep):
    """The same decay, on the torch optimizer inside Lightning's wrapper (``self.optimizers().optimizer``)."""

    def groups(self):
        return self.optimizers().optimizer.param_groups


class _DecaysThroughTheScheduler(_DecaysInTheStep):
    """The same decay, on the optimizer of the scheduler (``self.lr_schedulers().optimizer``), which Lightning steps
    once an epoch."""

    def groups(self):
        return self.lr_schedulers().optimizer.param_groups

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)]


class _DecaysInAManualStep(ManualOptimization, _DecaysInTheStep):
    """The decay under manual optimization, before the step's ``opt.step()``, which must use the new rate."""

    def manual_loss(self, batch, batch_idx):
        for group in self.groups():
            group["lr"] *= 0.5
        self.log("lr", self.groups()[0]["lr"])
        return F.cross_entropy(self.head(self.features(batch)), batch["labels"])


class _DecaysThroughTheTorchOptimizerManually(_DecaysInAManualStep):
    def groups(self):
        return self.optimizers().optimizer.param_groups


class _DecaysThroughTheSchedulerManually(_DecaysInAManualStep, _DecaysThroughTheScheduler):
    def groups(self):
        return self.lr_schedulers().optimizer.param_groups


@pytest.mark.parametrize("cls", [
    _DecaysInTheStep, _DecaysThroughTheTrainer, _DecaysThroughTheStrategy, _DecaysThroughTheTorchOptimizer,
    _DecaysThroughTheScheduler, _DecaysInAManualStep, _DecaysThroughTheTorchOptimizerManually,
    _DecaysThroughTheSchedulerManually,
], ids=["optimizers", "trainer", "strategy", "torch", "scheduler", "manual", "manual-torch", "manual-scheduler"])
def test_a_learning_rate_changed_in_place_in_the_step_changes_once(cls):
    """Every replica halved the shared optimizer's rate: 2**3 a step on 3 replicas where one device halves it once
    (the rate 0.0016 for 0.025 after 2 steps, the parameters 6e-2 off, silently with the check off); through
    ``self.trainer.optimizers`` (automatic) and ``self.optimizers()`` (manual) too (0.85 off in the logged rate). Each
    replica after the root one changes copies of its own now, as a DDP rank its own optimizer; the root's change is
    the trainer's, before the optimizer steps under manual optimization. Through the strategy's optimizers, the
    torch optimizer inside Lightning's wrapper or the scheduler's optimizer the rate was still changed once per replica
    (0.12 off); these reach the replica's copies too."""
    batches = [collate_dict(random_samples(8, seed=s)) for s in (31, 32)]
    ours, reference = same_start(cls, seed=0)
    t = trainer64(strategy="sparse_dp", devices=3, max_steps=2)
    t.fit(ours, loader(*batches))
    r = trainer64(max_steps=2)
    r.fit(reference, loader(*batches))
    assert t.optimizers[0].param_groups[0]["lr"] == r.optimizers[0].param_groups[0]["lr"] == 0.025
    assert float(t.callback_metrics["lr"]) == float(r.callback_metrics["lr"])
    assert_same_states(ours, reference)
