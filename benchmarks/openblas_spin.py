"""OpenBLAS's spin-wait against one-device steps: fresh processes with and without ``OPENBLAS_THREAD_TIMEOUT=4``.

    .venv/bin/python benchmarks/openblas_spin.py                       # segmentation, auto-1 and sparse_dp-1, 4 pairs
    .venv/bin/python benchmarks/openblas_spin.py --model digits --repeats 6 --timeouts 4 22

ME's CPU convolutions call OpenBLAS's GEMM; the pthreads OpenBLAS that ME links keeps its own thread pool, which
ignores ``OMP_WAIT_POLICY`` and, after every call, spins on ``sched_yield`` for ``2**THREAD_TIMEOUT`` cycles
(28 unless ``OPENBLAS_THREAD_TIMEOUT`` says otherwise, read when the library loads). Each repetition runs every
case once in a fresh process per setting (OpenBLAS's default, then each ``--timeouts`` value; the order of the
settings reversed every other repetition), with ``OMP_WAIT_POLICY=PASSIVE`` and the benchmark's allocator
settings in all: the measurement behind ``harness.OPENBLAS_THREAD_TIMEOUT``. Prints per process the median step
time (ms), the CPU time per step (ms, all threads), and the busiest thread other than the main one (its CPU
seconds and its voluntary context switches: a thread that spins never sleeps, so it has almost none). Then, per case
and setting, the median step time with its [min-max].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from harness import GLOBAL_BATCH, OMP_WAIT_POLICY, RESULT, child_result

HERE = Path(__file__).resolve().parent


def thread_usage() -> list[tuple[float, int]]:
    """``(cpu_s, voluntary_switches)`` of every thread of this process but the main one, busiest first."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        voluntary = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_"))
        out.append((cpu, voluntary))
    return sorted(out, reverse=True)


def child(model: str, case: str, steps: int, warmup: int) -> None:
    sys.path.insert(0, str(HERE))
    import bench  # noqa: PLC0415  (its allocator settings apply to this process)
    from bench_cases import case_strategy  # noqa: PLC0415

    strategy, devices = case_strategy(model, case)
    r = bench.run_case(model, strategy, devices, GLOBAL_BATCH[model], steps, warmup)
    busiest = thread_usage()[0]
    print(RESULT + json.dumps({"step_ms": r["step_s"] * 1e3, "cpu_ms": r["cpu_s"] * 1e3, "thread_cpu_s": busiest[0],
                                 "thread_voluntary": busiest[1]}))


def run(model: str, case: str, timeout: int | None, steps: int, warmup: int) -> dict:
    """One case in a fresh process; ``timeout``: ``OPENBLAS_THREAD_TIMEOUT`` (``None``: unset, OpenBLAS's 28)."""
    env = dict(os.environ, OMP_WAIT_POLICY=OMP_WAIT_POLICY)
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    if timeout is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = str(timeout)
    command = [sys.executable, __file__, "--child", case, "--model", model, "--steps", str(steps), "--warmup", str(warmup)]
    return child_result(command, case, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("digits", "segmentation"), default="segmentation")
    parser.add_argument("--cases", nargs="+", default=["auto-1", "sparse_dp-1"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeouts", nargs="+", type=int, default=[4],
                        help="OPENBLAS_THREAD_TIMEOUT values (2**N cycles, 4..30) run beside OpenBLAS's default")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.steps, args.warmup)
        return
    settings = {None: "OpenBLAS default", **{t: f"OPENBLAS_THREAD_TIMEOUT={t}" for t in args.timeouts}}
    results: dict = {(c, t): [] for c in args.cases for t in settings}
    for k in range(args.repeats):
        for timeout in list(settings) if k % 2 == 0 else list(settings)[::-1]:
            for case in args.cases:
                r = run(args.model, case, timeout, args.steps, args.warmup)
                results[(case, timeout)].append(r["step_ms"])
                print(f"  {k + 1}/{args.repeats} {settings[timeout]:<26} {case:<12} {r['step_ms']:7.1f} ms/step, "
                      f"CPU {r['cpu_ms']:7.1f} ms/step; busiest other thread {r['thread_cpu_s']:.2f} s CPU, "
                      f"{r['thread_voluntary']} voluntary switches", flush=True)
    for (case, timeout), ms in results.items():
        print(f"{args.model} {case:<12} {settings[timeout]:<26} {statistics.median(ms):7.1f} ms [{min(ms):.1f}-{max(ms):.1f}]")


if __name__ == "__main__":
    main()
