"""Side-by-side benchmark: plain Lightning, sparse_dp with 1/2/3 devices (with and without sync BN), DDP with 2 processes.

    .venv/bin/python benchmarks/bench.py            # 3 interleaved repetitions; about 15 minutes on 2 cores
    .venv/bin/python benchmarks/bench.py --quick    # 6 timed steps per case: about 6-10 minutes
    .venv/bin/python benchmarks/bench.py --terms-cost   # only what loss_weighting="terms" costs (about a minute)
    python benchmarks/bench.py --accelerator gpu    # on GPUs: sparse_dp with 1..N GPUs, DDP with 2 (NCCL)

Same model, data and global batch in every case. Models: the MinkUNet-style segmentation network of
examples/train_segmentation.py on generated rooms whose point counts are log-normal, and the digits
network of examples/train_digits.py. Batch norm is per replica in the plain cases (Lightning's DDP on
CPU cannot synchronize it: torch's SyncBatchNorm refuses CPU inputs), plus sparse_dp-2 and sparse_dp-3
with ``sync_batchnorm=True`` to show what exact batch norm costs.

Every case runs in a fresh process, so that two cases differ in their strategy only: a server per thread
setting imports everything once and forks one child per case, which runs it and exits (DDP cases, whose
rank 1 Lightning starts by re-running the command line, are fresh processes of their own). Nothing
carries over from one case to the next: not the threads ME or a previous strategy set, not the
allocator's heap, not a warm-up. Each case's peak resident memory is its process's (``peak RSS MB``).
Every case runs ``--repeats`` times (3), interleaved: repetition ``k`` runs all cases in turn (in reverse
order every other repetition), so the two cases of every ratio run minutes apart at most and a slow
spell of a shared machine lands on both. Each ratio is computed within each repetition; the JSON line
gives its median, and ``<key>_spread`` its [min, max] over the repetitions.

Two thread settings: ``default`` (sparse_dp splits the cores between its replicas, plain Lightning uses
them all; DDP children get ``OMP_NUM_THREADS=cores // 2``, what Lightning's launcher sets, but before
ME reads it at import, so both ranks of ``ddp`` and of ``sparse_ddp`` run with their share: see
:func:`case_env`), and the 1-thread-per-replica proxy (``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``):
each replica, each DDP process and plain Lightning get one intra-op thread, which is what independent
devices look like from the CPU's side.

Prints, per model and thread setting, a table in the seeds' form (devices, batch per device, time per
iteration as median [min-max] over repetitions, speedup over plain Lightning, ideal speedup, points per
second, CPU time per step, peak RSS), the median time of each stage of a sparse_dp step and, for the sync
BN cases, each synchronized layer's time and the wait for the slowest replica; writes ``speedup.png``
(speedup against devices for sparse_dp, sparse_dp with sync BN and DDP, with the ideal line and ME's
published MinkUNet GPU speedups 1.90 / 2.60 / 2.60 at 2 / 3 / 4 GPUs) and ``stages.png`` (stacked stage
times) to ``--figures`` (``benchmarks/figures``); and ends with one JSON line of headline figures
(segmentation unless named; each with ``<key>_spread``):

- ``overhead_ratio``: sparse_dp devices=1 over plain Lightning, step time (``overhead_ratio_1t``: one intra-op
  thread each, which leaves out the 2-thread cases' run-to-run spread, OpenBLAS's spinning workers among it);
- ``split_fraction``: (split + placement) over step time, sparse_dp devices=3, batches split in the
  main process (``presplit`` moves it to DataLoader workers when there are any);
- ``ddp_throughput_ratio`` / ``ddp_throughput_ratio_1t``: samples per second of sparse_dp devices=2 over
  DDP with 2 processes, default threads / 1-thread proxy;
- ``speedup_sparse_dp_2`` / ``speedup_sparse_dp_3`` / ``speedup_sparse_dp_2_1t``: plain Lightning's step
  time over sparse_dp's (``digits_speedup_sparse_dp_2_1t``: the same for the digits network);
- ``syncbn_cost_ratio`` / ``syncbn_cost_ratio_1t``: sparse_dp-3 with ``sync_batchnorm=True`` over without
  (``syncbn_cost_ratio_2`` / ``_2_1t``: sparse_dp-2; ``syncbn_cost_ratio_unpinned`` / ``_1t_unpinned``: with
  ``pin_replicas=False``, what the default's pinning of 3 replicas to 2 cores saves);
- ``digits_syncbn_speedup_3``: digits, plain Lightning's step time over sparse_dp-3 with sync BN (default threads);
- ``digits_ceiling_2_1t`` / ``digits_ceiling_3``: the most any strategy whose replicas are threads of one process
  could reach on this machine for the two digits figures above (one thread each / default threads): plain
  Lightning's step over its serial part plus its network part (``training_step`` + backward) run in 2 / 3 bare
  threads, each on its share of the batch with nothing else (``benchmarks/ceiling.py``; measured in one process
  per repetition, the ``ceiling-2`` / ``ceiling-3`` cases);
- ``replicate_ms``: median time of the ``replicate`` plus ``state`` stages of a sparse_dp-3 step
  (persistent replicas refreshed; metric copies reset, log recorders and batch-norm group installed,
  and undone after the step with the metric states merged);
- ``step_overhead_ms``: digits, sparse_dp-3 (default threads), the fixed cost sparse_dp adds to a step:
  ``split + place + replicate + state + gather + log`` (``log``: the replicas' logged values reduced; the
  ``emit`` stage, Lightning's own ``self.log`` of them, is left out: a one-device step runs it too, inside
  its step); ``step_overhead_ms_presplit``: the same with a DataLoader worker (``num_workers=1``), where sparse_dp's
  ``presplit`` collates and splits the batch, so ``split`` only takes the worker's chunks;
- ``sparse_ddp_vs_ddp``: samples per second of sparse_ddp over ddp, 2 processes each, same global batch;
  ``sparse_ddp_vs_ddp_launcher_threads``: the same on digits, both started without ``OMP_NUM_THREADS`` /
  ``OPENBLAS_NUM_THREADS`` (Lightning's launcher picks the threads, which sparse_ddp applies to ME and OpenBLAS);
  ``rank_imbalance``: per-rank point imbalance of both samplers on the benchmark's scenes;
- ``imbalance_balanced`` / ``imbalance_contiguous``: max over mean points per replica, 16 scenes, 3 replicas;
- ``dispatch_us``: per-step cost of handing 3 no-op replica steps to threads and collecting them, ours
  (persistent threads) and ``torch.nn.parallel.parallel_apply``'s way (new threads each call;
  ``parallel_apply`` itself needs CUDA, so its thread pattern is reproduced);
- ``peak_rss_mb``: peak resident memory of each segmentation case's process (default threads; DDP: rank
  0's), and ``rss_ratio_sparse_dp_3``: sparse_dp-3's over plain Lightning's.

The tables also give each case's CPU time per step (its process, all its threads; DDP: rank 0's
process only): on a loaded machine the wall times say little about parallelism, the CPU times still
say how much work a step costs.

Step times are medians over the steps after warm-up, taken with a callback from the start to the end
of each training batch (forward, backward and optimizer step). ``OMP_WAIT_POLICY=PASSIVE`` and fixed
glibc allocation thresholds are set unless given (see below; ``--default-malloc`` leaves the latter), and
the segmentation cases run with ``OPENBLAS_THREAD_TIMEOUT=4`` (``harness.OPENBLAS_THREAD_TIMEOUT``;
``--default-openblas`` leaves OpenBLAS's spin-wait alone).
The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from harness import GLOBAL_BATCH, wait_env  # the scripts' shared settings (no torch import there)

wait_env(os.environ)  # passive OpenMP waiting for this process and its children, before torch loads

# glibc returns freed large blocks to the kernel (heap trimming, mmap) and maps fresh pages for the next
# one; where page faults are slow (seen on this project's sandboxed machine: two live 5 MB tensors cost
# 8 ms to allocate and fill once lightning is imported, 0.16 ms with these settings) that cost lands on
# every large tensor of every case. Fixed thresholds keep freed pages in the heap. The environment
# variables reach the child processes (cases, DDP ranks); mallopt applies them to this process.
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
if "--default-malloc" not in sys.argv:
    for _name, _value in MALLOC_TUNING.items():
        os.environ.setdefault(_name, _value)
    try:
        import ctypes

        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallopt(-3, int(os.environ["MALLOC_MMAP_THRESHOLD_"]))  # M_MMAP_THRESHOLD
        _libc.mallopt(-1, int(os.environ["MALLOC_TRIM_THRESHOLD_"]))  # M_TRIM_THRESHOLD
    except (OSError, AttributeError, ValueError):  # not glibc: nothing to tune
        pass

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_sparse_dp  # noqa: E402,F401
from lightning_sparse_dp import ReplicaExecutor, SparseDataParallelStrategy, split_batch  # noqa: E402
from lightning_sparse_dp.ddp import SparseDDPStrategy  # noqa: E402
from lightning_sparse_dp.sampler import PointBalancedBatchSampler  # noqa: E402
import train_digits  # noqa: E402
from ceiling import NetworkClock, bare_thread_times, ceiling  # noqa: E402
import train_segmentation as seg  # noqa: E402


class LogNormalScenes(Dataset):
    """Rooms of examples/train_segmentation.py with a log-normal point density (sigma 0.5)."""

    def __init__(self, n: int, seed: int, voxel_size: float = 0.1) -> None:
        rng = np.random.default_rng(seed)
        self.scenes = []
        for _ in range(n):
            points, labels = seg.make_scene(rng, density=40.0 * rng.lognormal(0.0, 0.5))
            features = np.stack([np.ones(len(points)), points[:, 2] / 2.5], 1).astype(np.float32)
            self.scenes.append((torch.from_numpy(points / voxel_size), torch.from_numpy(features), torch.from_numpy(labels)))

    def __len__(self) -> int:
        return len(self.scenes)

    def __getitem__(self, i):
        return self.scenes[i]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StepClock(L.Callback):
    """Wall time and this process's CPU time (all its threads) of each training batch (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start, self._cpu_start = time.perf_counter(), _cpu_seconds()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.cpu.append(_cpu_seconds() - self._cpu_start)


def _workload(model_name: str, global_batch: int, steps: int):
    if model_name == "segmentation":
        data = LogNormalScenes(global_batch * steps, seed=7)
        return seg.Segmenter, data, seg.collate, float(np.mean([len(s[2]) for s in data.scenes]))
    from sklearn.datasets import load_digits

    digits = load_digits()
    n = global_batch * steps
    data = train_digits.SparseDigits(digits.images[:n], digits.target[:n])
    return train_digits.DigitNet, data, train_digits.collate, float(np.mean([len(s[0]) for s in data.samples]))


def _on_current_gpu(collate, samples):
    """``collate(samples)`` with its ME tensors built on the current GPU (:func:`lightning_sparse_dp.place.place_batch`):
    plain Lightning's ``batch_to_device`` cannot move an ``ME.TensorField``, and a CPU one meeting CUDA weights crashes
    ME's CUDA build (the segmentation reference segfaulted on the H200)."""
    from lightning_sparse_dp.place import place_batch

    return place_batch(collate(samples), torch.device("cuda", torch.cuda.current_device()))


def run_case(model_name: str, strategy, devices: int, global_batch: int, steps: int, warmup: int,
             accelerator: str = "cpu", num_workers: int = 0, callbacks: Sequence[L.Callback] = (), **trainer_kwargs):
    """Median step time (s) and the strategy's stage medians for one configuration (``num_workers``: the DataLoader's;
    ``callbacks``: the Trainer's, beside the step clock)."""
    model_cls, data, collate, points = _workload(model_name, global_batch, steps + warmup)
    distributed = strategy == "ddp" or isinstance(strategy, SparseDDPStrategy)
    batch = global_batch // devices if distributed else global_batch
    L.seed_everything(0)
    clock = StepClock()
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, *callbacks],
        num_sanity_val_steps=0, limit_val_batches=0, **trainer_kwargs,
    )
    if accelerator == "gpu" and not isinstance(strategy, (SparseDataParallelStrategy, SparseDDPStrategy)) \
            and strategy not in ("sparse_dp", "sparse_ddp"):
        collate = partial(_on_current_gpu, collate)  # plain Lightning leaves ME tensors where the collate made them
    loader = DataLoader(data, batch_size=batch, shuffle=False, collate_fn=collate, num_workers=num_workers,
                        persistent_workers=num_workers > 0)
    trainer.fit(model_cls(), loader)
    times = clock.times[warmup:]
    stages = {}
    if isinstance(strategy, SparseDataParallelStrategy) and strategy.stage_times is not None:
        stages = strategy.stage_times.medians(skip=warmup)
    return {"step_s": statistics.median(times), "times": times, "stages": stages, "points_per_sample": points,
            "rank": trainer.global_rank, "cpu_s": statistics.median(clock.cpu[warmup:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _passed_on() -> list[str]:
    """Flags of this run that child processes must get too."""
    return [flag for flag in ("--default-malloc", "--default-openblas") if flag in sys.argv]


#: Thread settings a case runs under. ``default``: the process's own (sparse_dp splits the cores between its
#: replicas, plain Lightning uses them all); ``1 thread``: ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``.
MODES = ("default", "1 thread")

#: The DDP cases and the strategy their child runs.
DDP_CASES = {"ddp-2 (gloo)": "ddp", "sparse_ddp-2 gloo": "sparse_ddp",
             "ddp-2 launcher threads": "ddp", "sparse_ddp-2 launcher threads": "sparse_ddp"}

#: DDP cases run as a user starts them from a shell (``OMP_NUM_THREADS`` / ``OPENBLAS_NUM_THREADS`` unset), so that
#: Lightning's launcher picks the threads; digits, default threads only (``sparse_ddp_vs_ddp_launcher_threads``).
LAUNCHER_CASES = ("ddp-2 launcher threads", "sparse_ddp-2 launcher threads")


#: The case whose DataLoader has a worker process (``num_workers=1``), so that sparse_dp's ``presplit`` collates and
#: splits there: digits, default threads only (``step_overhead_ms_presplit``).
PRESPLIT_CASE = "sparse_dp-3 presplit"


#: The ceiling cases (``benchmarks/ceiling.py``): plain Lightning's step, its network part in bare threads instead;
#: digits only, the thread setting of the target each one bounds (``digits_ceiling_2_1t``, ``digits_ceiling_3``).
CEILING_CASES = {"1 thread": "ceiling-2", "default": "ceiling-3"}


def case_names(mode: str, model_name: str = "segmentation") -> list[str]:
    """The cases of one model and thread setting, in the order of one repetition (the next one runs them reversed)."""
    names = ["auto-1", "sparse_dp-1"]
    names += ["sparse_dp-2", "sparse_dp-3", "sparse_dp-2 syncBN", "sparse_dp-3 syncBN", "sparse_dp-3 syncBN unpinned",
              "ddp-2 (gloo)"]
    names += ["sparse_ddp-2 gloo"] if mode == "default" else []
    names += [CEILING_CASES[mode]] if model_name == "digits" else []
    return names + ([PRESPLIT_CASE, *LAUNCHER_CASES] if mode == "default" and model_name == "digits" else [])


def case_workers(case: str) -> int:
    """DataLoader worker processes of a case: 1 for :data:`PRESPLIT_CASE`, else 0 (collated in the main process)."""
    return 1 if case == PRESPLIT_CASE else 0


def case_env(mode: str, case: str, model_name: str) -> dict[str, str]:
    """The environment of a case's process: the same for every case of a mode but for what its strategy needs.

    ``1 thread``: one intra-op thread for torch, ME's OpenMP and OpenBLAS in every process. ``default``: the
    parent's settings; DDP cases get ``OMP_NUM_THREADS=cores // 2`` (what Lightning's launcher sets for 2
    processes) before anything is imported, because ME (its OpenMP threads) and OpenBLAS read it at import,
    and Lightning's launcher sets it in every rank only after the script imported ME: plain DDP would run
    ME's OpenMP and OpenBLAS on every core in each rank (ME resets OpenMP's count whenever it builds a
    coordinate manager), sparse_ddp applies the launcher's count to them, so only the preset variable
    makes the two differ in their strategy alone. :data:`LAUNCHER_CASES` run without both variables instead.
    Every case of ``model_name`` gets the model's :data:`harness.OPENBLAS_THREAD_TIMEOUT`, unless the environment
    sets the variable or the run was given ``--default-openblas``.
    """
    env = wait_env(dict(os.environ), model_name, openblas="--default-openblas" not in sys.argv)
    if mode == "1 thread":
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    elif case in LAUNCHER_CASES:
        env.pop("OMP_NUM_THREADS", None)
        env.pop("OPENBLAS_NUM_THREADS", None)
    elif case in DDP_CASES and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // 2))
    return env


def case_strategy(model_name: str, case: str):
    """``(strategy, devices)`` of a case: ``auto-1``, ``sparse_dp-<d>[ syncBN[ unpinned]]``, or a DDP case (2 processes).

    ``unpinned``: ``pin_replicas=False`` (the operating system places the replica threads; the split is even per
    replica), beside the default, which pins when sync BN runs with more replicas than cores."""
    if case in DDP_CASES:
        return (sparse_ddp_strategy(model_name) if DDP_CASES[case] == "sparse_ddp" else "ddp"), 2
    if case == "auto-1":
        return "auto", 1
    devices = int(case.split("-")[1].split()[0])
    kwargs = {"loss_weighting": "points"} if model_name == "segmentation" else {}
    if case.endswith("unpinned"):
        kwargs["pin_replicas"] = False
    return SparseDataParallelStrategy(record_stage_times=True, sync_batchnorm="syncBN" in case, **kwargs), devices


class CaseRunner:
    """Runs cases in fresh processes with the environment of one thread setting (``mode``).

    Each non-DDP case runs in a process forked from a server that imported everything once with the mode's
    environment (and the model's, :func:`case_env`: one server per model) and has run nothing since
    (``--case-server``): every case starts from the same process state
    (imports, threads, allocator, no warm-up carried over), so two cases differ in their strategy only, and
    the child's peak resident memory is the case's (``peak_rss_mb``; the server's imports included, alike in
    every case). DDP cases need a command line Lightning can re-run for rank 1: each is a fresh process.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._servers: dict[str, tuple[subprocess.Popen, str]] = {}  # model -> (server, its stderr log)

    def run(self, model_name: str, case: str, global_batch: int, steps: int, warmup: int) -> dict:
        """``case``'s result (rank 0's for DDP)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "case.json"
            request = ["--case-child", case, "--model", model_name, "--case-out", str(out), "--global-batch",
                       str(global_batch), "--steps", str(steps), "--warmup", str(warmup)]
            if case in DDP_CASES:
                done = subprocess.run([sys.executable, __file__, *request, *_passed_on()], capture_output=True, text=True,
                                      timeout=1800, cwd=ROOT, env=case_env(self.mode, case, model_name))
                failed = done.returncode != 0
                log = f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            else:
                server, server_log = self._start(model_name)
                server.stdin.write(json.dumps(request) + "\n")
                server.stdin.flush()
                status = server.stdout.readline().strip()
                failed, log = status != "0", f"status {status!r}; the server's stderr: {_tail(Path(server_log))}"
            if failed or not out.exists():
                raise RuntimeError(f"the case {case!r} ({model_name}, {self.mode}) failed:\n{log}")
            return json.loads(out.read_text())

    def _start(self, model_name: str) -> tuple[subprocess.Popen, str]:
        if model_name not in self._servers or self._servers[model_name][0].poll() is not None:
            log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
            server = subprocess.Popen([sys.executable, __file__, "--case-server", *_passed_on()], cwd=ROOT,
                                      env=case_env(self.mode, "auto-1", model_name), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True)
            self._servers[model_name] = (server, log.name)
        return self._servers[model_name]

    def close(self) -> None:
        for server, _ in self._servers.values():
            if server.poll() is None:
                server.stdin.close()
                server.wait(timeout=60)
        self._servers = {}


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text()[-chars:]
    except OSError:
        return "(none)"


def case_server() -> None:
    """``--case-server``: for each request line (the arguments of a ``--case-child`` run, JSON) fork, run the case
    in the child, and answer the child's exit status. Nothing runs in the server itself, so every child starts alike
    (and OpenMP, never started here, starts fresh in each child)."""
    from sklearn.datasets import load_digits  # noqa: F401  (imported once here rather than in every case)

    while line := sys.stdin.readline():
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # the case's own output goes to the server's log; stdout answers the requests
            status = 1
            try:
                run_case_child(_parser().parse_args(json.loads(line)))
                status = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, code = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(code), flush=True)


def run_case_child(args) -> None:
    """One case, as asked by :class:`CaseRunner`; rank 0 writes its result to ``--case-out``."""
    if args.case_child in CEILING_CASES.values():
        result = run_ceiling_case(args.model, _devices(args.case_child), args.global_batch, args.steps, args.warmup)
        Path(args.case_out).write_text(json.dumps(result))
        return
    strategy, devices = case_strategy(args.model, args.case_child)
    result = run_case(args.model, strategy, devices, args.global_batch, args.steps, args.warmup, args.accelerator,
                      num_workers=case_workers(args.case_child))
    if result["rank"] == 0:
        Path(args.case_out).write_text(json.dumps(result))


def run_ceiling_case(model_name: str, replicas: int, global_batch: int, steps: int, warmup: int) -> dict:
    """A ceiling case: plain Lightning's steps (``step_s`` as ``auto-1``'s), the network part of each
    (:class:`ceiling.NetworkClock`), then the first batch's network part in ``replicas`` bare threads
    (:func:`ceiling.bare_thread_times`), all in this process; ``ceiling``: :func:`ceiling.ceiling` of them."""
    network = NetworkClock()
    plain = run_case(model_name, "auto", 1, global_batch, steps, warmup, callbacks=[network])
    model_cls, data, collate, _ = _workload(model_name, global_batch, 1)
    bare = bare_thread_times(model_cls(), [data[i] for i in range(global_batch)], collate, replicas, steps, warmup)
    parts = network.times[warmup:]
    return {**plain, "network_s": statistics.median(parts), "bare_s": statistics.median(bare),
            "ceiling": ceiling(plain["times"], parts, bare)}


def run_ddp_child(model_name: str, global_batch: int, steps: int, warmup: int, strategy: str = "ddp",
                  accelerator: str = "cpu") -> dict:
    """DDP (``strategy="ddp"``) or sparse_ddp with 2 processes on GPUs (NCCL), in a child process tree; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        case = "ddp-2 (gloo)" if strategy == "ddp" else "sparse_ddp-2 gloo"
        cmd = [sys.executable, __file__, "--case-child", case, "--model", model_name, "--case-out", str(out),
               "--global-batch", str(global_batch), "--steps", str(steps), "--warmup", str(warmup),
               "--accelerator", accelerator] + _passed_on()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the DDP child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def aggregate(reps: list[dict], devices: int) -> dict:
    """One case over its repetitions: medians of the per-repetition medians, their range, the highest peak RSS."""
    steps = [r["step_s"] for r in reps]
    names = sorted({n for r in reps for n in r["stages"]})
    stages = {n: statistics.median(r["stages"][n] for r in reps if n in r["stages"]) for n in names}
    return {**reps[0], "devices": devices, "step_s": statistics.median(steps), "step_range": (min(steps), max(steps)),
            "cpu_s": statistics.median(r["cpu_s"] for r in reps), "stages": stages,
            "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in reps), "reps": reps}


def imbalance(assignment: str, scenes: int = 16, replicas: int = 3) -> float:
    """Max over mean points per replica for one batch of ``scenes`` log-normal scenes."""
    data = LogNormalScenes(scenes, seed=11)
    _, plan = split_batch(seg.collate([data[i] for i in range(scenes)]), replicas, assignment=assignment)
    points = plan.points_per_chunk
    return max(points) / (sum(points) / len(points))


def sparse_ddp_strategy(model_name: str) -> SparseDDPStrategy:
    """sparse_ddp as the benchmark runs it: points-weighted loss for segmentation, samples for digits."""
    return SparseDDPStrategy(loss_weighting="points" if model_name == "segmentation" else "samples")


def sampler_imbalance(point_counts: list[int], per_rank: int, ranks: int = 2, seed: int = 0) -> dict[str, float]:
    """Mean over steps of max over mean points per rank, for Lightning's ``DistributedSampler`` (``ddp``: each
    rank takes ``per_rank`` consecutive indices of its round-robin share) and for sparse_ddp's
    ``PointBalancedBatchSampler`` (the same global batch of ``per_rank * ranks`` samples, balanced)."""
    from torch.utils.data import DistributedSampler

    def mean_ratio(per_rank_batches: list[list[list[int]]]) -> float:
        ratios = []
        for step in zip(*per_rank_batches):
            loads = [sum(point_counts[i] for i in batch) for batch in step]
            ratios.append(max(loads) / (sum(loads) / len(loads)))
        return statistics.mean(ratios)

    ddp, ours = [], []
    for rank in range(ranks):
        order = list(DistributedSampler(range(len(point_counts)), num_replicas=ranks, rank=rank, shuffle=True, seed=seed))
        ddp.append([order[i : i + per_rank] for i in range(0, len(order), per_rank)])
        ours.append(list(PointBalancedBatchSampler(point_counts, per_rank * ranks, num_replicas=ranks, rank=rank, seed=seed)))
    return {"ddp": round(mean_ratio(ddp), 4), "sparse_ddp": round(mean_ratio(ours), 4)}


def dispatch_us(replicas: int = 3, calls: int = 2000) -> tuple[float, float]:
    """Median microseconds to run ``replicas`` no-op callables on threads and collect them: ours, thread-per-call."""
    devices = [torch.device("cpu")] * replicas
    noops = [lambda: None] * replicas
    executor = ReplicaExecutor(replicas)
    ours = []
    for _ in range(calls):
        start = time.perf_counter()
        executor.run(noops, devices)
        ours.append(time.perf_counter() - start)
    executor.shutdown()
    fresh = []
    for _ in range(calls):  # torch.nn.parallel.parallel_apply: a new thread per replica, started and joined
        start = time.perf_counter()
        threads = [threading.Thread(target=fn) for fn in noops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fresh.append(time.perf_counter() - start)
    return statistics.median(ours) * 1e6, statistics.median(fresh) * 1e6


def terms_cost(steps: int, warmup: int, pairs: int = 3, reps: int = 60) -> dict:
    """What ``loss_weighting="terms"`` (the default) costs on a digits step: sparse_dp, 2 replicas, batch 96.

    Side by side in one run: the whole step with ``"terms"`` and with ``"auto"`` (no capture), alternating
    ``pairs`` times, pooled medians and the range of the per-pair ratios; and, below the noise of whole
    steps, the capture's own cost: the loss and its backward from one replica's logits with and without
    the capture (interleaved ABBA, ``10 * reps`` each, median difference), which is all it adds to a
    replica's pass because the mode is entered at the step's first loss (``calls_in_mode``: the torch
    calls it sees in a whole digits replica pass), and the weighting alone (decision, gradient scales,
    shifted losses, one logged value; median of ``reps``). ``cost_fraction`` is (capture, taken as 0 when
    the difference is below the noise, + weighting) over the step with ``"auto"``: the replicas capture at
    once, in their own threads.
    """
    import MinkowskiEngine as ME
    from lightning.pytorch.utilities.rank_zero import WarningCache

    from lightning_sparse_dp.loss.values import loss_of
    from lightning_sparse_dp.loss.step import StepTerms
    from lightning_sparse_dp.loss.weights import chunk_weights

    batch = GLOBAL_BATCH["digits"]

    times: dict[str, list[float]] = {"terms": [], "auto": []}
    ratios = []
    for _ in range(pairs):
        medians = {}
        for weighting in ("terms", "auto"):
            r = run_case("digits", SparseDataParallelStrategy(loss_weighting=weighting), 2, batch, steps, warmup)
            times[weighting] += r["times"]
            medians[weighting] = r["step_s"]
        ratios.append(medians["terms"] / medians["auto"])
    model_cls, data, collate, _ = _workload("digits", batch, 1)
    model = model_cls()
    chunks, plan = split_batch(collate([data[i] for i in range(batch)]), 2)

    def replica_pass(chunk, capture=None):
        def step():
            x = ME.SparseTensor(chunk["features"], chunk["coordinates"])
            return torch.nn.functional.cross_entropy(model(x), chunk["labels"])
        loss = capture.run(step) if capture is not None else step()
        loss.backward()
        return loss

    with torch.no_grad():
        logits = model(ME.SparseTensor(chunks[0]["features"], chunks[0]["coordinates"]))

    def loss_pass(capture=None):  # the part of a step the capture sees (calls_in_mode: the mode enters at the loss)
        x = logits.clone().requires_grad_()

        def step():
            return torch.nn.functional.cross_entropy(x, chunks[0]["labels"])
        (capture.run(step) if capture is not None else step()).backward()

    plain, captured = [], []
    for i in range(reps * 10):  # ABBA: neither case always runs second
        cases = ((plain, None), (captured, StepTerms(1, WarningCache())))
        for store, terms in cases if i % 2 else cases[::-1]:
            start = time.perf_counter()
            loss_pass(terms.captures[0] if terms is not None else None)
            store.append(time.perf_counter() - start)
    calls = []

    class Counting(type(StepTerms(1, WarningCache()).captures[0])):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    replica_pass(chunks[0], Counting())
    weighing = []
    for _ in range(reps):
        terms = StepTerms(2, WarningCache())
        outputs = [replica_pass(c, cap) for c, cap in zip(chunks, terms.captures)]
        weights = chunk_weights(plan, "auto")
        start = time.perf_counter()
        terms.weigh(outputs, plan, weights)
        terms.exact_outputs(outputs, weights)
        terms.log_value([0, 1], [loss_of(o) for o in outputs])
        weighing.append(time.perf_counter() - start)
    on, off = statistics.median(times["terms"]), statistics.median(times["auto"])
    capture_s = statistics.median(captured) - statistics.median(plain)
    weighting_s = statistics.median(weighing)
    return {
        "step_ms_terms": round(on * 1e3, 2), "step_ms_auto": round(off * 1e3, 2),
        "step_ratio": round(on / off, 4), "step_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "loss_pass_ms": round(statistics.median(plain) * 1e3, 3), "capture_ms": round(capture_s * 1e3, 3),
        "weighting_ms": round(weighting_s * 1e3, 3), "cost_fraction": round((max(capture_s, 0.0) + weighting_s) / off, 4),
        "calls_in_mode": len(calls), "load_average": round(os.getloadavg()[0], 2),
    }


def table(model_name: str, results: dict, global_batch: int, label: str = "") -> None:
    base = results["auto-1"]["step_s"]
    points = results["auto-1"]["points_per_sample"] * global_batch
    print(f"\n== {model_name}{label}: global batch {global_batch} samples, about {points:.0f} points per batch ==")
    print(f"{'case':<30}{'devices':>8}{'batch/dev':>10}{'ms/iter [min-max]':>24}{'speedup':>9}{'ideal':>7}{'points/s':>11}"
          f"{'CPU ms/iter':>13}{'peak RSS MB':>13}")
    ceilings = {name: r for name, r in results.items() if name in CEILING_CASES.values()}
    for name, r in results.items():
        if name in ceilings:
            continue
        devices = r["devices"]
        low, high = r.get("step_range", (r["step_s"], r["step_s"]))
        spread = f"{r['step_s'] * 1e3:.1f} [{low * 1e3:.1f}-{high * 1e3:.1f}]"
        print(f"{name:<30}{devices:>8}{global_batch / devices:>10.1f}{spread:>24}"
              f"{base / r['step_s']:>9.2f}{devices:>7}{points / r['step_s']:>11.0f}{r.get('cpu_s', 0.0) * 1e3:>13.1f}"
              f"{r.get('peak_rss_mb', 0.0):>13.0f}")
    for name, r in ceilings.items():
        reps = r.get("reps", [r])
        values = [x["ceiling"] for x in reps]
        print(f"{name}: plain Lightning {r['step_s'] * 1e3:.1f} ms a step, its network part "
              f"{statistics.median(x['network_s'] for x in reps) * 1e3:.1f} ms, in {r['devices']} bare threads "
              f"{statistics.median(x['bare_s'] for x in reps) * 1e3:.1f} ms: a thread-parallel strategy with no cost of its "
              f"own would reach {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}] (benchmarks/ceiling.py)")


#: Stages of a sparse_dp step as drawn and tabulated (``other``: the optimizer step and Lightning's loop).
STAGES = ["split", "place", "replicate", "state", "apply", "gather", "log", "backward", "reduce", "other"]


def stage_breakdown(result: dict) -> dict[str, float]:
    """Median ms of each stage of one case; ``backward`` without ``reduce``; ``other`` = step - the rest."""
    st = {k: v * 1e3 for k, v in (result.get("stages") or {}).items()}
    if not st:
        return {}
    out = {n: st.get(n, 0.0) for n in STAGES[:-1]}
    out["backward"] = max(0.0, out["backward"] - out["reduce"])
    out["other"] = max(0.0, result["step_s"] * 1e3 - sum(out.values()))
    out["replica forward max"] = max((v for k, v in st.items() if re.fullmatch(r"replica\d+", k)), default=0.0)
    out["replica backward max"] = max((v for k, v in st.items() if re.fullmatch(r"backward\d+", k)), default=0.0)
    return out


def stage_table(results: dict) -> None:
    names = STAGES + ["replica forward max", "replica backward max"]
    print(f"\n{'stage medians (ms)':<30}" + "".join(f"{n.replace('replica ', 'r.'):>12}" for n in names))
    for case, r in results.items():
        st = stage_breakdown(r)
        if st:
            print(f"{case:<30}" + "".join(f"{st[n]:>12.2f}" for n in names))
    for case, r in results.items():
        layers = syncbn_layers(r)
        if layers:
            st = {k: v * 1e3 for k, v in r["stages"].items()}
            print(f"{case:<30} sync BN: {st['syncbn']:.2f} ms per step in {len(layers)} layers (forward + backward, mean "
                  f"over replicas), {st['syncbn_wait']:.2f} ms of it waiting for the slowest replica; per layer: "
                  + " ".join(f"{v:.2f}" for v in layers))


def syncbn_layers(result: dict) -> list[float]:
    """Median ms of each synchronized batch-norm layer of one case (``syncbn<j>``), layer order; empty without."""
    st = result.get("stages") or {}
    found = sorted(int(k[6:]) for k in st if re.fullmatch(r"syncbn\d+", k))
    return [st[f"syncbn{j}"] * 1e3 for j in found]


#: ME's documentation, MinkUNet on 4 Titan XP GPUs: average speedup at 2 / 3 / 4 GPUs (the seed's table).
ME_GPU_SPEEDUP = {1: 1.0, 2: 1.90, 3: 2.60, 4: 2.60}


def _speedup_lines(results: dict) -> dict[str, tuple[list[int], list[float]]]:
    base = results["auto-1"]["step_s"]
    one = results.get("sparse_dp-1", results["auto-1"])["step_s"]
    lines = {
        "sparse_dp": ([1] + [d for d in (2, 3) if f"sparse_dp-{d}" in results],
                      [base / one] + [base / results[f"sparse_dp-{d}"]["step_s"] for d in (2, 3) if f"sparse_dp-{d}" in results]),
        "sparse_dp, sync BN": ([1] + [d for d in (2, 3) if f"sparse_dp-{d} syncBN" in results],
                               [base / one] + [base / results[f"sparse_dp-{d} syncBN"]["step_s"] for d in (2, 3)
                                               if f"sparse_dp-{d} syncBN" in results]),
        "DDP (gloo)": ([1, 2], [1.0, base / results["ddp-2 (gloo)"]["step_s"]]),
    }
    return lines


def plot(runs: dict, out_dir: Path) -> list[Path]:
    """``speedup.png`` (speedup against devices) and ``stages.png`` (stacked stage times) from ``runs``.

    ``runs[(model, mode)]`` is a results dict of :func:`run_model`; ``mode`` is ``"default"`` or ``"1 thread"``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    models = sorted({m for m, _ in runs}, key=["segmentation", "digits"].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.6), squeeze=False)
    colors = {"sparse_dp": "tab:blue", "sparse_dp, sync BN": "tab:orange", "DDP (gloo)": "tab:green"}
    for ax, model in zip(axes[0], models):
        for mode, style in (("default", "-"), ("1 thread", "--")):
            if (model, mode) not in runs:
                continue
            for name, (xs, ys) in _speedup_lines(runs[(model, mode)]).items():
                ax.plot(xs, ys, style, marker="o", color=colors[name], label=f"{name} ({mode})")
        ax.plot([1, 4], [1, 4], ":", color="gray", label="ideal")
        ax.plot(list(ME_GPU_SPEEDUP), list(ME_GPU_SPEEDUP.values()), "-.", marker="s", color="black",
                label="ME docs, MinkUNet on GPUs")
        ax.set(title=f"{model}: speedup over plain Lightning on one device", xlabel="devices (CPU replicas / processes)",
               ylabel="speedup", xticks=[1, 2, 3, 4])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    speedup = out_dir / "speedup.png"
    fig.savefig(speedup, dpi=110, bbox_inches="tight")
    plt.close(fig)

    bars = [(f"{model} {case} ({mode})", stage_breakdown(r)) for (model, mode), results in runs.items()
            for case, r in results.items() if model == "segmentation" and stage_breakdown(r)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 2.0))
    left = np.zeros(len(bars))
    cmap = plt.get_cmap("tab10")
    for i, stage in enumerate(STAGES):
        widths = np.array([b[stage] for _, b in bars])
        ax.barh([name for name, _ in bars], widths, left=left, color=cmap(i), label=stage)
        left += widths
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (medians; apply = the replicas' forward, backward = their backward passes)",
           title="segmentation: where a sparse_dp step's time goes")
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / len(bars)), frameon=False)
    fig.tight_layout()
    stages = out_dir / "stages.png"
    fig.savefig(stages, dpi=110, bbox_inches="tight")  # "tight": the legend below the axes and the label stay in
    plt.close(fig)
    return [speedup, stages]


def run_all(models: list[tuple[str, int]], steps: int, warmup: int, repeats: int) -> dict:
    """Every case of every model and thread setting, ``repeats`` times, each in a fresh process.

    Repetition ``k`` runs all cases in turn (the order reversed every other repetition), so the two cases of
    every ratio run close together in each repetition and a slow spell of a shared machine lands on both.

    Returns:
        ``(raw, failed)``: ``raw[(model, mode)][case]``, the case's results, one per repetition (none for a case
        that failed in any repetition); ``failed["<model> <mode> <case>"]``, what a failed case said. A failed
        case (the DDP child seen to end with "terminate called without an active exception") is reported and the
        run goes on.
    """
    raw: dict = {(m, mode): {c: [] for c in case_names(mode, m)} for m, _ in models for mode in MODES}
    failed: dict[str, str] = {}
    total, done, started = sum(len(v) for v in raw.values()) * repeats, 0, time.perf_counter()
    runners = {mode: CaseRunner(mode) for mode in MODES}
    try:
        for rep in range(repeats):
            for model_name, global_batch in models:
                for mode in MODES:
                    names = case_names(mode, model_name)
                    for case in names if rep % 2 == 0 else names[::-1]:
                        done += 1
                        where = f"  [{done}/{total} {time.perf_counter() - started:.0f} s] repetition {rep + 1}: " \
                                f"{model_name}, {mode}, {case}"
                        if f"{model_name} {mode} {case}" in failed:
                            continue
                        try:
                            result = runners[mode].run(model_name, case, global_batch, steps, warmup)
                        except Exception as err:  # noqa: BLE001 - reported in the tables and the JSON line
                            lines = str(err).strip().splitlines()
                            failed[f"{model_name} {mode} {case}"] = f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"
                            print(f"{where}: FAILED ({failed[f'{model_name} {mode} {case}']})", flush=True)
                            continue
                        raw[(model_name, mode)][case].append(result)
                        print(f"{where}: {result['step_s'] * 1e3:.1f} ms/iter", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
    for key in failed:
        model_name, rest = key.split(" ", 1)
        mode = next(m for m in MODES if rest.startswith(m + " "))
        raw[(model_name, mode)][rest[len(mode) + 1:]] = []
    return raw, failed


def _devices(case: str) -> int:
    return 2 if case in DDP_CASES else int(case.split("-")[1].split()[0])


def headline(raw: dict, global_batch: int, steps: int, warmup: int) -> dict:
    """The JSON line's figures: each the median over repetitions, with ``<key>_spread`` = [min, max]."""
    out: dict = {}

    def put(key: str, values: list[float], digits: int = 4) -> None:
        if not values:  # a case it needs failed (see "failed")
            out[key], out[f"{key}_spread"] = None, None
            return
        out[key] = round(statistics.median(values), digits)
        out[f"{key}_spread"] = [round(min(values), digits), round(max(values), digits)]

    def ratio(model: str, mode: str, numerator: str, denominator: str) -> list[float]:
        a, b = raw[(model, mode)][numerator], raw[(model, mode)][denominator]
        return [x["step_s"] / y["step_s"] for x, y in zip(a, b)] if a and b else []  # within each repetition

    def stage_sum(model: str, mode: str, case: str, names: tuple[str, ...]) -> list[float]:
        return [sum(r["stages"].get(n, 0.0) for n in names) for r in raw[(model, mode)][case]]

    seg, dig, d, one = "segmentation", "digits", "default", "1 thread"
    put("overhead_ratio", ratio(seg, d, "sparse_dp-1", "auto-1"))
    put("overhead_ratio_1t", ratio(seg, one, "sparse_dp-1", "auto-1"))
    put("split_fraction", [s / r["step_s"] for s, r in zip(stage_sum(seg, d, "sparse_dp-3", ("split", "place")),
                                                          raw[(seg, d)]["sparse_dp-3"])])
    put("ddp_throughput_ratio", ratio(seg, d, "ddp-2 (gloo)", "sparse_dp-2"))
    put("ddp_throughput_ratio_1t", ratio(seg, one, "ddp-2 (gloo)", "sparse_dp-2"))
    put("speedup_sparse_dp_2", ratio(seg, d, "auto-1", "sparse_dp-2"), 3)
    put("speedup_sparse_dp_3", ratio(seg, d, "auto-1", "sparse_dp-3"), 3)
    put("speedup_sparse_dp_2_1t", ratio(seg, one, "auto-1", "sparse_dp-2"), 3)
    for mode, suffix in ((d, ""), (one, "_1t")):
        put(f"syncbn_cost_ratio{suffix}", ratio(seg, mode, "sparse_dp-3 syncBN", "sparse_dp-3"))
        put(f"syncbn_cost_ratio_2{suffix}", ratio(seg, mode, "sparse_dp-2 syncBN", "sparse_dp-2"))
        put(f"syncbn_cost_ratio{suffix}_unpinned", ratio(seg, mode, "sparse_dp-3 syncBN unpinned", "sparse_dp-3"))
    put("replicate_ms", [v * 1e3 for v in stage_sum(seg, d, "sparse_dp-3", ("replicate", "state"))], 3)
    put("digits_speedup_sparse_dp_2_1t", ratio(dig, one, "auto-1", "sparse_dp-2"), 3)
    put("digits_syncbn_speedup_3", ratio(dig, d, "auto-1", "sparse_dp-3 syncBN"), 3)
    put("digits_ceiling_2_1t", [r["ceiling"] for r in raw[(dig, one)][CEILING_CASES[one]]], 3)
    put("digits_ceiling_3", [r["ceiling"] for r in raw[(dig, d)][CEILING_CASES[d]]], 3)
    fixed = ("split", "place", "replicate", "state", "gather", "log")
    put("step_overhead_ms", [v * 1e3 for v in stage_sum(dig, d, "sparse_dp-3", fixed)], 3)
    put("step_overhead_ms_presplit", [v * 1e3 for v in stage_sum(dig, d, PRESPLIT_CASE, fixed)], 3)
    put("sparse_ddp_vs_ddp", ratio(seg, d, "ddp-2 (gloo)", "sparse_ddp-2 gloo"))
    put("sparse_ddp_vs_ddp_launcher_threads", ratio(dig, d, *LAUNCHER_CASES))
    data = LogNormalScenes(global_batch * (steps + warmup), seed=7)  # the segmentation cases' scenes
    out["rank_imbalance"] = sampler_imbalance([len(labels) for _, _, labels in data.scenes], global_batch // 2)
    out["imbalance_balanced"] = round(imbalance("balanced"), 4)
    out["imbalance_contiguous"] = round(imbalance("contiguous"), 4)
    ours, fresh = dispatch_us()
    out["dispatch_us"] = {"sparse_dp": round(ours, 1), "parallel_apply_threads": round(fresh, 1)}
    peaks = {case: max(r["peak_rss_mb"] for r in reps) for case, reps in raw[(seg, d)].items() if reps}
    out["peak_rss_mb"] = {case: round(v, 1) for case, v in peaks.items()}
    out["rss_ratio_sparse_dp_3"] = round(peaks["sparse_dp-3"] / peaks["auto-1"], 3) \
        if "sparse_dp-3" in peaks and "auto-1" in peaks else None
    return out


def main_gpu(args) -> None:
    """``--accelerator gpu``: plain Lightning on one GPU, sparse_dp on 1..N GPUs (with sync BN on N), DDP with 2
    processes (NCCL) where there are 2 GPUs, and, where fewer GPUs than 3 are visible, 2 and 3 replicas sharing one
    GPU (``replicas_per_device``, labelled ``shared``; sync BN on the 3). Tables, stage medians and one JSON line:
    ``overhead_ratio_gpu`` (segmentation; ``digits_overhead_ratio_gpu``), ``speedup_sparse_dp_<d>_gpu``, each case's
    ms per step and sparse_dp-1's stage medians per model, and ``failed``: a case that raised is reported there and
    in the output, and the run goes on (``null`` for a ratio it leaves without a side)."""
    if torch.cuda.device_count() == 0:
        sys.exit("bench: --accelerator gpu but torch.cuda.device_count() == 0 (no GPU visible): nothing run")
    gpus = args.devices or torch.cuda.device_count()
    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"torch {torch.__version__}; GPUs: {names}; {steps} timed steps after {warmup} warm-up steps per case")
    headline: dict = {"gpus": gpus, "gpu": names[0], "failed": {}}

    def sdp(**kwargs):
        return SparseDataParallelStrategy(record_stage_times=True, **kwargs)

    for model_name, global_batch in (("segmentation", args.global_batch), ("digits", GLOBAL_BATCH["digits"])):
        kwargs = {"loss_weighting": "points"} if model_name == "segmentation" else {}
        cases = {"auto-1": (1, lambda: run_case(model_name, "auto", 1, global_batch, steps, warmup, "gpu"))}
        for d in range(1, gpus + 1):
            cases[f"sparse_dp-{d}"] = (d, partial(run_case, model_name, sdp(**kwargs), d, global_batch, steps, warmup,
                                                  "gpu"))
        for k in (2, 3):
            if k > gpus:
                cases[f"sparse_dp-{k} shared"] = (k, partial(run_case, model_name, sdp(replicas_per_device=k, **kwargs),
                                                             1, global_batch, steps, warmup, "gpu"))
        if gpus >= 2:
            cases[f"sparse_dp-{gpus} syncBN"] = (gpus, partial(run_case, model_name, sdp(sync_batchnorm=True, **kwargs),
                                                               gpus, global_batch, steps, warmup, "gpu"))
            cases["ddp-2 (nccl)"] = (2, partial(run_ddp_child, model_name, global_batch, steps, warmup, "ddp", "gpu"))
        else:
            cases["sparse_dp-3 shared syncBN"] = (3, partial(
                run_case, model_name, sdp(replicas_per_device=3, sync_batchnorm=True, **kwargs), 1, global_batch,
                steps, warmup, "gpu"))
        results = {}
        for label, (devices, run) in cases.items():
            try:
                results[label] = {**run(), "devices": devices}
            except Exception as err:  # reported in the table's place and the JSON line; the other cases still run
                said = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}"
                headline["failed"][f"{model_name} {label}"] = said
                print(f"bench: the case {label!r} ({model_name}) failed: {said}", file=sys.stderr, flush=True)
        if "auto-1" in results:
            table(model_name, results, global_batch)
        stage_table(results)
        prefix = "" if model_name == "segmentation" else f"{model_name}_"
        plain, one = results.get("auto-1"), results.get("sparse_dp-1")
        headline[f"{prefix}overhead_ratio_gpu"] = round(one["step_s"] / plain["step_s"], 4) if plain and one else None
        if model_name == "segmentation":
            for d in range(2, gpus + 1):
                ours = results.get(f"sparse_dp-{d}")
                headline[f"speedup_sparse_dp_{d}_gpu"] = round(plain["step_s"] / ours["step_s"], 3) \
                    if plain and ours else None
        headline[f"{model_name}_step_ms"] = {label: round(r["step_s"] * 1e3, 3) for label, r in results.items()}
        headline[f"{model_name}_stages_ms_sparse_dp_1"] = (
            {k: round(v, 3) for k, v in stage_breakdown(one).items()} if one else None)
    print(json.dumps(headline))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="lightning-sparse-dp benchmark")
    parser.add_argument("--quick", action="store_true", help="6 timed steps after 2 warm-up steps per case (noisier)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH["segmentation"])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every case (interleaved), >= 3 for spreads")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's allocation thresholds alone (see MALLOC_TUNING)")
    parser.add_argument("--default-openblas", action="store_true",
                        help="leave OpenBLAS's spin-wait after each call alone (OPENBLAS_THREAD_TIMEOUT unset)")
    parser.add_argument("--figures", default=str(ROOT / "benchmarks" / "figures"), help="where the PNG plots go")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, help="most devices for sparse_dp (default: 3 on CPU, every GPU)")
    parser.add_argument("--terms-cost", action="store_true",
                        help="only the cost of loss_weighting='terms' on a digits step, on and off (about a minute)")
    parser.add_argument("--case-child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    parser.add_argument("--case-server", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.terms_cost:
        print(json.dumps({"terms_cost": terms_cost(*((6, 2) if args.quick else (20, 3)))}))
        return None
    if args.case_server:  # run by CaseRunner
        return case_server()
    if args.case_child:  # run by CaseRunner (and again by Lightning for DDP's rank 1)
        return run_case_child(args)
    if args.accelerator == "gpu":
        return main_gpu(args)
    started = time.perf_counter()
    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; every case in a fresh process, {args.repeats} "
          f"interleaved repetitions, {steps} timed steps after {warmup} warm-up steps each; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    models = [("segmentation", args.global_batch), ("digits", GLOBAL_BATCH["digits"])]
    raw, failed = run_all(models, steps, warmup, args.repeats)
    runs = {key: {case: aggregate(reps, _devices(case)) for case, reps in cases.items() if reps}
            for key, cases in raw.items()}
    for (model_name, mode), results in runs.items():
        label = "" if mode == "default" else ", one intra-op thread per replica / process"
        if "auto-1" in results:
            table(model_name, results, dict(models)[model_name], label=label)
        stage_table(results)
    for key, said in failed.items():
        print(f"FAILED {key}: {said}")
    try:
        figures = plot(runs, Path(args.figures))
    except (KeyError, ValueError) as err:  # a case the plots need failed
        figures = [f"(no plots: {err!r})"]
    line = {**headline(raw, args.global_batch, steps, warmup), "failed": failed}
    load = os.getloadavg()
    print(f"\nplots: {', '.join(str(f) for f in figures)}; {time.perf_counter() - started:.0f} s in all; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
