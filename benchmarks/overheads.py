"""What the exactness machinery adds, piece by piece, as medians of many calls (microseconds), on this machine.

    .venv/bin/python benchmarks/overheads.py

- a cross entropy over 100 rows, plain and under a term capture (``terms.TermCapture``: the call's site, its
  input's rows, whether it is a statistic of the chunk, its denominator);
- ``terms.call_site`` and ``terms.reduces_rows`` alone;
- ``replica/changes.py`` ModuleChanges around a step of 3 replicas (snapshot and merge of what the step set on ``self``);
- ``sparse_ddp``'s exchange of the ranks' term summaries (``exchange.gather_objects``: one fixed-size all-gather) against
  the 138-float all-reduce it replaced and ``torch.distributed.all_gather_object``, 2 gloo ranks on this machine.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_us(fn, n: int = 2000, skip: int = 100) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[skip:]) * 1e6


def _gather(rank: int, port: int) -> None:
    from lightning_sparse_dp.ddp.exchange import gather_objects
    from lightning_sparse_dp.loss.decide import SiteTerms, Summary

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    site = SiteTerms(1, "x.py:1", "F.cross_entropy", False, [False], [1.0], [100.0], [1.3], [100], False, [False])
    summary = Summary(None, 3, 3.0, [site], [(0, 0)], 0.0, 1e-14)
    vector = torch.zeros(138, dtype=torch.float64)

    def objects():
        out = [None, None]
        dist.all_gather_object(out, summary)

    cpu = torch.device("cpu")
    rows = {
        "gather_objects": median_us(lambda: gather_objects(summary, cpu), 400, 50),
        "all_reduce of 138 floats": median_us(lambda: dist.all_reduce(vector), 400, 50),
        "all_gather_object": median_us(objects, 400, 50),
    }
    if rank == 0:
        for name, us in rows.items():
            print(f"  sparse_ddp, 2 gloo ranks: {name:<26} {us:8.1f} us")
    dist.destroy_process_group()


def main() -> None:
    from lightning_sparse_dp.loss.capture import TermCapture
    from lightning_sparse_dp.loss.sites import call_site, reduces_rows
    from lightning_sparse_dp.replica.changes import ModuleChanges
    from tests.support.helpers import SparseNet

    x = torch.randn(100, 10, requires_grad=True)
    y = torch.randint(0, 10, (100,))

    def captured():
        TermCapture().run(lambda: F.cross_entropy(x, y))

    module, replicas = SparseNet(), [SparseNet() for _ in range(3)]

    def state():
        ModuleChanges(module, replicas).merge(lambda values: (values[0], True), None)

    print(f"  cross entropy, plain:                 {median_us(lambda: F.cross_entropy(x, y)):8.1f} us")
    print(f"  cross entropy, under a term capture:  {median_us(captured):8.1f} us")
    print(f"  terms.call_site:                      {median_us(lambda: call_site(0)):8.1f} us")
    print(f"  terms.reduces_rows (x * 2):           {median_us(lambda: reduces_rows(x * 2)):8.1f} us")
    print(f"  ModuleChanges, 3 replicas:                {median_us(state):8.1f} us")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
