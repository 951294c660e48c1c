"""Collectives: which of ``torch.distributed``'s collectives the user's own code calls during a step.

DETR-style criteria (Mask3D and most set-prediction code on ME) normalize a sum of per-element losses by a
count they all-reduce across ranks and divide by the world size, written for DDP's equal averaging of
gradients::

    num = target.sum(); dist.all_reduce(num); num = (num / dist.get_world_size()).clamp(min=1)
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum() / num

Such a step is already the global batch's under DDP's averaging; weighting its ranks again (``"auto"``, or a
sum term read as the one-device coefficient) would move it away. :func:`watching` notes every collective a
frame outside torch, Lightning, torchmetrics and this package calls while a step runs, so ``sparse_ddp``
(:mod:`lightning_sparse_dp.ddp`) can weight such a step's ranks as DDP does and say so.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_sparse_dp.terms import library_dirs

#: ``torch.distributed``'s collectives that user code reduces a count or a loss with
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast",
)


def _watched(name: str, fn: Callable[..., Any], found: list[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if not caller.f_code.co_filename.startswith(library_dirs()):
            found.append(f"dist.{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        return fn(*args, **kwargs)

    return watched


@contextmanager
def watching(found: list[str]) -> Iterator[list[str]]:
    """While the block runs, ``torch.distributed.<collective>`` called from the user's code appends
    ``"dist.all_reduce at file.py:line"`` to ``found`` (calls by torch, Lightning, torchmetrics and this package
    are not noted). Only attribute lookups on the module are seen (``dist.all_reduce(...)``, as user code and
    mmdetection's ``reduce_mean`` write it), not a name imported before (``from torch.distributed import
    all_reduce``). Not thread-safe across concurrent steps of one process (``sparse_ddp`` runs one at a time).
    """
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _watched(name, fn, found))
    try:
        yield found
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


__all__ = ["COLLECTIVES", "watching"]
