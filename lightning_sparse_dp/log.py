"""Log: capture ``self.log`` calls made in replicas and log each value once, reduced, from the main thread.

Lightning's result collection takes no locks and moves a logged value to the device of whoever
logs, so replicas must never log into it from their threads (PL 1.x "dp" logged on-step values from
whichever GPU wrote last, Lightning issue #9839). Each replica gets a :class:`LogRecorder` in place
of its ``log`` method (``log_dict`` goes through ``log``); after the step, :func:`reduce_log_calls`
merges the replicas' calls name by name and :func:`emit` logs them through the root module.

A ``torchmetrics.Metric`` logged from a replica (``self.log(name, self.acc)``) is logged as the root
module's metric of the same name, whose state :mod:`lightning_sparse_dp.metrics` has merged.

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
from torchmetrics import Metric

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


@dataclass(frozen=True)
class MetricRef:
    """A logged ``torchmetrics.Metric``, by its module path (e.g. ``"val_acc"`` for ``self.val_acc``)."""

    path: str


class LogRecorder:
    """Stands in for ``LightningModule.log`` on a replica and records the calls.

    Same signature as ``LightningModule.log``; the value is a number, a one-element tensor or a
    ``torchmetrics.Metric`` that is a submodule of the replica.

    Args:
        metric_paths: ``id(metric) -> module path`` of the replica's metrics.

    Raises:
        TypeError: a value of another type, or a metric that is not a submodule of the module.
        ValueError: a tensor with more than one element.
    """

    def __init__(self, metric_paths: dict[int, str] | None = None) -> None:
        self.calls: dict[str, LogCall] = {}
        self.metric_paths = metric_paths or {}

    def __call__(self, name: str, value: Any, **kwargs: Any) -> None:
        if isinstance(value, Metric):
            if id(value) not in self.metric_paths:
                raise TypeError(
                    f"self.log({name!r}, <{type(value).__name__}>): the metric is not an attribute of the LightningModule, "
                    "so sparse_dp cannot merge its state across replicas. Make it an attribute (self.metric = ...)."
                )
            value = MetricRef(self.metric_paths[id(value)])
        elif not isinstance(value, (Tensor, numbers.Number)):
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) in a sparse_dp replica: log a number, a one-element "
                "tensor or a torchmetrics Metric."
            )
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, tensor of shape {tuple(value.shape)}): a logged tensor must have one element; "
                "log value.mean() or another reduction."
            )
        self.calls.pop(name, None)  # a later call with the same name replaces the earlier one, as in Lightning
        self.calls[name] = LogCall(name, value, kwargs)


def install_recorder(replica: Any) -> LogRecorder:
    """Replace ``replica.log`` (an instance attribute shadowing the method) with a new recorder.

    Remove it with ``del replica.log`` when ``replica`` is the root module itself.
    """
    paths = {id(m): name for name, m in replica.named_modules() if isinstance(m, Metric)}
    recorder = LogRecorder(paths)
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
    recorders: Sequence[LogRecorder],
    weights: Sequence[float],
    num_samples: int,
    device: torch.device,
    root: torch.nn.Module | None = None,
) -> list[LogCall]:
    """Merge the calls of every replica into one call per name, in the order names were first logged.

    Args:
        recorders: one per replica, in replica order.
        weights: ``w_i`` of each replica (see :func:`lightning_sparse_dp.gather.chunk_weights`).
        num_samples: samples in the whole batch, the default ``batch_size``.
        device: the root device; reduced values are put there.
        root: the root module, whose metrics stand for logged replica metrics.
    """
    names: list[str] = []
    for rec in recorders:
        names.extend(n for n in rec.calls if n not in names)
    merged: list[LogCall] = []
    for name in names:
        present = [(i, rec.calls[name]) for i, rec in enumerate(recorders) if name in rec.calls]
        kwargs = dict(present[0][1].kwargs)
        first = present[0][1].value
        if isinstance(first, MetricRef):
            if root is None:
                raise ValueError("a metric was logged in a replica but no root module was given to resolve it.")
            merged.append(LogCall(name, root.get_submodule(first.path), kwargs))
            continue
        values = [torch.as_tensor(c.value).to(device) for _, c in present]
        reduce_fx = kwargs.get("reduce_fx", "mean")
        if len(values) == 1 and (reduce_fx in (*_MEAN, *_NAMED) or reduce_fx in (torch.mean, *_NAMED.values())):
            value = values[0].reshape(())  # one replica: any of these reductions is the value itself
        else:
            value = _reduce(values, [weights[i] for i, _ in present], reduce_fx)
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        kwargs["batch_size"] = sum(sizes) if all(s is not None for s in sizes) else num_samples
        merged.append(LogCall(name, value, kwargs))
    return merged


def emit(module: Any, calls: Sequence[LogCall]) -> None:
    """Log ``calls`` through ``module.log`` (the real ``LightningModule.log``), from the calling thread."""
    for call in calls:
        module.log(call.name, call.value, **call.kwargs)


__all__ = ["LogCall", "LogRecorder", "MetricRef", "emit", "install_recorder", "reduce_log_calls"]
