"""Exact data parallelism: torchmetrics metrics updated, called and logged in the step, merged as one device's.

The metrics' values and the trained states are compared with one device's in float64 (tests/support/exact.py), the
module trained there by plain Lightning on the whole batch.
"""

from __future__ import annotations

import MinkowskiEngine as ME
import pytest
import torch
import torchmetrics
from torch import nn

from tests.support.exact import REL, same_start
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


def _fit_pair(cls, seeds, samples: int = 9, **sample_kwargs):
    """``cls`` trained from the same start with sparse_dp on 3 CPU replicas and with plain Lightning on one device,
    one batch of ``samples`` per seed (``random_samples(samples, seed, **sample_kwargs)``): ``(ours, its trainer,
    reference, its trainer)``."""
    batches = [collate_dict(random_samples(samples, seed=s, **sample_kwargs)) for s in seeds]
    ours, reference = same_start(cls)
    t = trainer(strategy="sparse_dp", devices=3, logger=False, max_steps=len(batches))
    t.fit(ours, loader(*batches))
    r = trainer(devices=1, logger=False, max_steps=len(batches))
    r.fit(reference, loader(*batches))
    return ours, t, reference, r



class _WithMetrics(SparseNet):
    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="macro")
        self.val_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.train_acc(logits, batch["labels"])  # forward: update + batch value
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):  # Lightning resets logged metrics at epoch end
        self.after_step = {s: getattr(self.train_acc, s).clone() for s in ("tp", "fp", "tn", "fn")}

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.val_acc.update(logits, batch["labels"])
        self.val_mean.update(logits.max(1).values)
        self.log("val_acc", self.val_acc, on_epoch=True)


def test_metric_state_after_a_step_equals_one_update_with_the_whole_batch():
    batch = collate_dict(random_samples(7, seed=27))
    ours, reference = same_start(_WithMetrics)
    t = trainer(strategy="sparse_dp", devices=3, logger=False)
    with torch.no_grad():
        whole = reference(ME.SparseTensor(batch["features"], batch["coordinates"]))
    t.fit(ours, loader(batch))
    expected = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
    expected.update(whole, batch["labels"])
    for state in ("tp", "fp", "tn", "fn"):
        assert torch.equal(ours.after_step[state], getattr(expected, state)), state
    assert t.callback_metrics["train_acc"].item() == pytest.approx(expected.compute().item(), rel=REL)


class _ForwardMetrics(SparseNet):
    """Metrics called as Lightning's docs call them (``forward``: the batch value), logged on every step."""

    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.train_sum = torchmetrics.SumMetric()  # of whole numbers below: exact in its float32 state in any order
        self.batch_values: list[tuple[float, float]] = []
        self.states: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.train_acc(logits, batch["labels"])
        self.train_sum((logits.argmax(1) + batch["labels"] + 1).float())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        self.log("train_sum", self.train_sum, on_step=True, on_epoch=False)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):  # the root's batch values and states after each step
        self.batch_values.append((self.train_acc._forward_cache.item(), self.train_sum._forward_cache.item()))
        acc = self.train_acc
        self.states.append([t.clone() for t in (acc.tp, acc.fp, acc.tn, acc.fn, self.train_sum.sum_value)])


def test_forward_metric_values_of_every_step_equal_single_device():
    """The replicas' forward values are merged in an empty metric kept for the run (emptied every step): each
    step's batch value is the whole batch's."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (41, 42, 43)]
    ours, reference = same_start(_ForwardMetrics)
    trainer(strategy="sparse_dp", devices=3, logger=False, max_steps=3).fit(ours, loader(*batches))
    trainer(strategy="auto", devices=1, logger=False, max_steps=3).fit(reference, loader(*batches))
    assert len(ours.batch_values) == len(reference.batch_values) == 3
    for (acc, total), (acc_ref, total_ref) in zip(ours.batch_values, reference.batch_values):
        assert acc == pytest.approx(acc_ref, rel=REL) and total == pytest.approx(total_ref, rel=REL)
    # the states the root accumulates over the steps (each step's batch states added to them, as forward does)
    assert len(ours.states) == len(reference.states) == 3 and reference.states[-1][-1] > reference.states[0][-1]
    for step, step_ref in zip(ours.states, reference.states):
        assert all(torch.equal(a, b) for a, b in zip(step, step_ref))


class _LoggedForwardValues(SparseNet):
    """The value a metric's forward returns, logged as a tensor (torchmetrics' Lightning page: ``self.log(name,
    self.metric(preds, y))``), of metrics whose chunk values do not average to the batch's (macro averages), alone and
    in a MetricCollection's ``log_dict``."""

    def __init__(self):
        super().__init__()
        c = NUM_CLASSES
        self.train_precision = torchmetrics.classification.MulticlassPrecision(c, average="macro").set_dtype(torch.float64)
        self.collection = torchmetrics.MetricCollection({
            "recall": torchmetrics.classification.MulticlassRecall(c, average="macro"),
            "f1": torchmetrics.classification.MulticlassF1Score(c, average="macro"),
        }).set_dtype(torch.float64)
        self.logged: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.log("precision_step", self.train_precision(logits, batch["labels"]), on_step=True, on_epoch=False)
        self.log_dict(self.collection(logits, batch["labels"]), on_step=True, on_epoch=False)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        metrics = self.trainer.callback_metrics
        self.logged.append({k: metrics[k].item() for k in ("precision_step", "recall", "f1")})


def test_a_logged_metric_forward_value_is_the_whole_batch_value():
    ours, _, reference, _ = _fit_pair(_LoggedForwardValues, (63, 64, 65))
    assert len(ours.logged) == len(reference.logged) == 3
    for step, step_ref in zip(ours.logged, reference.logged):
        for key, value in step_ref.items():
            assert step[key] == pytest.approx(value, rel=REL), key


class _PerSampleEntries(torchmetrics.Metric):
    """A list state with one entry per sample (as ``MeanAveragePrecision`` keeps per-image boxes)."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("entries", [], dist_reduce_fx="cat")

    def update(self, features, batch_index, num_samples):
        self.entries.extend(features[batch_index == i, 0] for i in range(num_samples))

    def compute(self):
        return torch.cat(self.entries)


class _ConcatenatedStates(SparseNet):
    """Metrics whose states are lists the merge concatenates: per-sample rows, per-point rows, per-sample entries."""

    def __init__(self):
        super().__init__()
        self.sample_values = torchmetrics.CatMetric()
        self.point_values = torchmetrics.CatMetric()
        self.per_sample = _PerSampleEntries()

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        batch_index = batch["coordinates"][:, 0].long()
        features = batch["features"]
        sums = torch.zeros(len(batch["labels"]), dtype=features.dtype).index_add_(0, batch_index, features[:, 0])
        self.sample_values.update(batch["labels"] * 1000 + sums)  # per-sample rows, in sample order on one device
        self.point_values.update(batch["features"][:, 1])  # per-point rows
        self.per_sample.update(batch["features"], batch_index, len(batch["labels"]))
        return nn.functional.cross_entropy(logits, batch["labels"])


@pytest.mark.parametrize("points", [None, 3], ids=["any-points", "as-many-points-as-samples-per-chunk"])
def test_concatenated_metric_states_keep_one_devices_order(points):
    # 3 points per sample and 3 samples per chunk: each per-sample entry has as many rows as its chunk has samples,
    # which must not make the entries of one chunk look like rows of one update
    sizes = {} if points is None else {"min_points": points, "max_points": points}
    ours, _, reference, _ = _fit_pair(_ConcatenatedStates, (66, 67), **sizes)
    for name, state in (("sample_values", "value"), ("point_values", "value"), ("per_sample", "entries")):
        a, b = getattr(getattr(ours, name), state), getattr(getattr(reference, name), state)
        assert len(a) == len(b) == {"per_sample": 18}.get(name, 2), name  # one entry per update, or per sample
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name


class _Total(torchmetrics.Metric):
    """A custom metric that does not set ``full_state_update`` (torchmetrics then refuses ``merge_state``)."""

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, x):
        self.total += x.sum()

    def compute(self):
        return self.total


class _FullStateMetrics(SparseNet):
    """Metrics torchmetrics' ``merge_state`` refuses, updated in the step: ``MaxMetric`` (``full_state_update=True``)
    and a custom one without the flag."""

    def __init__(self):
        super().__init__()
        self.largest = torchmetrics.MaxMetric().set_dtype(torch.float64)
        self.total = _Total()

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.largest.update(logits.detach().amax(1))
        self.total.update(batch["features"][:, 0].double())
        self.log("largest", self.largest, on_step=False, on_epoch=True)
        self.log("total", self.total, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(logits, batch["labels"])


def test_metrics_merge_state_refuses_are_merged_by_their_reductions_as_one_device():
    _, t, _, r = _fit_pair(_FullStateMetrics, (68, 69))
    for key in ("largest", "total"):
        assert t.callback_metrics[key].item() == pytest.approx(r.callback_metrics[key].item(), rel=REL), key


class _LoggedComputedValues(SparseNet):
    """``compute()`` of a metric after the step's update, logged as a tensor: one device's reads the epoch so far."""

    def __init__(self):
        super().__init__()
        self.train_recall = torchmetrics.classification.MulticlassRecall(NUM_CLASSES, average="macro").set_dtype(
            torch.float64
        )
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.train_recall.update(logits, batch["labels"])
        self.log("recall_so_far", self.train_recall.compute(), on_step=True, on_epoch=False)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.logged.append(self.trainer.callback_metrics["recall_so_far"].item())


def test_a_logged_metric_compute_value_is_one_devices():
    ours, _, reference, _ = _fit_pair(_LoggedComputedValues, (76, 77, 78))
    assert len(ours.logged) == len(reference.logged) == 3
    assert ours.logged == pytest.approx(reference.logged, rel=REL)


class _WithPSNR(SparseNet):
    """A metric with a state reduced by a mean (``data_range``), updated in the step and logged for the epoch."""

    def __init__(self):
        super().__init__()
        from torchmetrics.image import PeakSignalNoiseRatio

        self.train_psnr = PeakSignalNoiseRatio(data_range=1.0).set_dtype(torch.float64)  # its states' sums, exact
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.train_psnr(logits.softmax(1), nn.functional.one_hot(batch["labels"], NUM_CLASSES).to(logits.dtype))
        self.log("train_psnr", self.train_psnr, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(self.train_psnr.data_range.item())


def test_a_metric_state_reduced_by_a_mean_equals_single_device():
    ours, t, reference, t_ref = _fit_pair(_WithPSNR, (61, 62), samples=7)
    assert ours.seen == reference.seen == [1.0, 1.0]
    for key in ("train_psnr_step", "train_psnr_epoch"):
        assert t.callback_metrics[key].item() == pytest.approx(t_ref.callback_metrics[key].item(), rel=REL), key


class _WrappedMetrics(SparseNet):
    """torchmetrics wrappers, whose states live in the metrics inside them (MinMaxMetric counts only its inner
    metric's updates)."""

    def __init__(self):
        super().__init__()
        from torchmetrics.wrappers import ClasswiseWrapper, MinMaxMetric

        c = NUM_CLASSES
        self.per_class = ClasswiseWrapper(torchmetrics.classification.MulticlassAccuracy(c, average=None))
        self.min_max = MinMaxMetric(torchmetrics.classification.MulticlassAccuracy(c, average="micro"))

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.per_class.update(logits, batch["labels"])
        self.min_max.update(logits, batch["labels"])
        return nn.functional.cross_entropy(logits, batch["labels"])


def test_wrapped_metrics_merge_level_by_level_as_one_device():
    ours, _, reference, _ = _fit_pair(_WrappedMetrics, (73, 74, 75))
    for name in ("per_class", "min_max"):
        a, b = getattr(ours, name).compute(), getattr(reference, name).compute()
        assert a.keys() == b.keys(), name
        for key in a:
            assert a[key].item() == pytest.approx(b[key].item(), rel=REL), (name, key)


def test_epoch_level_metric_compute_equals_single_device():
    batches = [collate_dict(random_samples(7, seed=28)), collate_dict(random_samples(5, seed=29))]
    ours, reference = same_start(_WithMetrics)
    t = trainer(strategy="sparse_dp", devices=3, limit_val_batches=1.0)
    t.validate(ours, loader(*batches), verbose=False)
    r = trainer(devices=1, limit_val_batches=1.0)
    r.validate(reference, loader(*batches), verbose=False)
    assert t.callback_metrics["val_acc"].item() == pytest.approx(r.callback_metrics["val_acc"].item(), rel=REL)
    # torchmetrics keeps metric states float32 under "64-true" (Metric._apply leaves dtypes alone): float32 sums
    assert ours.val_mean.compute().item() == pytest.approx(reference.val_mean.compute().item(), rel=1e-6)
