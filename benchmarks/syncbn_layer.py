"""CPU time of one batch-norm layer, forward + backward: torch's BatchNorm1d against sparse_dp's SyncBatchNorm.

    .venv/bin/python benchmarks/syncbn_layer.py                  # float32, 11,000 points x 64 channels
    .venv/bin/python benchmarks/syncbn_layer.py --points 33000 --channels 128 --float64
    .venv/bin/python benchmarks/syncbn_layer.py --points 750 --channels 32 --threads 2
    .venv/bin/python benchmarks/syncbn_layer.py --points 5500 --channels 32 --threads 3 --pin

The synchronized layer runs as one of two ranks whose other rank's statistics are its own (a collective
that hands back two copies of what it gets), so the figure is the layer's own work: statistics, one
combination, normalization, backward sums, input gradient; no waiting for another replica (the stage
times ``syncbn_wait`` of ``record_stage_times=True`` show that part in a real step). The two layers
alternate, one thread, and the process CPU time (``time.process_time``) of each call is taken, so other
work on the machine changes the figures little. Prints the medians in microseconds and their ratio.

``--threads R`` (R >= 2) runs the layers the way replica threads do instead: R threads of one thread each,
each with its own input of ``--points`` rows, torch's layer unsynchronized and the synchronized one as the
ranks of one :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup`, and prints the wall-clock
microseconds per forward + backward (the slowest thread's mean over ``--calls``; medians of 5 rounds). On
a small layer this is the GIL's figure more than the arithmetic's: every op that releases the GIL waits to
take it back while another thread runs Python. The synchronized layer runs as it would (gathered when the
threads' inputs hold at most ``GATHER_MAX_BYTES`` bytes together, else per rank), then forced onto each
path (``gathered``: every rank's input at once, by one thread; ``per rank``), which is how that threshold was
chosen (docs/benchmarks.md). The row ``+ rendezvous`` is torch's layer meeting the other threads forward and
backward as the synchronized layer does, with nothing exchanged: the synchronized layer's time above it is its own
work, the rest the waits. ``--pin`` (3 threads) lays them out as ``sparse_dp`` pins 3 replicas to 2 cores (the
first thread alone on a core with twice the points, the others sharing the second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_sparse_dp.syncbn import _gathered  # noqa: E402
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm  # noqa: E402
from lightning_sparse_dp.syncbn.collective import ThreadGroup  # noqa: E402


class _Rendezvous(torch.autograd.Function):
    """The identity, meeting the other ranks once forward and once backward as a synchronized layer does (a
    rendezvous with nothing to exchange): torch's layer behind it shows what the waits alone cost."""

    @staticmethod
    def forward(ctx, x: Tensor, member) -> Tensor:  # noqa: ANN001
        ctx.member = member
        member.all_gather_reduce(torch.zeros(1), lambda _: None)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001
        ctx.member.all_gather_reduce(torch.zeros(1), lambda _: None)
        return grad, None


class _Mirror:
    """A two-rank collective whose other rank gave the same tensor (``all_gather(t) == [t, t]``)."""

    rank, world_size = 0, 2

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        return [tensor, tensor]


def layer_cpu_us(layer: nn.Module, x: Tensor, dy: Tensor, calls: int) -> list[float]:
    """CPU microseconds of ``calls`` forward + backward passes of ``layer`` on ``x`` with output gradient ``dy``."""
    out = []
    for _ in range(calls):
        start = time.process_time()
        layer(x).backward(dy)
        out.append((time.process_time() - start) * 1e6)
    return out


def threaded_us(kind: str, threads: int, points: int, channels: int, dtype: torch.dtype, calls: int,
                pin: bool = False) -> float:
    """Wall-clock us per forward + backward of the slowest of ``threads`` threads each running its own layer:
    ``kind`` ``"torch"`` (torch's ``BatchNorm1d``, unsynchronized), ``"rendezvous"`` (torch's, meeting the other
    threads forward and backward: :class:`_Rendezvous`) or ``"sync"`` (the synchronized layer). ``pin``: the
    layout ``sparse_dp`` pins 3 replicas to 2 cores in (thread 0 alone on the first core with twice the points,
    the others on the second; ``threads=3`` on a machine with 2 cores or more)."""
    group = ThreadGroup(threads) if kind != "torch" else None
    barrier = threading.Barrier(threads)
    seconds = [0.0] * threads
    cores = sorted(os.sched_getaffinity(0)) if pin else []

    def rank(r: int) -> None:
        torch.set_num_threads(1)
        if pin:
            os.sched_setaffinity(0, {cores[0] if r == 0 else cores[1]})
        g = torch.Generator().manual_seed(r)
        n = points * 2 if pin and r == 0 else points
        x = (torch.randn(n, channels, generator=g) * 3 + 1).to(dtype).requires_grad_()
        dy = torch.randn(n, channels, generator=g).to(dtype)
        layer = (SyncBatchNorm if kind == "sync" else nn.BatchNorm1d)(channels).to(dtype)
        member = group.member(r) if group is not None else None
        if kind == "sync":
            layer.collective = member
            layer.update_running_stats = r == 0
        barrier.wait()
        start = time.perf_counter()
        for _ in range(calls):
            (layer(_Rendezvous.apply(x, member)) if kind == "rendezvous" else layer(x)).backward(dy)
        seconds[r] = time.perf_counter() - start

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return max(seconds) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=11_000)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="R >= 2: R replica threads at once (wall-clock us)")
    parser.add_argument("--pin", action="store_true", help="with --threads 3: sparse_dp's pinning of 3 replicas to 2 cores")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = torch.float64 if args.float64 else torch.float32
    if args.threads >= 2:
        if args.pin and (args.threads != 3 or len(os.sched_getaffinity(0)) < 2):
            parser.error("--pin takes --threads 3 and at least 2 cores")
        rounds = {"torch BatchNorm1d": [], "  + rendezvous": [], "SyncBatchNorm": [], "  gathered": [], "  per rank": []}
        threshold = _gathered.GATHER_MAX_BYTES
        shape = (args.threads, args.points, args.channels, dtype, args.calls, args.pin)
        for _ in range(5):
            rounds["torch BatchNorm1d"].append(threaded_us("torch", *shape))
            rounds["  + rendezvous"].append(threaded_us("rendezvous", *shape))
            rounds["SyncBatchNorm"].append(threaded_us("sync", *shape))
            for name, forced in (("  gathered", 1 << 62), ("  per rank", 0)):
                _gathered.GATHER_MAX_BYTES = forced
                try:
                    rounds[name].append(threaded_us("sync", *shape))
                finally:
                    _gathered.GATHER_MAX_BYTES = threshold
        print(f"{args.threads} threads x {args.points} x {args.channels} {dtype}{' pinned' if args.pin else ''}, forward + "
              f"backward, wall-clock us per layer (median of 5 rounds of {args.calls} calls [min-max]):")
        for name, values in rounds.items():
            print(f"  {name:<18} {statistics.median(values):8.0f} [{min(values):.0f}-{max(values):.0f}]")
        return
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.points, args.channels, generator=g) * 3 + 1).to(dtype).requires_grad_()
    dy = torch.randn(args.points, args.channels, generator=g).to(dtype)
    plain = nn.BatchNorm1d(args.channels).to(dtype)
    synced = SyncBatchNorm(args.channels).to(dtype)
    synced.collective = _Mirror()
    times: dict[str, list[float]] = {"torch BatchNorm1d": [], "SyncBatchNorm": []}
    for _ in range(args.calls // 10):
        times["torch BatchNorm1d"] += layer_cpu_us(plain, x, dy, 10)
        times["SyncBatchNorm"] += layer_cpu_us(synced, x, dy, 10)
    medians = {k: statistics.median(v[5:]) for k, v in times.items()}
    print(f"{args.points} x {args.channels} {dtype}, forward + backward, CPU us (median of {args.calls - 5}):")
    for name, value in medians.items():
        print(f"  {name:<18} {value:8.0f}")
    print(f"  ratio {medians['SyncBatchNorm'] / medians['torch BatchNorm1d']:.2f}")


if __name__ == "__main__":
    main()
