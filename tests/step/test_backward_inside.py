"""A backward inside the step (``aux.backward()``, Lightning's ``measure_flops``) on replicas, against one device with
the whole batch (float64): Lightning's ``zero_grad`` between the step and its backward clears what it left, on the
replicas too; inside an accumulation window, where one device keeps it, it is said."""

from __future__ import annotations

import pytest

from tests.support.exact import assert_same_states, same_start
from tests.support.helpers import collate_dict, loader, random_samples, trainer
from tests.support.step_forms import BackwardInside

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

F64 = dict(precision="64-true")


@pytest.mark.parametrize("devices", [2, 3])
def test_a_backward_inside_the_step_leaves_one_devices_gradients(devices):
    """``aux.backward()`` in the step: on one device Lightning's ``zero_grad`` (between the step and its backward)
    clears what it left; the replicas' gradients are cleared at the same point (issue 65, item 1: they were added
    into the reduced gradient, 7.6-11 relative)."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (81, 82)]
    ours, reference = same_start(BackwardInside, seed=0)
    trainer(strategy="sparse_dp", devices=devices, max_steps=2, **F64).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=2, **F64).fit(reference, loader(*batches))
    assert_same_states(ours, reference)


def test_a_backward_inside_the_step_in_an_accumulation_window_is_said():
    """Inside an accumulation window one device keeps what an inner backward left; each replica's is its chunk's, which
    no weight makes the whole batch's: said once, naming the fix."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (81, 82, 83, 84)]
    with pytest.warns(UserWarning, match="a backward inside training_step .* left gradients in an accumulation window"):
        trainer(strategy="sparse_dp", devices=2, max_steps=2, accumulate_grad_batches=2, **F64).fit(
            BackwardInside(), loader(*batches)
        )


def _counting_zero_grad_due(monkeypatch):
    """Counts the reads of Lightning's zero_grad schedule (:func:`~lightning_sparse_dp.step.backward.zero_grad_due`)."""
    from lightning_sparse_dp.step import backward

    calls = []
    real = backward.zero_grad_due

    def counted(module, batch_idx):
        calls.append(batch_idx)
        return real(module, batch_idx)

    monkeypatch.setattr(backward, "zero_grad_due", counted)
    return calls


def test_a_steady_step_reads_no_zero_grad_schedule(monkeypatch):
    """The previous backward took every replica's gradient (``Replicas.reduce_gradients`` leaves ``None``): a step with
    no backward inside has nothing to clear, and reads Lightning's schedule at no step."""
    from tests.support.helpers import SparseNet

    calls = _counting_zero_grad_due(monkeypatch)
    batches = [collate_dict(random_samples(7, seed=s)) for s in (81, 82, 83)]
    trainer(strategy="sparse_dp", devices=3, max_steps=3, **F64).fit(SparseNet(), loader(*batches))
    assert calls == []


def test_a_backward_inside_mid_fit_reads_the_schedule_and_clears_as_one_device(monkeypatch):
    """A backward inside the step from the second step on (the structure changes mid-fit): the schedule is read at those
    steps only, and the replicas' gradients end as one device's."""

    class LateBackwardInside(BackwardInside):
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                return super(BackwardInside, self).training_step(batch, batch_idx)
            return super().training_step(batch, batch_idx)

    calls = _counting_zero_grad_due(monkeypatch)
    batches = [collate_dict(random_samples(7, seed=s)) for s in (81, 82, 83)]
    ours, reference = same_start(LateBackwardInside, seed=0)
    trainer(strategy="sparse_dp", devices=2, max_steps=3, **F64).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=3, **F64).fit(reference, loader(*batches))
    assert set(calls) == {1, 2}  # the step that first backpropagates inside is checked too (its loss is new)
    assert_same_states(ours, reference)
