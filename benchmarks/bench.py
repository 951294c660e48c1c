"""Side-by-side benchmark: plain Lightning, sparse_dp with 1/2/3 devices, and Lightning's DDP with 2 processes.

    .venv/bin/python benchmarks/bench.py            # about 5-6 minutes on a 2-core CPU machine
    .venv/bin/python benchmarks/bench.py --quick    # fewer steps, for a smoke run
    .venv/bin/python benchmarks/bench.py --terms-cost   # only what loss_weighting="terms" costs (about a minute)
    python benchmarks/bench.py --accelerator gpu    # on GPUs: sparse_dp with 1..N GPUs, DDP with 2 (NCCL)

Same model, data and global batch in every case, in one process tree (DDP runs as a child process
that Lightning forks once more). Models: the MinkUNet-style segmentation network of
examples/train_segmentation.py on generated rooms whose point counts are log-normal, and the digits
network of examples/train_digits.py. Batch norm is per replica in every timed case (Lightning's DDP on
CPU cannot synchronize it: torch's SyncBatchNorm refuses CPU inputs), plus one sparse_dp case with
``sync_batchnorm=True`` to show what exact batch norm costs.

Every case runs twice: with the default threads (sparse_dp splits the cores between its replicas,
Lightning's DDP launcher between its processes, plain Lightning uses them all), and as the
1-thread-per-replica proxy, in a child process with ``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``: each
replica, each DDP process and plain Lightning get one intra-op thread, which is what independent
devices look like from the CPU's side.

Prints, per model and thread setting, a table in the seeds' form (devices, batch per device, time per
iteration, speedup over plain Lightning, ideal speedup, points per second) and the median time of each
stage of a sparse_dp step; writes ``speedup.png`` (speedup against devices for sparse_dp, sparse_dp with
sync BN and DDP, with the ideal line and ME's published MinkUNet GPU speedups 1.90 / 2.60 / 2.60 at 2 / 3 /
4 GPUs) and ``stages.png`` (stacked stage times) to ``--figures`` (``benchmarks/figures``); and ends with
one JSON line of headline figures (segmentation unless named):

- ``overhead_ratio``: sparse_dp devices=1 over plain Lightning, median step time (the two cases
  alternate ``--pairs`` times and their steps are pooled);
- ``split_fraction``: (split + placement) over step time, sparse_dp devices=3, batches split in the
  main process (``presplit`` moves it to DataLoader workers when there are any);
- ``ddp_throughput_ratio`` / ``ddp_throughput_ratio_1t``: samples per second of sparse_dp devices=2 over
  DDP with 2 processes, default threads / 1-thread proxy;
- ``speedup_sparse_dp_2`` / ``speedup_sparse_dp_3`` / ``speedup_sparse_dp_2_1t``: plain Lightning's step
  time over sparse_dp's (``digits_speedup_sparse_dp_2_1t``: the same for the digits network);
- ``syncbn_cost_ratio`` (``_1t``): sparse_dp-3 with ``sync_batchnorm=True`` over without;
- ``replicate_ms``: median time of the ``replicate`` plus ``state`` stages of a sparse_dp-3 step
  (persistent replicas refreshed; metric copies reset, log recorders and batch-norm group installed,
  and undone after the step with the metric states merged);
- ``imbalance_balanced`` / ``imbalance_contiguous``: max over mean points per replica, 16 scenes, 3 replicas;
- ``dispatch_us``: per-step cost of handing 3 no-op replica steps to threads and collecting them, ours
  (persistent threads) and ``torch.nn.parallel.parallel_apply``'s way (new threads each call;
  ``parallel_apply`` itself needs CUDA, so its thread pattern is reproduced);
- ``peak_rss_mb``: peak resident memory of this process (the child processes not included).

The tables also give each case's CPU time per step (this process, all its threads; DDP: rank 0's
process only): on a loaded machine the wall times say little about parallelism, the CPU times still
say how much work a step costs.

Step times are medians over the steps after warm-up, taken with a callback from the start to the end
of each training batch (forward, backward and optimizer step). ``OMP_WAIT_POLICY=PASSIVE`` and fixed
glibc allocation thresholds are set unless given (see below; ``--default-malloc`` leaves the latter).
The load average is printed at the start and the end: on a shared machine, compare ratios within one
run, and repeat.
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
from pathlib import Path

# ME's OpenMP runtime, torch's own copy of it and OpenBLAS each keep threads that spin while idle; on a
# 2-core machine they take turns stealing the cores and step times become bimodal (seen: 11 ms vs 31 ms
# for the same digits forward). Passive waiting makes the timings repeatable; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# glibc returns freed large blocks to the kernel (heap trimming, mmap) and maps fresh pages for the next
# one; where page faults are slow (seen on this project's sandboxed machine: two live 5 MB tensors cost
# 8 ms to allocate and fill once lightning is imported, 0.16 ms with these settings) that cost lands on
# every large tensor of every case. Fixed thresholds keep freed pages in the heap. The environment
# variables reach the child processes (DDP, the 1-thread proxy); mallopt applies them to this process.
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


def run_case(model_name: str, strategy, devices: int, global_batch: int, steps: int, warmup: int,
             accelerator: str = "cpu", **trainer_kwargs):
    """Median step time (s) and the strategy's stage medians for one configuration."""
    model_cls, data, collate, points = _workload(model_name, global_batch, steps + warmup)
    distributed = strategy == "ddp" or isinstance(strategy, SparseDDPStrategy)
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
            "rank": trainer.global_rank, "cpu_s": statistics.median(clock.cpu[warmup:])}


def _pooled(runs: list[dict]) -> dict:
    """One result from runs of the same case: the median over all their steps, stage medians of the first."""
    times = [t for r in runs for t in r["times"]]
    return {**runs[0], "times": times, "step_s": statistics.median(times),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs)}


def _passed_on() -> list[str]:
    """Flags of this run that child processes must get too."""
    return ["--default-malloc"] if "--default-malloc" in sys.argv else []


def run_ddp_child(model_name: str, global_batch: int, steps: int, warmup: int, strategy: str = "ddp",
                  accelerator: str = "cpu") -> dict:
    """DDP (``strategy="ddp"``) or sparse_ddp with 2 processes (gloo on CPU, NCCL on GPUs), in a child process
    tree; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [sys.executable, __file__, "--ddp-child", model_name, "--ddp-out", str(out), "--global-batch",
               str(global_batch), "--steps", str(steps), "--warmup", str(warmup), "--ddp-strategy", strategy,
               "--accelerator", accelerator] + _passed_on()
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


def sparse_ddp_headline(results: dict, global_batch: int, num_batches: int) -> dict:
    """``sparse_ddp_vs_ddp``: samples per second of sparse_ddp over ddp, 2 processes each, same global batch;
    ``rank_imbalance``: per-rank point imbalance of both samplers on the benchmark's scenes."""
    data = LogNormalScenes(global_batch * num_batches, seed=7)  # the segmentation cases' scenes
    counts = [len(labels) for _, _, labels in data.scenes]
    return {
        "sparse_ddp_vs_ddp": round(results["ddp-2 (gloo)"]["step_s"] / results["sparse_ddp-2 gloo"]["step_s"], 4),
        "rank_imbalance": sampler_imbalance(counts, global_batch // 2),
    }


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

    from lightning_sparse_dp.backward import loss_of
    from lightning_sparse_dp.term_weights import StepTerms
    from lightning_sparse_dp.weighting import chunk_weights

    times: dict[str, list[float]] = {"terms": [], "auto": []}
    ratios = []
    for _ in range(pairs):
        medians = {}
        for weighting in ("terms", "auto"):
            r = run_case("digits", SparseDataParallelStrategy(loss_weighting=weighting), 2, 96, steps, warmup)
            times[weighting] += r["times"]
            medians[weighting] = r["step_s"]
        ratios.append(medians["terms"] / medians["auto"])
    model_cls, data, collate, _ = _workload("digits", 96, 1)
    model = model_cls()
    chunks, plan = split_batch(collate([data[i] for i in range(96)]), 2)

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
    print(f"{'case':<18}{'devices':>8}{'batch/dev':>10}{'time/iter ms':>14}{'speedup':>9}{'ideal':>7}{'points/s':>11}"
          f"{'CPU ms/iter':>13}")
    for name, r in results.items():
        devices = r["devices"]
        print(f"{name:<18}{devices:>8}{global_batch / devices:>10.1f}{r['step_s'] * 1e3:>14.1f}"
              f"{base / r['step_s']:>9.2f}{devices:>7}{points / r['step_s']:>11.0f}{r.get('cpu_s', 0.0) * 1e3:>13.1f}")


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
    print(f"\n{'stage medians (ms)':<20}" + "".join(f"{n.replace('replica ', 'r.'):>12}" for n in names))
    for case, r in results.items():
        st = stage_breakdown(r)
        if st:
            print(f"{case:<20}" + "".join(f"{st[n]:>12.2f}" for n in names))


#: ME's documentation, MinkUNet on 4 Titan XP GPUs: average speedup at 2 / 3 / 4 GPUs (the seed's table).
ME_GPU_SPEEDUP = {1: 1.0, 2: 1.90, 3: 2.60, 4: 2.60}


def _speedup_lines(results: dict) -> dict[str, tuple[list[int], list[float]]]:
    base = results["auto-1"]["step_s"]
    one = results.get("sparse_dp-1", results["auto-1"])["step_s"]
    lines = {
        "sparse_dp": ([1] + [d for d in (2, 3) if f"sparse_dp-{d}" in results],
                      [base / one] + [base / results[f"sparse_dp-{d}"]["step_s"] for d in (2, 3) if f"sparse_dp-{d}" in results]),
        "sparse_dp, sync BN": ([1, 3], [base / one, base / results["sparse_dp-3 syncBN"]["step_s"]]),
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
    fig.savefig(speedup, dpi=110)
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
    ax.legend(ncol=9, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / len(bars)), frameon=False)
    fig.tight_layout()
    stages = out_dir / "stages.png"
    fig.savefig(stages, dpi=110)
    plt.close(fig)
    return [speedup, stages]


def run_model(model_name: str, global_batch: int, steps: int, warmup: int, pairs: int, proxy: bool) -> dict:
    """Every case of one model; ``proxy``: the 1-thread-per-replica run (no sparse_dp-1, one plain Lightning run)."""
    def sdp(**kwargs):
        return SparseDataParallelStrategy(record_stage_times=True, **kwargs)

    kwargs = {"loss_weighting": "points"} if model_name == "segmentation" else {}
    results = {}
    if proxy:
        results["auto-1"] = {**run_case(model_name, "auto", 1, global_batch, steps, warmup), "devices": 1}
    else:
        # plain Lightning and sparse_dp devices=1 alternate (A B A B) and pool their steps, so that a slow
        # spell of the machine does not land on one of them only
        runs = [(run_case(model_name, "auto", 1, global_batch, steps, warmup),
                 run_case(model_name, sdp(**kwargs), 1, global_batch, steps, warmup)) for _ in range(pairs)]
        results["auto-1"] = {**_pooled([a for a, _ in runs]), "devices": 1}
        results["sparse_dp-1"] = {**_pooled([b for _, b in runs]), "devices": 1}
    for d in (2, 3):
        results[f"sparse_dp-{d}"] = {**run_case(model_name, sdp(**kwargs), d, global_batch, steps, warmup), "devices": d}
    results["sparse_dp-3 syncBN"] = {
        **run_case(model_name, sdp(sync_batchnorm=True, **kwargs), 3, global_batch, steps, warmup), "devices": 3
    }
    results["ddp-2 (gloo)"] = {**run_ddp_child(model_name, global_batch, steps, warmup), "devices": 2}
    if not proxy:
        results["sparse_ddp-2 gloo"] = {
            **run_ddp_child(model_name, global_batch, steps, warmup, "sparse_ddp"), "devices": 2
        }
    return results


def run_proxy_child(models: list[tuple[str, int]], steps: int, warmup: int) -> dict:
    """The 1-thread-per-replica proxy in a child process with ``OMP_NUM_THREADS=1`` and ``OPENBLAS_NUM_THREADS=1``.

    Each replica, each DDP process (Lightning keeps a set ``OMP_NUM_THREADS``) and plain Lightning get
    one intra-op thread: what independent devices look like from the CPU's side.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "proxy.json"
        cmd = [sys.executable, __file__, "--proxy-child", ",".join(f"{m}:{b}" for m, b in models), "--proxy-out",
               str(out), "--steps", str(steps), "--warmup", str(warmup)] + _passed_on()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the 1-thread child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def main_gpu(args) -> None:
    """``--accelerator gpu``: plain Lightning on one GPU, sparse_dp on 1..N GPUs (and with sync BN on N), DDP with
    2 processes (NCCL); tables, stage medians and a JSON line of ``speedup_sparse_dp_<d>_gpu`` / ``overhead_ratio_gpu``."""
    if torch.cuda.device_count() == 0:
        sys.exit("bench: --accelerator gpu but torch.cuda.device_count() == 0 (no GPU visible): nothing run")
    max_devices = args.devices or torch.cuda.device_count()
    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    print(f"torch {torch.__version__}; GPUs: {[torch.cuda.get_device_name(i) for i in range(max_devices)]}; "
          f"{steps} timed steps after {warmup} warm-up steps per case")
    headline = {}
    for model_name, global_batch in (("segmentation", args.global_batch), ("digits", 96)):
        def sdp(**kwargs):
            return SparseDataParallelStrategy(record_stage_times=True, **kwargs)

        kwargs = {"loss_weighting": "points"} if model_name == "segmentation" else {}
        results = {"auto-1": {**run_case(model_name, "auto", 1, global_batch, steps, warmup, "gpu"), "devices": 1}}
        for d in range(1, max_devices + 1):
            results[f"sparse_dp-{d}"] = {**run_case(model_name, sdp(**kwargs), d, global_batch, steps, warmup, "gpu"),
                                         "devices": d}
        if max_devices >= 2:
            results[f"sparse_dp-{max_devices} syncBN"] = {
                **run_case(model_name, sdp(sync_batchnorm=True, **kwargs), max_devices, global_batch, steps, warmup, "gpu"),
                "devices": max_devices,
            }
            results["ddp-2 (nccl)"] = {**run_ddp_child(model_name, global_batch, steps, warmup, "ddp", "gpu"), "devices": 2}
        table(model_name, results, global_batch)
        stage_table(results)
        if model_name == "segmentation":
            for d in range(2, max_devices + 1):
                headline[f"speedup_sparse_dp_{d}_gpu"] = round(
                    results["auto-1"]["step_s"] / results[f"sparse_dp-{d}"]["step_s"], 3
                )
            headline["overhead_ratio_gpu"] = round(results["sparse_dp-1"]["step_s"] / results["auto-1"]["step_s"], 4)
    print(json.dumps(headline))


def main() -> None:
    parser = argparse.ArgumentParser(description="lightning-sparse-dp benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run; figures are noisier)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=2, help="alternations of plain Lightning and sparse_dp devices=1")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's allocation thresholds alone (see MALLOC_TUNING)")
    parser.add_argument("--figures", default=str(ROOT / "benchmarks" / "figures"), help="where the PNG plots go")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--devices", type=int, help="most devices for sparse_dp (default: 3 on CPU, every GPU)")
    parser.add_argument("--ddp-child")
    parser.add_argument("--ddp-out")
    parser.add_argument("--proxy-child")
    parser.add_argument("--proxy-out")
    parser.add_argument("--ddp-strategy", default="ddp", choices=["ddp", "sparse_ddp"])
    parser.add_argument("--terms-cost", action="store_true",
                        help="only the cost of loss_weighting='terms' on a digits step, on and off (about a minute)")
    args = parser.parse_args()
    if args.terms_cost:
        print(json.dumps({"terms_cost": terms_cost(*((6, 2) if args.quick else (20, 3)))}))
        return
    if args.ddp_child:  # run by run_ddp_child, and again by Lightning for rank 1
        strategy = sparse_ddp_strategy(args.ddp_child) if args.ddp_strategy == "sparse_ddp" else "ddp"
        result = run_case(args.ddp_child, strategy, 2, args.global_batch, args.steps, args.warmup, args.accelerator)
        if result["rank"] == 0:
            Path(args.ddp_out).write_text(json.dumps(result))
        return
    if args.proxy_child:  # run by run_proxy_child
        models = [(m, int(b)) for m, b in (item.split(":") for item in args.proxy_child.split(","))]
        out = {m: run_model(m, b, args.steps, args.warmup, 1, proxy=True) for m, b in models}
        Path(args.proxy_out).write_text(json.dumps(out))
        return
    if args.accelerator == "gpu":
        return main_gpu(args)
    started = time.perf_counter()
    steps, warmup = (6, 2) if args.quick else (args.steps, args.warmup)
    if args.quick:
        args.pairs = 1
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} intra-op threads; "
          f"{steps} timed steps after {warmup} warm-up steps per case; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    models = [("segmentation", args.global_batch), ("digits", 96)]
    runs = {}
    for model_name, global_batch in models:
        runs[(model_name, "default")] = run_model(model_name, global_batch, steps, warmup, args.pairs, proxy=False)
    for model_name, results in run_proxy_child(models, steps, warmup).items():
        runs[(model_name, "1 thread")] = results
    for (model_name, mode), results in runs.items():
        global_batch = dict(models)[model_name]
        table(model_name, results, global_batch, label="" if mode == "default" else ", one intra-op thread per replica / process")
        stage_table(results)
    seg_default, seg_1t = runs[("segmentation", "default")], runs[("segmentation", "1 thread")]
    three = seg_default["sparse_dp-3"]
    headline = {
        "overhead_ratio": round(seg_default["sparse_dp-1"]["step_s"] / seg_default["auto-1"]["step_s"], 4),
        "split_fraction": round((three["stages"].get("split", 0) + three["stages"].get("place", 0)) / three["step_s"], 4),
        "ddp_throughput_ratio": round(seg_default["ddp-2 (gloo)"]["step_s"] / seg_default["sparse_dp-2"]["step_s"], 4),
        "ddp_throughput_ratio_1t": round(seg_1t["ddp-2 (gloo)"]["step_s"] / seg_1t["sparse_dp-2"]["step_s"], 4),
        "speedup_sparse_dp_2": round(seg_default["auto-1"]["step_s"] / seg_default["sparse_dp-2"]["step_s"], 3),
        "speedup_sparse_dp_3": round(seg_default["auto-1"]["step_s"] / three["step_s"], 3),
        "speedup_sparse_dp_2_1t": round(seg_1t["auto-1"]["step_s"] / seg_1t["sparse_dp-2"]["step_s"], 3),
        "syncbn_cost_ratio": round(seg_default["sparse_dp-3 syncBN"]["step_s"] / three["step_s"], 4),
        "syncbn_cost_ratio_1t": round(seg_1t["sparse_dp-3 syncBN"]["step_s"] / seg_1t["sparse_dp-3"]["step_s"], 4),
        "replicate_ms": round((three["stages"].get("replicate", 0.0) + three["stages"].get("state", 0.0)) * 1e3, 3),
        "digits_speedup_sparse_dp_2_1t": round(
            runs[("digits", "1 thread")]["auto-1"]["step_s"] / runs[("digits", "1 thread")]["sparse_dp-2"]["step_s"], 3
        ),
    }
    headline.update(sparse_ddp_headline(seg_default, args.global_batch, steps + warmup))
    headline["imbalance_balanced"] = round(imbalance("balanced"), 4)
    headline["imbalance_contiguous"] = round(imbalance("contiguous"), 4)
    ours, fresh = dispatch_us()
    headline["dispatch_us"] = {"sparse_dp": round(ours, 1), "parallel_apply_threads": round(fresh, 1)}
    headline["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    figures = plot(runs, Path(args.figures))
    load = os.getloadavg()
    print(f"\nplots: {', '.join(str(f) for f in figures)}; {time.perf_counter() - started:.0f} s in all; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
