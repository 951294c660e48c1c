"""Statistics in the logits' path (issue 65 item 7), against plain Lightning on one device in float64: a statistic of
the parameters alone (``mean(bias ** 2)``, one value in every replica) is no statistic of the chunk, so the loss stays
exact and unsaid (it was read as one and weighted per replica, 0.17 / 0.25 off); a statistic of the chunk is still said."""

from __future__ import annotations

import logging
import warnings

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F

from tests.support.exact import REL, same_start, state_differences, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import ChunkStatisticOfLogits, ParameterStatistic, PooledNet


def _fit_both(cls, devices, caplog):
    batches = [collate_dict(random_samples(8, seed=s)) for s in (3, 4, 5)]
    ours, reference = same_start(cls, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=devices, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    said = {r.getMessage() for r in caplog.records if "cannot weight the step's loss term by term" in r.getMessage()}
    return max(state_differences(ours, reference).values()), said


@pytest.mark.parametrize("devices", [2, 3])
def test_a_statistic_of_the_parameters_in_the_logits_path_is_exact_and_unsaid(devices, caplog):
    worst, said = _fit_both(ParameterStatistic, devices, caplog)
    assert worst <= REL and not said


@pytest.mark.parametrize("devices", [2, 3])
def test_a_statistic_of_the_chunk_in_the_logits_path_is_still_said(devices, caplog):
    worst, said = _fit_both(ChunkStatisticOfLogits, devices, caplog)
    assert len(said) == 1 and "a statistic of the chunk" in next(iter(said)), said
    assert worst > 1e-8  # weighted per replica: not one device's (the exactness check says so too)


class HardestPoints(PooledNet):
    """OHEM: the mean of the k largest per-sample losses of the chunk (which are the largest depends on the others)."""

    def training_step(self, batch, batch_idx):
        losses = F.cross_entropy(self.head(self.features(batch)), batch["labels"], reduction="none")
        return losses.topk(2).values.mean()


@pytest.mark.parametrize("devices", [2, 3])
def test_a_selection_of_rows_by_their_losses_is_said(devices, caplog):
    """loss.topk(k).values.mean() was read as an ordinary mean term, so nothing but the exactness check said it
    (silent with check_exactness=False): it is a statistic of the chunk, said by the loss reading."""
    worst, said = _fit_both(HardestPoints, devices, caplog)
    assert len(said) == 1 and "a top-k / sort of its rows' losses" in next(iter(said)), said
    assert worst > 1e-8


class SoftDice(PooledNet):
    """A soft Dice over the classes (sums over the chunk's rows, ``1 - dice``) added to the cross-entropy."""

    def dice(self, batch):
        """The logits and each class's ``1 - dice`` over the chunk's rows."""
        logits, labels = self.head(self.features(batch)), batch["labels"]
        p, onehot = logits.softmax(1), F.one_hot(labels, logits.shape[1]).to(logits)
        return logits, 1 - (2 * (p * onehot).sum(0) + 1) / (p.sum(0) + onehot.sum(0) + 1)

    def training_step(self, batch, batch_idx):
        logits, dice = self.dice(batch)
        return F.cross_entropy(logits, batch["labels"]) + dice.mean()


class SortedErrors(PooledNet):
    """A Lovasz-like loss: the chunk's errors sorted, weighted by their rank, over the weights' sum."""

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch))
        errors = 1 - logits.softmax(1).gather(1, batch["labels"][:, None]).squeeze(1)
        ranked, _ = torch.sort(errors, descending=True)
        weights = torch.linspace(1, 0, ranked.numel(), dtype=ranked.dtype)
        return (ranked * weights).sum() / weights.sum()


@pytest.mark.parametrize("cls", [SoftDice, SortedErrors])
def test_a_statistic_behind_one_minus_or_a_divided_sum_is_said(cls, caplog):
    """``1 - x`` (RsubBackward) stopped the walk to the statistic, and a sum over sorted errors divided by a constant
    was read as a sum divided by its rows before the statistic was looked at: both were weighted as exact terms (a Dice
    0.17 off one device, a Lovasz-like loss 0.18), silently with check_exactness=False or once the check had passed."""
    worst, said = _fit_both(cls, 3, caplog)
    assert len(said) == 1 and "a statistic of the chunk" in next(iter(said)), said
    assert worst > 1e-8


class ValidationDice(SoftDice):
    """The soft Dice as a validation score, logged per epoch: computed without autograd, under inference mode."""

    def validation_step(self, batch, batch_idx):
        self.log("val_dice", self.dice(batch)[1].mean())


def test_a_statistic_in_a_validation_step_is_said(caplog):
    """Without autograd's graph the statistic went unseen: the score was read as a counted mean over its classes, the
    replicas' scores averaged, 2.2e-2 relative off one device's, silently. It is followed through the step's torch
    calls now, and the logged value is said."""
    batches = [collate_dict(random_samples(8, seed=s)) for s in (6, 7)]
    ours, reference = same_start(ValidationDice, seed=0)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        t = trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None)
        t.validate(ours, loader(*batches), verbose=False)
    said = [m for m in [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records] if "'val_dice'" in m]
    r = trainer64(limit_val_batches=None)
    r.validate(reference, loader(*batches), verbose=False)
    assert any("differs between replicas" in m or "a statistic of the chunk" in m for m in said), said
    assert abs(float(t.callback_metrics["val_dice"]) - float(r.callback_metrics["val_dice"])) > 1e-8


class NoGradThreshold(PooledNet):
    """OHEM as mmseg writes it: a threshold from the chunk's sorted probabilities of the true class, computed under
    ``torch.no_grad``, selecting the rows the loss is over (``how``: a weight, or a target set to ``ignore_index``)."""

    how = "weight"

    def training_step(self, batch, batch_idx):
        logits, labels = self.head(self.features(batch)), batch["labels"]
        with torch.no_grad():
            prob = logits.softmax(1).gather(1, labels[:, None]).squeeze(1)
            threshold = max(prob.sort().values[prob.numel() // 2], 0.0)
            if self.how == "weight":
                weight = torch.zeros_like(prob)
                weight[prob < threshold] = 1.0
            else:
                labels = labels.clone()
                labels[prob >= threshold] = -100
        if self.how == "weight":
            return (F.cross_entropy(logits, labels, reduction="none") * weight).mean()
        return F.cross_entropy(logits, labels)


class NoGradThresholdTarget(NoGradThreshold):
    how = "target"


class NoGradAccuracy(PooledNet):
    """A score of the chunk computed under ``torch.no_grad`` beside the loss, logged: no part of the loss."""

    def training_step(self, batch, batch_idx):
        logits, labels = self.head(self.features(batch)), batch["labels"]
        with torch.no_grad():
            self.log("acc", (logits.argmax(1) == labels).to(logits.dtype).mean())
        return F.cross_entropy(logits, labels)


@pytest.mark.parametrize("cls", [NoGradThreshold, NoGradThresholdTarget])
def test_a_selection_by_a_threshold_computed_under_no_grad_is_said(cls, caplog):
    """A threshold of the chunk computed where autograd records nothing left no trace in the loss's graph: the loss was
    weighted as a mean over the selected rows (0.81 relative off one device after 3 steps on the segmentation network,
    silently once the check of step 0, where the threshold did not bind, had passed). The statistic is followed
    through the no_grad block into the weight or target, and said."""
    worst, said = _fit_both(cls, 3, caplog)
    assert len(said) == 1 and "an OHEM threshold" in next(iter(said)), said
    assert worst > 1e-8


def test_a_score_computed_under_no_grad_beside_the_loss_stays_exact_and_unsaid(caplog):
    worst, said = _fit_both(NoGradAccuracy, 3, caplog)
    assert worst <= REL and not said


def test_only_the_steps_own_torch_calls_start_following_a_statistic():
    """Where autograd records nothing in a training step, a row reduction starts the following only when the step's
    own code made it (through torch's op wrappers: ``x.sort(0)``, ``torch.norm``), not inside MinkowskiEngine's code
    (its layers' ``autograd.Function`` forwards run without autograd too, and their outputs are recorded)."""
    import MinkowskiEngine as ME
    from torch.overrides import TorchFunctionMode

    from lightning_sparse_dp.loss.sites import from_step_code

    seen: list[tuple[str, bool]] = []

    class Observe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append((getattr(func, "__name__", "?"), from_step_code(1)))
            return func(*args, **(kwargs or {}))

    x, coordinates, features = torch.rand(6, 3), [torch.zeros(2, 3, dtype=torch.int32)] * 2, [torch.ones(2, 1)] * 2
    with Observe():
        x.sort(0)
        torch.norm(x, dim=0)
        mark = len(seen)
        ME.utils.sparse_collate(coordinates, features)
    assert seen[:mark] and all(own for _, own in seen[:mark]), seen[:mark]
    assert seen[mark:] and not any(own for _, own in seen[mark:]), seen[mark:]


class DenseGridMean(PooledNet):
    """A penalty averaged over ME's dense grid of the first convolution's output (``F.mse_loss`` over
    ``x.dense()``), beside the cross-entropy; ``fixed``: the grid given by ``shape=`` (coordinates are 0..7)."""

    fixed = False

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        h = self.body[1](self.body[0](x))
        shape = torch.Size([len(batch["labels"]), 8, 8, 8, 8]) if self.fixed else None
        grid = h.dense(shape=shape)[0]
        return F.cross_entropy(self.head(self.body(x).F), batch["labels"]) + F.mse_loss(grid, torch.zeros_like(grid))


class FixedDenseGridMean(DenseGridMean):
    fixed = True


@pytest.mark.parametrize("cls", [DenseGridMean, FixedDenseGridMean])
def test_a_mean_over_a_dense_grid_sized_by_the_chunk_is_said(cls, caplog):
    """``x.dense()`` without ``shape=`` sizes each replica's grid by its chunk's largest coordinates: a mean over the
    grid was over other cells than one device's (1.6e-4 relative in the first kernel after 3 steps), silently once the
    check of step 0 (where every chunk's grid was the batch's) had passed. Said now; a fixed grid is exact."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "SparseTensor.dense() without shape=" in m})
    # step 0: every chunk's grid is 8^3, the batch's (its check passes); then chunks of few points, smaller grids
    batches = [collate_dict(random_samples(7, seed=s, max_points=40 if s == 1 else 8)) for s in (1, 2, 3)]
    ours, reference = same_start(cls, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    said = {r.getMessage() for r in caplog.records if "SparseTensor.dense() without shape=" in r.getMessage()}
    worst = max(state_differences(ours, reference).values())
    if cls.fixed:
        assert worst <= REL and not said, (worst, said)
    else:
        assert len(said) == 1 and next(iter(said)).startswith("sparse_dp:"), said
        assert worst > 1e-8
