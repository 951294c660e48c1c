"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch

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


#: What a DDP fit of one rank in this process sets in ``os.environ``: the rendezvous (Lightning's launcher and
#: ``DDPStrategy``) and ``OMP_NUM_THREADS`` (the launcher's ``_set_num_threads_if_needed``, with
#: ``torch.set_num_threads``), as plain Lightning's ``ddp`` does.
IN_PROCESS_DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "OMP_NUM_THREADS")


@pytest.fixture
def in_process_ddp():
    """A sparse_ddp / ddp fit of one rank in this process leaves its process group up, MASTER_PORT (a port its store
    still listens on) and the rest of :data:`IN_PROCESS_DDP_ENV` in os.environ, and the main thread's torch thread
    count at the launcher's: all taken back after the test, so that later launches pick their own port and later
    sparse_dp fits split the cores as in a fresh process (an ``OMP_NUM_THREADS`` left set reads as the user's count,
    and each CPU replica would run every core's threads, which ME's kernel maps and OpenBLAS do not repeat bitwise)."""
    import torch.distributed as dist

    saved, threads = {k: os.environ.get(k) for k in IN_PROCESS_DDP_ENV}, torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
