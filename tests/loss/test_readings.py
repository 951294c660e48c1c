"""How a loss's terms are read across replicas (``loss/readings.py``), against plain Lightning on one device in float64:
a ``reduction="sum"`` loss whose input is a batch of one holding the chunk's rows in another dimension; a loss called
under a condition on the chunk."""

from __future__ import annotations

import logging

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import REL, same_start, state_differences, trainer64
from tests.support.helpers import NUM_CLASSES, collate_dict, loader, random_samples
from tests.support.step_forms import PooledNet
from tests.support.term_models import ScanNetSeg, seg_batch


class SummedOverOneBatch(PooledNet):
    """The cross-entropy's K-dimensional layout, ``[1, C, B]``: rows in the last dimension, ``reduction="sum"``."""

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch))
        return F.cross_entropy(logits.T[None], batch["labels"][None], reduction="sum")


class BatchmeanOverOneBatch(PooledNet):
    """``F.kl_div(..., reduction="batchmean")`` on ``[1, B, C]``: torch divides by ``input.size(0)``, which is 1."""

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch))
        target = (0.7 * F.one_hot(batch["labels"], logits.shape[1]) + 0.3 / logits.shape[1]).to(logits)
        return F.kl_div(logits.log_softmax(1)[None], target[None], reduction="batchmean")


@pytest.mark.parametrize("cls", [SummedOverOneBatch, BatchmeanOverOneBatch])
def test_a_sum_over_a_batch_of_one_is_the_chunks_sum(cls):
    """Its input has one row in every replica, so its coefficient (1) times its rows (1) was read as ``sum / len(y)``:
    the whole batch's sum divided by the replicas' rows, 3 on 3 replicas (the loss and gradients 1 - 1/3 off one
    device's, the parameters 1.27 after 3 steps), with an info line promising a later batch would settle it. A
    ``batchmean`` KL divergence there was weighted as a mean over the chunks' one row each: their average, not their
    sum (1.33 off after 2 steps, silently with the check off)."""
    batches = [collate_dict(random_samples(n, seed=s)) for n, s in ((7, 11), (8, 12), (5, 13))]
    ours, reference = same_start(cls, seed=0)
    trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    assert max(state_differences(ours, reference).values()) <= REL


class _Conditional(PooledNet):
    """An auxiliary loss added only where the batch holds class 0 (a head trained only on batches with positives)."""

    def aux_due(self, batch):
        return bool((batch["labels"] == 0).any())

    def training_step(self, batch, batch_idx):
        logits, labels = self.head(self.features(batch)), batch["labels"]
        loss = F.cross_entropy(logits, labels)
        if self.aux_due(batch):
            loss = loss + F.binary_cross_entropy_with_logits(logits[:, 0], (labels == 0).to(logits))
        return loss


class _ConditionOfTheBatch(_Conditional):
    """The fix the line names: the condition decided on the whole batch, before the split."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "aux": bool((batch["labels"] == 0).any())}

    def aux_due(self, batch):
        return batch["aux"]


def test_a_loss_under_a_condition_on_the_chunk_names_the_fix_that_is_exact(caplog):
    """Each replica decided the condition on its own chunk: the line suggested a loss_weighting callable counting
    labels != 255, which cannot mend that (0.59 relative off one device with it). It now says no weighting makes it
    exact and names what does: the condition decided on the whole batch, which is one device's."""
    batches = [collate_dict(random_samples(8, seed=s)) for s in (14, 15)]
    for b in batches:
        b["labels"][:3] = 0  # class 0 in the first samples only: the other chunks hold none
        b["labels"][3:] = b["labels"][3:].clamp(min=1)
    ours, reference = same_start(_Conditional, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, max_steps=2).fit(
            ours, loader(*batches))
    said = [r.getMessage() for r in caplog.records if "No loss weighting makes that exact" in r.getMessage()]
    assert len(said) == 1 and "on_before_batch_transfer" in said[0] and "loss_weighting=lambda" not in said[0]
    ours, reference = same_start(_ConditionOfTheBatch, seed=0)
    trainer64(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, max_steps=2).fit(ours, loader(*batches))
    trainer64(max_steps=2).fit(reference, loader(*batches))
    assert max(state_differences(ours, reference).values()) <= REL


class _DropsNaNLosses(ScanNetSeg):
    """A per-sample loop that drops the NaN loss of a sample whose every label is ignored, as many published steps do."""

    def training_step(self, batch, batch_idx):
        logits, labels, ids = self.logits(batch), batch["labels"], batch["coordinates"][:, 0]
        losses = [F.cross_entropy(logits[ids == s], labels[ids == s], ignore_index=255) for s in range(int(ids.max()) + 1)]
        return torch.stack([x for x in losses if not torch.isnan(x)]).mean()


class _SkipsEmptySamples(ScanNetSeg):
    """The fix the line names: the call skipped for such a sample."""

    def training_step(self, batch, batch_idx):
        logits, labels, ids = self.logits(batch), batch["labels"], batch["coordinates"][:, 0]
        losses = [F.cross_entropy(logits[ids == s], labels[ids == s], ignore_index=255)
                  for s in range(int(ids.max()) + 1) if (labels[ids == s] != 255).any()]
        return torch.stack(losses).mean()


def test_a_per_sample_loss_dropped_as_nan_is_said_with_the_fix_that_is_exact(caplog):
    """A replica's call over nothing gives 0, not one device's NaN, so the step's NaN filter kept it and the mean ran
    over one sample more (4.3e-2 relative off one device), said as "the step's loss is NaN, as on one device", which
    it was not. It is said now as what it is, naming the skip, which is exact."""
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.6)) for s in (121, 122)]
    for b in batches:
        b["labels"][b["coordinates"][:, 0] == 1] = 255  # sample 1: every label ignored
    ours, _ = same_start(_DropsNaNLosses, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, max_steps=2, sync_batchnorm=True).fit(ours, loader(*batches))
    said = [r.getMessage() for r in caplog.records if "nothing to average over" in r.getMessage()]
    assert len(said) == 1 and "(y_s != ignore_index).any()" in said[0] and "is NaN, as on one device" not in said[0]
    ours, reference = same_start(_SkipsEmptySamples, seed=0)
    trainer64(strategy="sparse_dp", devices=3, max_steps=2, sync_batchnorm=True).fit(ours, loader(*batches))
    trainer64(max_steps=2).fit(reference, loader(*batches))
    assert max(state_differences(ours, reference).values()) <= REL


class _PlainSum(PooledNet):
    """A cross-entropy summed over the samples."""

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.head(self.features(batch)), batch["labels"], reduction="sum")


def test_a_sum_over_one_sample_in_every_replica_is_the_chunks_sum():
    """A batch of as many samples as replicas (one scene per device) leaves every call one row: coefficient 1 times
    1 row was read as sum / len(y), the whole batch's sum over 3 (the loss 0.67 off one device's, every step, as no
    batch of unequal chunks came to settle it). One row in every replica is read as the sum now, said once."""
    batches = [collate_dict(random_samples(3, seed=s)) for s in (16, 17)]
    ours, reference = same_start(_PlainSum, seed=0)
    trainer64(strategy="sparse_dp", devices=3, max_steps=2).fit(ours, loader(*batches))
    trainer64(max_steps=2).fit(reference, loader(*batches))
    assert max(state_differences(ours, reference).values()) <= REL


class _PerPositive(PooledNet):
    """A loss normalized by the number of positives (detection style): ``l.sum() / count``, the count of the chunk's
    positives as a tensor (``t.sum().clamp(min=1)``) or a Python number (``max(int(t.sum()), 1)``)."""

    def __init__(self, tensor_count: bool = True):
        super().__init__()
        self.tensor_count = tensor_count

    def count(self, batch, t):
        return t.sum().clamp(min=1) if self.tensor_count else max(int(t.sum()), 1)

    def training_step(self, batch, batch_idx):
        logit = self.head(self.features(batch))[:, 0]
        t = (batch["labels"] == 0).to(logit)
        return F.binary_cross_entropy_with_logits(logit, t, reduction="none").sum() / self.count(batch, t)


class _PerPositiveOfTheBatch(_PerPositive):
    """The fix the line names: the count taken on the whole batch, which every replica gets alike."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "num_pos": (batch["labels"] == 0).sum()}

    def count(self, batch, t):
        return batch["num_pos"].clamp(min=1)


@pytest.mark.parametrize("tensor_count", [True, False], ids=["tensor", "int"])
def test_a_sum_over_a_count_of_the_chunk_is_said_also_when_the_counts_are_equal(tensor_count, caplog):
    """One positive in every chunk of 2: each replica divided by 1, read as a plain sum, so the loss was the replicas'
    sum, 3x one device's (which divides by 3), silently. The count is followed from the chunk's data now, and such a
    division is said whatever its value; the count taken on the whole batch is exact."""
    batch = collate_dict(random_samples(6, seed=16, min_points=12, max_points=12))
    batch["labels"] = torch.tensor([0, 1, 0, 2, 0, 3])
    with caplog.at_level(logging.INFO):
        trainer64(strategy=SparseDataParallelStrategy(split="contiguous", check_exactness=False), devices=3).fit(
            _PerPositive(tensor_count), loader(batch))
    said = [r.getMessage() for r in caplog.records if "by a count of their chunk" in r.getMessage()]
    assert len(said) == 1 and "on_before_batch_transfer" in said[0]
    ours, reference = same_start(_PerPositiveOfTheBatch, seed=0)
    trainer64(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3).fit(ours, loader(batch))
    trainer64().fit(reference, loader(batch))
    assert max(state_differences(ours, reference).values()) <= REL


class _Saliency(PooledNet):
    """Input gradients of the loss in a validation step (a saliency map), under ``Trainer(inference_mode=False)``."""

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            features = batch["features"].detach().requires_grad_(True)
            logits = self.head(self.features({**batch, "features": features}))
            (grad,) = torch.autograd.grad(F.cross_entropy(logits, batch["labels"]), features)
        self.log("saliency", grad.abs().sum(), batch_size=len(batch["labels"]))


def test_input_gradients_of_a_chunks_loss_in_validation_are_said():
    """Each replica differentiates its chunk's mean: the gradients were about 3x one device's on 3 replicas (a logged
    saliency 2.0 off), silently. It is said, naming the sum and the whole batch's count."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "calls torch.autograd.grad of a loss over its chunk" in m})
    with pytest.warns(UserWarning, match=r"calls torch.autograd.grad of a loss over its chunk.*reduction='sum'"):
        trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None, inference_mode=False).validate(
            _Saliency(), loader(collate_dict(random_samples(7, seed=28))), verbose=False)


class _SumPerScene(PooledNet):
    """A per-point loss "per scene": ``reduction="sum"`` over the points divided by the number of samples the step got."""

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self.head(self.body[0](x).F.repeat(1, 2))
        return F.cross_entropy(logits, batch["point_labels"], reduction="sum") / len(batch["labels"])


def _with_point_labels(batch: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {**batch, "point_labels": torch.randint(0, NUM_CLASSES, (len(batch["coordinates"]),), generator=g)}


def test_a_coefficient_of_the_chunk_is_said_also_at_later_steps_of_equal_chunks(caplog):
    """A per-point sum divided by the chunk's number of samples: 7 samples (chunks of 2, 2, 3) give different
    coefficients, said and weighted as "auto" (exact here); at the next steps 6 samples (chunks of 2) gave every replica
    1/2, read as a constant coefficient, so the loss was the replicas' sum, 3x one device's, silently (the hand-written
    form, ``l.sum() / n``, was remembered already). The site is remembered now: weighted as "auto", said."""
    batches = [_with_point_labels(collate_dict(random_samples(n, seed=s)), s)
               for n, s in ((7, 30), (6, 31), (6, 32))]
    ours, reference = same_start(_SumPerScene, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    said = [r.getMessage() for r in caplog.records if "different coefficients at an earlier step" in r.getMessage()]
    assert len(said) == 1 and "on_before_batch_transfer" in said[0], said
    assert max(state_differences(ours, reference).values()) <= REL


class _StopsWhenEmpty(PooledNet):
    """A validation loss over "levels" that stops once the chunk has no row left (a decoder pruning by its own scores:
    ``examples/train_completion.py`` before it kept the target voxels): level 1 keeps the rows of classes above 0."""

    stops = True

    def validation_step(self, batch, batch_idx):
        logits, labels = self.head(self.features(batch)), batch["labels"]
        keep, losses = torch.ones_like(labels, dtype=torch.bool), []
        for _ in range(2):
            losses.append(F.cross_entropy(logits[keep], labels[keep]))
            keep = keep & (labels > 0)
            if self.stops and not bool(keep.any()):
                break
        self.log("val_loss", sum(losses) / len(losses), batch_size=len(labels))


class _EveryLevel(_StopsWhenEmpty):
    """The fix the line names: the loss called at every level, on no rows where the chunk has none left."""

    stops = False


def _val_loss(model, batches, **kwargs) -> float:
    strategy = SparseDataParallelStrategy(split="contiguous") if kwargs else "auto"
    t = trainer64(strategy=strategy, limit_val_batches=None, **kwargs)
    return t.validate(model, loader(*batches), verbose=False)[0]["val_loss"]


def test_a_logged_loss_whose_loop_stops_on_an_empty_chunk_is_said_with_the_fix(caplog):
    """The completion example's validation (3 replicas, float64): a chunk whose rows were all gone after the first
    level called the loss once where the others, and one device, called it twice, so the logged combination had no
    whole-batch value and fell back to the replicas' mean weighted by batch_size (8.8e-4 off one device's on the
    example, 4.3e-3 here over two batches, the second unseen by the exactness check of step 0), said only as "not a
    mean the step computed" (a hand-made ratio), which names no fix. The reason is said now, once, with the fix:
    calling the loss at every level, which is one device's."""
    batches = [collate_dict(random_samples(8, seed=s)) for s in (33, 34)]
    batches[0]["labels"][:] = batches[0]["labels"].clamp(min=1)  # every chunk reaches both levels (checked step 0)
    batches[1]["labels"][:3] = 0  # the first chunk (samples 0-2 of a contiguous split) has no row left after level 1
    batches[1]["labels"][3:] = batches[1]["labels"][3:].clamp(min=1)
    ours, reference = same_start(_StopsWhenEmpty, seed=0)
    with caplog.at_level(logging.INFO):
        value = _val_loss(ours, batches, devices=3)
    said = [r.getMessage() for r in caplog.records if "self.log('val_loss', ...) is a combination" in r.getMessage()]
    assert len(said) == 1, said
    assert "different numbers of times" in said[0] and "call the loss at every level" in said[0]
    assert "not a mean the step computed" not in caplog.text  # the guess at a hand-made ratio is not said beside it
    assert abs(value - _val_loss(reference, batches)) > 1e-4 * abs(value)  # what the line says: not one device's
    ours, reference = same_start(_EveryLevel, seed=0)
    assert _val_loss(ours, batches, devices=3) == pytest.approx(_val_loss(reference, batches), rel=REL, abs=0)
