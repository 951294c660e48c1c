"""sparse_dp as a drop-in for the LightningModules ME's own examples write (see tests/support/clients.py).

Reference: the same module, same initial weights, on one device with the whole batch (strategy="auto").
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

import lightning_sparse_dp  # noqa: F401  (registers strategy="sparse_dp")
from tests.support.clients import CLIENTS, fresh_loader
from tests.support.exact import same_start, state_differences
from tests.support.helpers import trainer


class _LoggedLosses(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].item())


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_client_fits_and_validates_unchanged_on_three_replicas(name):
    cls, make = CLIENTS[name]
    train = [make(range(0, 6)), make(range(6, 13))]
    val = [make(range(100, 105)), make(range(105, 109))]
    model = cls()
    fit = trainer(strategy="sparse_dp", devices=3, max_steps=2, max_epochs=1, limit_val_batches=1.0)
    fit.fit(model, fresh_loader(train), fresh_loader(val))
    ours = fit.callback_metrics["val_loss"].item()
    # the trained weights validated on one device: eval mode is per sample, so the values agree
    one = trainer(devices=1, limit_val_batches=1.0)
    one.validate(model, fresh_loader(val), verbose=False)
    assert ours == pytest.approx(one.callback_metrics["val_loss"].item(), rel=1e-5)


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_client_two_sync_batchnorm_steps_equal_one_device_in_float64(name):
    cls, make = CLIENTS[name]
    batches = [make(range(20, 27)), make(range(27, 32))]  # 7 and 5 samples on 3 replicas: uneven chunks
    ours, reference = same_start(cls, seed=0)
    initial = copy.deepcopy(reference.state_dict())
    logged_ours, logged_reference = _LoggedLosses(), _LoggedLosses()
    common = dict(max_steps=2, precision="64-true")
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, callbacks=[logged_ours], **common).fit(
        ours, fresh_loader(batches)
    )
    trainer(devices=1, callbacks=[logged_reference], **common).fit(reference, fresh_loader(batches))
    differences = state_differences(ours, reference)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= 1e-10, f"{worst}: {differences[worst]:.3g}"
    assert len(logged_ours.losses) == 2
    assert logged_ours.losses == pytest.approx(logged_reference.losses, rel=1e-10)
    moved = [k for k, v in reference.state_dict().items() if v.is_floating_point() and not torch.equal(v, initial[k].to(v))]
    assert len(moved) > len(initial) // 2  # the steps changed the weights, so agreeing is not trivial
