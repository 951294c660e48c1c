"""Activation checkpointing (``torch.utils.checkpoint``) and the loss capture (issue 65 item 2), against plain
Lightning on one device in float64: a loss computed inside the checkpointed function is recomputed in backward, where
no capture runs, so it is said (with the fix) and weighted per replica, never torch's ``CheckpointError``; the fix it
names, the layers checkpointed and the loss outside, is exact."""

from __future__ import annotations

import logging

import pytest

from tests.support.exact import REL, same_start, state_differences, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import (
    CheckpointedHead,
    CheckpointedHeadNonReentrant,
    CheckpointedLoss,
    CheckpointedLossNonReentrant,
)

BATCHES = [collate_dict(random_samples(8, seed=s)) for s in (3, 4, 5)]


def _fit_both(cls, devices):
    ours, reference = same_start(cls, seed=0)
    trainer64(strategy="sparse_dp", devices=devices, max_steps=3).fit(ours, loader(*BATCHES))
    trainer64(max_steps=3).fit(reference, loader(*BATCHES))
    return max(state_differences(ours, reference).values())


@pytest.mark.parametrize("cls", [CheckpointedHead, CheckpointedHeadNonReentrant], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("devices", [2, 3])
def test_checkpointed_layers_with_the_loss_outside_are_exact(cls, devices, caplog):
    with caplog.at_level(logging.INFO):
        worst = _fit_both(cls, devices)
    assert worst <= REL
    assert "cannot weight" not in caplog.text


@pytest.mark.parametrize("cls", [CheckpointedLoss, CheckpointedLossNonReentrant], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("devices", [2, 3])
def test_a_loss_inside_the_checkpointed_function_is_said_with_the_fix_and_trains(cls, devices, caplog):
    with caplog.at_level(logging.INFO):
        _fit_both(cls, devices)  # non-reentrant: no CheckpointError (the loss is handed back unscaled)
    said = {r.getMessage() for r in caplog.records if "cannot weight the step's loss term by term" in r.getMessage()}
    assert len(said) == 1, said
    (line,) = said
    assert "runs inside torch.utils.checkpoint" in line and "h = checkpoint(self.head, h" in line
