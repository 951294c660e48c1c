"""Exact data parallelism: the module's buffers the step reads and updates (nn.DataParallel's rule, and where it
is not one device's, said).

Each test is an exactness pair (tests/support/exact.py): sparse_dp on CPU replicas, and the same module trained by
plain Lightning on one device with the whole batch, in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import assert_same_states, same_start
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


class _StepCounter(SparseNet):
    """Buffers the step reads: one it then updates in place (every replica reads the module's value from before the
    step, as nn.DataParallel broadcasts the buffers first; the root replica's update is the module's), one the module
    changes between steps (every replica reads the new value)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.float64))
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch) * (1.0 + self.steps_seen) * self.scale
        self.steps_seen += 1.0
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.scale.mul_(0.5)


def test_every_replica_reads_the_buffers_as_the_step_found_them():
    batches = [collate_dict(random_samples(7, seed=s)) for s in (51, 52, 53)]
    ours, reference = same_start(_StepCounter)
    trainer(strategy="sparse_dp", devices=3, logger=False, max_steps=3).fit(ours, loader(*batches))
    trainer(devices=1, logger=False, max_steps=3).fit(reference, loader(*batches))
    assert ours.steps_seen.item() == reference.steps_seen.item() == 3.0 and ours.scale.item() == 0.125
    assert_same_states(ours, reference)


class _LabelCounts(SparseNet):
    """A buffer the step updates in place from its chunk (a histogram of the labels)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("label_counts", torch.zeros(NUM_CLASSES, dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        self.label_counts += torch.bincount(batch["labels"], minlength=NUM_CLASSES).double()
        return self.loss(batch)


@pytest.mark.parametrize(("module", "said"), [(_LabelCounts, True), (_StepCounter, False)], ids=["histogram", "counter"])
def test_a_buffer_the_replicas_update_differently_is_said(module, said):
    # nn.DataParallel's rule (the first replica's update is the module's) is one device's for an update every replica
    # makes alike (a counter, checked against one device above), not for one computed from the chunk: said once
    batches = [collate_dict(random_samples(9, seed=s)) for s in (71, 72)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = module()
        trainer(strategy="sparse_dp", devices=3, logger=False, max_steps=2).fit(ours, loader(*batches))
    messages = [str(w.message) for w in caught if "the module's buffer" in str(w.message)]
    assert len(messages) == int(said), messages
    if said:
        assert "'label_counts'" in messages[0]
        whole = sum(torch.bincount(b["labels"], minlength=NUM_CLASSES) for b in batches).double()
        assert not torch.equal(ours.label_counts, whole)  # the first replica's chunks only, as the warning says


class _RareCounts(SparseNet):
    """A buffer the step updates only in a branch on its chunk (a sample of a rare class present)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rare_seen", torch.zeros((), dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        rare = batch["labels"] == NUM_CLASSES - 1
        if rare.any():
            self.rare_seen += rare.sum()
        return self.loss(batch)


def test_a_buffer_only_other_replicas_update_is_said():
    """The root replica's chunk holds no rare sample, the others' do: the module kept the root replica's buffer as it
    was (0 where one device counts them), and nothing was said, the root replica having left it unchanged."""
    labels = torch.tensor([0, 0, 0, NUM_CLASSES - 1, 0, NUM_CLASSES - 1])  # chunks of 2: the root's has none
    batch = collate_dict(random_samples(6, seed=73, min_points=10, max_points=10))
    batch["labels"] = labels
    strategy = SparseDataParallelStrategy(check_exactness=False, split="contiguous")
    with pytest.warns(UserWarning, match=r"the module's buffer 'rare_seen' to a different value"):
        ours = _RareCounts()
        trainer(strategy=strategy, devices=3, logger=False).fit(ours, loader(batch))
    assert ours.rare_seen.item() == 0.0  # the root replica's, as the warning says (one device's: 2)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_teacher_updated_in_place_in_the_step_is_one_devices(devices):
    """An EMA teacher updated in place at the top of ``training_step`` (BYOL / MoCo): the replicas shared its storage on
    CPU, so each applied the update (teacher 4.5e-2 / 8.4e-2 off after 3 steps, and a race with the replicas' saved
    tensors that could fail the backward). The exactness check finds the parameters the step changes in place and
    every replica owns a copy of them; the module keeps the root replica's update (issue 65, item 6)."""
    from tests.support.step_forms import TeacherInPlace

    batches = [collate_dict(random_samples(7, seed=s)) for s in (61, 62, 63)]
    ours, reference = same_start(TeacherInPlace, seed=0)
    trainer(strategy="sparse_dp", devices=devices, max_steps=3, precision="64-true").fit(ours, loader(*batches))
    trainer(max_steps=3, precision="64-true").fit(reference, loader(*batches))
    assert_same_states(ours, reference)


def test_a_teacher_updated_in_place_without_the_check_is_said_once_then_owned():
    from lightning_sparse_dp import SparseDataParallelStrategy
    from tests.support.step_forms import TeacherInPlace

    batches = [collate_dict(random_samples(7, seed=s)) for s in (61, 62, 63)]
    with pytest.warns(UserWarning, match=r"changed the frozen parameter 'teacher.weight' in place") as caught:
        strategy = SparseDataParallelStrategy(check_exactness=False)
        try:
            trainer(strategy=strategy, devices=3, max_steps=3, precision="64-true").fit(TeacherInPlace(), loader(*batches))
        except RuntimeError as err:  # the first step's replicas may race on the shared teacher (said before, noted)
            assert "modified by an inplace operation" in str(err)
            assert any("frozen parameters" in note for note in err.__notes__), err.__notes__
    assert len([w for w in caught if "'teacher.weight'" in str(w.message)]) == 1
    assert strategy._frozen_written == {"teacher.weight", "teacher.bias"}  # the next fit's replicas own them


class _CountsSamples(SparseNet):
    """Counts of the samples and points the step saw, in a buffer and in a Python attribute."""

    def __init__(self):
        super().__init__()
        self.register_buffer("samples_seen", torch.zeros((), dtype=torch.long))
        self.points_seen = 0
        self.seen = {"samples": 0}
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.samples_seen += batch["labels"].numel()
        self.points_seen += int(batch["coordinates"].shape[0])
        self.seen["samples"] += len(batch["labels"])
        self.sizes.append(len(batch["labels"]))
        return self.loss(batch)


def test_a_count_of_equal_chunks_the_replicas_agree_on_is_said():
    """Over chunks of equal sizes every replica adds the same count, so the replicas agree and nothing was said, while
    the module kept a third of one device's count (4 samples where it counts 12). Both are said now, and so are such a
    count in a dict of the module and one appended to its list (they were not)."""
    samples = random_samples(6, seed=74, min_points=10, max_points=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _CountsSamples()
        strategy = SparseDataParallelStrategy(check_exactness=False)
        trainer(strategy=strategy, devices=3, logger=False, max_steps=1).fit(ours, loader(collate_dict(samples)))
    said = [str(w.message) for w in caught]
    assert any("buffer 'samples_seen' by 2 in every replica" in m for m in said), said
    assert any("self.points_seen grew by 20 in every replica's step" in m for m in said), said
    assert any("self.seen['samples'] grew by 2 in every replica's step" in m for m in said), said
    assert any("the entry appended to self.sizes is one number in every replica's step" in m for m in said), said
    assert (ours.seen, ours.sizes) == ({"samples": 2}, [2])  # the replicas' value, as the lines say (one device's: 6)
    assert int(ours.samples_seen) == 2  # the root replica's change, as the warning says (one device's: 6)
