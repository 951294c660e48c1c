"""Exact data parallelism: torchmetrics metrics beyond their merged states (lightning_sparse_dp/replica/metric_updates.py,
metric_merge.py): aggregation metrics updated with one number per step, a wrapper whose states are its inner metric's,
attributes a metric's compute() sets in the step; against one device with the whole batch, float64.
"""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import pytest
import torch
import torchmetrics

import lightning_sparse_dp
from tests.support.exact import REL, same_start
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


class _Aggregators(SparseNet):
    """lightning-hydra-template's pattern: aggregation metrics updated with one number of the step each (its loss, a
    mean accuracy, a count), in training and validation, logged per epoch; and one with a value no rule tells (a
    maximum of the logits), which keeps the replicas' merged updates and is said."""

    def __init__(self):
        super().__init__()
        self.train_loss, self.val_loss = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
        self.val_worst, self.val_losses = torchmetrics.MaxMetric(), torchmetrics.CatMetric()
        self.val_acc, self.val_hits = torchmetrics.MeanMetric(), torchmetrics.SumMetric()
        self.val_top = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        hits = logits.argmax(1) == batch["labels"]
        self.val_loss(loss)
        self.val_worst.update(loss)
        self.val_losses.update(loss)
        self.val_acc.update(hits.double().mean())
        self.val_hits.update(hits.sum())
        self.val_top.update(logits.max())
        for name in ("val_loss", "val_worst", "val_acc", "val_hits", "val_top"):
            self.log(f"val/{name}", getattr(self, name), on_step=False, on_epoch=True)

    def on_validation_epoch_end(self):
        self.cat_losses = self.val_losses.compute().clone()


def test_aggregation_metrics_updated_with_a_number_per_step_are_one_devices():
    """One device updates them once per step with the whole batch's number; the replicas each with their chunk's (the
    merge gave the unweighted mean of the chunks' losses, a max over chunk losses, three list entries a step, silently,
    as DDP's ranks give). Each update is now the whole batch's: the loss by the step's loss weights, a mean by its
    element counts, a count summed; a number no rule tells keeps the merge, said once."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE  # said once per process: again for this test

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "'val_top'" in m})
    batches = [collate_dict(random_samples(9, seed=s)) for s in (81, 82)]
    ours, reference = same_start(_Aggregators)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(strategy="sparse_dp", devices=3, max_epochs=1, max_steps=-1, limit_val_batches=None)
        t.fit(ours, loader(*batches), loader(*batches))
    r = trainer(devices=1, max_epochs=1, max_steps=-1, limit_val_batches=None)
    r.fit(reference, loader(*batches), loader(*batches))
    said = " ".join(str(w.message) for w in caught)
    for name in ("train/loss_epoch", "val/val_loss", "val/val_worst", "val/val_acc", "val/val_hits"):
        assert float(t.callback_metrics[name]) == pytest.approx(float(r.callback_metrics[name]), rel=REL), name
    assert torch.allclose(ours.cat_losses, reference.cat_losses, rtol=REL, atol=0)
    assert "'val_top' (MeanMetric) was updated with one value per replica" in said
    assert not any(f"'{n}'" in said for n in ("train_loss", "val_loss", "val_worst", "val_losses", "val_acc", "val_hits"))


class _PerClass(SparseNet):
    """Per-class counts (a ClasswiseWrapper, whose states are its inner metric's) updated in validation."""

    def __init__(self):
        super().__init__()
        self.support = torchmetrics.wrappers.ClasswiseWrapper(
            torchmetrics.classification.MulticlassStatScores(NUM_CLASSES, average=None)
        )

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.support.update(self(x), batch["labels"])


def test_a_wrapper_whose_states_are_its_inner_metrics_is_merged_once():
    """ClasswiseWrapper proxies its inner metric's states: merged at the inner level and again at the wrapper's, its
    counts were twice one device's (per-class support 2x, silently in validation; a ratio hid it)."""
    batches = [collate_dict(random_samples(9, seed=s)) for s in (83, 84)]
    ours, reference = same_start(_PerClass)
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3}), (reference, {})):
        t = trainer(max_epochs=1, max_steps=-1, limit_val_batches=None, **kwargs)
        t.validate(model, loader(*batches))
    for state in ("tp", "fp", "tn", "fn"):
        assert torch.equal(getattr(ours.support.metric, state), getattr(reference.support.metric, state)), state
    assert int(reference.support.metric.tp.sum() + reference.support.metric.fn.sum()) == 18  # every sample once


class _MinMaxInStep(SparseNet):
    """MinMaxMetric's compute() in the step: its min_val / max_val are attributes, not states, set on the copies."""

    def __init__(self):
        super().__init__()
        self.bounds = torchmetrics.wrappers.MinMaxMetric(torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES))

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.bounds.update(self(x), batch["labels"])
        self.log("val_max", self.bounds.compute()["max"])


def test_what_a_metric_sets_outside_its_states_in_the_step_is_said():
    """min_val / max_val set by compute() on the replicas' copies never reached the module's metric, silently."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE  # said once per process: again for this test

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "bounds" in m})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(
            _MinMaxInStep(), loader(*[collate_dict(random_samples(9, seed=s)) for s in (85, 86)])
        )
    said = [str(w.message) for w in caught if "'bounds' (MinMaxMetric) set max_val, min_val in the step" in str(w.message)]
    assert len(said) == 1


class _Extremes(SparseNet):
    """Aggregation metrics fed a count (a Python int), a maximum over the chunk (an integer and a float) and a sum."""

    def __init__(self):
        super().__init__()
        self.seen, self.top_label = torchmetrics.SumMetric(), torchmetrics.MaxMetric()
        self.top_logit, self.hits = torchmetrics.MaxMetric(), torchmetrics.SumMetric()
        self.rows = torchmetrics.SumMetric()  # a float sum of the chunk that is one value in every chunk (3 samples)

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits, labels = self(x), batch["labels"]
        self.seen.update(len(labels))
        self.top_label.update(labels.max())
        self.top_logit.update(logits.max())
        self.hits.update((logits.argmax(1) == labels).double().sum())
        self.rows.update((labels >= 0).double().sum())


def test_counts_maxima_and_sums_fed_to_aggregation_metrics_stay_one_devices_and_unsaid():
    """A Python int count equal in every chunk (chunks of 3 samples) is still summed, an integer or float maximum over
    the chunk and a sum over it merged as before: one device's, nothing said."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "updated with one value per replica" in m})
    batches = [collate_dict(random_samples(9, seed=s)) for s in (87, 88)]
    ours, reference = same_start(_Extremes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy=lightning_sparse_dp.SparseDataParallelStrategy(split="contiguous"), devices=3,
                limit_val_batches=None).validate(ours, loader(*batches))
    trainer(limit_val_batches=None).validate(reference, loader(*batches))
    for name in ("seen", "top_label", "top_logit", "hits", "rows"):
        assert float(getattr(ours, name).compute()) == pytest.approx(float(getattr(reference, name).compute()), rel=REL)
    assert not any("updated with one value per replica" in str(w.message) for w in caught)
    assert float(reference.seen.compute()) == float(reference.rows.compute()) == 18


class _WrappedMean(SparseNet):
    """MeanMetric of the loss inside MinMaxMetric, updated (``update``) or called (``forward``, which resets the inner
    metric and updates it again) in the training step, and an accuracy updated once a step."""

    def __init__(self, call: str):
        super().__init__()
        self.call, self.acc = call, torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.bounded = torchmetrics.wrappers.MinMaxMetric(torchmetrics.MeanMetric())

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        self.acc.update(logits, batch["labels"])
        getattr(self.bounded, self.call)(loss.detach())
        return loss


@pytest.mark.parametrize("call", ["update", "forward"])
def test_a_wrapped_aggregator_and_update_counts_are_one_devices(call):
    """The inner MeanMetric of a wrapper got each replica's chunk loss (its state 3x one device's weight, 2.0 off,
    silently with the check off); and every metric's update count was the replicas' sum, 3x one device's."""
    batches = [collate_dict(random_samples(9, seed=s)) for s in (89, 90)]
    ours, reference = same_start(_WrappedMean, call)
    trainer(strategy=lightning_sparse_dp.SparseDataParallelStrategy(check_exactness=False), devices=3,
            max_steps=2).fit(ours, loader(*batches))
    trainer(max_steps=2).fit(reference, loader(*batches))
    inner, expected = ours.bounded._base_metric, reference.bounded._base_metric
    for state in ("mean_value", "weight"):
        assert torch.allclose(getattr(inner, state), getattr(expected, state), rtol=REL, atol=0), state
    assert (ours.acc._update_count, inner._update_count) == (reference.acc._update_count, expected._update_count)
    assert reference.acc._update_count == 2


class _ResetInStep(SparseNet):
    """An accuracy of each batch alone: reset, updated and computed in the step (its state left for the epoch's end)."""

    def __init__(self):
        super().__init__()
        self.acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.acc.reset()
        self.acc.update(logits, batch["labels"])
        self.log("batch_acc", self.acc.compute())
        return torch.nn.functional.cross_entropy(logits, batch["labels"])


def test_a_metric_reset_in_the_step_is_reset_on_the_module_too():
    """The replicas' copies start every step empty, so their reset did nothing, and the module's metric kept every
    earlier step's state: its logged value and state 9e-2 off one device's, silently (the check runs at step 0 only)."""
    batches = [collate_dict(random_samples(9, seed=s)) for s in (91, 92, 93)]
    ours, reference = same_start(_ResetInStep)
    t = trainer(strategy="sparse_dp", devices=3, max_steps=3)
    t.fit(ours, loader(*batches))
    r = trainer(max_steps=3)
    r.fit(reference, loader(*batches))
    assert float(t.callback_metrics["batch_acc"]) == pytest.approx(float(r.callback_metrics["batch_acc"]), rel=REL)
    for state in ("tp", "fp", "tn", "fn"):
        assert torch.equal(getattr(ours.acc, state), getattr(reference.acc, state)), state
    assert int(reference.acc.tp.sum() + reference.acc.fn.sum()) == 9  # the last batch's samples alone


class _RowsOfOneSample(SparseNet):
    """Aggregation metrics updated with per-sample rows: with one sample per replica each is a ``[1]`` tensor."""

    def __init__(self):
        super().__init__()
        self.hits, self.labels, self.count = torchmetrics.MeanMetric(), torchmetrics.CatMetric(), torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        hits = self(x).argmax(1) == batch["labels"]
        self.hits.update(hits.double())
        self.labels.update(batch["labels"])
        self.count.update(hits.double().sum())


def test_per_sample_rows_of_one_sample_chunks_update_metrics_as_one_devices():
    """A chunk of one sample makes its per-sample rows [1] tensors, which were taken for one number of the chunk:
    equal ones became one update (a mean over 7 samples where one device's is over 9), integers were summed, a sum of
    the chunk's hits was averaged (0.33 where one device counts 1), silently."""
    batches = [collate_dict(random_samples(n, seed=s)) for n, s in ((6, 94), (3, 95))]
    ours, reference = same_start(_RowsOfOneSample)
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3}), (reference, {})):
        trainer(limit_val_batches=None, **kwargs).validate(model, loader(*batches))
    for name in ("hits", "labels", "count"):
        assert torch.allclose(getattr(ours, name).compute().double(), getattr(reference, name).compute().double(),
                              rtol=REL, atol=0), name
    assert int(reference.hits.weight) == 9


class _Retrieval(SparseNet):
    """A retrieval metric with one query per sample: its points' scores, ``indexes=`` each point's sample id."""

    def __init__(self, whole_batch_ids: bool):
        super().__init__()
        self.mrr, self.whole_batch_ids = torchmetrics.retrieval.RetrievalMRR(), whole_batch_ids

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "point_sample_ids": batch["coordinates"][:, 0].long().clone()}

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        scores = self.net[0](x).F[:, 0]
        ids = batch["point_sample_ids"] if self.whole_batch_ids else x.C[:, 0].long()
        self.mrr.update(scores, batch["features"][:, 0] > 0, indexes=ids)
        self.log("mrr", self.mrr)


@pytest.mark.parametrize("whole_batch_ids", [False, True], ids=["chunk-column", "whole-batch-ids"])
def test_a_metric_updated_with_the_chunks_batch_column_is_said(whole_batch_ids):
    """x.C[:, 0] as a retrieval metric's indexes= numbers each chunk's samples from 0: queries of different chunks
    were grouped as one (0.24 off one device), silently. It is said; ids of the whole batch put in the batch before
    the split are exact and not said."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "updated with the chunk's batch column" in m})
    batch = collate_dict(random_samples(7, seed=23))
    values = []
    for strategy, devices in (("sparse_dp", 3), ("auto", 1)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = trainer(strategy=strategy, devices=devices, limit_val_batches=None)
            torch.manual_seed(0)
            t.validate(_Retrieval(whole_batch_ids), loader(batch), verbose=False)
        values.append(float(t.callback_metrics["mrr"]))
        said = [w for w in caught if "updated with the chunk's batch column" in str(w.message)]
        assert bool(said) == (strategy == "sparse_dp" and not whole_batch_ids)
    if whole_batch_ids:
        assert values[0] == pytest.approx(values[1], rel=REL)
