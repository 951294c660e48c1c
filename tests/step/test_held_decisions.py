"""Decisions of the step that depend only on the module and its devices, made when the replicas are built and reused
while they hold: whether a refresh copies parameters, whether the replicas' threads have buffers to copy; and stages
with nothing to do not entered (the skipped stage, a gather's suggestion of an ``output_layout`` key)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_sparse_dp.split import split_batch
from lightning_sparse_dp.step import gather as gather_module
from lightning_sparse_dp.step import output_roles as roles_module
from lightning_sparse_dp.step.copies import BufferHandOff
from lightning_sparse_dp.step.gather import gather_outputs
from lightning_sparse_dp.step.replicate import Replicas
from tests.support.devices import CPU3
from tests.support.helpers import SparseNet, collate_dict, random_samples

CPU = torch.device("cpu")


class _Teacher(nn.Module):
    """A trainable layer and two frozen ones (an EMA teacher's parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(2, 2)
        self.teacher = nn.Linear(2, 2)
        self.teacher.requires_grad_(False)


def _counted(monkeypatch: pytest.MonkeyPatch, replicas: Replicas) -> list[int]:
    """The counts ``replicas._copy_parameters`` is called with from now on (it still copies)."""
    calls: list[int] = []
    copy = replicas._copy_parameters

    def counting(count=None):
        calls.append(count)
        copy(count)

    monkeypatch.setattr(replicas, "_copy_parameters", counting)
    return calls


def _copies_anything(replicas: Replicas, count: int) -> bool:
    """What ``_copy_parameters`` derives for ``count`` replicas: a frozen parameter a replica owns, or a replica on
    another GPU with parameters (the derivation the replicas hold since they were built)."""
    owned = any(replicas._owned_copies[r] for r in range(1, count))
    others = any(d != replicas.devices[0] and d.type == "cuda" for d in replicas.devices[1:count])
    return owned or (others and bool(replicas.trainable or replicas.frozen))


def test_cpu_replicas_owning_no_frozen_parameter_copy_no_parameters_at_a_refresh(monkeypatch):
    replicas = Replicas(SparseNet(), CPU3)
    calls = _counted(monkeypatch, replicas)
    for count in (1, 2, 3):
        replicas.refresh_tensors(count)
    assert calls == []  # decided when built: nothing to copy, the copy is not entered


def test_frozen_parameters_the_replicas_own_are_copied_from_the_second_replica_on(monkeypatch):
    module = _Teacher()
    replicas = Replicas(module, CPU3, own_frozen={"teacher.weight"})
    calls = _counted(monkeypatch, replicas)
    replicas.refresh_tensors(1)  # the root replica alone shares the module's storage: nothing to copy
    assert calls == []
    with torch.no_grad():
        module.teacher.weight.mul_(0.5)  # an EMA update in place
    replicas.refresh_tensors(3)
    assert calls == [3]
    for r in (1, 2):
        assert torch.equal(replicas.modules[r].teacher.weight, module.teacher.weight)
        assert replicas.modules[r].teacher.weight.data_ptr() != module.teacher.weight.data_ptr()
    rebuilt = Replicas(module, CPU3)  # rebuilt owning none: decided anew
    calls = _counted(monkeypatch, rebuilt)
    rebuilt.refresh_tensors(3)
    assert calls == []


@settings(max_examples=30, deadline=None)
@given(owned=st.sets(st.sampled_from(["teacher.weight", "teacher.bias"])), replicas=st.integers(1, 3),
       count=st.integers(1, 3))
def test_the_held_parameter_copy_decision_is_the_derivation(owned, replicas, count):
    built = Replicas(_Teacher(), [CPU] * replicas, own_frozen=owned)
    count = min(count, replicas)
    assert (count > built._copied_from) == _copies_anything(built, count)


def test_buffer_hand_off_only_where_the_module_has_buffers_to_copy():
    without = Replicas(SparseNet(), CPU3)
    assert without.buffers_in_threads and without.buffer_hand_off(3) is None  # nothing for the threads to copy or wait for
    module = SparseNet()
    module.register_buffer("seen", torch.zeros(2))  # a buffer added between steps: the replicas no longer fit ...
    assert not without.matches(module, CPU3)
    rebuilt = Replicas(module, CPU3)  # ... and the rebuilt ones hand their copies to the threads
    hand_off = rebuilt.buffer_hand_off(3)
    assert isinstance(hand_off, BufferHandOff)
    module.seen.fill_(3.0)
    hand_off.copy(1)
    hand_off.copy(2)
    hand_off.wait()
    assert all(torch.equal(r.seen, module.seen) for r in rebuilt.modules[1:])
    assert isinstance(Replicas(SparseNet(batch_norm=True), CPU3).buffer_hand_off(3), BufferHandOff)


def _plan():
    return split_batch(collate_dict(random_samples(6)), 3)[1]


def test_a_gather_prints_a_leaf_and_its_key_only_when_it_says_something(monkeypatch):
    calls: list = []
    key, printed = roles_module.output_key, roles_module.printed
    for module in (gather_module, roles_module):  # the gather's own lines, and the roles' (guess_role)
        monkeypatch.setattr(module, "output_key", lambda path: calls.append(path) or key(path))
        monkeypatch.setattr(module, "printed", lambda path: calls.append(path) or printed(path))
    plan = _plan()
    losses = [torch.tensor(float(i)) for i in range(3)]
    gather_outputs(losses, plan, [1 / 3] * 3, CPU)
    gather_outputs([{"loss": v} for v in losses], plan, [1 / 3] * 3, CPU)
    assert calls == []  # a mean: nothing said, no name printed, no key looked up
    with pytest.warns(UserWarning, match=r"output\['hits'\] is a 0-dim integer.*output_layout=\{'hits': 'list'\}"):
        out = gather_outputs([{"hits": torch.tensor(i)} for i in range(3)], plan, [1 / 3] * 3, CPU)
    assert int(out["hits"]) == 3 and calls  # said: printed, with its key
