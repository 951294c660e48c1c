"""One function of the step, old against new, taking turns step by step inside one fit: its time where it runs.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/alternate.py /tmp/before lightning_sparse_dp.split.assign assign \
        --patch lightning_sparse_dp.split
    .venv/bin/python benchmarks/alternate.py /tmp/before lightning_sparse_dp.step.gather gather_outputs \
        --patch lightning_sparse_dp.strategies.sparse_dp --model digits --devices 3 --steps 60

The main thread's share of a sparse_dp step is many small calls that run on caches the replicas' passes have
just flushed: inside a fit each costs two to four times its time in a loop (measured: the digits split's plan, 157 us
in a loop, 440 us in a fit), so a loop does not tell which version is faster where it matters. This runs one fit
(``bench_cases.run_case``) in which the named function is replaced by a wrapper that calls the old tree's version
(``BASE``'s file of ``MODULE``, loaded under another name) and this tree's in turn, call after call, and times each:
the two share the fit, its caches and the machine's slow spells, so their medians differ by the function alone.
Prints each version's median time per call and the number of calls (the first 3 of each dropped). Runs with
``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it, as ``bench.py``'s cases do.

``--patch`` names the module whose attribute the step looks up (where the caller imported the function: the
strategy's ``from ... import gather_outputs``); ``ATTR`` may be ``Class.method``. Only for functions whose result
the step does not compare with one of the other version's (``Replicas``' fingerprint is compared with the one its
build made: mixing two versions rebuilds the replicas every other step). The old module is loaded from its file
alone: what it imports comes from this tree, so compare a function whose callees are unchanged, or each callee on
its own.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import GLOBAL_BATCH

ROOT = Path(__file__).resolve().parents[1]


def _owner(root: Any, dotted: str) -> tuple[Any, str]:
    """The object holding the last name of ``dotted`` under ``root``, and that name."""
    *parents, last = dotted.split(".")
    for name in parents:
        root = getattr(root, name)
    return root, last


def load_base(base: Path, module: str) -> Any:
    """``module`` as ``base``'s source file defines it (a package's ``__init__.py`` too), under another name.

    Raises:
        FileNotFoundError: ``base`` has no such file.
    """
    path = base / Path(*module.split("."))
    path = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
    if not path.exists():
        raise FileNotFoundError(f"{base} has no source file for {module} ({path}).")
    name = "alternate_base_" + module.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # dataclasses look their module up while the file runs
    spec.loader.exec_module(loaded)
    return loaded


def alternating(old: Callable[..., Any], new: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, list[float]]]:
    """A function that calls ``old`` and ``new`` in turn (``old`` first) and the seconds of each call, per version."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    calls = [0]

    def call(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        label, fn = ("old", old) if calls[0] % 2 else ("new", new)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - start)

    return call, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the old source tree (a git worktree of the old commit)")
    parser.add_argument("module", help="the module that defines the function, e.g. lightning_sparse_dp.split.assign")
    parser.add_argument("attr", help="the function's name in it (Class.method for a method)")
    parser.add_argument("--patch", help="the module whose attribute the step calls (default: MODULE)")
    parser.add_argument("--model", default="digits", choices=sorted(GLOBAL_BATCH))
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench.py runs its cases (harness.py says why)
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    from bench_cases import run_case  # after the arguments: imports torch and Lightning

    from lightning_sparse_dp import SparseDataParallelStrategy

    owner_new, name = _owner(importlib.import_module(args.module), args.attr)
    owner_old, _ = _owner(load_base(args.base, args.module), args.attr)
    call, times = alternating(getattr(owner_old, name), getattr(owner_new, name))
    target, target_name = _owner(importlib.import_module(args.patch or args.module), args.attr)
    setattr(target, target_name, call)
    options = {"loss_weighting": "points"} if args.model == "segmentation" else {}
    run_case(args.model, SparseDataParallelStrategy(**options), args.devices, GLOBAL_BATCH[args.model], args.steps, 6)
    for label, seconds in times.items():
        kept = seconds[3:]
        median = f"{statistics.median(kept) * 1e6:.1f} us" if kept else "not called"
        print(f"{label}: {median} a call, {len(kept)} calls ({args.module}.{args.attr}, {args.model}, "
              f"{args.devices} replicas)")


if __name__ == "__main__":
    main()
