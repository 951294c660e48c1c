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
  main process (``presplit`` moves it to DataLoader workers when there are any): the main thread's ``split`` and
  ``place`` plus the slowest replica thread's cut and placing of its chunk (``scatter<i>``);
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
- ``digits_ceiling_fraction_2_1t`` / ``digits_ceiling_fraction_3``: ``digits_speedup_sparse_dp_2_1t`` over
  ``digits_ceiling_2_1t`` and ``digits_syncbn_speedup_3`` over ``digits_ceiling_3``, each repetition's speedup over
  the same repetition's ceiling (issue 35's targets: >= 0.90 and >= 0.85);
- ``digits_floor_fraction_2_1t`` / ``digits_floor_fraction_3``: the most of that ceiling the same step could reach
  if everything of its own cost nothing but the work no thread-parallel strategy can leave out: the split's plan,
  the slowest chunk's cut and placing, the gradients' reduction and two hand-overs to the replica threads
  (``dispatch_us`` for the case's replica count); ``ceiling.floor_fraction`` of each repetition. A ceiling fraction
  target above it cannot be met by trimming the rest;
- ``thread_prep_ratio_2_1t`` / ``thread_prep_ratio_3``: digits, sparse_dp-2 (one thread each) / sparse_dp-3 (default
  threads), the step with each replica's preparation in its own thread (the default) over the same step with it
  on the main thread (``prepare_in_threads=False``, the ``main-prep`` cases): above 1, the threads cost more;
- ``replicate_ms``: median time of the ``replicate`` plus ``state`` stages of a sparse_dp-3 step
  (persistent replicas refreshed; metric copies reset, log recorders and batch-norm group installed,
  and undone after the step with the metric states merged);
- ``replica_check_ms`` / ``digits_replica_check_ms``: segmentation / digits, sparse_dp-3 (default threads), the main
  thread's check that the module has not changed under its replicas (stage ``check``: their fingerprint, then their
  tensors' refresh and the step's replica state installed; ``step/check.py`` DeferredCheck), which since 2026-11-27 runs
  inside ``apply``, while the replicas' threads cut and place their chunks (each waits for it before it touches the
  module), and so is in neither ``replicate_ms`` nor ``step_overhead_ms``; before, it was ``replicate``'s main part
  and the first ``state`` stage;
- ``step_overhead_ms``: digits, sparse_dp-3 (default threads), the fixed cost sparse_dp adds to a step on the main
  thread: ``split + place + replicate + state + weigh + gather + log`` (``split``: the split's plan, each chunk's
  cut and placing being its replica's thread's, ``scatter<i>``, since 2026-11-26 on CPU too; ``weigh``: the loss
  weights and the terms' decision, counted since 2026-11-26, before which they ran unclocked; ``log``: the
  replicas' logged values reduced; the
  ``emit`` stage, Lightning's own ``self.log`` of them, is left out: a one-device step runs it too, inside
  its step); ``step_overhead_ms_presplit``: the same with a DataLoader worker (``num_workers=1``), where sparse_dp's
  ``presplit`` collates and splits the batch, so ``split`` only takes the worker's chunks;
  ``step_overhead_ms_main_prep``: the same with the replicas' preparation on the main thread
  (``prepare_in_threads=False``: ``split`` is then the plan and the cuts, ``place`` the chunks' placing);
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

import json
import os
import statistics
import sys
import time
import warnings
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

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
warnings.filterwarnings("ignore")

import bench_gpu  # noqa: E402  (--accelerator gpu)
from bench_cases import (  # noqa: E402
    CEILING_CASES,
    LAUNCHER_CASES,
    MAIN_PREP_CASES,
    MODES,
    PRESPLIT_CASE,
    CaseRunner,
    LogNormalScenes,
    _devices,
    _parser,
    aggregate,
    case_names,
    case_server,
    failure_line,
    run_case,
    run_case_child,
)
from bench_micro import dispatch_us, imbalance, sampler_imbalance, terms_cost  # noqa: E402
from bench_report import (  # noqa: E402
    plot,
    stage_table,
    table,
)
from ceiling import floor_fraction, unavoidable_seconds  # noqa: E402

import lightning_sparse_dp  # noqa: E402,F401


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
                        key = f"{model_name} {mode} {case}"
                        if key in failed:
                            continue
                        try:
                            result = runners[mode].run(model_name, case, global_batch, steps, warmup)
                        except Exception as err:  # noqa: BLE001 - reported in the tables and the JSON line
                            failed[key] = failure_line(err)
                            raw[(model_name, mode)][case] = []  # its earlier repetitions too: no ratio of it
                            print(f"{where}: FAILED ({failed[key]})", flush=True)
                            continue
                        raw[(model_name, mode)][case].append(result)
                        print(f"{where}: {result['step_s'] * 1e3:.1f} ms/iter", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
    return raw, failed


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

    def _slowest(result: dict, prefix: str) -> float:
        return max((v for k, v in result["stages"].items() if k[len(prefix):].isdigit() and k.startswith(prefix)),
                   default=0.0)

    def stage_sum(model: str, mode: str, case: str, names: tuple[str, ...]) -> list[float]:
        return [sum(r["stages"].get(n, 0.0) for n in names) for r in raw[(model, mode)][case]]

    seg, dig, d, one = "segmentation", "digits", "default", "1 thread"
    put("overhead_ratio", ratio(seg, d, "sparse_dp-1", "auto-1"))
    put("overhead_ratio_1t", ratio(seg, one, "sparse_dp-1", "auto-1"))
    put("split_fraction", [(s + _slowest(r, "scatter")) / r["step_s"]
                           for s, r in zip(stage_sum(seg, d, "sparse_dp-3", ("split", "place")), raw[(seg, d)]["sparse_dp-3"])])
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
    put("replica_check_ms", [v * 1e3 for v in stage_sum(seg, d, "sparse_dp-3", ("check",))], 3)
    put("digits_replica_check_ms", [v * 1e3 for v in stage_sum(dig, d, "sparse_dp-3", ("check",))], 3)
    put("digits_speedup_sparse_dp_2_1t", ratio(dig, one, "auto-1", "sparse_dp-2"), 3)
    put("digits_syncbn_speedup_3", ratio(dig, d, "auto-1", "sparse_dp-3 syncBN"), 3)
    put("digits_ceiling_2_1t", [r["ceiling"] for r in raw[(dig, one)][CEILING_CASES[one]]], 3)
    put("digits_ceiling_3", [r["ceiling"] for r in raw[(dig, d)][CEILING_CASES[d]]], 3)
    ours, fresh = dispatch_us()  # 3 no-op replicas' hand-over: the JSON line's dispatch_us, the 3-replica floor's
    hand_over_s = {2: dispatch_us(2, 500)[0] * 1e-6, 3: ours * 1e-6}
    for key, mode, case in (("2_1t", one, "sparse_dp-2"), ("3", d, "sparse_dp-3 syncBN")):  # each repetition's own
        ceilings = [r["ceiling"] for r in raw[(dig, mode)][CEILING_CASES[mode]]]
        put(f"digits_ceiling_fraction_{key}", [s / c for s, c in zip(ratio(dig, mode, "auto-1", case), ceilings)], 3)
        # the same repetitions' best fraction with only the step's unavoidable work (ceiling.unavoidable_seconds)
        steps_of = [r["step_s"] / r["ceiling"] for r in raw[(dig, mode)][CEILING_CASES[mode]]]
        dispatch_s = hand_over_s[_devices(case)]
        put(f"digits_floor_fraction_{key}", [floor_fraction(c, unavoidable_seconds(r["stages"], dispatch_s))
                                             for c, r in zip(steps_of, raw[(dig, mode)][case])], 3)
    put("thread_prep_ratio_2_1t", ratio(dig, one, "sparse_dp-2", MAIN_PREP_CASES[one]))
    put("thread_prep_ratio_3", ratio(dig, d, "sparse_dp-3", MAIN_PREP_CASES[d]))
    fixed = ("split", "place", "replicate", "state", "weigh", "gather", "log")
    put("step_overhead_ms", [v * 1e3 for v in stage_sum(dig, d, "sparse_dp-3", fixed)], 3)
    put("step_overhead_ms_presplit", [v * 1e3 for v in stage_sum(dig, d, PRESPLIT_CASE, fixed)], 3)
    put("step_overhead_ms_main_prep", [v * 1e3 for v in stage_sum(dig, d, MAIN_PREP_CASES[d], fixed)], 3)
    put("sparse_ddp_vs_ddp", ratio(seg, d, "ddp-2 (gloo)", "sparse_ddp-2 gloo"))
    put("sparse_ddp_vs_ddp_launcher_threads", ratio(dig, d, *LAUNCHER_CASES))
    data = LogNormalScenes(global_batch * (steps + warmup), seed=7)  # the segmentation cases' scenes
    out["rank_imbalance"] = sampler_imbalance([len(labels) for _, _, labels in data.scenes], global_batch // 2)
    out["imbalance_balanced"] = round(imbalance("balanced"), 4)
    out["imbalance_contiguous"] = round(imbalance("contiguous"), 4)
    out["dispatch_us"] = {"sparse_dp": round(ours, 1), "parallel_apply_threads": round(fresh, 1)}
    peaks = {case: max(r["peak_rss_mb"] for r in reps) for case, reps in raw[(seg, d)].items() if reps}
    out["peak_rss_mb"] = {case: round(v, 1) for case, v in peaks.items()}
    out["rss_ratio_sparse_dp_3"] = round(peaks["sparse_dp-3"] / peaks["auto-1"], 3) \
        if "sparse_dp-3" in peaks and "auto-1" in peaks else None
    return out


def main_gpu(args) -> None:
    """``--accelerator gpu``: :func:`bench_gpu.main_gpu`, its cases run by this module's ``run_case``."""
    bench_gpu.main_gpu(args, run_case)


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
