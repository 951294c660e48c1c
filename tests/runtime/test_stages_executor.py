"""The replica executor as a plain function, without a Trainer: replicas run at once, with the caller's grad mode,
inference mode and autocast, work meanwhile on the calling thread, and errors re-raised naming the replica."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_sparse_dp.runtime.executor import ReplicaExecutor, run_on_replicas
from tests.support.devices import CPU3


def test_the_executor_runs_meanwhile_on_the_calling_thread_once_the_replicas_started():
    executor = ReplicaExecutor(3)
    started = threading.Barrier(4, timeout=10)  # the three replicas and meanwhile: only if all run at once
    caller = threading.current_thread().name

    def replica(i):
        started.wait()
        return i

    seen = []
    try:
        assert executor.run([lambda i=i: replica(i) for i in range(3)], CPU3,
                            meanwhile=lambda: seen.append(threading.current_thread().name) or started.wait()) == [0, 1, 2]
        assert seen == [caller]
        finished = []

        def fails():
            raise KeyError("meanwhile")

        with pytest.raises(KeyError, match="meanwhile"):  # raised once every replica has finished
            executor.run([lambda i=i: finished.append(i) for i in range(3)], CPU3, meanwhile=fails)
        assert sorted(finished) == [0, 1, 2]
        order = []
        executor.run([lambda: order.append("replica")], CPU3[:1], meanwhile=lambda: order.append("meanwhile"))
        assert order == ["meanwhile", "replica"]  # a single replica runs here, after it
    finally:
        executor.shutdown()
    broken = ReplicaExecutor(3)
    broken._threads[2].shutdown()  # replica 2's call is refused after replica 0's started
    released, waited = threading.Event(), []
    with pytest.raises(RuntimeError, match="shutdown"):
        broken.run([lambda: waited.append(released.wait(10)), lambda: None, lambda: None], CPU3, meanwhile=released.set)
    broken.shutdown()
    assert waited == [True]  # what replica 0 waited for ran all the same


def test_executor_runs_concurrently_and_carries_grad_mode_and_autocast():
    barrier = threading.Barrier(3, timeout=10)  # passes only if all three run at once

    def probe():
        barrier.wait()
        return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    executor = ReplicaExecutor(3)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            results = executor.run([probe] * 3, CPU3)
        assert results == [(False, True, torch.bfloat16)] * 3
        results = executor.run([probe] * 3, CPU3)
        assert all(r[:2] == (True, False) for r in results)
    finally:
        executor.shutdown()


def test_executor_carries_inference_mode_and_the_dtype_of_a_disabled_autocast():
    # the executor enters only what differs from a replica thread's own state; what it enters is undone after
    def probe():
        return (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"))

    executor = ReplicaExecutor(2)
    default = torch.get_autocast_dtype("cpu")
    try:
        with torch.inference_mode():
            assert executor.run([probe] * 2, CPU3[:2]) == [(True, False, False, default)] * 2
        torch.set_autocast_dtype("cpu", torch.float16)  # disabled, but a step's torch.autocast("cpu") would take it
        try:
            assert executor.run([probe] * 2, CPU3[:2]) == [(False, True, False, torch.float16)] * 2
        finally:
            torch.set_autocast_dtype("cpu", default)
        assert executor.run([probe] * 2, CPU3[:2]) == [(False, True, False, default)] * 2
    finally:
        executor.shutdown()


def test_executor_reraises_with_replica_index_after_all_finish():
    finished = []

    def ok(i):
        def run():
            finished.append(i)
            return i
        return run

    def bad():
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk") as info:
        run_on_replicas([ok(0), bad, ok(2)], CPU3)
    assert sorted(finished) == [0, 2]
    assert "raised in replica 1 on device cpu" in "".join(info.value.__notes__)


def test_each_replicas_device_context_is_decided_once_per_call(monkeypatch):
    """On CPU nothing is entered: ``replica_contexts`` gives ``nullcontext`` once per call, and ``device_context`` is
    not called in the replicas' threads (on CUDA: tests/runtime/test_cuda_paths_devices.py); a single replica on the
    calling thread takes its device's own context."""
    import contextlib

    from lightning_sparse_dp.runtime import executor as executor_module
    from lightning_sparse_dp.runtime.devices import replica_contexts

    assert replica_contexts(CPU3) == [contextlib.nullcontext] * 3
    entered, decided = [], []
    context, contexts = executor_module.device_context, executor_module.replica_contexts
    monkeypatch.setattr(executor_module, "device_context", lambda *a: entered.append(a) or context(*a))
    monkeypatch.setattr(executor_module, "replica_contexts", lambda d: decided.append(len(d)) or contexts(d))
    executor = ReplicaExecutor(3)
    try:
        assert executor.run([lambda i=i: i for i in range(3)], CPU3) == [0, 1, 2]
        assert decided == [3] and entered == []
        assert executor.run([lambda: 7], CPU3[:1]) == [7]
        assert decided == [3] and entered == [(CPU3[0],)]
    finally:
        executor.shutdown()


def test_shared_draws_are_compared_after_a_call_only_where_they_were_noted_before(monkeypatch):
    """``SharedDraws.after`` runs only for a call ``before`` looked at (deterministic algorithms on, grad mode on)."""
    from lightning_sparse_dp.runtime.randomness import SharedDraws

    compared = []
    after = SharedDraws.after
    monkeypatch.setattr(SharedDraws, "after", lambda self, states: compared.append(len(states)) or after(self, states))
    executor = ReplicaExecutor(2)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)  # whatever an earlier test's Trainer(deterministic=True) left
        executor.run([lambda: 0, lambda: 1], CPU3[:2])
        assert compared == []  # not deterministic: nothing noted, nothing compared
        torch.use_deterministic_algorithms(True)
        executor.run([lambda: 0, lambda: 1], CPU3[:2])
        assert len(compared) == 1 and compared[0] >= 1
    finally:
        torch.use_deterministic_algorithms(deterministic)
        executor.shutdown()
