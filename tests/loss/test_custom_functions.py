"""A custom ``torch.autograd.Function`` whose forward calls a loss and whose backward is written by hand (issue 65
item 5), against plain Lightning on one device in float64: the loss runs where autograd records nothing, so its
term's gradient scale could never reach the hand-written backward (sparse_ddp trained 0.4-0.7 off, silently); it is
said once, naming the construct and the fix, and weighted per replica (exact here: a mean over the samples)."""

from __future__ import annotations

import logging

import pytest

from tests.support.exact import REL, fit_pair, same_start, state_differences, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import CustomFunctionLoss, PooledNet


@pytest.mark.parametrize("devices", [2, 3])
def test_a_loss_inside_a_custom_function_is_said_and_weighted_per_replica(devices, caplog):
    batches = [collate_dict(random_samples(8, seed=s)) for s in (3, 4)]
    ours, reference = same_start(CustomFunctionLoss, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=devices, max_steps=2).fit(ours, loader(*batches))
    trainer64(max_steps=2).fit(reference, loader(*batches))
    said = {r.getMessage() for r in caplog.records if "cannot weight the step's loss term by term" in r.getMessage()}
    assert len(said) == 1, said
    assert "torch.autograd.Function's forward" in next(iter(said))
    assert max(state_differences(ours, reference).values()) <= REL  # "auto": by samples, as the cross-entropy's mean


def test_a_loss_logged_under_no_grad_beside_the_step_loss_changes_nothing(caplog):
    """A term computed under ``torch.no_grad`` that the loss does not use (a logged extra) is not a reason to fall back."""
    import torch
    import torch.nn.functional as F

    class LogsUnderNoGrad(PooledNet):
        def training_step(self, batch, batch_idx):
            logits = self.head(self.features(batch))
            with torch.no_grad():
                self.log("smoothed", F.cross_entropy(logits, batch["labels"], label_smoothing=0.1))
            return F.cross_entropy(logits, batch["labels"])

    batches = [collate_dict(random_samples(8, seed=s)) for s in (3, 4)]
    ours, reference = same_start(LogsUnderNoGrad, seed=0)
    with caplog.at_level(logging.INFO):
        t, r = fit_pair(ours, reference, batches, max_steps=2)
    assert "cannot weight" not in caplog.text
    assert max(state_differences(ours, reference).values()) <= REL
    want = float(r.logged_metrics["smoothed"])
    assert abs(float(t.logged_metrics["smoothed"]) - want) <= REL * want
