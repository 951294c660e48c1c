"""Side by side: the same bench cases from two source trees (e.g. main before and after a change), interleaved.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/compare_trees.py /tmp/before . --repeats 5
    .venv/bin/python benchmarks/compare_trees.py /tmp/before . --model segmentation --cases auto-1 "sparse_dp-3 syncBN"

Each repetition runs, for each tree in turn (the order of the trees and of the cases reversed every other
repetition), one fresh process that imports that tree's ``benchmarks/bench.py`` and package and runs the cases
through its :class:`bench.CaseRunner` (every case in a fresh process of its own, as ``bench.py`` runs them), so
the two trees differ in their code only and a slow spell of the machine lands on both (the same tree twice gives
an A/A run: how far two arms of identical code drift apart). Prints, per tree and case,
the median step time with its [min-max] over repetitions, the first case's step time over each case's within
each repetition (``vs <first case>``: plain Lightning's speedup when the first case is ``auto-1``), and the
median time of the synchronized batch-norm layers per replica (``syncbn``) where a case has them. Both trees run
with ``OMP_WAIT_POLICY=PASSIVE``, and segmentation with ``OPENBLAS_THREAD_TIMEOUT=4``, unless the environment
sets them (the settings of today's ``bench.py``, whatever an older tree's sets). The trees
must be importable with this interpreter (the same dependencies); the package each process imports is
checked to be its tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from harness import GLOBAL_BATCH, child_result, wait_env

#: The child: imports ``bench`` from the tree given, runs the cases, prints one ``RESULT`` JSON line.
_CHILD = r"""
import json, sys
root, model, cases, batch, steps, warmup = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *map(int, sys.argv[4:7])
sys.path.insert(0, root + "/benchmarks")
import bench, lightning_sparse_dp
if not lightning_sparse_dp.__file__.startswith(root):
    sys.exit(f"compare_trees: {root} imported lightning_sparse_dp from {lightning_sparse_dp.__file__}")
runner = bench.CaseRunner("default")
out = {}
try:
    for case in cases:
        r = runner.run(model, case, batch, steps, warmup)
        out[case] = {"step_s": r["step_s"], "syncbn": r["stages"].get("syncbn", 0.0)}
finally:
    runner.close()
print("RESULT" + json.dumps(out))  # harness.RESULT
"""


def run_tree(root: Path, model: str, cases: list[str], batch: int, steps: int, warmup: int) -> dict:
    """``{case: {"step_s", "syncbn"}}`` of one tree's run of ``cases``.

    Raises:
        RuntimeError: the child failed (its stderr's end in the message).
    """
    command = [sys.executable, "-c", _CHILD, str(root), model, json.dumps(cases), str(batch), str(steps), str(warmup)]
    # both trees under today's bench.py's settings, whatever an older tree's sets
    return child_result(command, f"{root}: the run", env=wait_env(dict(os.environ), model), cwd=root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2, type=Path, help="two source trees (checkouts or worktrees)")
    parser.add_argument("--model", choices=("digits", "segmentation"), default="digits")
    parser.add_argument("--cases", nargs="+", default=["auto-1", "sparse_dp-3", "sparse_dp-3 syncBN"],
                        help="bench.py case names; the first is the reference of the ratios")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    batch = GLOBAL_BATCH[args.model]
    trees = [t.resolve() for t in args.trees]
    results: list[dict] = [{c: [] for c in args.cases} for _ in trees]  # by position: a tree may be given twice (A/A)
    for k in range(args.repeats):
        for i in (0, 1) if k % 2 == 0 else (1, 0):
            cases = args.cases if k % 2 == 0 else args.cases[::-1]
            for case, r in run_tree(trees[i], args.model, cases, batch, args.steps, args.warmup).items():
                results[i][case].append(r)
            print(f"  repetition {k + 1}/{args.repeats}: {trees[i]} done", flush=True)
    first = args.cases[0]
    for i, tree in enumerate(trees):
        print(f"{'AB'[i]}: {tree}")
        for case in args.cases:
            ms = [r["step_s"] * 1e3 for r in results[i][case]]
            ratio = [a["step_s"] / b["step_s"] for a, b in zip(results[i][first], results[i][case])]
            syncbn = [r["syncbn"] * 1e3 for r in results[i][case]]
            line = (f"  {case:<28} {statistics.median(ms):7.2f} ms [{min(ms):.1f}-{max(ms):.1f}]   vs {first} "
                    f"{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]")
            if any(syncbn):
                line += f"   syncbn {statistics.median(syncbn):.2f} ms"
            print(line)


if __name__ == "__main__":
    main()
