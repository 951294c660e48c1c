"""A step whose replicas do not finish is reported with where each one is (lightning_sparse_dp.runtime.stall)."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_sparse_dp.runtime.executor import ReplicaExecutor
from lightning_sparse_dp.runtime.stall import DEFAULT_STALL_WARNING_S, stall_seconds

CPU2 = [torch.device("cpu")] * 2


def _stuck_in_a_named_place(release: threading.Event) -> int:
    release.wait(timeout=20)
    return 2


def test_a_replica_that_takes_too_long_is_named_with_its_stack_once_and_the_step_still_ends(monkeypatch):
    monkeypatch.setenv("LSDP_STALL_WARNING_S", "0.3")
    release = threading.Event()
    executor = ReplicaExecutor(2)
    try:
        def slow():
            threading.Timer(1.5, release.set).start()  # ends after the warning: the step is slow, not stuck
            return _stuck_in_a_named_place(release)

        with pytest.warns(UserWarning, match=r"(?s)replica\(s\) \[1\] of this step have not finished after [0-9.]+ s.*"
                          r"replica 1 on cpu:.*_stuck_in_a_named_place") as seen:
            assert executor.run([lambda: 1, slow], CPU2) == [1, 2]
    finally:
        executor.shutdown()
    assert len([w for w in seen if "have not finished" in str(w.message)]) == 1
    assert "replica 0" not in str(seen[0].message).split("\n", 1)[1]  # the finished replica is not named


def test_a_quick_step_says_nothing_and_zero_turns_the_warning_off(monkeypatch, recwarn):
    monkeypatch.setenv("LSDP_STALL_WARNING_S", "0")
    assert stall_seconds() == 0
    executor = ReplicaExecutor(2)
    try:
        assert executor.run([lambda: threading.Event().wait(0.2) or 1, lambda: 2], CPU2) == [1, 2]
    finally:
        executor.shutdown()
    assert not [w for w in recwarn if "have not finished" in str(w.message)]
    monkeypatch.delenv("LSDP_STALL_WARNING_S")
    assert stall_seconds() == DEFAULT_STALL_WARNING_S


def test_a_wait_that_is_not_a_number_is_refused_at_once(monkeypatch):
    monkeypatch.setenv("LSDP_STALL_WARNING_S", "five minutes")
    with pytest.raises(ValueError, match=r"LSDP_STALL_WARNING_S='five minutes': give seconds"):
        ReplicaExecutor(2)


@pytest.mark.parametrize("seconds", ["0", "-1", ""])
def test_whether_calls_are_watched_is_decided_once_for_the_executor(monkeypatch, seconds):
    """``LSDP_STALL_WARNING_S=0`` (or less): no watch is made and no call marks one; otherwise every call marks its start
    and end on the executor's watch."""
    from lightning_sparse_dp.runtime.stall import StallWatch

    marks = []
    begin, end = StallWatch.begin, StallWatch.end
    monkeypatch.setattr(StallWatch, "begin", lambda self, *a: marks.append("begin") or begin(self, *a))
    monkeypatch.setattr(StallWatch, "end", lambda self: marks.append("end") or end(self))
    monkeypatch.setenv("LSDP_STALL_WARNING_S", seconds)
    executor = ReplicaExecutor(2)
    try:
        for _ in range(2):
            assert executor.run([lambda: 1, lambda: 2], CPU2) == [1, 2]
    finally:
        executor.shutdown()
    off = seconds in ("0", "-1")
    assert (executor._watch is None) == off
    assert marks == ([] if off else ["begin", "end"] * 2)
    with pytest.raises(ValueError, match=r"seconds=0; give a positive wait"):
        StallWatch(0)
