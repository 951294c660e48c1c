"""Side-by-side benchmark: plain Lightning, sparse_dp with 1/2/3 devices, and Lightning's DDP with 2 processes.

    .venv/bin/python benchmarks/bench.py            # about 5 minutes on a 2-core CPU machine
    .venv/bin/python benchmarks/bench.py --quick    # fewer steps, for a smoke run
    python benchmarks/bench.py --accelerator gpu    # on GPUs: sparse_dp with 1..N GPUs, DDP with 2 (NCCL)

Same model, data and global batch in every case, in one process tree (DDP runs as a child process
that Lightning forks once more). Models: the MinkUNet-style segmentation network of
examples/train_segmentation.py on generated rooms whose point counts are log-normal, and the digits
network of examples/train_digits.py. Batch norm is per replica in every timed case (DDP on CPU
cannot synchronize it: torch's SyncBatchNorm refuses CPU inputs), plus one sparse_dp case with
``sync_batchnorm=True`` to show what exact batch norm costs.

Prints, per model, a table in the seeds' form (devices, batch per device, time per iteration,
speedup over plain Lightning, ideal speedup, points per second), the median time of each stage of a
sparse_dp step, and ends with one JSON line of headline figures:

- ``overhead_ratio``: sparse_dp devices=1 over plain Lightning, median step time (segmentation; the two
  cases alternate ``--pairs`` times and their steps are pooled);
- ``split_fraction``: (split + placement) over step time, sparse_dp devices=3, batches split in the
  main process (``presplit`` moves it to DataLoader workers when there are any);
- ``imbalance_balanced`` / ``imbalance_contiguous``: max over mean points per replica, 16 scenes, 3 replicas;
- ``dispatch_us``: per-step cost of handing 3 no-op replica steps to threads and collecting them, ours
  (persistent threads) and ``torch.nn.parallel.parallel_apply``'s way (new threads each call;
  ``parallel_apply`` itself needs CUDA, so its thread pattern is reproduced);
- ``ddp_throughput_ratio``: samples per second of sparse_dp devices=2 over DDP with 2 processes;
- ``peak_rss_mb``: peak resident memory of this process (the DDP child not included).

Step times are medians over the steps after warm-up, taken with a callback from the start to the end
of each training batch (forward, backward and optimizer step). ``OMP_WAIT_POLICY=PASSIVE`` is set
unless given (see below).
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
import threading
import time
import warnings
from pathlib import Path

# ME's OpenMP runtime, torch's own copy of it and OpenBLAS each keep threads that spin while idle; on a
# 2-core machine they take turns stealing the cores and step times become bimodal (seen: 11 ms vs 31 ms
# for the same digits forward). Passive waiting makes the timings repeatable; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
import train_digits  # noqa: E402
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


class StepClock(L.Callback):
    """Wall time of each training batch (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


def _workload(model_name: str, global_batch: int, steps: int):
    if model_name == "segmentation":
        data = LogNormalScenes(global_batch * steps, seed=7)
        return seg.Segmenter, data, seg.collate, float(np.mean([len(s[2]) for s in data.scenes]))
    from sklearn.datasets import load_digits

    digits = load_digits()
    n = global_batch * steps
    data = train_digits.SparseDigits(digits.images[:n], digits.target[:n])
    return train_digits.DigitNet, data, train_digits.collate, float(np.mean([len(s[0]) for s in data.samples]))


def run_case(model_name: str, strategy, devices: int, global_batch: int, steps: int, warmup: int,
             accelerator: str = "cpu", **trainer_kwargs):
    """Median step time (s) and the strategy's stage medians for one configuration."""
    model_cls, data, collate, points = _workload(model_name, global_batch, steps + warmup)
    distributed = strategy == "ddp"
    batch = global_batch // devices if distributed else global_batch
    L.seed_everything(0)
    clock = StepClock()
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
        num_sanity_val_steps=0, limit_val_batches=0, **trainer_kwargs,
    )
    trainer.fit(model_cls(), DataLoader(data, batch_size=batch, shuffle=False, collate_fn=collate))
    times = clock.times[warmup:]
    stages = {}
    if isinstance(strategy, SparseDataParallelStrategy) and strategy.stage_times is not None:
        stages = strategy.stage_times.medians(skip=warmup)
    return {"step_s": statistics.median(times), "times": times, "stages": stages, "points_per_sample": points,
            "rank": trainer.global_rank}


def _pooled(runs: list[dict]) -> dict:
    """One result from runs of the same case: the median over all their steps, stage medians of the first."""
    times = [t for r in runs for t in r["times"]]
    return {**runs[0], "times": times, "step_s": statistics.median(times)}


def run_ddp_child(model_name: str, global_batch: int, steps: int, warmup: int, accelerator: str = "cpu") -> dict:
    """DDP with 2 processes (gloo on CPU, NCCL on GPUs), in a child process tree; returns rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, __file__, "--ddp-child", model_name, "--ddp-out", str(out), "--global-batch",
               str(global_batch), "--steps", str(steps), "--warmup", str(warmup), "--accelerator", accelerator]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the DDP child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def imbalance(assignment: str, scenes: int = 16, replicas: int = 3) -> float:
    """Max over mean points per replica for one batch of ``scenes`` log-normal scenes."""
    data = LogNormalScenes(scenes, seed=11)
    _, plan = split_batch(seg.collate([data[i] for i in range(scenes)]), replicas, assignment=assignment)
    points = plan.points_per_chunk
    return max(points) / (sum(points) / len(points))


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


def table(model_name: str, results: dict, global_batch: int) -> None:
    base = results["auto-1"]["step_s"]
    points = results["auto-1"]["points_per_sample"] * global_batch
    print(f"\n== {model_name}: global batch {global_batch} samples, about {points:.0f} points per batch ==")
    print(f"{'case':<18}{'devices':>8}{'batch/dev':>10}{'time/iter ms':>14}{'speedup':>9}{'ideal':>7}{'points/s':>11}")
    for name, r in results.items():
        devices = r["devices"]
        print(f"{name:<18}{devices:>8}{global_batch / devices:>10.1f}{r['step_s'] * 1e3:>14.1f}"
              f"{base / r['step_s']:>9.2f}{devices:>7}{points / r['step_s']:>11.0f}")


def stage_table(results: dict) -> None:
    names = ["split", "place", "replicate", "apply", "gather", "log", "backward"]
    print(f"\n{'stage medians (ms)':<20}" + "".join(f"{n:>10}" for n in names) + f"{'replica max':>12}")
    for case, r in results.items():
        st = r.get("stages") or {}
        if not st:
            continue
        replica_max = max((v for k, v in st.items() if k.startswith("replica")), default=0.0)
        print(f"{case:<20}" + "".join(f"{st.get(n, 0.0) * 1e3:>10.2f}" for n in names) + f"{replica_max * 1e3:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="lightning-sparse-dp benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run; figures are noisier)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3, help="alternations of plain Lightning and sparse_dp devices=1")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, help="most devices for sparse_dp (default: 3 on CPU, every GPU)")
    parser.add_argument("--ddp-child")
    parser.add_argument("--ddp-out")
    args = parser.parse_args()
    if args.ddp_child:  # run by run_ddp_child, and again by Lightning for rank 1
        result = run_case(args.ddp_child, "ddp", 2, args.global_batch, args.steps, args.warmup, args.accelerator)
        if result["rank"] == 0:
            Path(args.ddp_out).write_text(json.dumps(result))
        return
    acc = args.accelerator
    if acc == "gpu" and torch.cuda.device_count() == 0:
        sys.exit("bench: --accelerator gpu but torch.cuda.device_count() == 0 (no GPU visible): nothing run")
    max_devices = args.devices or (torch.cuda.device_count() if acc == "gpu" else 3)
    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    if args.quick:
        args.pairs = 1
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} intra-op threads; "
          f"{steps} timed steps after {warmup} warm-up steps per case")
    if acc == "gpu":
        print(f"GPUs: {[torch.cuda.get_device_name(i) for i in range(max_devices)]}")
    headline = {}
    for model_name, global_batch in (("segmentation", args.global_batch), ("digits", 96)):
        results = {}

        def sdp(**kwargs):
            return SparseDataParallelStrategy(record_stage_times=True, **kwargs)

        kwargs = {"loss_weighting": "points"} if model_name == "segmentation" else {}
        # plain Lightning and sparse_dp devices=1 alternate (A B A B) and pool their steps, so that a slow
        # spell of the machine does not land on one of them only
        pairs = [(run_case(model_name, "auto", 1, global_batch, steps, warmup, acc),
                  run_case(model_name, sdp(**kwargs), 1, global_batch, steps, warmup, acc)) for _ in range(args.pairs)]
        results["auto-1"] = {**_pooled([a for a, _ in pairs]), "devices": 1}
        results["sparse_dp-1"] = {**_pooled([b for _, b in pairs]), "devices": 1}
        for d in range(2, max_devices + 1):
            results[f"sparse_dp-{d}"] = {**run_case(model_name, sdp(**kwargs), d, global_batch, steps, warmup, acc), "devices": d}
        if max_devices >= 2:
            results[f"sparse_dp-{max_devices} syncBN"] = {
                **run_case(model_name, sdp(sync_batchnorm=True, **kwargs), max_devices, global_batch, steps, warmup, acc),
                "devices": max_devices,
            }
            ddp = "ddp-2 (nccl)" if acc == "gpu" else "ddp-2 (gloo)"
            results[ddp] = {**run_ddp_child(model_name, global_batch, steps, warmup, acc), "devices": 2}
        table(model_name, results, global_batch)
        stage_table(results)
        if model_name == "segmentation" and acc == "gpu":
            for d in range(2, max_devices + 1):
                headline[f"speedup_sparse_dp_{d}_gpu"] = round(results["auto-1"]["step_s"] / results[f"sparse_dp-{d}"]["step_s"], 3)
            headline["overhead_ratio_gpu"] = round(results["sparse_dp-1"]["step_s"] / results["auto-1"]["step_s"], 4)
        elif model_name == "segmentation":
            three = results["sparse_dp-3"]
            headline["overhead_ratio"] = round(results["sparse_dp-1"]["step_s"] / results["auto-1"]["step_s"], 4)
            headline["split_fraction"] = round(
                (three["stages"].get("split", 0) + three["stages"].get("place", 0)) / three["step_s"], 4
            )
            headline["ddp_throughput_ratio"] = round(results["ddp-2 (gloo)"]["step_s"] / results["sparse_dp-2"]["step_s"], 4)
            headline["speedup_sparse_dp_3"] = round(results["auto-1"]["step_s"] / three["step_s"], 3)
    headline["imbalance_balanced"] = round(imbalance("balanced"), 4)
    headline["imbalance_contiguous"] = round(imbalance("contiguous"), 4)
    ours, fresh = dispatch_us()
    headline["dispatch_us"] = {"sparse_dp": round(ours, 1), "parallel_apply_threads": round(fresh, 1)}
    headline["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print()
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
