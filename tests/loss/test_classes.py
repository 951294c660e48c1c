"""Per-class losses in a loop over the classes each chunk holds (``loss/classes.py``), against plain Lightning on one
device in float64: paired across replicas by their class, or said where they cannot be."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.loss.classes import Unpaired, pair_by_class, read_per_sample
from lightning_sparse_dp.loss.decide import SiteTerms, Summary, decide
from lightning_sparse_dp.loss.memory import SiteMemory
from tests.support.clients import fresh_loader
from tests.support.exact import REL, relative_difference, same_start, state_differences, trainer64
from tests.support.helpers import NUM_CLASSES, collate_dict, random_samples
from tests.support.step_forms import PooledNet
from tests.support.term_models import PerClass, class_batch

EVERY = [list(range(NUM_CLASSES))] * 6
SAME = [[0, 1, 2]] * 6  # every chunk holds classes 0, 1, 2
LACKING = [[0, 1, 2]] * 2 + [[0, 1, 3]] * 2 + [[0, 2, 3]] * 2  # each contiguous chunk of 2 samples lacks another class
FEWER = [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * 2 + [[2, 3]] * 2  # 4, 3 and 2 classes in the chunks


def _said(caplog) -> list[str]:
    """What the strategy said about the loss: the fallback line, the readings' notes, a differing exactness check."""
    return [r.getMessage() for r in caplog.records
            if "loss_weighting='terms' cannot" in r.getMessage() or "per-class losses" in r.getMessage()
            or "differs from one device's" in r.getMessage()]


def _compare(cls, batches, caplog, *args, **kwargs):
    """``cls(*args)`` fit on 3 replicas (contiguous split) and on one device from the same start: the worst state
    difference, the logged losses' difference and what was said."""
    ours, reference = same_start(cls, *args, seed=0)
    steps = len(batches)
    with caplog.at_level(logging.INFO):
        t = trainer64(strategy=SparseDataParallelStrategy(split="contiguous", **kwargs), devices=3, max_steps=steps,
                      sync_batchnorm=True)
        t.fit(ours, fresh_loader(batches))
    r = trainer64(max_steps=steps, sync_batchnorm=True)
    r.fit(reference, fresh_loader(batches))
    worst = max(state_differences(ours, reference).values())
    return worst, relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]), _said(caplog)


@pytest.mark.parametrize("form", ["mean", "sum", "weighted"])
def test_a_loss_over_the_classes_each_chunk_holds_is_exact(form, caplog):
    """Chunks lacking different classes make 3 calls each, and the j-th calls were paired across replicas as one loss
    (class 2 of one chunk with class 3 of another): after a first step whose chunks hold the same classes (checked
    equal), the loss / len(y.unique()) was 1.2e-2 off one device's (the parameters 0.37), the sum 0.24 (0.26),
    silently. The calls are paired by the class their targets hold."""
    batches = [class_batch(SAME, 0), class_batch(LACKING, 1), class_batch(LACKING, 2)]
    worst, loss, said = _compare(PerClass, batches, caplog, form)
    assert worst <= REL and loss <= REL
    assert not said


@pytest.mark.parametrize("form", ["mean", "sum"])
def test_chunks_holding_different_numbers_of_classes_are_exact(form, caplog):
    """4, 3 and 2 classes in the chunks: the replicas' calls were refused as different numbers of calls and weighted
    by the chunks' points; paired by class, a mean over the classes each chunk holds (1/4, 1/3, 1/2) is one device's
    mean over the batch's classes."""
    batches = [class_batch(FEWER, 3), class_batch(LACKING, 4)]
    worst, loss, said = _compare(PerClass, batches, caplog, form)
    assert worst <= REL and loss <= REL
    assert not said


@pytest.mark.parametrize(("form", "layout"), [("mean", SAME), ("sum", SAME), ("mean", EVERY), ("single", LACKING)])
def test_the_same_classes_in_every_chunk_and_one_call_stay_exact_and_silent(form, layout, caplog):
    """Chunks holding the same classes (the readings by position and by class agree), and the common single
    F.cross_entropy over every point: exact, nothing said."""
    worst, loss, said = _compare(PerClass, [class_batch(layout, 5), class_batch(layout, 6)], caplog, form)
    assert worst <= REL and loss <= REL
    assert not said


class PerClassPooled(PooledNet):
    """Classification (one label per sample): a cross entropy per class of the chunk's samples, their mean."""

    def training_step(self, batch, batch_idx):
        logits, y = self.head(self.features(batch)), batch["labels"]
        loss = sum(F.cross_entropy(logits[y == c], y[y == c]) for c in y.unique()) / len(y.unique())
        self.log("train_loss", loss)
        return loss


def test_per_class_losses_over_per_sample_labels_are_exact(caplog):
    """Per-sample labels, chunks of 4 samples holding 3 classes each, different ones: paired by class (weighted by the
    chunks' points before, 8.0e-2 off one device). A later batch whose chunks hold one sample of each of their
    classes (calls that are one per sample as well) is read by class as the earlier batch showed, silently."""
    batches = []
    for seed, labels in ((7, [0, 0, 1, 2, 0, 1, 3, 3, 0, 2, 2, 3]), (8, [1, 2, 2, 3, 0, 0, 1, 3, 0, 2, 3, 3]),
                         (9, [0, 1, 2, 0, 1, 3, 0, 2, 3])):
        batch = collate_dict(random_samples(len(labels), seed=seed))
        batch["labels"] = torch.tensor(labels)
        batches.append({k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
    worst, loss, said = _compare(PerClassPooled, batches, caplog)
    assert worst <= REL and loss <= REL
    assert not said


class TwoHeads(PerClass):
    """The per-class loss of two heads from one place in the code: each replica calls it twice for each class."""

    def loss(self, batch):
        logits, y = self.logits(batch), batch["labels"]
        loss = 0
        for scale in (1.0, 0.5):
            for c in y.unique():
                m = y == c
                loss = loss + F.cross_entropy(scale * logits[m], y[m])
        return loss


def test_per_class_calls_that_cannot_be_paired_are_said_once(caplog):
    """Calls over different classes at the same position that no pairing by class matches (a class called twice by a
    replica): refused, said once, naming a fixed list of classes (no loss weighting mends it)."""
    batches = [class_batch(LACKING, s) for s in (9, 10)]
    worst, _, said = _compare(TwoHeads, batches, caplog, check_exactness=False)
    lines = [s for s in said if "loss_weighting='terms' cannot" in s]
    assert len(lines) == 1 and "cannot be paired by class: a replica's step called it twice for one class" in lines[0]
    assert "range(num_classes)" in lines[0] and "loss_weighting=lambda" not in lines[0]
    assert worst > 1e-6  # weighted per replica: not one device's, as said


def _site(classes, coeffs, key=1, per_sample=False):
    n = len(classes)
    return SiteTerms(key, "m.py:3", "F.cross_entropy", True, [False] * n, list(coeffs), [5.0] * n, [0.5] * n, [1] * n,
                     per_sample, [False] * n, [0] * n, classes=list(classes))


def test_calls_one_per_sample_and_one_per_class_are_read_per_sample_until_a_batch_tells():
    """Each call over one class of its own that is also one sample's rows (a chunk's samples of distinct classes): per
    sample, said once, where a class is in two chunks (the readings differ); by class where none is (they agree) and
    once a step's rows were not one per sample."""
    memory, notes = SiteMemory(), []
    shared = [_site([0, 1], [0.5] * 2, per_sample=True), _site([1, 2], [0.5] * 2, per_sample=True)]
    chunks = [Summary(None, 2), Summary(None, 2)]
    assert read_per_sample(shared, chunks, memory, "replica", notes) is True
    assert len(notes) == 1 and "taken as one loss per sample" in notes[0]
    apart = [_site([0, 1], [0.5] * 2, per_sample=True), _site([2, 3], [0.5] * 2, per_sample=True)]
    assert read_per_sample(apart, chunks, memory, "replica", notes) is False
    rows = [_site([0, 1], [0.5] * 2), _site([1, 2], [0.5] * 2)]  # the rows of a class over several samples
    assert read_per_sample(rows, chunks, memory, "replica", notes) is False and memory[1] == ("classes", None)
    assert read_per_sample(shared, chunks, memory, "replica", notes) is False and len(notes) == 1
    repeated = [_site([0, 0], [0.5] * 2, per_sample=True), _site([1, 2], [0.5] * 2, per_sample=True)]
    assert read_per_sample(repeated, chunks, memory, "replica", notes) is None  # a class twice: not a loop over classes


def test_pairing_reads_a_coefficient_both_readings_fit_once_a_step_tells_them_apart():
    """One coefficient in every replica, as many calls in each: 1 / calls is a mean over the chunk's classes; 0.5 is
    read as one coefficient per class and said; a step whose chunks hold different numbers of classes settles it."""
    memory, notes = SiteMemory(), []
    groups = pair_by_class([_site([0, 1, 2], [1 / 3] * 3), _site([0, 1, 3], [1 / 3] * 3)], memory, "replica", notes)
    assert [k for k, _ in groups] == [0.25] * 4 and not notes
    groups = pair_by_class([_site([0, 1, 2], [0.5] * 3), _site([0, 1, 3], [0.5] * 3)], memory, "replica", notes)
    assert [k for k, _ in groups] == [0.5] * 4 and len(notes) == 1 and "read as 0.5 times their sum" in notes[0]
    pair_by_class([_site([0, 1], [0.75] * 2), _site([0, 1, 3], [0.5] * 3)], memory, "replica", notes)  # 1.5 / calls
    assert memory.classes[1] == "mean"
    groups = pair_by_class([_site([0, 1, 2], [0.5] * 3), _site([0, 1, 3], [0.5] * 3)], memory, "replica", notes)
    assert [k for k, _ in groups] == [1.5 / 4] * 4 and len(notes) == 1


def test_pairing_leaves_calls_whose_classes_agree_or_are_unknown_to_their_positions():
    """Calls over several classes (decoder levels, a loss over the chunk): read by position as before, also where a
    coarse level happens to hold one class, another in each replica (a loop over classes calls each over one)."""
    memory = SiteMemory()
    assert pair_by_class([_site([None, None], [1, 1]), _site([None, None], [1, 1])], memory, "replica", []) is None
    assert pair_by_class([_site([0, None], [1, 1]), _site([0, None], [1, 1])], memory, "replica", []) is None
    assert pair_by_class([_site([0, None], [1, 1]), _site([1, None], [1, 1])], memory, "replica", []) is None
    with pytest.raises(Unpaired, match="neither one number per class"):
        pair_by_class([_site([0, 1], [1, 2]), _site([1, 2], [1, 3])], memory, "replica", [])


def _class_step(held, form, values, weights=(0.5, 0.75, 1.0, 1.25)):
    """One step's summaries of a per-class loop: replica ``i`` calls classes ``held[i]`` (in that order), each call of
    denominator ``2 + class + i`` and value ``values[i][j]``, combined as ``form``: a sum, a mean over the classes the
    chunk holds, or a weight per class."""
    out = []
    for i, (classes, vs) in enumerate(zip(held, values)):
        n = len(classes)
        cs = [1.0 if form == "sum" else 1.0 / n if form == "mean" else weights[k] for k in classes]
        site = SiteTerms(1, "m.py:3", "F.cross_entropy", True, [False] * n, cs, [2.0 + k + i for k in classes], list(vs),
                         [50 + k for k in classes], False, [False] * n, [0] * n, classes=list(classes))
        out.append(Summary(None, 4, sites=[site], order=[(0, j) for j in range(n)], tolerance=1e-12))
    return out


def _one_device(held, form, values, weights=(0.5, 0.75, 1.0, 1.25)) -> float:
    """The whole batch's value: each class's mean over every chunk's calls of it, combined as ``form``."""
    union = sorted({k for classes in held for k in classes})
    total = 0.0
    for k in union:
        calls = [(2.0 + k + i, v) for i, (classes, vs) in enumerate(zip(held, values)) for c, v in zip(classes, vs) if c == k]
        mean = sum(d * v for d, v in calls) / sum(d for d, _ in calls)
        total += (1.0 / len(union) if form == "mean" else 1.0 if form == "sum" else weights[k]) * mean
    return total


_HELD = st.lists(st.permutations(range(NUM_CLASSES)).flatmap(lambda p: st.integers(1, NUM_CLASSES).map(lambda n: p[:n])),
                 min_size=2, max_size=3)


@settings(max_examples=200, deadline=None)
@given(_HELD, st.sampled_from(["sum", "mean", "weighted"]), st.data())
def test_any_per_class_step_is_one_devices_or_said(held, form, data):
    """Per-class calls in any order, any classes per chunk: the decided value is one device's (each class's mean over
    the chunks, combined as the step does), or the reading is said (coefficients both readings fit); a step decided
    again from its recalled readings decides alike."""
    values = [data.draw(st.lists(st.floats(0.1, 3.0), min_size=len(c), max_size=len(c))) for c in held]
    memory = SiteMemory()
    first = decide(_class_step(held, form, values), memory)
    again = decide(_class_step(held, form, values), memory)
    assert first.reason is None and again.value == first.value and again.scales == first.scales
    assert math.isclose(first.value, _one_device(held, form, values), rel_tol=1e-12) or first.notes


class LoggedPerClass(PerClass):
    """:class:`PerClass`, its loss logged in validation too."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))


#: validation batches whose samples hold one class each, a class in several chunks: a call per class of the chunk is
#: also a call per sample there, which such a batch cannot tell apart
ONE_CLASS_EACH = [[0], [1], [1], [0], [2], [3]]


def test_validation_reads_a_loop_over_classes_as_the_training_steps_showed_it(caplog):
    """Validation keeps a site memory of its own, and began without what the training steps settled of the loop's
    kind: batches whose samples hold one class each were read one loss per sample, 1.6e-2 off one device's val_loss
    in the fit, silently. What the training steps settled stands in validation now; a validate() of such batches,
    with nothing to settle it, says its reading once."""
    train = [class_batch(FEWER, seed=s) for s in (1, 2)]
    val = [class_batch(ONE_CLASS_EACH, seed=s) for s in (5, 6)]
    ours, reference = same_start(LoggedPerClass, seed=0)
    run = dict(max_epochs=1, max_steps=-1, limit_val_batches=None, sync_batchnorm=True)
    ours_trainer = trainer64(strategy="sparse_dp", devices=3, **run)
    ours_trainer.fit(ours, fresh_loader(train), fresh_loader(val))
    reference_trainer = trainer64(**run)
    reference_trainer.fit(reference, fresh_loader(train), fresh_loader(val))
    assert max(state_differences(ours, reference).values()) <= REL
    got, want = (float(t.callback_metrics["val_loss"]) for t in (ours_trainer, reference_trainer))
    assert relative_difference(got, want) <= REL, (got, want)

    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(ours, fresh_loader(val), verbose=False)
    said = [r.getMessage() for r in caplog.records if "called in a loop once per sample" in r.getMessage()]
    assert len(said) == 1, said
