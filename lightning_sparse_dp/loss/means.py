"""Means: how many elements each mean a step computes is over, for the logged values that are such means.

A value logged as ``self.log("acc", (pred[mask] == y[mask]).float().mean())`` is a mean over the
selection's elements, not over the chunk's samples or points: the whole batch's value is
``sum_i c_i v_i / sum_i c_i`` with ``c_i`` the element count of replica ``i``'s mean. While a step runs
under :func:`counting` (in its own thread: each replica's, or a ``sparse_ddp`` rank's step), every
``torch.mean(x)`` / ``x.mean()`` that gives one value is recorded with ``x.numel()`` by :func:`note_mean`, which the
step's own torch function mode calls (:class:`~lightning_sparse_dp.loss.observer.StepObserver`: modes are per thread,
so no other thread sees anything, and ``torch.mean`` stays torch's own object everywhere); :func:`count_of` then gives
the count of a logged value, a tensor or its ``.item()``. A mean computed with other ops after it (``100 * acc``) is
not followed.

:data:`MEAN_NAMES`: the names of a mean as ``reduce_fx`` (``self.log``) and ``reduce_op`` (``Strategy.reduce``) spell
them, read as a mean by the log stage and by ``sparse_ddp``'s reductions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_sparse_dp.runtime.process import MEAN_COUNTS as _local

#: torch's means whose one-value results are counted (``torch.mean(x)``, ``x.mean()``), as a torch function mode sees them
MEAN_FUNCTIONS = frozenset({torch.mean, torch.Tensor.mean})


def note_mean(args: tuple, kwargs: dict, out: Any) -> None:
    """Record ``out`` (a :data:`MEAN_FUNCTIONS` call's result) with its input's element count, when it is one value
    and the calling thread counts (:func:`counting`)."""
    counts = getattr(_local, "counts", None)
    if counts is not None and isinstance(out, Tensor) and out.dim() == 0:
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, Tensor):
            counts[id(out)] = (out, x.numel())


#: torch calls whose result is the same value as their input (``mean.detach()``, ``mean.clone()``): a counted mean's
#: result keeps its count (:func:`pass_mean`)
PASSING_FUNCTIONS = frozenset({torch.Tensor.detach, torch.Tensor.clone, torch.clone, torch.detach})


def pass_mean(args: tuple, out: Any) -> None:
    """Record ``out`` (a :data:`PASSING_FUNCTIONS` call's result) with the count of its input, when that is a mean the
    calling thread counted (:func:`note_mean`): ``acc.mean().detach()`` is the same mean."""
    counts = getattr(_local, "counts", None)
    x = args[0] if args else None
    if counts and isinstance(x, Tensor) and isinstance(out, Tensor):
        entry = counts.get(id(x))
        if entry is not None and entry[0] is x:
            counts[id(out)] = (out, entry[1])


@contextmanager
def counting() -> Iterator[dict[int, tuple[Tensor, int]]]:
    """Record, in the calling thread only, the element count of every one-value mean its step's torch function mode
    reports (:func:`note_mean`) in the ``with`` body."""
    previous = getattr(_local, "counts", None)
    _local.counts = counts = {}
    try:
        yield counts
    finally:
        _local.counts = previous


def count_of(value: Any) -> int | None:
    """The element count of ``value`` when the calling thread's step computed it as a mean: the tensor itself,
    or a Python float equal to such means' value (its ``.item()``) when they all have one count; else ``None``."""
    counts = getattr(_local, "counts", None)
    if not counts:
        return None
    if isinstance(value, Tensor):
        entry = counts.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None
    if isinstance(value, float):  # means of other counts holding the same value (two fractions at 0.0): none of them
        entries = [(mean, count) for mean, count in counts.values() if mean.numel() == 1]
        found = {count for (_, count), v in zip(entries, scalar_values([mean for mean, _ in entries])) if v == value}
        return found.pop() if len(found) == 1 else None
    return None


def last_holding(tensors: Sequence[Tensor], value: float) -> int | None:
    """The index of the last of the one-element ``tensors`` whose value is ``value`` (a logged ``.item()``), else
    ``None``; read with :func:`scalar_values` (one host copy per device)."""
    for i, v in zip(range(len(tensors) - 1, -1, -1), reversed(scalar_values(tensors))):
        if v == value:
            return i
    return None


def scalar_values(tensors: Sequence[Tensor]) -> list[float]:
    """``[float(t) for t in tensors]`` (one-element tensors, as float64) with one device-to-host copy per device
    rather than one per tensor: on a GPU each copy waits for the device, and a logged ``.item()`` is looked up
    among every mean and loss term of the step."""
    out = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        with torch._C.DisableTorchFunction():  # a step's loss capture (a torch function mode) must not see these
            values = torch.stack([tensors[i].detach().reshape(()).double() for i in indices]).tolist()
        for i, v in zip(indices, values):
            out[i] = v
    return out


#: The names of a mean, as ``reduce_fx`` (``self.log``) and ``reduce_op`` (``Strategy.reduce``) spell it.
MEAN_NAMES = ("mean", "avg")


__all__ = ["MEAN_FUNCTIONS", "MEAN_NAMES", "count_of", "counting", "last_holding", "note_mean", "scalar_values"]
