"""CPU cores split between CPU replicas (torch, ME's OpenMP, OpenBLAS), in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.distributed import _suggested_max_num_threads

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.runtime import threads
from lightning_sparse_dp.runtime.threads import (
    available_cores,
    chosen_torch_threads,
    me_coordinate_manager_module,
    threads_per_replica,
)

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys, threading, torch
import MinkowskiEngine as ME
import lightning_sparse_dp
from lightning_sparse_dp.runtime.threads import _openblas, me_coordinate_manager_module
cm = me_coordinate_manager_module()
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer, unchecked
{before}
seen = []

class Probe(SparseNet):
    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)  # ME sets OpenMP threads here
        seen.append([threading.current_thread().name, torch.get_num_threads(), cm.CPU_COUNT,
                     int(_openblas().openblas_get_num_threads())])
        return super().training_step(batch, batch_idx)

start = [cm.CPU_COUNT, torch.get_num_threads(), int(_openblas().openblas_get_num_threads())]
trainer(strategy=unchecked(), devices={devices}).fit(Probe(), loader(collate_dict(random_samples(6))))
end = [cm.CPU_COUNT, torch.get_num_threads(), int(_openblas().openblas_get_num_threads())]
print(json.dumps({{"seen": seen, "start": start, "end": end}}))
"""


def _probe(tmp_path, devices: int, before: str = "", env: dict | None = None) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(_PROBE.format(before=before, devices=devices)))
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    environ.update(env or {}, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_threads_per_replica_is_lightnings_ddp_share():
    assert threads_per_replica(3, cores=16) == 5
    assert threads_per_replica(4, cores=2) == 1
    assert threads_per_replica(1, cores=8) == 8
    with pytest.raises(ValueError, match="num_replicas"):
        threads_per_replica(0)


def test_each_replica_gets_its_share_for_torch_and_me_and_everything_is_restored(tmp_path):
    out = _probe(tmp_path, devices=2)
    share = max(1, available_cores() // 2)
    assert len(out["seen"]) == 2
    for name, torch_threads, me_count, blas_threads in out["seen"]:
        assert name.startswith("sparse_dp-replica")
        assert torch_threads == share and me_count == share  # after ME built its coordinate manager in the thread
        assert blas_threads == share
    assert out["end"] == out["start"]  # ME's CPU_COUNT, the main thread's torch threads, OpenBLAS


def test_nothing_is_changed_when_the_user_set_omp_num_threads(tmp_path):
    out = _probe(tmp_path, devices=2, env={"OMP_NUM_THREADS": "1"})
    for _, torch_threads, me_count, blas_threads in out["seen"]:
        assert torch_threads == 1 and me_count == 1 and blas_threads == 1  # the user's count, read at import
    assert out["end"] == out["start"]


def test_torch_set_num_threads_is_each_replicas_count_and_me_keeps_it(tmp_path):
    """ME sets a thread back to its import-time count at every SparseTensor: without giving it the user's
    count, each replica ran every core's worth of OpenMP threads (digits, 2 replicas after
    torch.set_num_threads(1): 34-70 ms a step against 18-21 ms)."""
    chosen = _probe(tmp_path, devices=2, before="torch.set_num_threads(3)")
    assert chosen["start"][1] == 3
    assert len(chosen["seen"]) == 2
    for name, torch_threads, me_count, blas_threads in chosen["seen"]:
        assert name.startswith("sparse_dp-replica")
        assert torch_threads == 3 and me_count == 3 and blas_threads == 3
    assert chosen["end"] == chosen["start"]  # ME's CPU_COUNT, the main thread's torch threads, OpenBLAS


_DDP_PROBE = """
import json, os, sys, torch
from datetime import timedelta
import MinkowskiEngine as ME
from lightning_sparse_dp import SparseDDPStrategy
from lightning_sparse_dp.runtime.threads import _openblas, me_coordinate_manager_module
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer
cm = me_coordinate_manager_module()
start = [cm.CPU_COUNT, int(_openblas().openblas_get_num_threads())]
seen = []

class Probe(SparseNet):
    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)  # ME sets OpenMP threads here
        seen.append([torch.get_num_threads(), cm.CPU_COUNT, int(_openblas().openblas_get_num_threads())])
        return super().training_step(batch, batch_idx)

t = trainer(strategy=SparseDDPStrategy(timeout=timedelta(seconds=120)), devices=2, max_steps=2)
t.fit(Probe(), loader(collate_dict(random_samples(8))))
end = [cm.CPU_COUNT, int(_openblas().openblas_get_num_threads())]
with open(f"seen-rank{t.global_rank}.json", "w") as f:
    json.dump({"seen": seen, "start": start, "end": end, "omp": os.environ.get("OMP_NUM_THREADS")}, f)
"""


def test_sparse_ddp_ranks_run_me_and_openblas_on_the_launchers_share(tmp_path):
    """Lightning's launcher sets OMP_NUM_THREADS (cores // 2) in every rank after ME read it at import: without
    follow_omp_num_threads each rank's ME would set OpenMP back to every core in each SparseTensor, beside
    OpenBLAS's every core (measured: digits sparse_ddp-2 steps 35-48 ms against 19-21 ms with it)."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(_DDP_PROBE))
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    environ.update(PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    share = _suggested_max_num_threads(2)  # what Lightning's launcher gives each of 2 processes
    for rank in (0, 1):
        out = json.loads((tmp_path / f"seen-rank{rank}.json").read_text())
        assert out["omp"] == str(share)  # set by the launcher, after the import
        assert out["seen"] and all(s == [share, share, share] for s in out["seen"])
        assert out["end"] == out["start"]  # put back at teardown


def test_omp_num_threads_set_after_the_imports_is_each_replicas_count(tmp_path):
    """A notebook cell setting the variable after ME read it: without taking it, every replica ran ME on
    every core (the variable counted as the user's choice, already applied)."""
    late = _probe(tmp_path, devices=2, before='import os; os.environ["OMP_NUM_THREADS"] = "1"')
    if late["start"][0] == 1:
        pytest.skip("ME read 1 thread at import (one core): nothing to tell apart")
    assert len(late["seen"]) == 2
    for _, torch_threads, me_count, blas_threads in late["seen"]:
        assert torch_threads == 1 and me_count == 1 and blas_threads == 1
    assert late["end"] == late["start"]


def test_a_count_me_set_is_not_taken_for_the_users_choice(monkeypatch):
    """ME sets a thread that builds a SparseTensor to min(CPU_COUNT, 20) threads (a forward pass before the fit
    does it to the main thread): that count is not the user's, nor is the one seen at import."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "DEFAULT_TORCH_THREADS", 4)
    monkeypatch.setattr(me_coordinate_manager_module(), "CPU_COUNT", 8)
    try:
        for count, expected in ((4, None), (8, None), (3, 3), (1, 1)):
            torch.set_num_threads(count)
            assert chosen_torch_threads() == expected, count
        monkeypatch.setattr(me_coordinate_manager_module(), "CPU_COUNT", 32)
        torch.set_num_threads(20)  # ME caps its count at 20
        assert chosen_torch_threads() is None
    finally:
        torch.set_num_threads(before)


def test_prepare_in_threads_is_checked_and_the_threads_prepare_by_default():
    with pytest.raises(ValueError, match="prepare_in_threads='yes'"):
        SparseDataParallelStrategy(prepare_in_threads="yes")
    strategy = SparseDataParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    assert strategy.prepare_in_threads is None and strategy._in_threads() is True  # the replicas' threads prepare
    assert SparseDataParallelStrategy(prepare_in_threads=True)._in_threads() is True
    assert SparseDataParallelStrategy(prepare_in_threads=False)._in_threads() is False
