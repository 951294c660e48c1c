"""How many moving parts one steady-state training step of ``sparse_dp`` runs through: package files, distinct
package functions and package function calls, over every thread.

    .venv/bin/python benchmarks/walk.py [--devices 3] [--step 2] [--top 25] [--json]

A fit of the test network (``tests.support.helpers.SparseNet``: sparse convolutions, global pooling, a linear
head, ``F.cross_entropy``, one ``self.log``) with ``strategy="sparse_dp"`` on ``--devices`` CPU replicas and
default options. A profile function (``sys.setprofile`` for this thread, ``threading.setprofile`` for the
replicas' threads, installed before the fit) counts the Python function calls whose code lives in
``lightning_sparse_dp/`` (a generator once, however often it resumes; comprehensions and generator expressions are
not counted) from the end of training step ``--step - 1`` to the end of step ``--step`` (batch transfer, hooks, the
step, its backward and the optimizer step): the step's whole path, counted the same way on every run. Prints the
three counts, each package folder's share of them, the files by calls and the functions called most; ``--json``
prints one JSON line instead.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys
import threading
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_sparse_dp  # noqa: E402,F401  (registers "sparse_dp")
from tests.support.helpers import SparseNet, collate_dict, random_samples  # noqa: E402

PACKAGE = str(ROOT / "lightning_sparse_dp") + os.sep
#: comprehensions and generator expressions are expressions, not functions (Python 3.12 inlines comprehensions)
EXPRESSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class Walk:
    """Counts package calls while :attr:`active`: ``calls[(file, function)]``."""

    def __init__(self) -> None:
        self.active = False
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._generators: set[int] = set()

    def profile(self, frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call" or not self.active:
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE) or code.co_name in EXPRESSIONS:
            return
        with self._lock:
            if code.co_flags & GENERATOR:  # a generator's every resume is a "call" event: count its first only
                if id(frame) in self._generators:
                    return
                self._generators.add(id(frame))
            self.calls[(code.co_filename[len(PACKAGE) :], code.co_qualname)] += 1


class Window(Callback):
    """Turns the walk on at the end of training step ``step - 1`` and off at the end of step ``step``."""

    def __init__(self, walk: Walk, step: int) -> None:
        self.walk, self.step = walk, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if batch_idx == self.step - 1:
            self.walk.active = True
        elif batch_idx == self.step:
            self.walk.active = False


def walk(devices: int, step: int) -> Walk:
    torch.manual_seed(0)
    samples = random_samples(12 * (step + 1), seed=0, min_points=20, max_points=80)
    data = DataLoader(samples, batch_size=12, collate_fn=collate_dict)
    counter = Walk()
    trainer = L.Trainer(
        strategy="sparse_dp", accelerator="cpu", devices=devices, max_steps=step + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Window(counter, step)],
    )
    threading.setprofile(counter.profile)
    sys.setprofile(counter.profile)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(SparseNet(), data)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--step", type=int, default=2, help="the training step counted (0-based; the third: 2)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counter = walk(args.devices, args.step)
    files = collections.Counter()
    for (file, _), n in counter.calls.items():
        files[file] += n
    figures = {"files": len(files), "functions": len(counter.calls), "calls": sum(counter.calls.values())}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"one training step of sparse_dp on {args.devices} CPU replicas (step {args.step}):")
    print(f"  package files {figures['files']}, distinct package functions {figures['functions']}, "
          f"package calls {figures['calls']}")
    print("\nfolders (files, distinct functions, calls):")
    folders: dict[str, list] = {}
    for (file, _), n in counter.calls.items():
        entry = folders.setdefault(file.split(os.sep)[0] if os.sep in file else ".", [set(), 0, 0])
        entry[0].add(file)
        entry[1] += 1
        entry[2] += n
    for folder, (names, functions, calls) in sorted(folders.items(), key=lambda kv: -kv[1][1]):
        print(f"  {folder + '/':14s} {len(names):4d} {functions:6d} {calls:6d}")
    print("\nfiles by calls:")
    for file, n in files.most_common():
        print(f"  {n:6d}  {file}")
    print(f"\nfunctions called most (top {args.top}):")
    for (file, name), n in counter.calls.most_common(args.top):
        print(f"  {n:6d}  {file}:{name}")


if __name__ == "__main__":
    main()
