"""Shared fixtures."""

from __future__ import annotations

import pytest

from lightning_sparse_dp import SparseDataParallelStrategy


@pytest.fixture(params=[False, True], ids=["main-prep", "thread-prep"])
def both_preparations(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Runs a test twice: each replica's share of the step's own work (cut, place, refresh, metric copies, log
    recorder) on the main thread, and in the replicas' own threads, the default (``prepare_in_threads``; a strategy
    given ``prepare_in_threads=True`` / ``False`` keeps it). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("both_preparations")``. Yields whether the threads prepare."""
    if not request.param:
        monkeypatch.setattr(SparseDataParallelStrategy, "_in_threads", lambda self: self.prepare_in_threads is True)
    return request.param
