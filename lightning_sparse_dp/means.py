"""Means: how many elements each mean a step computes is over, for the logged values that are such means.

A value logged as ``self.log("acc", (pred[mask] == y[mask]).float().mean())`` is a mean over the
selection's elements, not over the chunk's samples or points: the whole batch's value is
``sum_i c_i v_i / sum_i c_i`` with ``c_i`` the element count of replica ``i``'s mean. While a step runs
under :func:`counting` (in its own thread: each replica's, or a ``sparse_ddp`` rank's step), every
``torch.mean(x)`` / ``x.mean()`` that gives one value records ``x.numel()`` (``torch.mean`` and
``Tensor.mean`` are wrapped while any step counts, reference-counted, as :mod:`~lightning_sparse_dp.loss.capture`
wraps the losses); :func:`count_of` then gives the count of a logged value, a tensor or its ``.item()``.
A mean computed with other ops after it (``100 * acc``) is not followed. Lightning's own ``self.log`` must
run with torch's ``mean`` (:func:`plain_mean`); in ``sparse_dp`` replicas it never runs inside a step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_sparse_dp._patch import SharedPatch

T = TypeVar("T")

_local = threading.local()  # .counts: {id(mean): (mean, count)} of this thread's step, while it counts


def _counted(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(original)
    def mean(*args: Any, **kwargs: Any) -> Tensor:
        out = original(*args, **kwargs)
        counts = getattr(_local, "counts", None)
        if counts is not None and isinstance(out, Tensor) and out.dim() == 0:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, Tensor):
                counts[id(out)] = (out, x.numel())
        return out

    return mean


#: ``torch.mean`` and ``Tensor.mean`` counted while any step counts
_COUNTING = SharedPatch({(torch, "mean"): _counted(torch.mean), (torch.Tensor, "mean"): _counted(torch.Tensor.mean)})


@contextmanager
def counting() -> Iterator[dict[int, tuple[Tensor, int]]]:
    """Record the element count of every one-value mean the calling thread computes in the ``with`` body."""
    with _COUNTING.held():
        previous = getattr(_local, "counts", None)
        _local.counts = counts = {}
        try:
            yield counts
        finally:
            _local.counts = previous


def plain_mean() -> AbstractContextManager[None]:
    """torch's own ``torch.mean`` / ``Tensor.mean`` for the ``with`` body, in a process where one step counts
    (``sparse_ddp``): Lightning's ``self.log`` stores ``getattr(torch, "mean")`` as the reduction and later
    checks ``reduce_fx is torch.mean``, so it must never see the counting wrapper. Not for concurrent steps."""
    return _COUNTING.suspended()


def run_counting(fn: Callable[[], T]) -> T:
    """``fn()`` under :func:`counting` (for a replica's step, run in the replica's thread)."""
    with counting():
        return fn()


def count_of(value: Any) -> int | None:
    """The element count of ``value`` when the calling thread's step computed it as a mean: the tensor itself,
    or a Python float equal to one such mean's value (its ``.item()``; the latest such mean); else ``None``."""
    counts = getattr(_local, "counts", None)
    if not counts:
        return None
    if isinstance(value, Tensor):
        entry = counts.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None
    if isinstance(value, float):
        entries = [(mean, count) for mean, count in counts.values() if mean.numel() == 1]
        i = last_holding([mean for mean, _ in entries], value)
        return None if i is None else entries[i][1]
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


@contextmanager
def plain_mean_in_log(module: Any) -> Iterator[None]:
    """``module.log`` runs with torch's own ``torch.mean`` while the step counts means (:func:`plain_mean`): Lightning
    stores ``getattr(torch, "mean")`` and later checks its identity (``sparse_ddp``'s steps run ``self.log`` so)."""
    if module is None:
        yield
        return
    log = module.log

    def plain_log(*args: Any, **kwargs: Any) -> Any:
        with plain_mean():
            return log(*args, **kwargs)

    module.log = plain_log
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


__all__ = ["count_of", "counting", "last_holding", "plain_mean", "plain_mean_in_log", "run_counting", "scalar_values"]
