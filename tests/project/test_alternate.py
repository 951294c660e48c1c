"""benchmarks/alternate.py: the old tree's function loaded beside the imported one, and the two called in turn.

The figures themselves come from a fit (``benchmarks/alternate.py BASE MODULE ATTR``); these tests check its parts.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import load_file

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its harness.py
alternate = load_file("benchmarks/alternate.py")
ours = importlib.import_module("lightning_sparse_dp.split.assign")  # the package's `assign` is the function


def test_the_base_trees_module_is_loaded_from_its_file_beside_the_imported_one():
    base = alternate.load_base(ROOT, "lightning_sparse_dp.split.assign")
    assert base is not ours and base.assign is not ours.assign
    sizes = torch.tensor([5, 1, 4, 2, 3])
    old, new = base.assign(sizes, 2, "balanced"), ours.assign(sizes, 2, "balanced")
    assert [c.tolist() for c in old[0]] == [c.tolist() for c in new[0]]
    assert hasattr(alternate.load_base(ROOT, "lightning_sparse_dp.split"), "plan_split")  # a package: __init__.py
    with pytest.raises(FileNotFoundError, match="no source file"):
        alternate.load_base(ROOT, "lightning_sparse_dp.no_such_module")


def test_the_two_versions_are_called_in_turn_old_first_and_each_call_timed():
    seen = []
    call, times = alternate.alternating(lambda x: seen.append("old") or x, lambda x: seen.append("new") or -x)
    assert [call(i) for i in range(5)] == [0, -1, 2, -3, 4]
    assert seen == ["old", "new", "old", "new", "old"]
    assert len(times["old"]) == 3 and len(times["new"]) == 2 and min(times["old"] + times["new"]) >= 0
