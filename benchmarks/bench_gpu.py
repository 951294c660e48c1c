"""The benchmark on GPUs, ``bench.py --accelerator gpu`` (:func:`main_gpu`): plain Lightning on one GPU, sparse_dp on
1..N GPUs (with sync BN on N), DDP with 2 processes (NCCL) where there are 2 GPUs, replicas sharing one GPU where fewer
than 3 are visible, and the replicas' preparation on the main thread beside the default's; each case run in this process
(DDP: in a child process tree), its tables, stage medians and one JSON line of figures. Run through benchmarks/bench.py,
which tunes the allocator and sets the import paths first.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from functools import partial

import torch
from bench_cases import failure_line, run_ddp_child
from bench_report import stage_breakdown, stage_table, table
from harness import GLOBAL_BATCH  # the scripts' shared settings (no torch import there)

from lightning_sparse_dp import SparseDataParallelStrategy


def main_gpu(args, run_case) -> None:
    """``--accelerator gpu``: plain Lightning on one GPU, sparse_dp on 1..N GPUs (with sync BN on N), DDP with 2
    processes (NCCL) where there are 2 GPUs, and, where fewer GPUs than 3 are visible, 2 and 3 replicas sharing one
    GPU (``replicas_per_device``, labelled ``shared``; 3 of them with sync BN too). Tables, stage medians and one JSON line:
    ``overhead_ratio_gpu`` (segmentation; ``digits_overhead_ratio_gpu``), ``speedup_sparse_dp_<d>_gpu``,
    ``<model>_syncbn_cost_ratio_shared_gpu`` (3 replicas sharing a GPU, with sync BN over without),
    ``<model>_thread_prep_ratio_gpu`` (the most replicas' step, prepared in the replicas' threads as by default on
    GPUs, over the same step prepared on the main thread, ``prepare_in_threads=False``: below 1, the threads win), each case's
    ms per step and sparse_dp-1's stage medians per model, and ``failed``: a case that raised is reported there and
    in the output, and the run goes on (``null`` for a ratio it leaves without a side).

    ``run_case``: runs one case in this process, :func:`bench_cases.run_case` (bench.py passes the one in its
    namespace, which a test stands in for).
    """
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
        if gpus < 3:  # synchronized batch norm on replicas sharing a GPU: their own threads meet, as CPU replicas do
            cases["sparse_dp-3 shared syncBN"] = (3, partial(
                run_case, model_name, sdp(replicas_per_device=3, sync_batchnorm=True, **kwargs), 1, global_batch, steps,
                warmup, "gpu"))
        if gpus >= 2:
            cases[f"sparse_dp-{gpus} syncBN"] = (gpus, partial(run_case, model_name, sdp(sync_batchnorm=True, **kwargs),
                                                               gpus, global_batch, steps, warmup, "gpu"))
            cases["ddp-2 (nccl)"] = (2, partial(run_ddp_child, model_name, global_batch, steps, warmup, "ddp", "gpu"))
        # the GPU default prepares each replica in its thread: the same step prepared on the main thread beside it
        shared = {} if gpus >= 2 else {"replicas_per_device": 3}
        prep_base = f"sparse_dp-{gpus}" if gpus >= 2 else "sparse_dp-3 shared"
        cases[f"{prep_base} main-prep"] = (cases[prep_base][0], partial(
            run_case, model_name, sdp(prepare_in_threads=False, **shared, **kwargs), gpus if gpus >= 2 else 1,
            global_batch, steps, warmup, "gpu"))
        results = {}
        for label, (devices, run) in cases.items():
            if args.case_timeout:  # a hang prints every thread's stack and ends the run instead of eating the budget
                faulthandler.dump_traceback_later(args.case_timeout, exit=True, file=sys.__stderr__)
            try:
                results[label] = {**run(), "devices": devices}
                print(f"bench: {model_name} {label}: {results[label]['step_s'] * 1e3:.3f} ms a step", flush=True)
            except Exception as err:  # reported in the table's place and the JSON line; the other cases still run
                said = failure_line(err)
                headline["failed"][f"{model_name} {label}"] = said
                print(f"bench: the case {label!r} ({model_name}) failed: {said}", file=sys.stderr, flush=True)
            finally:
                faulthandler.cancel_dump_traceback_later()
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
        synced, unsynced = results.get("sparse_dp-3 shared syncBN"), results.get("sparse_dp-3 shared")
        headline[f"{model_name}_syncbn_cost_ratio_shared_gpu"] = (
            round(synced["step_s"] / unsynced["step_s"], 4) if synced and unsynced else None)
        threads, main_prep = results.get(prep_base), results.get(f"{prep_base} main-prep")
        headline[f"{model_name}_thread_prep_ratio_gpu"] = (
            round(threads["step_s"] / main_prep["step_s"], 4) if threads and main_prep else None)
        headline[f"{model_name}_step_ms"] = {label: round(r["step_s"] * 1e3, 3) for label, r in results.items()}
        headline[f"{model_name}_stages_ms_sparse_dp_1"] = (
            {k: round(v, 3) for k, v in stage_breakdown(one).items()} if one else None)
    print(json.dumps(headline))
