"""The thread collective, with plain threads (no Lightning, no ME)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_sparse_dp.syncbn.collective import Collective, ReplicaAborted, ThreadGroup, gather_reduce
from tests.support.helpers import run_ranks


def test_all_gather_returns_every_rank_in_rank_order_call_after_call():
    group = ThreadGroup(3)

    def fn(rank, member):
        assert isinstance(member, Collective) and member.rank == rank and member.world_size == 3
        out = []
        for call in range(5):
            if rank == call % 3:
                time.sleep(0.01)  # a late rank
            out.append([t.tolist() for t in member.all_gather(torch.tensor([rank, call]))])
        return out

    results = run_ranks(group, fn)
    expected = [[[r, call] for r in range(3)] for call in range(5)]
    assert results == [expected] * 3


def test_one_rank_gathers_its_own_tensor():
    member = ThreadGroup(1).member(0)
    t = torch.arange(3.0)
    gathered = member.all_gather(t)
    assert len(gathered) == 1 and torch.equal(gathered[0], t)


def test_a_failing_rank_stops_the_waiting_ones_at_once():
    group = ThreadGroup(3)

    def fn(rank, member):
        member.all_gather(torch.zeros(2))
        if rank == 1:
            raise KeyError("rank 1 fails")
        member.all_gather(torch.zeros(2))  # ranks 0 and 2 would wait here forever

    start = time.perf_counter()
    results = run_ranks(group, fn)
    assert time.perf_counter() - start < 10
    assert isinstance(results[1], KeyError)
    for r in (0, 2):
        assert isinstance(results[r], ReplicaAborted) and "replica 1 raised KeyError" in str(results[r])
    with pytest.raises(ReplicaAborted):  # and every later call
        group.member(0).all_gather(torch.zeros(2))


def test_a_rank_that_finishes_early_aborts_the_ones_waiting_for_it():
    group = ThreadGroup(3)

    def fn(rank, member):
        for _ in range(1 if rank == 2 else 2):
            member.all_gather(torch.zeros(1))

    results = run_ranks(group, fn)
    assert all(isinstance(r, ReplicaAborted) for r in results[:2])
    assert "replica 2 finished after 1 collective call(s)" in str(results[0])
    assert results[2] is None


def test_different_shapes_are_refused():
    group = ThreadGroup(2)
    results = run_ranks(group, lambda rank, member: member.all_gather(torch.zeros(rank + 1)))
    assert all(isinstance(r, ReplicaAborted) and "different shapes" in str(r) for r in results)


def test_phases_reuse_the_group_without_false_alarms():
    """A forward phase, then a backward phase in which one rank starts long before the others."""
    group = ThreadGroup(3)
    forward = run_ranks(group, lambda rank, member: member.all_gather(torch.tensor([rank]))[2].item())
    assert forward == [2, 2, 2]

    def backward(rank, member):
        if rank != 0:
            time.sleep(0.05)  # rank 0 enters the phase and waits while the others are still "finished"
        return sum(t.item() for t in member.all_gather(torch.tensor([10 * rank])))

    assert run_ranks(group, backward) == [30, 30, 30]


def test_tensors_come_back_on_the_callers_device_and_unaltered():
    group = ThreadGroup(2)
    results = run_ranks(group, lambda rank, member: member.all_gather(torch.full((2, 3), float(rank), dtype=torch.float64)))
    for gathered in results:
        assert [g.dtype for g in gathered] == [torch.float64] * 2
        assert [g[0, 0].item() for g in gathered] == [0.0, 1.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        ThreadGroup(0)
    with pytest.raises(ValueError, match="rank 3"):
        ThreadGroup(3).member(3)


def test_all_gather_reduce_computes_once_and_hands_every_rank_the_same_result():
    group = ThreadGroup(3)
    calls = []

    def combine(tensors):
        calls.append(threading.current_thread().name)
        return torch.stack(tensors).sum(0)

    results = run_ranks(group, lambda rank, member: member.all_gather_reduce(torch.tensor([rank, 10 * rank]), combine))
    assert len(calls) == 1
    assert all(r is results[0] for r in results) and results[0].tolist() == [3, 30]


def test_all_gather_apply_takes_items_of_any_shape_and_checks_their_kind():
    group = ThreadGroup(3)
    calls = []

    def concatenate(items):
        calls.append(len(items))
        return torch.cat([x for x, _ in items])

    items = [(torch.full((rank + 1,), float(rank)), f"rank {rank}") for rank in range(3)]  # 1, 2 and 3 rows
    results = run_ranks(group, lambda rank, member: member.all_gather_apply(items[rank], ("layer", 1), concatenate))
    assert calls == [1 * 3] and all(r is results[0] for r in results)
    assert results[0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]

    group = ThreadGroup(2)  # ranks naming different kinds ran different layers
    results = run_ranks(group, lambda rank, member: member.all_gather_apply(rank, ("layer", rank), lambda items: items))
    assert all(isinstance(r, ReplicaAborted) and "different" in str(r) for r in results)


def test_a_reduction_that_raises_raises_in_every_rank():
    group = ThreadGroup(2)

    def combine(tensors):
        raise ValueError("bad statistics")

    results = run_ranks(group, lambda rank, member: member.all_gather_reduce(torch.zeros(1), combine))
    assert all(isinstance(r, ValueError) and "bad statistics" in str(r) for r in results)


def test_gather_reduce_gathers_and_reduces_in_each_rank_for_other_collectives():
    class Pair:
        rank, world_size = 0, 2

        def all_gather(self, tensor):
            return [tensor, tensor + 1]

    assert gather_reduce(Pair(), torch.tensor([1.0]), torch.cat).tolist() == [1.0, 2.0]


def test_waits_and_layer_times_are_recorded_per_rank():
    group = ThreadGroup(2)

    def layer(rank, member):
        if rank == 1:
            time.sleep(0.3)  # rank 0 waits for it at the rendezvous
        member.all_gather(torch.zeros(1))
        index = member.record(0.01)  # a layer's forward ...
        member.record(0.02, index)  # ... and its backward

    run_ranks(group, layer)
    times = group.times.timings()
    assert times["syncbn0"] == pytest.approx(0.03) and times["syncbn"] == pytest.approx(0.03)
    assert 0.3 / 2 * 0.8 <= times["syncbn_wait"] < 0.3  # mean over the two ranks of rank 0's wait
    assert ThreadGroup(2).times.timings() == {}  # nothing recorded: no stage


def test_what_a_collective_can_do_is_its_protocol_not_a_probe():
    """A thread group's member is a FusedCollective (computed once, timed); a collective with ``all_gather`` alone is
    a plain Collective, and gather_reduce reduces on each rank over it."""
    from lightning_sparse_dp.syncbn.collective import Collective, FusedCollective, gather_reduce, is_fused

    class Plain:
        rank, world_size = 0, 1

        def all_gather(self, tensor):
            return [tensor]

    member = ThreadGroup(1).member(0)
    assert isinstance(member, FusedCollective) and isinstance(Plain(), Collective)
    assert not isinstance(Plain(), FusedCollective)
    assert is_fused(member) and not is_fused(Plain()) and is_fused(ThreadGroup(2).member(1))  # remembered per type
    assert gather_reduce(Plain(), torch.ones(2), lambda ts: ts[0] * 3).tolist() == [3.0, 3.0]
    assert gather_reduce(member, torch.ones(2), lambda ts: ts[0] * 3).tolist() == [3.0, 3.0]
