"""Logged values that are not means (counts, a max of the loss, a max of another value) and
``self.print`` once per step, against one device with the whole batch."""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
import torchmetrics

from tests.support.exact import assert_same_states, fit_float64, relative_difference, same_start
from tests.support.helpers import (
    NUM_CLASSES,
    SparseNet,
    collate_dict,
    loader,
    random_samples,
    sample_loader,
    trainer,
)

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

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


class EpochLoss(SparseNet):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)  # no batch_size: Lightning infers it
        return loss


def test_an_epoch_value_logged_without_batch_size_is_weighted_as_on_one_device():
    """Lightning weights each step's value of an epoch mean by the batch size it infers from the batch (the first tensor
    of a dict batch: the coordinates, so points) and says it guessed. sparse_dp gave it the batch's samples instead, so
    batches of one sample count but different point counts made another epoch mean (2e-3 relative apart), said by
    nothing; now Lightning infers it from the whole batch (its warning included), as on one device."""
    batches = [collate_dict(random_samples(7, seed=90 + i)) for i in range(3)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    assert len({b["coordinates"].shape[0] for b in batches}) == 3  # the weights differ by points, not samples
    ours, reference = same_start(EpochLoss)
    runs = []
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3}), (reference, {})):
        t = trainer(max_epochs=1, max_steps=-1, precision="64-true", **kwargs)
        t.fit(model, loader(*batches))
        runs.append(t.callback_metrics["epoch_loss"])
    assert relative_difference(*runs) <= 1e-10


def test_max_of_a_value_that_is_not_the_loss_warns():
    class MaxOfMeans(SparseNet):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("mean_feature", batch["features"].mean(), reduce_fx="max")
            return loss

    with pytest.warns(UserWarning, match=r"reduce_fx='max'\) takes the max / min over the replicas"):
        fit_float64(MaxOfMeans(), collate_dict(random_samples(5, seed=13)), strategy="sparse_dp", devices=3)


def test_a_score_logged_with_each_chunks_batch_size_is_said_not_one_devices(caplog):
    """An F1 or IoU per chunk logged with batch_size=len(labels) was reduced as a mean weighted by the chunks' sizes
    without a word (0.70 relative off in validation): it is said once, naming the value; a mean the step computed with
    .mean() and the loss are not."""
    import logging

    from torchmetrics.functional.classification import multiclass_f1_score

    class Scores(SparseNet):
        def validation_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            logits, y = self(x), batch["labels"]
            guess, n = y.roll(1), y.shape[0]  # a prediction of the data's own, so that the chunks' scores differ
            self.log("val_f1", multiclass_f1_score(guess, y, NUM_CLASSES, average="macro"), batch_size=n)
            self.log("val_acc", (guess == y).double().mean(), batch_size=n)
            self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), batch_size=n)

    batches = [collate_dict(random_samples(9, seed=s)) for s in (14, 15)]
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(Scores(), loader(*batches))
    said = [r.getMessage() for r in caplog.records if "batch_size=<each chunk's count>" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("sparse_dp: self.log('val_f1', ..., batch_size=<each chunk's count>)")


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


def test_logged_values_as_users_write_them_are_one_devices(caplog):
    """loss.item() (with batch_size= the batch dict's int), float(loss), masked accuracies and a mean over all
    points: one device's values on 3 replicas; a hand-made sum / count is said once; a value logged by some
    replicas only is said once."""
    import logging

    from lightning_sparse_dp import SparseDataParallelStrategy
    from tests.support.clients import fresh_loader
    from tests.support.scene_models import LoggedAsUsersDo
    from tests.support.term_models import seg_batch

    batches = []
    for s in (41, 42):
        b = seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.6))
        b["batch_size"] = 7
        batches.append(b)
    torch.manual_seed(0)
    ours, reference = LoggedAsUsersDo(), LoggedAsUsersDo()
    reference.load_state_dict(ours.state_dict())
    runs = []
    for model, strategy, devices in ((ours, SparseDataParallelStrategy(), 3), (reference, "auto", 1)):
        t = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      sync_batchnorm=devices > 1)
        t.fit(model, fresh_loader(batches))
        runs.append(t.logged_metrics)
    got, want = runs
    for name, rel in (("loss_item", 1e-10), ("loss_float", 1e-10), ("acc", 1e-6), ("acc_fn", 1e-10), ("labeled", 1e-10)):
        assert float(got[name]) == pytest.approx(float(want[name]), rel=rel), name

    class HandMade(LoggedAsUsersDo):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("handmade", (batch["labels"] == 1).sum() / len(batch["labels"]))
            if batch["coordinates"][:, 0].max() >= 2:  # a branch on the chunk
                self.log("some", loss.detach())
            return loss

    with caplog.at_level(logging.INFO):
        with pytest.warns(UserWarning, match=r"self.log\('some', ...\) was called by [12] of 3 replicas"):
            L.Trainer(accelerator="cpu", devices=3, strategy="sparse_dp", precision="64-true", max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      ).fit(HandMade(), fresh_loader(batches))
    said = [r.getMessage() for r in caplog.records if "self.log('handmade', ...) differs between replicas" in r.getMessage()]
    assert len(said) == 1 and "batch_size=" in said[0]


@pytest.mark.parametrize("devices", [2, 3])
def test_a_constant_batch_size_weighs_a_short_batch_as_one_device_does(devices):
    """``self.log(..., batch_size=self.hparams.batch_size)`` on every step, the epoch's last batch short: one device
    weighs that batch by the constant in epoch means; each replica passing the constant must not make it the sum of
    them (issue 65, item 8: 3x on 3 replicas, ``val_loss`` 0.2-0.3 % off where ModelCheckpoint watches it)."""
    from torch.utils.data import DataLoader

    class Constant(SparseNet):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.loss(batch), batch_size=7)
            self.log("val_loss_chunk", self.loss(batch), batch_size=len(batch["labels"]))

    samples = random_samples(12, seed=31)  # batches of 7 and 5
    metrics = []
    for strategy, n in (("sparse_dp", devices), ("auto", 1)):
        torch.manual_seed(0)
        model = Constant()
        t = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, precision="64-true", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.validate(model, DataLoader(samples, batch_size=7, collate_fn=collate_dict), verbose=False)
        metrics.append(t.callback_metrics)
    ours, one = metrics
    for name in ("val_loss", "val_loss_chunk"):
        assert float(ours[name]) == pytest.approx(float(one[name]), rel=1e-10), name


def test_a_batch_size_of_each_chunks_points_weighs_epoch_means_as_one_device_does():
    """``batch_size=<the chunk's points>`` with fixed-size point clouds: over equal chunks (6 samples of 10 points: 20,
    20, 20) the equal sizes were taken for one constant (20 where one device weighs the batch by 60), so the epoch mean
    was 7.5e-3 off, silently. Each chunk's point count is summed now, as its sample count is."""
    from torch.utils.data import DataLoader

    class PerPoint(SparseNet):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("loss_epoch", loss, on_step=False, on_epoch=True, batch_size=batch["coordinates"].shape[0])
            return loss

    samples = random_samples(13, seed=5, min_points=10, max_points=10)  # batches of 7 (uneven chunks) and 6 (even)
    ours, reference = same_start(PerPoint)
    for model, strategy, n in ((ours, "sparse_dp", 3), (reference, "auto", 1)):
        t = trainer(strategy=strategy, devices=n, precision="64-true", max_steps=2, max_epochs=1)
        t.fit(model, DataLoader(samples, batch_size=7, collate_fn=collate_dict))
        model.logged = float(t.callback_metrics["loss_epoch"])
    assert ours.logged == pytest.approx(reference.logged, rel=1e-10)


def test_integer_counts_logged_with_log_dict_are_the_batchs():
    """``self.log_dict({"correct": ..., "n": len(y)})`` passes ``reduce_fx="mean"``, which kept the integer counts
    from being summed: the replicas' mean (a third of one device's), silently. Integer counts under a mean are summed
    and said, as under no reduce_fx; equal chunks' counts too."""

    class Counts(SparseNet):
        def validation_step(self, batch, batch_idx):
            y = batch["labels"]
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            self.log_dict({"correct": (self(x).argmax(1) == y).sum(), "n": len(y)})

    for samples in (7, 6):  # chunks of 3, 2, 2 and of 2, 2, 2
        batch = collate_dict(random_samples(samples, seed=8))
        metrics = []
        for strategy, n in (("sparse_dp", 3), ("auto", 1)):
            torch.manual_seed(0)
            t = trainer(strategy=strategy, devices=n, precision="64-true", limit_val_batches=None)
            t.validate(Counts(), loader(batch), verbose=False)
            metrics.append({k: float(v) for k, v in t.callback_metrics.items()})
        assert metrics[0] == metrics[1] and metrics[1]["n"] == samples


class _TwoFractions(SparseNet):
    """Two fractions logged as ``.item()``: of the samples with label 0, over all samples and over those not of label 3."""

    def training_step(self, batch, batch_idx):
        y = batch["labels"]
        zero_all, zero_kept = (y == 0).double().mean().item(), (y[y != 3] == 0).double().mean().item()
        self.log("zero_all", zero_all)
        self.log("zero_kept", zero_kept)
        return self.loss(batch)


def test_fractions_logged_as_item_that_are_equal_in_a_chunk_are_not_weighted_by_each_others_count(caplog):
    """A logged ``.item()`` is matched to the mean it came from by its value, for its element count. Where a chunk had no
    sample of label 0, both fractions were 0.0 there and ``zero_all`` took the latest such mean's count,
    ``zero_kept``'s: 0.4 where one device logs 1/3, silently. A value that means of different counts hold is no longer
    matched: the logged value is one device's, or said."""
    import logging
    import warnings

    from tests.support.exact import trainer64

    batch = collate_dict(random_samples(6, seed=13, min_points=10, max_points=10))
    batch["labels"] = torch.tensor([0, 1, 2, 3, 0, 1])  # contiguous chunks of 2: the second has no label 0
    from lightning_sparse_dp import SparseDataParallelStrategy
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "zero_all" in m})
    ours, reference = same_start(_TwoFractions, seed=0)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer64(strategy=SparseDataParallelStrategy(split="contiguous", check_exactness=False), devices=3,
                      max_steps=1)
        t.fit(ours, loader(batch))
    r = trainer64(max_steps=1)
    r.fit(reference, loader(batch))
    said = [str(w.message) for w in caught] + [rec.getMessage() for rec in caplog.records]
    exact = float(t.callback_metrics["zero_all"]) == pytest.approx(float(r.callback_metrics["zero_all"]), rel=1e-10)
    assert exact or any("self.log('zero_all'" in m for m in said), (float(t.callback_metrics["zero_all"]), said)


class _CountsZeros(SparseNet):
    """Logs, with log_dict, the count of the batch's samples of label 0, and a per-sample value weighted by that count
    (``batch_size=`` the chunk's count of label 0), as epoch values."""

    def training_step(self, batch, batch_idx):
        zeros = batch["labels"] == 0
        self.log_dict({"zeros": zeros.sum()}, on_step=False, on_epoch=True, batch_size=len(zeros))
        self.log("zero_feature", batch["features"][:, 0].mean(), on_step=False, on_epoch=True,
                 batch_size=int(zeros.sum()))
        return self.loss(batch)


def test_counts_equal_in_every_replica_by_chance_are_read_as_earlier_steps_showed_them():
    """A count logged with log_dict (which passes reduce_fx="mean") that is the same in every replica (one sample of
    label 0 in each chunk) was taken as one value: 1 where one device counts 3 (the epoch value 2.5 for 3.6), though
    an earlier step, whose replicas counted differently, had summed it; a batch_size= of each chunk's count equal in
    every replica was taken as one constant (1.7e-4 off in an epoch mean), silently. A name an earlier step showed to
    be each chunk's count is summed at later steps too."""
    from lightning_sparse_dp import SparseDataParallelStrategy
    from tests.support.exact import trainer64

    first = collate_dict(random_samples(6, seed=40, min_points=10, max_points=10))
    first["labels"] = torch.tensor([0, 0, 0, 1, 1, 0])  # contiguous chunks of 2: 2, 1 and 1 of label 0
    second = collate_dict(random_samples(6, seed=41, min_points=10, max_points=10))
    second["labels"] = torch.tensor([0, 1, 0, 1, 0, 1])  # one in every chunk
    ours, reference = same_start(_CountsZeros, seed=0)
    t = trainer64(strategy=SparseDataParallelStrategy(split="contiguous", check_exactness=False), devices=3,
                  max_steps=2)
    t.fit(ours, loader(first, second))
    r = trainer64(max_steps=2)
    r.fit(reference, loader(first, second))
    for name in ("zero_feature", "zeros"):
        assert float(t.callback_metrics[name]) == pytest.approx(float(r.callback_metrics[name]), rel=1e-10), name


class _PerClassValues(SparseNet):
    """Per-class metric values logged one class at a time, as users log them: a ``ClasswiseWrapper``'s ``forward``
    through a ``MetricCollection``'s ``log_dict`` (its entries are views of the inner metric's value), a per-class
    ``forward`` value indexed (``recall[c]``), and a per-class ``compute()`` value indexed, in training and in
    validation, on the step and over the epoch."""

    def __init__(self):
        super().__init__(batch_norm=True)
        from torchmetrics.classification import MulticlassAccuracy, MulticlassRecall
        from torchmetrics.wrappers import ClasswiseWrapper

        c = NUM_CLASSES
        self.train_metrics = torchmetrics.MetricCollection({
            "acc": MulticlassAccuracy(c, average="micro"),
            "per_class": ClasswiseWrapper(MulticlassRecall(c, average=None), prefix="recall_"),
        }, prefix="train_").set_dtype(torch.float64)
        self.recall = MulticlassRecall(c, average=None).set_dtype(torch.float64)
        self.seen = MulticlassRecall(c, average=None).set_dtype(torch.float64)
        self.val_per_class = ClasswiseWrapper(MulticlassAccuracy(c, average=None), prefix="val_acc_").set_dtype(torch.float64)

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits, y = self(x), batch["labels"]
        n = len(y)
        self.log_dict(self.train_metrics(logits, y), on_step=True, on_epoch=True, batch_size=n)
        recall = self.recall(logits, y)
        for c in range(NUM_CLASSES):
            self.log(f"recall{c}", recall[c], on_step=True, on_epoch=True, batch_size=n)
        self.seen.update(logits, y)
        self.log("seen_recall1", self.seen.compute()[1], on_step=True, on_epoch=False, batch_size=n)
        return torch.nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.log_dict(self.val_per_class(self(x), batch["labels"]), batch_size=len(batch["labels"]))


def test_per_class_metric_values_logged_one_class_at_a_time_are_one_devices():
    """A per-class metric value's entries (a ``ClasswiseWrapper``'s, ``recall[c]``, ``compute()[c]``) were the replicas'
    chunk values averaged: 0.14-0.71 relative off one device's on every step and epoch, said by the exactness check at
    the first step only (and ``compute()[c]`` not at all there); they are the root metric's whole-batch values."""
    _assert_logged_as_on_one_device(_PerClassValues, {"train_recall_3", "recall3", "seen_recall1", "val_acc_3"})


class _ReducedPerClass(SparseNet):
    """Numbers users compute from a per-class metric value and log: its mean, sum, max, min, nanmean, ``100 *`` its
    mean, its mean over a fixed selection of classes, of a ``forward`` value and of a ``compute()`` value, in training
    and validation; with ``chunk_mask`` also a mean over the classes the chunk's labels hold (not one device's)."""

    def __init__(self, chunk_mask: bool = False):
        super().__init__(batch_norm=True)
        from torchmetrics.classification import MulticlassJaccardIndex, MulticlassRecall

        c = NUM_CLASSES
        self.recall = MulticlassRecall(c, average=None).set_dtype(torch.float64)
        self.iou = MulticlassJaccardIndex(c, average=None).set_dtype(torch.float64)
        self.seen = MulticlassRecall(c, average=None).set_dtype(torch.float64)
        self.val_iou = MulticlassJaccardIndex(c, average=None).set_dtype(torch.float64)
        self.chunk_mask = chunk_mask

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits, y = self(x), batch["labels"]
        recall, iou = self.recall(logits, y), self.iou(logits, y)
        kept = torch.tensor([True, False, True, True], device=self.device)
        self.log_dict({"macro_recall": recall.mean(), "iou_sum": iou.sum(), "max_recall": recall.max(),
                       "min_iou": iou.min(), "nan_recall": recall.nanmean(), "percent": 100 * recall.mean(),
                       "kept_iou": iou[kept].mean()}, on_step=True, on_epoch=True, batch_size=len(y))
        self.seen.update(logits, y)
        self.log("seen_macro", self.seen.compute().mean(), on_step=True, on_epoch=False, batch_size=len(y))
        if self.chunk_mask:
            present = torch.bincount(y, minlength=NUM_CLASSES) > 0
            self.log("present_recall", recall[present].mean(), on_step=True, on_epoch=False, batch_size=len(y))
        return torch.nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.log("val_miou", self.val_iou(self(x), batch["labels"]).mean(), batch_size=len(batch["labels"]))


def _fit_logged(module, samples, **kwargs):
    from tests.support.ddp_helpers import Capture

    logger = Capture()
    t = trainer(precision="64-true", max_steps=-1, max_epochs=2, limit_val_batches=1.0, logger=logger,
                log_every_n_steps=1, **kwargs)
    t.fit(module, sample_loader(samples), sample_loader(samples[:12]))
    return logger.history, {k: float(v) for k, v in t.callback_metrics.items()}


def _assert_logged_as_on_one_device(cls, names):
    """``cls`` fit on 3 replicas (sync BN) and on one device from the same start (:func:`_fit_logged`): every logged
    step value, every callback metric (``names`` among them) and the module's state within 1e-10."""
    modules = same_start(cls)
    (ours, ours_metrics), (reference, reference_metrics) = (
        _fit_logged(module, random_samples(26, seed=70), **kwargs)
        for module, kwargs in zip(modules, ({"strategy": "sparse_dp", "devices": 3, "sync_batchnorm": True}, {})))
    assert names <= reference_metrics.keys()
    assert ours_metrics.keys() == reference_metrics.keys()
    for name, value in reference_metrics.items():
        assert ours_metrics[name] == pytest.approx(value, rel=1e-10, abs=1e-12), name
    assert [step for step, _ in ours] == [step for step, _ in reference]
    for (step, logged), (_, logged_ref) in zip(ours, reference):
        assert logged.keys() == logged_ref.keys(), step
        for name, value in logged_ref.items():
            assert logged[name] == pytest.approx(value, rel=1e-10, abs=1e-12), (step, name)
    assert_same_states(*modules)


def test_mean_sum_max_of_per_class_metric_values_are_one_devices():
    """A per-class metric value reduced in the step (``self.recall(logits, y).mean()``, ``.sum()``, ``.max()``,
    ``.min()``, ``.nanmean()``, ``100 * ....mean()``, ``[fixed mask].mean()``, ``compute().mean()``) was logged as the
    replicas' chunk values averaged: 0.33-0.67 relative off one device's on every step, said by the exactness check at
    the first step only; it is that reduction of the root metric's whole-batch value."""
    _assert_logged_as_on_one_device(
        _ReducedPerClass, {"macro_recall_step", "iou_sum_epoch", "kept_iou_step", "seen_macro", "val_miou"})


def test_a_per_class_metric_value_reduced_over_the_chunks_classes_is_said():
    """``recall[present].mean()`` with ``present`` the classes of the chunk's labels: one device's mask is the whole
    batch's, which no replica's is, so the value is not recomputed from the root metric's; it is said (naming the
    metric and the fix), not logged silently as the replicas' values averaged."""
    import warnings

    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "present_recall" in m})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_logged(_ReducedPerClass(chunk_mask=True), random_samples(26, seed=70), strategy="sparse_dp", devices=3)
    said = [str(w.message) for w in caught if str(w.message).startswith("sparse_dp: self.log('present_recall'")]
    assert len(said) == 1, said
    assert "self.recall" in said[0] and "self.recall.compute()" in said[0] and "differ between" in said[0], said[0]
    print(said[0])
