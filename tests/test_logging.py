"""Logged values that are not means (counts, a max of the loss, a max of another value) and
``self.print`` once per step, against one device with the whole batch."""

from __future__ import annotations

import pytest

from tests.helpers import (
    SparseNet, collate_dict, fit_float64, loader, random_samples, relative_difference, same_start, trainer
)

# --- logged values that are not means ----------------------------------------------------------------


class Logs(SparseNet):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("n", batch["labels"].shape[0])
        self.log("points", batch["coordinates"].shape[0], reduce_fx="sum")
        self.log("loss_max", loss, reduce_fx="max")
        self.log("train_loss", loss)
        return loss


def test_logged_counts_and_the_loss_under_max_are_the_one_device_values():
    batch = collate_dict(random_samples(5, seed=12))
    ours, reference = same_start(Logs)
    with pytest.warns(UserWarning, match=r"self.log\('n', <integer>\).*sum over the replicas"):
        t = fit_float64(ours, batch, strategy="sparse_dp", devices=3)
    r = fit_float64(reference, batch)
    assert t.callback_metrics["n"].item() == r.callback_metrics["n"].item() == 5
    assert t.callback_metrics["points"].item() == r.callback_metrics["points"].item() == batch["coordinates"].shape[0]
    for name in ("loss_max", "train_loss"):
        assert relative_difference(t.callback_metrics[name], r.callback_metrics[name]) <= 1e-10, name


def test_max_of_a_value_that_is_not_the_loss_warns():
    class MaxOfMeans(SparseNet):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("mean_feature", batch["features"].mean(), reduce_fx="max")
            return loss

    with pytest.warns(UserWarning, match=r"reduce_fx='max'\) takes the max / min over the replicas"):
        fit_float64(MaxOfMeans(), collate_dict(random_samples(5, seed=13)), strategy="sparse_dp", devices=3)


# --- self.print --------------------------------------------------------------------------------------


def test_print_once_per_step(capsys):
    class Prints(SparseNet):
        def training_step(self, batch, batch_idx):
            self.print(f"step {batch_idx}")
            return super().training_step(batch, batch_idx)

    batches = [collate_dict(random_samples(7, seed=s)) for s in range(4)]
    trainer(strategy="sparse_dp", devices=3, max_steps=4).fit(Prints(), loader(*batches))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines == ["step 0", "step 1", "step 2", "step 3"]
