"""Collectives: which of ``torch.distributed``'s collectives the user's own code calls during a step.

DETR-style criteria (Mask3D and most set-prediction code on ME) normalize a sum of per-element losses by a
count they all-reduce across ranks and divide by the world size, written for DDP's equal averaging of
gradients::

    num = target.sum(); dist.all_reduce(num); num = (num / dist.get_world_size()).clamp(min=1)
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum() / num

Such a step is already the global batch's under DDP's averaging; weighting its ranks again (``"auto"``, or a
sum term read as the one-device coefficient) would move it away. :func:`note_collective` notes every collective a
frame outside torch, Lightning, torchmetrics and this package calls while a step runs, so ``sparse_ddp``
(:mod:`lightning_sparse_dp.strategies.sparse_ddp`) can weight such a step's ranks as DDP does and say so. It is
called by the step's own
torch function mode (:class:`~lightning_sparse_dp.loss.observer.StepObserver`, per thread): ``torch.distributed``'s
tensor collectives that dispatch ``__torch_function__`` (:data:`COLLECTIVE_FUNCTIONS`: ``all_reduce``, ``all_gather``,
``reduce``, ``broadcast``) are seen, under any name they were imported by, and nothing of ``torch.distributed`` is
replaced; ``all_gather_object``, ``all_gather_into_tensor`` and ``reduce_scatter*``, which do not dispatch, are not.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

from lightning_sparse_dp.loss.sites import library_dirs

#: ``torch.distributed``'s collectives that user code reduces a count or a loss with and that a torch function mode sees
COLLECTIVE_FUNCTIONS: dict[Any, str] = {
    getattr(dist, name): name for name in ("all_reduce", "all_gather", "reduce", "broadcast") if hasattr(dist, name)
}


_TORCH_DIR = os.path.dirname(os.path.dirname(dist.__file__))  # torch's own frames
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this package's


def note_collective(func: Any, found: list[str]) -> None:
    """Append ``"dist.all_reduce at file.py:line"`` to ``found`` when ``func`` (a :data:`COLLECTIVE_FUNCTIONS` entry a
    torch function mode was handed) was called by the user's code: the frame that called it (the first up the stack
    below the mode's own frames that is not torch's) is not this package's, Lightning's or torchmetrics' (their own
    reductions are not noted)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):  # the mode's own frames
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):  # the collective and its wrappers
        frame = frame.f_back
    if frame is not None and not frame.f_code.co_filename.startswith(library_dirs()):
        found.append(f"dist.{COLLECTIVE_FUNCTIONS[func]} at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")


__all__ = ["COLLECTIVE_FUNCTIONS", "note_collective"]
