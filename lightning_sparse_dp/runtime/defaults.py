"""Defaults: float64 tensors from torch's factory functions in one thread only, the exactness check's float64 runs.

Lightning's ``precision="64-true"`` calls ``torch.set_default_dtype(torch.float64)`` around a step, which is
process-wide: another thread (a fit of its own, a data-loading thread) would make float64 tensors meanwhile. The
exactness check runs float64 copies while the user's other threads go on, so it needs the same effect in its own
threads only: :class:`Float64Defaults` is a ``TorchFunctionMode`` (whose stack is thread-local) that turns a float32
tensor made by one of :data:`FACTORIES` without a ``dtype`` (the default dtype's) into float64, as
``set_default_dtype`` would have made it. :func:`float64_defaults` enters it in the calling thread and marks the thread,
so that the replica threads the step hands work to enter it too (:class:`~lightning_sparse_dp.runtime.executor.ThreadState`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_sparse_dp.runtime.process import FLOAT64_DEFAULTS as _this_thread

#: torch's functions that make a tensor of the default dtype when given no ``dtype`` (floating data or arguments)
FACTORIES = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.arange, torch.linspace,
    torch.logspace, torch.eye, torch.tensor, torch.as_tensor, torch.scalar_tensor,
})


#: the factories whose values come from Python numbers (``torch.tensor(0.1)``, ``torch.full(s, 0.1)``): made again with
#: ``dtype=torch.float64`` (``0.1``, not float32's ``0.10000000149``), as ``set_default_dtype`` makes them; they draw no
#: random numbers, so making them twice changes nothing else
VALUED = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.arange, torch.linspace,
                    torch.logspace})


class Float64Defaults(TorchFunctionMode):
    """In its thread: a float32 tensor a factory function made with no ``dtype`` given becomes float64 (values cast,
    ``requires_grad`` kept). A tensor built from another tensor (``torch.tensor(t)``) keeps that tensor's dtype, as
    under ``torch.set_default_dtype``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            func in FACTORIES
            and kwargs.get("dtype") is None
            and isinstance(out, Tensor)
            and out.dtype == torch.float32
            and torch.get_default_dtype() == torch.float32
            and not (func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], Tensor))
        ):
            if func in VALUED:  # made again in float64 from its Python numbers: a cast would keep float32's rounding
                return func(*args, **{**kwargs, "dtype": torch.float64})
            return out.detach().to(torch.float64).requires_grad_(out.requires_grad)
        return out


@contextmanager
def float64_defaults() -> Iterator[None]:
    """:class:`Float64Defaults` in the calling thread for the block (and in the replica threads it runs work on)."""
    before = getattr(_this_thread, "on", False)
    _this_thread.on = True
    try:
        with Float64Defaults():
            yield
    finally:
        _this_thread.on = before


def float64_defaults_on() -> bool:
    """Whether the calling thread runs under :func:`float64_defaults`."""
    return getattr(_this_thread, "on", False)


__all__ = ["FACTORIES", "VALUED", "Float64Defaults", "float64_defaults", "float64_defaults_on"]
