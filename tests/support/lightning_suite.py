"""A pytest plugin that runs Lightning's own test suite with ``sparse_dp`` swapped in (docs/development.md).

Every ``Trainer`` a test builds without a strategy or device count of its own (``strategy="auto"``, ``devices`` auto or
1, CPU or auto accelerator) gets ``strategy="sparse_dp"`` on 2 CPU devices. ``LSDP_LIGHTNING_SUITE_CHECK=0`` turns the
exactness check off: the check runs the step (and the hooks inside it) on copies of the module, which tests that
count hook calls through a closure see as extra calls.

    PYTHONPATH=<lightning checkout>/tests:. .venv/bin/python -m pytest -p tests.support.lightning_suite \\
        <lightning checkout>/tests/tests_pytorch/models/test_hooks.py

The ``Trainer`` class is changed for the pytest process that loads the plugin only (a test harness, never the package).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl

from lightning_sparse_dp import SparseDataParallelStrategy

_init = pl.Trainer.__init__


@functools.wraps(_init)
def _sparse_dp_init(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
    plain = (
        kwargs.get("strategy", "auto") == "auto"
        and kwargs.get("devices", "auto") in ("auto", 1, None)
        and kwargs.get("accelerator", "auto") in ("auto", "cpu")
    )
    if plain:
        check = os.environ.get("LSDP_LIGHTNING_SUITE_CHECK", "1") != "0"
        kwargs.update(strategy=SparseDataParallelStrategy(check_exactness=check), devices=2, accelerator="cpu")
    _init(self, *args, **kwargs)


pl.Trainer.__init__ = _sparse_dp_init
