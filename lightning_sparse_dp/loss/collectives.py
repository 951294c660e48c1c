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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_sparse_dp._patch import SharedPatch
from lightning_sparse_dp.loss.sites import library_dirs

#: ``torch.distributed``'s collectives that user code reduces a count or a loss with
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast",
)


_local = threading.local()  # .found: the list the calling thread's step notes its collectives in, while it watches


def _watched(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def watched(*args: Any, **kwargs: Any) -> Any:
        found = getattr(_local, "found", None)
        caller = sys._getframe(1)
        if found is not None and not caller.f_code.co_filename.startswith(library_dirs()):
            found.append(f"dist.{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}")
        return fn(*args, **kwargs)

    return watched


#: ``torch.distributed``'s collectives noted while any step watches
_WATCHING = SharedPatch({(dist, name): _watched(name, getattr(dist, name)) for name in COLLECTIVES if hasattr(dist, name)})


@contextmanager
def watching(found: list[str]) -> Iterator[list[str]]:
    """While the block runs, ``torch.distributed.<collective>`` called from the user's code appends
    ``"dist.all_reduce at file.py:line"`` to ``found`` (calls by torch, Lightning, torchmetrics and this package
    are not noted). Only attribute lookups on the module are seen (``dist.all_reduce(...)``, as user code and
    mmdetection's ``reduce_mean`` write it), not a name imported before (``from torch.distributed import
    all_reduce``). Each thread notes its own calls (the list is the calling thread's).
    """
    with _WATCHING.held():
        previous = getattr(_local, "found", None)
        _local.found = found
        try:
            yield found
        finally:
            _local.found = previous


__all__ = ["COLLECTIVES", "watching"]
