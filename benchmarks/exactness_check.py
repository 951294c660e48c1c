"""What the exactness check costs: the first training step with the check and without it, side by side.

    .venv/bin/python benchmarks/exactness_check.py                 # segmentation, 3 CPU replicas, 3 repetitions
    .venv/bin/python benchmarks/exactness_check.py --devices 2 --repeats 5 --batch 12

Each repetition runs two fresh processes, one with ``check_exactness=True`` and one with ``False`` (in turn, the order
alternating), each fitting ``--steps`` steps of examples/train_segmentation.py's network on the benchmark's rooms
(``benchmarks/bench_cases.py``, ``loss_weighting="points"``, synchronized batch norm). It prints, as medians
[min-max] over the repetitions: the first step's wall time with and without the check and their ratio, a later step's
(the check runs once a fit: the ratio is 1 within the machine's spread), and the process's peak resident memory with
and without the check and their difference (the check's two float64 copies of the module and one batch's activations
on one device, beside the replicas').
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples")]
    import warnings

    warnings.filterwarnings("ignore")
    import bench_cases

    from lightning_sparse_dp import SparseDataParallelStrategy

    strategy = SparseDataParallelStrategy(loss_weighting="points", check_exactness=args.check == "on")
    out = bench_cases.run_case("segmentation", strategy, args.devices, args.batch, args.steps, 0, sync_batchnorm=True)
    print(json.dumps({"times": out["times"], "peak_rss_mb": out["peak_rss_mb"]}))


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--batch", type=int, default=12, help="global batch (scenes), the benchmark's")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process's run
    args = parser.parse_args()
    if args.check is not None:
        child(args)
        return
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.repeats):
        for check in (("on", "off") if r % 2 == 0 else ("off", "on")):
            command = [sys.executable, __file__, "--check", check, "--devices", str(args.devices), "--batch",
                       str(args.batch), "--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            runs[check].append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = {c: [run["times"][0] for run in runs[c]] for c in runs}
    later = {c: [statistics.median(run["times"][1:]) for run in runs[c]] for c in runs}
    rss = {c: [run["peak_rss_mb"] for run in runs[c]] for c in runs}
    print(f"segmentation, {args.devices} CPU replicas, global batch {args.batch}, {args.repeats} repetitions "
          "(median [min-max])")
    print(f"first step, s:         check {_spread(first['on'])}   no check {_spread(first['off'])}   "
          f"ratio {_spread([a / b for a, b in zip(first['on'], first['off'])], 2)}")
    print(f"later steps, s:        check {_spread(later['on'])}   no check {_spread(later['off'])}   "
          f"ratio {_spread([a / b for a, b in zip(later['on'], later['off'])], 2)}")
    print(f"peak resident, MiB:    check {_spread(rss['on'], 0)}   no check {_spread(rss['off'], 0)}   "
          f"difference {_spread([a - b for a, b in zip(rss['on'], rss['off'])], 0)}")
    print(json.dumps({"check_first_step_ratio": statistics.median(a / b for a, b in zip(first["on"], first["off"])),
                      "check_later_step_ratio": statistics.median(a / b for a, b in zip(later["on"], later["off"])),
                      "check_peak_rss_mib": statistics.median(a - b for a, b in zip(rss["on"], rss["off"]))}))


if __name__ == "__main__":
    main()
