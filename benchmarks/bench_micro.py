"""The benchmark's small measurements beside the cases: the splits' point imbalance, the sampler's, the replica
threads' dispatch cost and the cost of ``loss_weighting='terms'``. Run through benchmarks/bench.py.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import train_segmentation as seg
from bench_cases import LogNormalScenes, _workload, run_case
from harness import GLOBAL_BATCH  # the scripts' shared settings (no torch import there)

from lightning_sparse_dp import ReplicaExecutor, SparseDataParallelStrategy, split_batch
from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).with_name("bench.py")  # the entry point every case process runs
for _path in (str(ROOT), str(ROOT / "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def imbalance(assignment: str, scenes: int = 16, replicas: int = 3) -> float:
    """Max over mean points per replica for one batch of ``scenes`` log-normal scenes."""
    data = LogNormalScenes(scenes, seed=11)
    _, plan = split_batch(seg.collate([data[i] for i in range(scenes)]), replicas, assignment=assignment)
    points = plan.points_per_chunk
    return max(points) / (sum(points) / len(points))




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

    from lightning_sparse_dp.loss.step import StepTerms
    from lightning_sparse_dp.loss.values import loss_of
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
