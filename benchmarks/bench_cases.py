"""The benchmark's cases: the workloads (examples/train_segmentation.py's rooms with log-normal densities, digits),
one case's run under Lightning with its step clock, and the runners that put every case in a fresh process
(:class:`CaseRunner`, DDP children). Run through benchmarks/bench.py, which tunes the allocator first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch
import train_digits
import train_segmentation as seg
from ceiling import NetworkClock, bare_thread_times, ceiling
from harness import GLOBAL_BATCH, wait_env  # the scripts' shared settings (no torch import there)
from torch.utils.data import DataLoader, Dataset

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.strategies.sparse_ddp import SparseDDPStrategy

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).with_name("bench.py")  # the entry point every case process runs
for _path in (str(ROOT), str(ROOT / "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


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
    """``collate(samples)`` with its ME tensors built on the current GPU (:func:`lightning_sparse_dp.step.scatter.place_batch`):
    plain Lightning's ``batch_to_device`` cannot move an ``ME.TensorField``, and a CPU one meeting CUDA weights crashes
    ME's CUDA build (the segmentation reference segfaulted on the H200)."""
    from lightning_sparse_dp.step.scatter import place_batch

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


#: The same step with each replica's preparation (cut, place, refresh, state) on the main thread
#: (``prepare_in_threads=False``), beside the default, where each replica's thread prepares its own: digits, per
#: thread setting (``thread_prep_ratio_*``, ``step_overhead_ms_main_prep``).
MAIN_PREP_CASES = {"1 thread": "sparse_dp-2 main-prep", "default": "sparse_dp-3 main-prep"}


def case_names(mode: str, model_name: str = "segmentation") -> list[str]:
    """The cases of one model and thread setting, in the order of one repetition (the next one runs them reversed)."""
    names = ["auto-1", "sparse_dp-1"]
    names += ["sparse_dp-2", "sparse_dp-3", "sparse_dp-2 syncBN", "sparse_dp-3 syncBN", "sparse_dp-3 syncBN unpinned",
              "ddp-2 (gloo)"]
    names += ["sparse_ddp-2 gloo"] if mode == "default" else []
    names += [CEILING_CASES[mode], MAIN_PREP_CASES[mode]] if model_name == "digits" else []
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
    """``(strategy, devices)`` of a case: ``auto-1``, ``sparse_dp-<d>[ syncBN[ unpinned]]``, ``sparse_dp-<d> main-prep``
    (:data:`MAIN_PREP_CASES`), or a DDP case (2 processes).

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
    if case.endswith("main-prep"):
        kwargs["prepare_in_threads"] = False
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
                done = subprocess.run([sys.executable, str(BENCH), *request, *_passed_on()], capture_output=True, text=True,
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
            server = subprocess.Popen([sys.executable, str(BENCH), "--case-server", *_passed_on()], cwd=ROOT,
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
        cmd = [sys.executable, str(BENCH), "--case-child", case, "--model", model_name, "--case-out", str(out),
               "--global-batch", str(global_batch), "--steps", str(steps), "--warmup", str(warmup),
               "--accelerator", accelerator] + _passed_on()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the DDP child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def failure_line(err: BaseException) -> str:
    """A failed case in one line for the tables and the JSON line: the error's type and its last line (a case
    child's error ends with what the child printed last)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"


def aggregate(reps: list[dict], devices: int) -> dict:
    """One case over its repetitions: medians of the per-repetition medians, their range, the highest peak RSS."""
    steps = [r["step_s"] for r in reps]
    names = sorted({n for r in reps for n in r["stages"]})
    stages = {n: statistics.median(r["stages"][n] for r in reps if n in r["stages"]) for n in names}
    return {**reps[0], "devices": devices, "step_s": statistics.median(steps), "step_range": (min(steps), max(steps)),
            "cpu_s": statistics.median(r["cpu_s"] for r in reps), "stages": stages,
            "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in reps), "reps": reps}


def _devices(case: str) -> int:
    return 2 if case in DDP_CASES else int(case.split("-")[1].split()[0])


def sparse_ddp_strategy(model_name: str) -> SparseDDPStrategy:
    """sparse_ddp as the benchmark runs it: points-weighted loss for segmentation, samples for digits."""
    return SparseDDPStrategy(loss_weighting="points" if model_name == "segmentation" else "samples")


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
    parser.add_argument("--case-timeout", type=float, default=0,
                        help="--accelerator gpu: a case running longer (s) prints every thread's stack and ends the run "
                        "(faulthandler), so a hang says where it is; 0: no limit")
    parser.add_argument("--terms-cost", action="store_true",
                        help="only the cost of loss_weighting='terms' on a digits step, on and off (about a minute)")
    parser.add_argument("--case-child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    parser.add_argument("--case-server", action="store_true", help=argparse.SUPPRESS)
    return parser
