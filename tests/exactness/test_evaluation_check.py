"""The exactness check on evaluation steps and on training steps after the first: what the code reading cannot see
(values that couple the batch's samples) is measured, one device's step against the replicas', and said.

The reference is the same module's step on one device with the whole batch (plain Lightning), run here too: each
"differs" the check says is a real difference from it, each "equals" a real equality.
"""

from __future__ import annotations

import logging

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.clients import Completion, voxel_batch
from tests.support.exact import same_start, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import PooledNet


def _info_nce(z: torch.Tensor) -> torch.Tensor:
    """InfoNCE between the batch's samples: each sample's embedding against every other sample's."""
    z = F.normalize(z, dim=1)
    return F.cross_entropy(z @ z.T / 0.5, torch.arange(z.shape[0], device=z.device))


class _CoupledValidation(PooledNet):
    """A validation step logging a loss between the batch's samples, beside a plain one."""

    def validation_step(self, batch, batch_idx):
        z = self.features(batch)
        self.log("val_ce", F.cross_entropy(self.head(z), batch["labels"]), batch_size=z.shape[0])
        self.log("val_nce", _info_nce(z), batch_size=z.shape[0])


class _PlainValidation(PooledNet):
    def validation_step(self, batch, batch_idx):
        z = self.features(batch)
        self.log("val_ce", F.cross_entropy(self.head(z), batch["labels"]), batch_size=z.shape[0])


class _NearestNeighbour(PooledNet):
    """Predictions that depend on the batch's other samples: each sample's nearest neighbour among them."""

    def predict_step(self, batch, batch_idx):
        z = self.features(batch)
        d = torch.cdist(z, z) + torch.eye(z.shape[0], dtype=z.dtype) * 1e9
        return {"logits": self.head(z), "nn_distance": d.min(1).values}


class _WarmedUp(PooledNet):
    """A contrastive term added after a warm-up of one step."""

    def training_step(self, batch, batch_idx):
        z = self.features(batch)
        loss = F.cross_entropy(self.head(z), batch["labels"])
        if self.global_step >= 1:
            loss = loss + _info_nce(z)
        self.log("train_loss", loss)
        return loss


class _WarmedUpFromZero(PooledNet):
    """The contrastive term there from the first step, its coefficient 0 there (a linear warm-up)."""

    def training_step(self, batch, batch_idx):
        z = self.features(batch)
        loss = F.cross_entropy(self.head(z), batch["labels"]) + min(1.0, self.global_step / 2) * _info_nce(z)
        self.log("train_loss", loss)
        return loss


def _ce(logits, target):
    return F.cross_entropy(logits, target)


class _WarmedUpThroughAHelper(PooledNet):
    """Both terms through one helper (one call site), the contrastive one after a warm-up of one step: or in a loop."""

    loop = False

    def training_step(self, batch, batch_idx):
        z = self.features(batch)
        pairs = [(self.head(z), batch["labels"])]
        if self.global_step >= 1:
            pairs.append((z @ z.T / 0.5, torch.arange(len(z))))
        loss = sum(F.cross_entropy(a, b) for a, b in pairs) if self.loop else sum(_ce(a, b) for a, b in pairs)
        self.log("train_loss", loss)
        return loss


class _WarmedUpInALoop(_WarmedUpThroughAHelper):
    loop = True


def _said(caplog, recwarn) -> list[str]:
    return [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]


def _checks(said: list[str]) -> list[str]:
    return [m.split(" on ")[0] + (": differs" if "differs" in m else ": equals" if "equals" in m else "")
            for m in said if "exactness check of" in m]


BATCHES = [collate_dict(random_samples(7, seed=s)) for s in (51, 52)]


def test_a_validation_value_coupling_the_samples_is_measured_and_said(caplog, recwarn):
    """InfoNCE between samples logged in validation: each replica's is its chunk's (0.55 off one device's), which no
    reading of the code saw: silent. The first validation step is now run on one device and on the replicas, and the
    difference is said, naming the logged value."""
    ours, reference = same_start(_CoupledValidation, seed=0)
    with caplog.at_level(logging.INFO):
        t = trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None)
        t.validate(ours, loader(*BATCHES), verbose=False)
    r = trainer64(limit_val_batches=None)
    r.validate(reference, loader(*BATCHES), verbose=False)
    nce = abs(float(t.callback_metrics["val_nce"]) - float(r.callback_metrics["val_nce"]))
    assert nce > 1e-3 * abs(float(r.callback_metrics["val_nce"]))  # the difference the check is about is real
    assert float(t.callback_metrics["val_ce"]) == pytest.approx(float(r.callback_metrics["val_ce"]), rel=1e-10)
    said = [m for m in _said(caplog, recwarn) if "exactness check of validation step 0" in m]
    assert len(said) == 1 and "differs" in said[0] and "'val_nce'" in said[0] and "'val_ce'" not in said[0], said
    assert "on_validation_batch_end" in said[0]


def test_an_exact_validation_step_is_said_equal_once(caplog, recwarn):
    ours, _ = same_start(_PlainValidation, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(ours, loader(*BATCHES), verbose=False)
    assert _checks(_said(caplog, recwarn)) == ["sparse_dp: exactness check of validation step 0: equals"]


def test_predictions_coupling_the_samples_are_measured_and_said(caplog, recwarn):
    ours, reference = same_start(_NearestNeighbour, seed=0)
    with caplog.at_level(logging.INFO):
        got = trainer64(strategy="sparse_dp", devices=3).predict(ours, loader(*BATCHES))
    want = trainer64().predict(reference, loader(*BATCHES))
    assert torch.allclose(got[0]["logits"], want[0]["logits"], rtol=1e-10, atol=0)
    assert not torch.allclose(got[0]["nn_distance"], want[0]["nn_distance"], rtol=1e-3)
    said = [m for m in _said(caplog, recwarn) if "exactness check of predict step 0" in m]
    assert len(said) == 1 and "\"output['nn_distance']\"" in said[0] and "logits" not in said[0], said


def test_the_check_off_checks_no_evaluation_step(caplog, recwarn):
    ours, _ = same_start(_CoupledValidation, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy=SparseDataParallelStrategy(check_exactness=False), devices=3, limit_val_batches=None).validate(
            ours, loader(*BATCHES), verbose=False)
    assert not _checks(_said(caplog, recwarn))


@pytest.mark.parametrize("cls", [_WarmedUp, _WarmedUpFromZero, _WarmedUpThroughAHelper, _WarmedUpInALoop])
def test_a_loss_term_that_starts_after_the_checked_step_is_checked_when_it_starts(cls, caplog, recwarn):
    """A contrastive term added after a warm-up: the first step (checked) is exact, the term's steps are not (0.23 off
    in the loss), and only 'equals' was said. A step that calls a loss call site no checked step called is checked
    too now; and so is one whose term was there with coefficient 0 at the checked step, or that calls a checked site
    more times (a helper both terms go through, a loop over them), which were not ('equals' only)."""
    ours, reference = same_start(cls, seed=0)
    batches = [collate_dict(random_samples(7, seed=s)) for s in (53, 54, 55)]
    with caplog.at_level(logging.INFO):
        t = trainer64(strategy="sparse_dp", devices=3, max_steps=3)
        t.fit(ours, loader(*batches))
    r = trainer64(max_steps=3)
    r.fit(reference, loader(*batches))
    assert abs(float(t.callback_metrics["train_loss"]) - float(r.callback_metrics["train_loss"])) > 1e-3
    assert _checks(_said(caplog, recwarn)) == ["sparse_dp: exactness check of training step 0: equals",
                                               "sparse_dp: exactness check of training step 1: differs"]


class _TermUnderACountOfTheBatch(PooledNet):
    """An auxiliary term only where the step's batch has at least two samples of label 0."""

    def training_step(self, batch, batch_idx):
        z = self.features(batch)
        logits = self.head(z)
        loss = F.cross_entropy(logits, batch["labels"])
        if int((batch["labels"] == 0).sum()) >= 2:
            loss = loss + F.mse_loss(logits[:, 0], torch.ones_like(logits[:, 0]))
        self.log("train_loss", loss)
        return loss


def test_a_step_that_drops_a_checked_term_under_a_condition_on_the_batch_is_checked(caplog, recwarn):
    """Two samples of label 0 in every chunk at the checked step: every replica and one device add the term. At the
    next step the batch has three, one per chunk: one device adds it, no replica does (a third of the loss off),
    and nothing was said, the step calling no site the checked one had not. A step calling a set of sites no step
    called is checked too now."""
    from lightning_sparse_dp import SparseDataParallelStrategy

    first = collate_dict(random_samples(6, seed=60, min_points=10, max_points=10))
    first["labels"] = torch.tensor([0, 0, 0, 0, 0, 0])
    second = collate_dict(random_samples(6, seed=61, min_points=10, max_points=10))
    second["labels"] = torch.tensor([0, 1, 0, 1, 0, 1])  # contiguous chunks of 2: one 0 each
    ours, reference = same_start(_TermUnderACountOfTheBatch, seed=0)
    with caplog.at_level(logging.INFO):
        t = trainer64(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, max_steps=2)
        t.fit(ours, loader(first, second))
    r = trainer64(max_steps=2)
    r.fit(reference, loader(first, second))
    assert abs(float(t.callback_metrics["train_loss"]) - float(r.callback_metrics["train_loss"])) > 1e-3
    assert _checks(_said(caplog, recwarn)) == ["sparse_dp: exactness check of training step 0: equals",
                                               "sparse_dp: exactness check of training step 1: differs"]


class _CoupledOnTheSecondLoader(PooledNet):
    """Two validation loaders: the second logs a loss between the batch's samples, the first a plain one only."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        z = self.features(batch)
        self.log("val_ce", F.cross_entropy(self.head(z), batch["labels"]), batch_size=z.shape[0])
        if dataloader_idx == 1:
            self.log("val_nce", _info_nce(z), batch_size=z.shape[0])


def test_the_first_step_of_each_validation_loader_is_checked(caplog, recwarn):
    """The first validation step of a run was checked, the first loader's; a value the second loader's steps log (its
    own metric, a coupled loss) was never compared: 2.8e-3 off, silently. Each loader's first step is checked now, and
    the line names the loader."""
    ours, _ = same_start(_CoupledOnTheSecondLoader, seed=0)
    with caplog.at_level(logging.INFO):
        trainer64(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(
            ours, [loader(*BATCHES), loader(*BATCHES)], verbose=False)
    assert _checks(_said(caplog, recwarn)) == ["sparse_dp: exactness check of validation step 0: equals",
                                               "sparse_dp: exactness check of validation step 0 of dataloader 1: differs"]


class _PointTermsInALoop(PooledNet):
    """A per-point mean term called in a loop: once or twice in the training steps (alternating), twice in validation."""

    def term(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return F.mse_loss(self.body[0](x).F.sum(1), batch["features"][:, 0])

    def training_step(self, batch, batch_idx):
        return sum(self.term(batch) for _ in range(1 + batch_idx % 2))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", sum(self.term(batch) for _ in range(2)) / 2, batch_size=len(batch["labels"]))


def test_validation_inside_a_fit_reads_its_losses_as_a_validate_run_does():
    """The training steps call the loop's term a number of times that changes from step to step, which the site memory
    keeps (the loop is read as one over what the chunk holds); validation inside the fit read its own loop by that
    memory, could not weigh it term by term and weighted the replicas by their samples: val_loss 2e-4 off for a mean
    over points (the completion example), where a validate() run, with a memory of its own, is exact. Evaluation steps
    keep a memory of their own now."""
    train = [collate_dict(random_samples(7, seed=s)) for s in (71, 72, 73)]
    val = [collate_dict(random_samples(7, seed=s)) for s in (74, 75)]
    ours, reference = same_start(_PointTermsInALoop, 0.0, seed=0)  # lr 0: the fits' validation on the same weights
    t = trainer64(strategy="sparse_dp", devices=3, max_steps=3, limit_val_batches=None, num_sanity_val_steps=0)
    t.fit(ours, loader(*train), loader(*val))
    r = trainer64(max_steps=3, limit_val_batches=None, num_sanity_val_steps=0)
    r.fit(reference, loader(*train), loader(*val))
    assert float(t.callback_metrics["val_loss"]) == pytest.approx(float(r.callback_metrics["val_loss"]), rel=1e-10)



class _CompletedShapes(Completion):
    """The generative decoder of tests/support/clients.py (stride-2 encoder, ``MinkowskiGenerativeConvolutionTranspose``,
    scores, ``MinkowskiPruning`` of the rows scored negative) predicting as examples/train_completion.py does: one
    ``(coordinates [n_i, 3], logits [n_i, 1])`` pair per sample, and the last level as ``{"C", "F"}`` beside it."""

    def kept(self, score: ME.SparseTensor) -> torch.Tensor:
        return score.F[:, 0] > 0

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        score = self.score(self.gen(self.enc(x)))
        out = self.prune(score, self.kept(score))
        index, b = out.C[:, 0].long(), int(batch["coordinates"][:, 0].max()) + 1
        return {"shapes": [(out.C[index == i, 1:], out.F[index == i]) for i in range(b)], "last": {"C": out.C, "F": out.F}}


class _CompletedAboveTheBatchsMedian(_CompletedShapes):
    """Rows kept above the median score of the batch: each replica keeps those above its chunk's median."""

    def kept(self, score: ME.SparseTensor) -> torch.Tensor:
        return score.F[:, 0] > score.F[:, 0].median()


def _rows(output: dict) -> list[dict]:
    """Each sample's ``(coordinates, logits)`` and the last level's ``(C, F)`` as ``{coordinate tuple: logits}``."""
    pairs = [*output["shapes"], (output["last"]["C"], output["last"]["F"])]
    return [{tuple(c.tolist()): f for c, f in zip(coords, feats)} for coords, feats in pairs]


def _predicted(cls, caplog) -> tuple[list[dict], list[dict], list]:
    """``cls``'s predictions on 3 replicas and on one device (plain Lightning) from the same start, in float64
    (:func:`_rows`), and what the replicas' run said."""
    ours, reference = same_start(cls, seed=0)
    batch = {k: v for k, v in voxel_batch(range(300, 306)).items() if k != "labels"}
    with caplog.at_level(logging.INFO):
        got = trainer64(strategy="sparse_dp", devices=3).predict(ours, loader(batch))
    want = trainer64().predict(reference, loader(batch))
    return _rows(got[0]), _rows(want[0]), [got[0], want[0]]


def test_generated_rows_in_another_order_than_one_devices_are_said_equal(caplog, recwarn):
    """A generative decoder's pruned rows, returned as one ``(coordinates, logits)`` pair per sample (the completion
    example's predict_step) and as ``{"C", "F"}``: one device's on 3 replicas, row by row (matched by coordinates,
    1e-10), but ME gives them in its coordinate map's order, which differs between the batch and a chunk; the check
    compared them position by position and said 'differs' (logits 0.9 to 1.0 relative) on every run. The rows of
    coordinates returned with their features are compared by their coordinates now."""
    ours, reference, (got, want) = _predicted(_CompletedShapes, caplog)
    assert all(len(r) for r in reference) and [r.keys() for r in ours] == [r.keys() for r in reference]
    for mine, theirs in zip(ours, reference):
        for c in theirs:
            torch.testing.assert_close(mine[c], theirs[c], rtol=1e-10, atol=0)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(got["shapes"], want["shapes"]))  # rows in another order
    assert _checks(_said(caplog, recwarn)) == ["sparse_dp: exactness check of predict step 0: equals"]


def test_other_generated_rows_than_one_devices_are_still_said_different(caplog, recwarn):
    """Rows kept above the batch's median score: each replica keeps those above its chunk's, other coordinates than
    one device's (and other numbers of rows): said 'differs', naming the pairs, with rows matched by coordinates."""
    ours, reference, _ = _predicted(_CompletedAboveTheBatchsMedian, caplog)
    assert [r.keys() for r in ours] != [r.keys() for r in reference]  # the difference the check is about is real
    said = [m for m in _said(caplog, recwarn) if "exactness check of predict step 0" in m]
    assert len(said) == 1 and "differs" in said[0] and "output['shapes']" in said[0], said


def test_returned_coordinates_and_features_are_compared_as_rows():
    """What the check reads of returned ``(coordinates, features)``: the same rows in another order are equal; another
    value, another coordinate or a missing row differ; rows of a tensor returned without coordinates keep their order;
    a sample left without rows (the completion example's per-sample pairs) is compared too."""
    from lightning_sparse_dp.exactness.compare import StepRecord, differences, output_tensors

    coords = torch.tensor([[0, 0, 1], [0, 2, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.int32)
    feats = torch.tensor([[0.5, 1.0], [-1.0, 2.0], [3.0, 0.25], [1.5, -2.0]], dtype=torch.float64)
    order = torch.tensor([2, 0, 3, 1])

    def worst(a, b) -> float:
        return max(d for _, d in differences(StepRecord(None, outputs=output_tensors(a)),
                                             StepRecord(None, outputs=output_tensors(b))))

    changed_value, changed_coordinate = feats.clone(), coords.clone()
    changed_value[1, 0] += 1e-6
    changed_coordinate[3, 2] = 5
    expected = [(coords, feats)]
    assert worst([(coords[order], feats[order])], expected) == 0.0
    assert worst({"C": coords[order], "F": feats[order]}, {"C": coords, "F": feats}) == 0.0
    assert worst([(coords, changed_value)], expected) == pytest.approx(1e-6 / 3.0)
    assert worst([(changed_coordinate, feats)], expected) > 0.1
    assert worst([(coords[:3], feats[:3])], expected) == float("inf")
    assert worst([feats[order]], [feats]) > 0.1  # features alone: no coordinates to match them by
    empty = (torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.float64))  # a sample left without rows
    assert worst([empty, (coords[order], feats[order])], [empty, (coords, feats)]) == 0.0
    assert worst([empty], expected) == float("inf")
