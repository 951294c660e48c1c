"""Log: capture ``self.log`` calls made in replicas and log each value once, reduced, from the main thread.

Lightning's result collection takes no locks and moves a logged value to the device of whoever
logs, so replicas must never log into it from their threads (PL 1.x "dp" logged on-step values from
whichever GPU wrote last, Lightning issue #9839). Each replica gets a :class:`LogRecorder` in place
of its ``log`` method (``log_dict`` goes through ``log``); after the step, :func:`reduce_log_calls`
merges the replicas' calls name by name and :func:`emit` logs them through the root module.

Reduction across replicas (``reduce_fx``, as in ``LightningModule.log``): ``"mean"`` is the mean
weighted like the loss (``w_i`` of the replicas that logged the name, renormalized), so a logged
mean over samples equals the whole-batch value; ``"sum"``, ``"max"``, ``"min"`` reduce the values
as named; any other callable is applied to the stacked values ``[k]``. The ``batch_size`` given to
Lightning (which weights epoch-level means) is the sum of the replicas' ``batch_size`` arguments,
else the number of samples in the whole batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_MEAN = ("mean", "avg")
_NAMED: dict[str, Callable[[Tensor], Tensor]] = {
    "sum": torch.sum,
    "max": torch.max,
    "min": torch.min,
}


@dataclass
class LogCall:
    """One ``self.log(name, value, **kwargs)`` call."""

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


class LogRecorder:
    """Stands in for ``LightningModule.log`` on a replica and records the calls.

    Same signature as ``LightningModule.log``; the value must be a number or a one-element tensor.

    Raises:
        TypeError: a ``torchmetrics.Metric`` object or another non-scalar value is logged.
    """

    def __init__(self) -> None:
        self.calls: dict[str, LogCall] = {}

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        if not isinstance(value, (Tensor, numbers.Number)):
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) in a sparse_dp replica: only numbers and one-element "
                "tensors can be logged from a replica's step in this version (a torchmetrics Metric object is not yet "
                "merged across replicas). Log the metric's value for the step, e.g. self.log(name, metric(preds, "
                "target)), or compute the metric in an epoch-end hook."
            )
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, tensor of shape {tuple(value.shape)}): a logged tensor must have one element; "
                "log value.mean() or another reduction."
            )
        self.calls.pop(name, None)  # a later call with the same name replaces the earlier one, as in Lightning
        self.calls[name] = LogCall(name, value, kwargs)


def install_recorder(replica: Any) -> LogRecorder:
    """Replace ``replica.log`` (an instance attribute shadowing the method) with a new recorder."""
    recorder = LogRecorder()
    replica.log = recorder
    return recorder


def _reduce(values: Sequence[Tensor], weights: Sequence[float], reduce_fx: Any) -> Tensor:
    stacked = torch.stack([v.reshape(()) for v in values])
    if reduce_fx in _MEAN or reduce_fx is torch.mean:
        w = torch.tensor(weights, dtype=torch.float64, device=stacked.device)
        out = (stacked.double() * (w / w.sum())).sum()
        return out.to(stacked.dtype if stacked.dtype.is_floating_point else torch.float32)
    if isinstance(reduce_fx, str):
        if reduce_fx not in _NAMED:
            raise ValueError(f"reduce_fx={reduce_fx!r} is not supported; use 'mean', 'sum', 'max', 'min' or a callable.")
        reduce_fx = _NAMED[reduce_fx]
    return reduce_fx(stacked)


def reduce_log_calls(
    recorders: Sequence[LogRecorder], weights: Sequence[float], num_samples: int, device: torch.device
) -> list[LogCall]:
    """Merge the calls of every replica into one call per name, in the order names were first logged.

    Args:
        recorders: one per replica, in replica order.
        weights: ``w_i`` of each replica (see :func:`lightning_sparse_dp.gather.chunk_weights`).
        num_samples: samples in the whole batch, the default ``batch_size``.
        device: the root device; reduced values are put there.
    """
    names: list[str] = []
    for rec in recorders:
        names.extend(n for n in rec.calls if n not in names)
    merged: list[LogCall] = []
    for name in names:
        present = [(i, rec.calls[name]) for i, rec in enumerate(recorders) if name in rec.calls]
        kwargs = dict(present[0][1].kwargs)
        values = [torch.as_tensor(c.value).to(device) for _, c in present]
        value = _reduce(values, [weights[i] for i, _ in present], kwargs.get("reduce_fx", "mean"))
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        kwargs["batch_size"] = sum(sizes) if all(s is not None for s in sizes) else num_samples
        merged.append(LogCall(name, value, kwargs))
    return merged


def emit(module: Any, calls: Sequence[LogCall]) -> None:
    """Log ``calls`` through ``module.log`` (the real ``LightningModule.log``), from the calling thread."""
    for call in calls:
        module.log(call.name, call.value, **call.kwargs)


__all__ = ["LogCall", "LogRecorder", "emit", "install_recorder", "reduce_log_calls"]
