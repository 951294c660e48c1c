"""The exactness check against plain Lightning on one device: it says a step differs exactly when training does.

Each form of tests/support/step_forms.py is trained one step in float64 by plain Lightning and by ``sparse_dp`` on 2
and 3 CPU replicas from the same start; the check's word must match the outcome: "equals one device's" when every
parameter is within 1e-10 of plain Lightning's, a warning naming the difference when it is not.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchmetrics

from lightning_sparse_dp.exactness.check import TOLERANCE, ExactnessError
from lightning_sparse_dp.exactness.compare import StepRecord, differences, relative_difference
from tests.support.exact import REL, same_start, state_differences, trainer64
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples
from tests.support.step_forms import FORMS, ManualOptimization, PooledNet

EQUAL = "equals one device's"
DIFFERS = "differs from one device's"
FAILS = "fails on the replicas where one device's step runs"


def fit_saying(model, devices: int, caplog, **strategy_kwargs):
    """Fit ``model`` one step on ``sparse_dp`` (float64); ``(infos, warnings)`` said by the exactness check."""
    from lightning_sparse_dp import SparseDataParallelStrategy

    batch = collate_dict(random_samples(8, seed=3))
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer64(strategy=SparseDataParallelStrategy(**strategy_kwargs), devices=devices, max_steps=1)
        try:
            t.fit(model, loader(batch))
            failed = None
        except Exception as err:
            failed = err
    infos = [r.getMessage() for r in caplog.records if "exactness check" in r.getMessage()]
    said = [str(w.message) for w in caught if "exactness check" in str(w.message)]
    if failed is not None and not said:
        raise failed
    return infos, said, failed


def one_device(model):
    trainer64(max_steps=1).fit(model, loader(collate_dict(random_samples(8, seed=3))))


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("form", ["PooledNet", *FORMS])
def test_the_check_says_a_difference_exactly_when_the_step_differs_from_one_device(form, devices, caplog):
    cls = FORMS.get(form, PooledNet)
    ours, reference = same_start(cls, seed=0)
    one_device(reference)
    infos, said, failed = fit_saying(ours, devices, caplog)
    if failed is not None:  # the strategy's step raised where one device's ran: said before it raised (a step whose
        # replicas race on shared state, an in-place teacher update, may raise in one run and differ in another)
        assert len(said) == 1 and (FAILS in said[0] and type(failed).__name__ in said[0] or DIFFERS in said[0]), said
        return
    worst = max(state_differences(ours, reference).values())
    if worst <= REL:
        assert any(EQUAL in m for m in infos) and not said, (form, worst, infos, said)
    else:
        assert len(said) == 1 and DIFFERS in said[0], (form, worst, infos, said)
        assert "Fixes:" in said[0] and "check_exactness" in said[0]


def test_a_difference_is_an_error_when_asked(caplog):
    ours, _ = same_start(FORMS["CoupledSamples"], seed=0)
    with pytest.raises(ExactnessError, match=DIFFERS):
        fit_saying(ours, 2, caplog, check_exactness="error")


def test_the_check_is_off_when_asked_and_that_is_said_once(caplog):
    ours, reference = same_start(FORMS["CoupledSamples"], seed=0)
    one_device(reference)
    infos, said, _ = fit_saying(ours, 2, caplog, check_exactness=False)
    assert not said and len(infos) == 1 and "exactness check off (check_exactness=False)" in infos[0], (infos, said)
    assert "coupling the batch's samples" in infos[0] and "check_exactness=True (the default)" in infos[0]
    # what the line says of: a step coupling the samples trains unlike one device, and no other line says so
    assert max(state_differences(ours, reference).values()) > REL


def test_bad_options_are_refused():
    from lightning_sparse_dp import SparseDataParallelStrategy

    with pytest.raises(ValueError, match="check_exactness="):
        SparseDataParallelStrategy(check_exactness="loud")
    with pytest.raises(ValueError, match="check_exactness_every_n_steps="):
        SparseDataParallelStrategy(check_exactness_every_n_steps=-1)


class Manual(ManualOptimization, PooledNet):
    def manual_loss(self, batch, batch_idx):
        return PooledNet.training_step(self, batch, batch_idx)


def test_a_manual_step_is_said_unchecked(caplog):
    infos, said, _ = fit_saying(Manual(), 2, caplog)
    assert not said and len(infos) == 1 and "not run, because the module optimizes manually" in infos[0]


class _Dropped(PooledNet):
    """PooledNet with dropout before its head."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.3)

    def features(self, batch):
        return self.drop(super().features(batch))


@pytest.mark.parametrize("model", ["plain", "batch_norm", "dropout"])
def test_equals_names_what_both_runs_left_out(model, caplog):
    """The check runs per-replica batch norm (sync_batchnorm=False) in eval mode and dropout off in both runs, where
    training does neither as one device does: its "equals" line names them, so that it never claims them (it said
    "equals" while training ended 0.24 relative from one device's)."""
    module = {"plain": PooledNet, "batch_norm": lambda: SparseNet(batch_norm=True), "dropout": _Dropped}[model]()
    infos, said, _ = fit_saying(module, 3, caplog)
    assert len(infos) == 1 and EQUAL in infos[0] and not said, (infos, said)
    assert ("batch norm in eval mode (not synchronized, training normalizes each replica's chunk" in infos[0]) is (
        model == "batch_norm")
    assert ("dropout off (in training each replica draws its own masks" in infos[0]) is (model == "dropout")
    assert ("in both runs" in infos[0]) is (model != "plain")


class _BiasBeforeNorm(PooledNet):
    """PooledNet whose head's logits are batch-normalized: the head's bias gradient is zero in exact math (the
    normalization's mean removes the bias), rounding noise in any run."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(NUM_CLASSES)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.norm(self.head(self.features(batch))), batch["labels"])


def test_a_gradient_zero_in_exact_math_is_not_a_difference(caplog):
    """The check said "differs: grad of 'head.bias' 1.6e+00" where every tensor matched one device's to 1e-15: two
    rounding noises compared to each other. Gradients are measured over a floor of the step's largest gradient."""
    ours, reference = same_start(_BiasBeforeNorm, seed=0)
    one_device(reference)
    infos, said, _ = fit_saying(ours, 3, caplog, sync_batchnorm=True)
    assert max(state_differences(ours, reference).values()) <= REL
    assert len(infos) == 1 and EQUAL in infos[0] and not said, (infos, said)


def test_a_real_difference_in_a_small_gradient_still_shows():
    """The floor does not hide a difference: a gradient a millionth of the largest, 1e-3 off, reads above the tolerance;
    the same gradient's rounding noise reads below it."""
    big, small = torch.ones(4, dtype=torch.float64), torch.full((4,), 1e-6, dtype=torch.float64)
    expected = StepRecord(loss=None, grads={"big": big, "small": small})
    off = dict(differences(StepRecord(loss=None, grads={"big": big, "small": small * (1 + 1e-3)}), expected))
    noise = dict(differences(StepRecord(loss=None, grads={"big": big, "small": small + 1e-16}), expected))
    assert off["grad of 'small'"] > TOLERANCE and noise["grad of 'small'"] < TOLERANCE
    assert relative_difference(small * 2, small, floor=0.0) == pytest.approx(1.0)


class _LowPrecisionValues(PooledNet):
    """A learning rate logged as a Python float, and a torchmetrics mean of the per-sample losses (its states stay
    float32 under "64-true": torchmetrics ignores .double())."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.losses = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        per_sample = F.cross_entropy(self.head(self.features(batch)), batch["labels"], reduction="none")
        self.losses.update(per_sample)
        self.log("lr", 0.1)
        return per_sample.mean()


def test_values_held_below_float64_are_compared_at_their_precision(caplog):
    """The check said "differs" for a logged 0.1 (1.5e-8: the check's copies made it float32 and cast it) and for a
    float32 metric state (9.9e-8: float32 sums in another order), with the loss's fixes, where training matched one
    device's to 1e-16. A logged number is now float64 in the check's runs, and a float32 tensor equal within its own
    rounding; a real difference in it still shows."""
    ours, reference = same_start(_LowPrecisionValues, seed=0)
    one_device(reference)
    infos, said, _ = fit_saying(ours, 3, caplog)
    assert max(state_differences(ours, reference).values()) <= REL
    assert len(infos) == 1 and EQUAL in infos[0] and not said, (infos, said)
    state = torch.tensor([1.0, 3.0])
    expected = StepRecord(loss=None, metrics={"m.s": state})
    off = dict(differences(StepRecord(loss=None, metrics={"m.s": state * (1 + 1e-3)}), expected))
    assert off["metric state 'm.s'"] > TOLERANCE


class _KeepsCounts(SparseNet):
    """State a step keeps on the module besides tensors: a count of its chunk's labels (an int, an appended int, a dict
    entry), ``hparams`` changed, a torchmetrics metric kept in a plain dict (no submodule), and a step counter, which is
    one device's on the replicas too."""

    def __init__(self, keep: str):
        super().__init__()
        self.keep, self.steps = keep, 0
        self.save_hyperparameters()
        self.num_labeled, self.per_batch, self.counts = 0, [], {"labeled": 0}
        self.meters = {"loss": torchmetrics.MeanMetric()}

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.steps += 1
        n = int((batch["labels"] >= 0).sum())
        if self.keep == "count":
            self.num_labeled += n
        elif self.keep == "appended":
            self.per_batch.append(n)
        elif self.keep == "dict":
            self.counts["labeled"] += n
        elif self.keep == "hparams":
            self.hparams.steps = self.hparams.get("steps", 0) + 1  # shared by the replicas: each adds its 1
        elif self.keep == "metric":
            self.meters["loss"].update(loss.detach())
        return loss


@pytest.mark.parametrize(("keep", "named"), [
    ("count", "attribute 'num_labeled'"), ("appended", "attribute 'per_batch[0]'"),
    ("dict", "attribute \"counts['labeled']\""), ("hparams", "attribute \"hparams['steps']\""),
    ("metric", "metric state \"meters['loss']."), ("steps", None),
])
def test_numbers_and_metrics_the_module_keeps_are_compared(keep, named, caplog):
    """A count of the chunk kept on the module as a Python int (every replica's chunk counting the same, 2 of 6 on 3
    replicas: nothing tells it from a step counter), in a list or dict, a step count in ``hparams`` (one object the
    replicas share), or a MeanMetric kept in a plain dict (each replica updating the shared metric with its chunk's
    loss) left the module unlike one device's, and the check said 'equals': it compared tensors only. It names them
    now; a step counter, one device's, still equals."""
    batch = collate_dict(random_samples(6, seed=3))
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer64(strategy="sparse_dp", devices=3, max_steps=1).fit(_KeepsCounts(keep), loader(batch))
    infos = [r.getMessage() for r in caplog.records if "exactness check" in r.getMessage()]
    said = [str(w.message) for w in caught if "exactness check" in str(w.message)]
    if named is None:
        assert any(EQUAL in m for m in infos) and not said, (infos, said)
    else:
        assert len(said) == 1 and DIFFERS in said[0] and named in said[0], said


class _EmaTeacher(SparseNet):
    """An EMA teacher of the network made with ``copy.deepcopy`` (which keeps ``requires_grad=True``) and updated in the
    step, before the loss; ``frozen``: the teacher frozen, as the line advises."""

    def __init__(self, frozen: bool):
        import copy

        super().__init__()
        self.teacher = copy.deepcopy(self.net).requires_grad_(not frozen)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.mul_(0.5).add_(s, alpha=0.5)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_teacher_that_requires_grad_updated_in_place_in_the_step_is_said(frozen):
    """The teacher's parameters require grad, so the replicas share them (frozen ones they own): each replica applied
    the update, three EMA steps a step (1.1e-2 off in the teacher after 3 steps), while the check said 'equals': its
    first update of a copy of the student changes nothing. It is said now, naming the fix; a frozen teacher is one
    device's and not said."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "require grad in place" in m})
    batches = [collate_dict(random_samples(7, seed=s)) for s in (21, 22, 23)]
    ours, reference = same_start(_EmaTeacher, frozen, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    said = [str(w.message) for w in caught if "require grad in place" in str(w.message)]
    worst = max(state_differences(ours, reference).values())
    if frozen:
        assert said == [] and worst <= REL, (said, worst)
    else:
        assert len(said) == 1 and "teacher.0.kernel" in said[0] and "requires_grad_(False)" in said[0], said
        assert worst > 1e-6  # what the line is about
