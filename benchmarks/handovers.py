"""One hand-over to the replica threads per training step, or two: bare threads, the three orders side by side.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/handovers.py            # 2 threads, 2 ms
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/handovers.py --threads 3 --main-ms 1

sparse_dp hands a training step to its replica threads twice: the forward (then the main thread weighs the losses,
merges the step's state, gathers, logs, and Lightning runs its closure), then, when Lightning calls backward, every
replica's backward. Whether handing the step over once (each replica runs its backward right after its forward,
once its loss's weight is known) or overlapping the main thread's work with the replicas' backward would shorten
the step is measured here without a strategy: the digits network on ``--threads`` chunks of one batch, each
thread with its own copy (as ``ceiling.bare_thread_times``), and ``--main-ms`` of pure-Python work on the main
thread standing for its part between forward and backward. Per repetition, in turn:

- ``two``: forward in the threads, then the main thread's work, then backward in the threads (today's order);
- ``overlap``: the threads go on to their backward once every forward is done, while the main thread works;
- ``one``: forward and backward in one hand-over, then the main thread's work.

Prints the median wall time of each (ms) with its quartiles. Each thread runs one intra-op thread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (str(HERE), str(HERE.parent / "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

ORDERS = ("two", "overlap", "one")


def python_work(seconds: float) -> None:
    """Pure-Python work for ``seconds`` (dict updates: holds the GIL, as the main thread's log calls do)."""
    end, table = time.perf_counter() + seconds, {}
    while time.perf_counter() < end:
        for i in range(50):
            table[i] = i * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--main-ms", type=float, default=2.0, help="the main thread's work between forward and backward")
    parser.add_argument("--steps", type=int, default=80, help="timed steps of each order")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # self.log outside a Trainer, ME's CPU-only note
    import bench_cases  # noqa: PLC0415  (the workloads; imports ME)

    torch.set_num_threads(1)
    batch, n = 96, args.threads
    model_cls, data, collate, _ = bench_cases._workload("digits", batch, 1)
    bounds = [round(k * batch / n) for k in range(n + 1)]
    chunks = [collate([data[i] for i in range(bounds[k], bounds[k + 1])]) for k in range(n)]
    module = model_cls()
    copies = [copy.deepcopy(module).train() for _ in range(n)]
    work = args.main_ms / 1e3

    def forward(k: int):
        torch.set_num_threads(1)
        out = copies[k].training_step(chunks[k], 0)
        return out["loss"] if isinstance(out, dict) else out

    def both(k: int, arrived: threading.Barrier, go: threading.Event) -> None:
        loss = forward(k)
        arrived.wait()  # every forward done (the losses' weights known)
        go.wait()
        loss.backward()

    times: dict[str, list[float]] = {order: [] for order in ORDERS}
    with ThreadPoolExecutor(n) as pool:
        for i in range((args.warmup + args.steps) * len(ORDERS)):
            order = ORDERS[i % len(ORDERS)]
            start = time.perf_counter()
            if order == "two":
                losses = [f.result() for f in [pool.submit(forward, k) for k in range(n)]]
                python_work(work)
                for f in [pool.submit(loss.backward) for loss in losses]:
                    f.result()
            else:
                arrived, go = threading.Barrier(n + 1), threading.Event()
                futures = [pool.submit(both, k, arrived, go) for k in range(n)]
                arrived.wait()
                go.set()
                if order == "overlap":
                    python_work(work)
                for f in futures:
                    f.result()
                if order == "one":
                    python_work(work)
            elapsed = time.perf_counter() - start
            for c in copies:
                c.zero_grad(set_to_none=True)
            if i >= args.warmup * len(ORDERS):
                times[order].append(elapsed)
    for order, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        print(f"{n} threads, {args.main_ms:g} ms main: {order:8s} {statistics.median(values) * 1e3:6.2f} ms "
              f"[{q1 * 1e3:.2f}-{q3 * 1e3:.2f}]")


if __name__ == "__main__":
    main()
