"""Replica threads pinned to cores: the plan (threads.plan_cores), the split evened per core
(balanced_assignment(groups=...)), the executor's affinity, and sync-BN steps with and without pinning
against one device with the whole batch."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.runtime.executor import ReplicaExecutor
from lightning_sparse_dp.runtime.threads import configure_replica_threads, plan_cores
from lightning_sparse_dp.split.assign import balanced_assignment
from tests.support.exact import assert_same_states, same_start
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples

_real_affinity = getattr(os, "sched_getaffinity", None)  # kept from the test below's monkeypatch
needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no os.sched_setaffinity here")


@needs_affinity
@pytest.mark.parametrize(
    "replicas, cores, placement",
    [(3, [0, 1], [0, 1, 1]), (5, [0, 1], [0, 0, 1, 1, 1]), (4, [4, 5, 6], [4, 5, 6, 6]), (7, [2], [2] * 7)],
)
def test_more_replicas_than_cores_are_spread_in_order(replicas, cores, placement):
    plan = plan_cores(replicas, cores=cores)
    assert plan is not None
    assert plan.cores == tuple(frozenset([c]) for c in placement)
    # one group per core: replicas share a group exactly when they share a core
    for i in range(replicas):
        for j in range(replicas):
            assert (plan.groups[i] == plan.groups[j]) == (placement[i] == placement[j])


@needs_affinity
def test_when_nothing_is_pinned():
    assert plan_cores(1, cores=[0]) is None  # one replica
    assert plan_cores(2, cores=[0, 1, 2]) is None  # as many cores as replicas, or more
    assert plan_cores(3, cores=[0, 1], synchronized=False) is None  # no sync BN: replicas meet at the step's end only
    assert plan_cores(3, pin=False, cores=[0, 1]) is None
    assert plan_cores(3, pin=True, cores=[0, 1], synchronized=False) is not None
    plan = plan_cores(2, pin=True, cores=[0, 1, 2, 3, 4])  # fewer replicas than cores: C // R cores each
    assert plan is not None and plan.cores == (frozenset({0, 1}), frozenset({2, 3})) and plan.groups == (0, 1)


def _lpt_max(sizes: list[int], bins: int) -> int:
    """The largest bin of Graham's rule (samples in decreasing size to the emptiest bin): the reference."""
    loads = [0] * bins
    for s in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += s
    return max(loads)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40),
    groups=st.lists(st.integers(0, 3), min_size=1, max_size=6),
)
def test_split_evened_per_group(sizes, groups):
    chunks = balanced_assignment(torch.tensor(sizes), len(groups), groups=groups)
    k = min(len(groups), len(sizes))
    assert len(chunks) == k
    members = [c.tolist() for c in chunks]
    assert sorted(i for m in members for i in m) == list(range(len(sizes)))  # every sample once
    assert all(m == sorted(m) for m in members)  # sample order kept inside each chunk
    group_of = groups[:k]
    loads = {g: sum(sizes[i] for j, m in enumerate(members) if group_of[j] == g for i in m) for g in set(group_of)}
    assert max(loads.values()) <= _lpt_max(sizes, len(loads))  # the moves and swaps never make the fullest worse
    for g in loads:  # inside a group, chunks as Graham's rule leaves them: apart by at most the largest sample
        chunk_loads = [sum(sizes[i] for i in members[j]) for j in range(k) if group_of[j] == g]
        largest = max([sizes[i] for j in range(k) if group_of[j] == g for i in members[j]], default=0)
        assert max(chunk_loads) - min(chunk_loads) <= largest
    assert [c.tolist() for c in balanced_assignment(torch.tensor(sizes), len(groups), groups=groups)] == members


def test_split_per_core_beats_split_per_replica_for_a_shared_core():
    sizes = torch.tensor([900, 800, 700, 600, 500, 400, 300, 200, 100, 100, 50, 50])
    per_replica = [int(sizes[c].sum()) for c in balanced_assignment(sizes, 3)]
    per_core = [int(sizes[c].sum()) for c in balanced_assignment(sizes, 3, groups=(0, 1, 1))]
    total = int(sizes.sum())
    assert per_core[0] == total // 2 and per_core[1] + per_core[2] == total - total // 2  # 2300 : 2300
    assert per_replica[1] + per_replica[2] > per_replica[0] * 1.5  # the shared core would carry ~2/3 of the work


def test_groups_must_cover_the_chunks():
    with pytest.raises(ValueError, match="groups must name a group for each of the 3 chunks"):
        balanced_assignment(torch.tensor([5, 4, 3, 2]), 3, groups=(0, 1))


@needs_affinity
def test_executor_pins_each_replica_thread_and_leaves_the_caller_alone():
    mine = os.sched_getaffinity(0)
    available = sorted(mine)
    affinity = [frozenset([available[i % len(available)]]) for i in range(3)]
    executor = ReplicaExecutor(3, affinity=affinity)
    try:
        seen = executor.run([lambda: os.sched_getaffinity(0)] * 3, [torch.device("cpu")] * 3)
    finally:
        executor.shutdown()
    assert seen == [set(a) for a in affinity]
    assert os.sched_getaffinity(0) == mine


class RecordsCores(SparseNet):
    """SparseNet that records, per replica step, the cores its thread may run on and its chunk's samples (in a
    list of the class: a list of the module would get one device's entries, merged across replicas)."""

    seen: list[tuple[frozenset, int]] = []

    def __init__(self):
        super().__init__(batch_norm=True)
        type(self).seen.clear()

    def training_step(self, batch, batch_idx):
        type(self).seen.append((frozenset(_real_affinity(0)), int(batch["labels"].numel())))
        return super().training_step(batch, batch_idx)


@needs_affinity
@pytest.mark.parametrize("pin", [True, False])
def test_sync_batchnorm_step_with_pinned_replicas_equals_one_device(pin, monkeypatch):
    cores = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))  # what plan_cores sees: 2 cores
    batch = collate_dict(random_samples(9, seed=31))
    ours, reference = same_start(RecordsCores)
    strategy = SparseDataParallelStrategy(pin_replicas=pin, check_exactness=False)  # counts the step's threads
    trainer(strategy=strategy, devices=3, sync_batchnorm=True).fit(ours, loader(batch))
    seen = list(RecordsCores.seen)
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)
    masks = {mask for mask, _ in seen}
    if pin:  # replica 0 alone on the first core, replicas 1 and 2 on the second
        assert masks == {frozenset([cores[0]]), frozenset([cores[-1]])}
    else:
        assert all(len(mask) >= len(cores) for mask in masks)
    assert sum(n for _, n in seen) == 9


def test_presplit_in_workers_uses_the_per_core_split():
    import pickle

    from lightning_sparse_dp.split import split_batch
    from lightning_sparse_dp.split.presplit import PreSplitCollate

    samples = random_samples(10, seed=33)
    assignment = partial(balanced_assignment, groups=(0, 1, 1))
    collate = pickle.loads(pickle.dumps(PreSplitCollate(collate_dict, 3, assignment=assignment)))  # as a worker gets it
    _, expected = split_batch(collate_dict(samples), 3, assignment=assignment)
    _, even = split_batch(collate_dict(samples), 3)
    got = collate(samples).plan
    assert [c.tolist() for c in got.chunk_samples] == [c.tolist() for c in expected.chunk_samples]
    assert [c.tolist() for c in got.chunk_samples] != [c.tolist() for c in even.chunk_samples]


@needs_affinity
def test_loader_workers_split_per_core_when_pinned(monkeypatch):
    from torch.utils.data import DataLoader

    cores = sorted(_real_affinity(0))[:2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    samples = random_samples(10, seed=34)
    ours = RecordsCores()
    strategy = SparseDataParallelStrategy(pin_replicas=True, check_exactness=False)  # counts the chunks seen
    data = DataLoader(samples, batch_size=len(samples), collate_fn=collate_dict, num_workers=1)
    trainer(strategy=strategy, devices=3, sync_batchnorm=True).fit(ours, data)
    sizes = torch.tensor([len(coordinates) for coordinates, _, _ in samples])
    groups = plan_cores(3, pin=True, cores=cores).groups  # (0, 1, 1) on 2 cores
    expected = sorted(len(c) for c in balanced_assignment(sizes, 3, groups=groups))
    assert sorted(n for _, n in ours.seen) == expected
    if len(cores) == 2:
        assert expected != sorted(len(c) for c in balanced_assignment(sizes, 3))  # the test can tell them apart


def test_pin_replicas_must_be_none_or_a_bool():
    with pytest.raises(ValueError, match="pin_replicas must be None .* True or False, got 'yes'"):
        SparseDataParallelStrategy(pin_replicas="yes")


@needs_affinity
def test_a_refused_mask_runs_unpinned_and_says_so(monkeypatch):
    def refuse(pid, mask):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    executor = ReplicaExecutor(2, affinity=[frozenset([0]), frozenset([0])])
    try:
        with pytest.warns(UserWarning, match="could not pin replica .* runs unpinned"):
            assert executor.run([lambda: 1, lambda: 2], [torch.device("cpu")] * 2) == [1, 2]
    finally:
        executor.shutdown()


@needs_affinity
def test_pinned_split_with_ignore_labels_and_class_weights_equals_one_device(monkeypatch):
    # the per-core split gives the replicas uneven shares of the ignored points: the loss as users write it
    # (nn.CrossEntropyLoss with ignore_index and class weights) must still train and log as one device
    from tests.support.clients import fresh_loader
    from tests.support.exact import same_start, state_differences
    from tests.support.helpers import trainer
    from tests.support.term_models import ScanNetSeg, seg_batch

    def fit(model, strategy="auto", devices=1):
        t = trainer(strategy=strategy, devices=devices, max_steps=2, sync_batchnorm=True, precision="64-true")
        t.fit(model, fresh_loader(batches))
        return t

    cores = sorted(_real_affinity(0))[:2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    weight = torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64)
    batches = [seg_batch(8, seed=s, fractions=(0.0, 0.4, 1.0)) for s in (41, 42)]
    ours, reference = same_start(ScanNetSeg, seed=0, weight=weight)
    t = fit(ours, SparseDataParallelStrategy(pin_replicas=True), 3)
    r = fit(reference)
    assert max(state_differences(ours, reference).values()) <= 1e-10
    loss, expected = t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]
    assert abs(float(loss) - float(expected)) <= 1e-10 * abs(float(expected))


@pytest.mark.parametrize("pin", [True, None, False])
def test_pinning_on_gpu_replicas_changes_nothing_and_says_so_when_asked(pin, recwarn):
    class Executor:  # what configure_replica_threads sets on a ReplicaExecutor
        threads_per_replica = "untouched"
        affinity = "untouched"

    executor = Executor()
    assert configure_replica_threads(executor, 3, pin, True, "cuda") == (None, None)
    assert executor.threads_per_replica == "untouched" and executor.affinity == "untouched"
    said = [str(w.message) for w in recwarn if "pin_replicas=True applies to CPU replicas only" in str(w.message)]
    assert len(said) == (1 if pin else 0)
