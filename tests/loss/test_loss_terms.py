"""loss_weighting="terms" (the default): the losses users write, exact on 2 and 3 replicas.

Every test fits the same module on one device with the whole batch (plain Lightning) as the
reference, in float64, and compares every parameter and buffer at 1e-10 relative per tensor, and the
logged values. Chunks are given 0 %, 5-40 % and 100 % ignored labels by the split the strategy makes.
"""

from __future__ import annotations

import logging

import MinkowskiEngine as ME
import pytest
import torch

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from tests.support.clients import fresh_loader
from tests.support.exact import REL, relative_difference, state_differences
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import NUM_CLASSES, unchecked
from tests.support.term_models import (
    MODE_DEPTHS,
    BatchClassWeights,
    ChunkClassWeights,
    ChunkStatistic,
    HandMean,
    HandSum,
    LevelCompletion,
    LoggedOnly,
    MaskedMean,
    MultiHead,
    PerSampleBeside,
    PerSampleLoop,
    ScanNetSeg,
    SmallRemainder,
    SometimesL1,
    SumReduction,
    WithMetrics,
    WithPenalty,
    class_batch,
    seg_batch,
)

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


def _same(cls, *args, **kwargs):
    torch.manual_seed(0)
    a = cls(*args, **kwargs)
    b = cls(*args, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def _fit(model, batches, strategy="auto", devices=1, steps=2, **kwargs):
    t = trainer(strategy=strategy, devices=devices, max_steps=steps, sync_batchnorm=True, **kwargs)
    t.fit(model, fresh_loader(batches))
    return t


def _worst(ours, reference) -> float:
    return max(state_differences(ours, reference).values())


def _compare(cls, batches, devices=3, *args, strategy="sparse_dp", **kwargs):
    ours, reference = _same(cls, *args, **kwargs)
    t = _fit(ours, batches, strategy, devices)
    r = _fit(reference, batches)
    return _worst(ours, reference), t, r


@pytest.mark.parametrize("ignore", [255, -100])
@pytest.mark.parametrize("devices", [2, 3])
def test_ignore_index_with_ignored_chunks_is_exact(ignore, devices):
    fractions = [(0.0, 0.3, 1.0), (0.05, 0.4, 0.0)]
    batches = [seg_batch(7, seed=s, ignore=ignore, fractions=f, chunks=devices) for s, f in zip((1, 2), fractions)]
    worst, t, r = _compare(ScanNetSeg, batches, devices, ignore_index=ignore)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


def test_the_old_default_is_not_exact_with_ignored_labels():  # the comparison above can fail
    batches = [seg_batch(7, seed=1)]
    ours, reference = _same(ScanNetSeg)
    _fit(ours, batches, SparseDataParallelStrategy(loss_weighting="auto"), 3)
    _fit(reference, batches)
    assert _worst(ours, reference) > 1e-3


@pytest.mark.parametrize("kwargs", [
    {"weight": torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64)},
    {"label_smoothing": 0.1},
    {"weight": torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64), "label_smoothing": 0.2},
])
def test_class_weights_and_label_smoothing_are_exact(kwargs):
    worst, t, r = _compare(ScanNetSeg, [seg_batch(7, seed=3, fractions=(0.1, 0.0, 0.35))], 3, **kwargs)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


@pytest.mark.parametrize("devices", [2, 3])
def test_multi_head_sum_over_different_masks_with_a_scheduled_coefficient(devices):
    batches = [seg_batch(8, seed=s, ignore=-100, fractions=(0.2, 0.0, 0.5), chunks=devices) for s in (4, 5)]
    worst, t, r = _compare(MultiHead, batches, devices)
    assert worst <= REL
    for name in ("ce", "l1"):
        assert relative_difference(t.logged_metrics[name], r.logged_metrics[name]) <= REL


@pytest.mark.parametrize("devices", [2, 3])
def test_sum_over_decoder_levels_is_exact(devices):
    batches = [{k: v for k, v in seg_batch(7, seed=s).items() if k != "labels"} for s in (6, 7)]
    worst, t, r = _compare(LevelCompletion, batches, devices)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL
    ours, reference = _same(LevelCompletion)  # the same step weighted per replica is not exact
    _fit(ours, batches, SparseDataParallelStrategy(loss_weighting="samples"), devices)
    _fit(reference, batches)
    assert _worst(ours, reference) > 1e-6


def test_a_dense_batchs_plain_sum_plus_a_constant_is_exact_as_lightnings_own_flow_tests_ask():
    """Lightning's ``DeterministicModel`` (``loops/test_training_loop_flow_scalar.py``): ``l1(x).sum() + batch_idx`` on a
    dense batch of 3 rows: the step's loss is one device's (171 there), on 2 replicas."""
    import lightning as L

    class Deterministic(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(2, 3, bias=False)
            self.l1.weight = torch.nn.Parameter(torch.tensor([[4.0, 3, 5], [10, 11, 13]]).T.contiguous())
            self.losses = []

        def training_step(self, batch, batch_idx):
            return self.l1(batch).sum() + batch_idx

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.tensor([[0.5, 2.0], [1.0, 1.0], [2.0, 0.25]], dtype=torch.float64)
    models = []
    for kwargs in ({"strategy": "sparse_dp", "devices": 2}, {"devices": 1}):
        torch.manual_seed(0)
        m = Deterministic()
        trainer(max_steps=2, **kwargs).fit(m, torch.utils.data.DataLoader([data, data], batch_size=None))
        models.append(m)
    ours, plain = models
    assert ours.losses == pytest.approx(plain.losses, rel=REL) and len(plain.losses) == 2
    assert relative_difference(ours.l1.weight, plain.l1.weight) <= REL


def test_a_hand_written_masked_mean_falls_back_and_says_so_once(caplog):
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.1)) for s in (1, 2)]
    with caplog.at_level(logging.INFO):
        worst, _, _ = _compare(MaskedMean, batches, 3)
    lines = [r.getMessage() for r in caplog.records if "loss_weighting='terms' cannot" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "hand-written masked mean" in lines[0] and "divided torch.sum at" in lines[0], lines[0]
    assert "loss_weighting=lambda chunk" in lines[0] and "'auto'" in lines[0]
    assert worst > 1e-3  # weighted per replica by points: not exact, and said


def test_an_explicit_loss_weighting_wins(caplog):
    batches = [seg_batch(7, seed=1)]
    ours, reference = _same(ScanNetSeg)
    valid = lambda chunk: (chunk["labels"] != 255).sum()  # noqa: E731
    with caplog.at_level(logging.INFO):
        _fit(ours, batches, SparseDataParallelStrategy(loss_weighting=valid), 3)
    _fit(reference, batches)
    assert _worst(ours, reference) <= REL
    assert "loss_weighting='terms'" not in caplog.text


def test_validation_logs_of_terms_are_whole_batch_values():
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.25, 1.0)) for s in (8, 9)]
    ours, reference = _same(ScanNetSeg)
    kwargs = dict(max_steps=-1, max_epochs=1, limit_val_batches=2, sync_batchnorm=True)
    t = trainer(strategy="sparse_dp", devices=3, **kwargs)
    t.fit(ours, fresh_loader(batches), fresh_loader(batches))
    r = trainer(devices=1, **kwargs)
    r.fit(reference, fresh_loader(batches), fresh_loader(batches))
    assert relative_difference(t.callback_metrics["val_loss"], r.callback_metrics["val_loss"]) <= REL


def test_a_term_empty_in_the_whole_batch_is_nan_as_on_one_device():
    batch = seg_batch(7, seed=1, fractions=(1.0, 1.0, 1.0))
    ours, reference = _same(ScanNetSeg)
    with pytest.warns(Warning, match="F.cross_entropy has nothing to average over in the whole batch"):
        t = _fit(ours, [batch], "sparse_dp", 3, steps=1)
    r = _fit(reference, [batch], steps=1)
    assert torch.isnan(r.logged_metrics["train_loss"]) and torch.isnan(t.logged_metrics["train_loss"])
    assert _worst(ours, reference) <= REL


def test_a_penalty_on_the_parameters_beside_the_terms_is_exact():
    worst, _, _ = _compare(WithPenalty, [seg_batch(7, seed=s, fractions=(0.0, 0.3, 1.0)) for s in (1, 2)], 3)
    assert worst <= REL


def test_replicas_calling_different_losses_fall_back_and_say_so(caplog):
    batch = seg_batch(7, seed=1, ignore=-100, fractions=(0.0, 0.2, 0.0))
    chunks, _ = split_batch(batch, 3)
    assert len({bool(c["coordinates"][:, 0].max() >= 2) for c in chunks}) == 2  # some chunks call l1_loss, some not
    with caplog.at_level(logging.INFO):
        _fit(_same(SometimesL1)[0], [batch], "sparse_dp", 3, steps=1)
    assert "different sequences of mean-reduced losses" in caplog.text


def test_a_loss_computed_only_to_be_logged_has_its_own_weights_and_no_gradient():
    batches = [seg_batch(7, seed=s, fractions=(0.1, 0.0, 0.3)) for s in (10, 11)]
    worst, t, r = _compare(LoggedOnly, batches, 3)
    assert worst <= REL  # the gradients are the loss's alone
    for name in ("aux", "total"):
        assert relative_difference(t.logged_metrics[name], r.logged_metrics[name]) <= REL, name


def test_metrics_updated_in_the_step_run_outside_the_capture_and_stay_exact():
    """A metric's update and forward in a replica run with no torch function mode (the capture is popped for
    them: nothing a metric computes is a loss term), before and after the step's loss; values stay exact."""
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.1)) for s in (12, 13)]
    MODE_DEPTHS.clear()
    ours, reference = _same(WithMetrics)
    t = _fit(ours, batches, unchecked(), 3)  # counts the metric's calls: the exactness check's runs would add theirs
    assert len(MODE_DEPTHS) == 6 and set(MODE_DEPTHS) == {0}  # 3 replicas, 2 steps; the loss came before each
    r = _fit(reference, batches)
    assert _worst(ours, reference) <= REL
    for name in ("train_loss", "acc", "mean_ce"):
        assert relative_difference(t.logged_metrics[name], r.logged_metrics[name]) <= REL, name


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "loss_weighting='terms' cannot" in r.getMessage()]


def _even(num_samples: int, seed: int, chunks: int = 3, **kwargs) -> dict:
    """A segmentation batch whose ``split="contiguous"`` gives every chunk the same number of samples (where
    position-matched per-sample terms used to pass unnoticed)."""
    assert num_samples % chunks == 0
    return seg_batch(num_samples, seed=seed, chunks=chunks, **kwargs)


@pytest.mark.parametrize("form", ["len", "stack", "sum"])
@pytest.mark.parametrize("even", [True, False])
def test_a_loss_per_sample_is_exact(form, even, caplog):
    """sum(losses) / len(losses), torch.stack(losses).mean() and sum(losses) / 8 over the chunk's samples: one
    device's loss, with chunks of equal and of unequal sample counts; nothing falls back."""
    fractions = (0.1, 0.3, 0.2)
    make = (lambda s: _even(6, s, fractions=fractions)) if even else (lambda s: seg_batch(7, seed=s, fractions=fractions))
    batches = [make(s) for s in (21, 22)]
    strategy = SparseDataParallelStrategy(split="contiguous" if even else "balanced")
    with caplog.at_level(logging.INFO):
        worst, t, r = _compare(PerSampleLoop, batches, 3, form=form, strategy=strategy)
    assert not _fallback_lines(caplog)
    if even and form == "sum":  # 1/8 in every replica of 2 samples: a sum over 8 or 2/8 of a mean, said once
        assert "read as 0.25 times their mean over the batch's samples, not 0.125 times their sum" in caplog.text
        return
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


def test_per_sample_losses_weighted_by_points_are_off():  # the comparison above can fail
    batches = [_even(6, s, fractions=(0.1, 0.3, 0.2)) for s in (21, 22)]
    ours, reference = _same(PerSampleLoop)
    _fit(ours, batches, SparseDataParallelStrategy(loss_weighting="points", split="contiguous"), 3)
    _fit(reference, batches)
    assert _worst(ours, reference) > 1e-3


def _exact_and_unsaid(cls, batches, caplog):
    """``cls`` on 3 replicas against one device: every tensor and the logged loss within ``REL``, nothing said."""
    with caplog.at_level(logging.INFO):
        worst, t, r = _compare(cls, batches, 3)
    assert not _fallback_lines(caplog)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


def test_per_sample_losses_beside_a_whole_chunk_loss_are_exact(caplog):
    _exact_and_unsaid(PerSampleBeside, [seg_batch(8, seed=s, fractions=(0.1, 0.0, 0.4)) for s in (23, 24)], caplog)


@pytest.mark.parametrize("model", [SumReduction, HandSum, HandMean])
@pytest.mark.parametrize("devices", [2, 3])
def test_sums_and_means_over_the_batch_are_exact(model, devices, caplog):
    """``reduction="sum"`` and, written by hand, ``x.sum()`` / ``x.mean()`` over the chunk's rows (terms too, issue 66):
    each replica's sum counts once, each mean by its elements, a penalty summed over the parameters once."""
    batches = [seg_batch(7, seed=s, fractions=(0.1, 0.3, 1.0), chunks=devices) for s in (25, 26)]
    with caplog.at_level(logging.INFO):
        worst, t, r = _compare(model, batches, devices)
    assert not _fallback_lines(caplog)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


@pytest.mark.parametrize("model, words", [
    (SmallRemainder, "hand-written masked mean"),
    (ChunkStatistic, "a statistic of the chunk"),
    (ChunkClassWeights, "the weight given to F.cross_entropy"),
])
def test_what_no_split_computes_exactly_is_said_once(model, words, caplog):
    """A remainder 1e-6 of the loss that differs between replicas, a loss on a statistic of the chunk, and class
    weights computed from the chunk's labels: each said once, with the reason (they used to pass as exact, off by 3e-7,
    4 % and 4 %)."""
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.1)) for s in (1, 2)]
    with caplog.at_level(logging.INFO):
        worst, _, _ = _compare(model, batches, 3)
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and words in lines[0], lines
    assert worst > 1e-12  # not exact, and said


def test_class_weights_from_the_whole_batch_kept_on_the_module_are_exact(caplog):
    """The fix the fallback above names: class weights computed from the whole batch before the split and kept on the
    module are every replica's, so the cross entropy is weighted term by term, exactly, and nothing is said."""
    _exact_and_unsaid(BatchClassWeights, [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.1)) for s in (1, 2)], caplog)


def test_one_sample_per_replica_reads_a_loss_in_a_loop_as_per_sample_and_says_so(caplog):
    """Chunks of one sample each: a loss called in a loop once per replica is read as one loss per sample (said
    once), a loss called once outside any loop as the chunk's loss (nothing said); both exact."""
    batches = [seg_batch(3, seed=s, fractions=(0.1, 0.3, 0.2)) for s in (27, 28)]
    for model, said in ((PerSampleLoop, True), (ScanNetSeg, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            worst, t, r = _compare(model, batches, 3)
        assert ("is called in a loop, once in each replica's step" in caplog.text) is said
        assert not _fallback_lines(caplog)
        assert worst <= REL
        assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


def test_a_reading_seen_without_doubt_is_kept_for_steps_of_equal_chunks(caplog):
    """sum(losses) / 8: a step of unequal chunks shows it is a sum (not a mean); the next step, of equal chunks,
    where either reading fits, keeps it: exact, nothing said."""
    batches = [seg_batch(7, seed=29, fractions=(0.1, 0.3, 0.2)), _even(6, 30, fractions=(0.1, 0.3, 0.2))]
    with caplog.at_level(logging.INFO):
        worst, _, _ = _compare(PerSampleLoop, batches, 3, form="sum", strategy=SparseDataParallelStrategy(split="contiguous"))
    assert "read as" not in caplog.text and not _fallback_lines(caplog)
    assert worst <= REL


class SumOverRows(ScanNetSeg):
    """A mean written by hand: the cross entropy's sum divided by its input's rows (``len(labels)``), per point."""

    def loss(self, batch):
        logits, labels = self.logits(batch), batch["labels"]
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=255, reduction="sum") / len(labels)


class SumOverSamples(SumOverRows):
    """The same over the samples: one row per sample after global pooling (per-sample labels)."""

    def logits(self, batch):
        field = ME.TensorField(batch["features"], batch["coordinates"].double())
        return self.head(ME.MinkowskiGlobalAvgPooling()(self.net(field.sparse())).F)

    def loss(self, batch):
        logits, labels = self.logits(batch), batch["scene_labels"]
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / len(labels)


@pytest.mark.parametrize("cls", [SumOverRows, SumOverSamples])
@pytest.mark.parametrize("even", [True, False])
def test_a_sum_divided_by_its_rows_is_exact(cls, even, caplog):
    """F.cross_entropy(..., reduction="sum") / len(labels): each replica's sum over its rows divided by them. Chunks of
    equal rows (equal samples, for one row per sample) gave every replica one coefficient, read as a constant: the
    gradient was world-size times one device's, silently (0.30 relative); chunks of unequal rows fell back to "auto".
    Now the whole batch's sum over all its rows, the equal case said once."""
    make = (lambda s: _even(6, s, fractions=(0.1, 0.3, 0.2))) if even else (lambda s: seg_batch(7, seed=s))
    batches = [make(s) for s in (23, 24)]
    for b in batches:
        b["scene_labels"] = torch.arange(int(b["coordinates"][:, 0].max()) + 1) % NUM_CLASSES
    strategy = SparseDataParallelStrategy(split="contiguous" if even else "balanced")
    with caplog.at_level(logging.INFO):
        worst, t, r = _compare(cls, batches, 3, strategy=strategy)
    assert worst <= REL and not _fallback_lines(caplog)
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL
    said = "(reduction='sum') has one coefficient in every replica" in caplog.text
    assert said is (even and cls is SumOverSamples)  # equal rows: each chunk's samples (points never are equal here)


class SkipsUnlabeled(ScanNetSeg):
    """A loss per sample that skips the samples with no labeled point (a mean over nothing), then their mean."""

    def loss(self, batch):
        logits, labels, index = self.logits(batch), batch["labels"], batch["coordinates"][:, 0]
        losses = [self.criterion(logits[index == s], labels[index == s]) for s in index.unique()
                  if (labels[index == s] != 255).any()]
        return torch.stack(losses).mean()


@pytest.mark.parametrize("even", [True, False])
def test_a_loss_per_sample_that_skips_unlabeled_samples_is_exact(even, caplog):
    """Every replica skipped one sample (its calls fewer than its samples, as many in each): the j-th calls were paired
    as one loss across replicas, silently (0.10 relative); they are one loss per sample, the mean over the batch's
    labeled samples."""
    def make(seed):
        batch = _even(6, seed, fractions=(0.1, 0.3, 0.2)) if even else seg_batch(7, seed=seed, fractions=(0.1, 0.3, 0.2))
        index = batch["coordinates"][:, 0]
        for s in (0, 3, 5):  # one sample of each chunk of the contiguous split (and of most balanced ones) unlabeled
            batch["labels"][index == s] = 255
        return batch

    strategy = SparseDataParallelStrategy(split="contiguous" if even else "balanced")
    with caplog.at_level(logging.INFO):
        worst, t, r = _compare(SkipsUnlabeled, [make(s) for s in (25, 26)], 3, strategy=strategy)
    assert worst <= REL and not _fallback_lines(caplog)
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= REL


class ClassMeans(ScanNetSeg):
    """A mean over the classes the batch holds of each class's mean loss (a class-balanced loss)."""

    def loss(self, batch):
        logits, labels = self.logits(batch), batch["labels"]
        per_point = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        return torch.stack([per_point[labels == c].mean() for c in range(NUM_CLASSES) if (labels == c).any()]).mean()


def test_a_loop_over_what_the_chunk_holds_is_said_once_its_calls_change(caplog):
    """Chunks lacking different classes make as many calls each, so the j-th calls were paired across replicas as one
    loss (another class in each: 0.35 relative, silently, after a first step that was exact). A site in a loop whose
    number of calls changes from step to step is refused from then on, said once."""
    every = [list(range(NUM_CLASSES))] * 6
    fewer = [[0, 1, 2]] * 2 + [[0, 1, 3]] * 2 + [[0, 2, 3]] * 2  # each contiguous chunk of 2 samples lacks a class
    batches = [class_batch(every, 0), class_batch(fewer, 1)]
    with caplog.at_level(logging.INFO):
        _compare(ClassMeans, batches, 3, strategy=SparseDataParallelStrategy(split="contiguous", check_exactness=False))
    said = _fallback_lines(caplog)
    assert len(said) == 1 and "is called in a loop a number of times that changes from step to step" in said[0]
