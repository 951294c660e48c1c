"""Log: capture ``self.log`` calls made in replicas and log each value once, reduced, from the main thread.

Lightning's result collection takes no locks and moves a logged value to the device of whoever
logs, so replicas must never log into it from their threads (PL 1.x "dp" logged on-step values from
whichever GPU wrote last, Lightning issue #9839). While the replicas run the step, :func:`install_recorder`
gives each a :class:`LogRecorder` in place of its ``log`` method (``log_dict`` goes through ``log``); after the step,
:func:`reduce_log_calls`
merges the replicas' calls name by name and :func:`emit` logs them through the root module.

A ``torchmetrics.Metric`` logged from a replica (``self.log(name, self.acc)``) is logged as the root
module's metric of the same name, whose state :mod:`lightning_sparse_dp.metrics` has merged; the value a metric's
``forward`` returned (``self.log(name, self.acc(preds, y))``, the chunk's value) as the root metric's value for the
whole batch, when every replica logged it from the step's one ``forward`` call of that metric, and the value its
``compute`` returned after the step's updates (``self.acc.compute()``) as the root metric's ``compute()``.

Reduction across replicas, and when it gives the one-device (whole-batch) value:

- under ``loss_weighting="terms"``, a value that is a combination of the step's captured losses
  (a term, the loss, a sum of terms) in every replica: its whole-batch value
  (:mod:`lightning_sparse_dp.loss.decide`), before any of the rules below;

- the step's loss itself (the tensor the step returns, ``self.log("loss", loss)``): the weighted
  mean the loss is gathered by, whatever ``reduce_fx`` says (``reduce_fx`` is Lightning's reduction
  over the steps of an epoch; a loss is a mean whatever it is later reduced by);
- ``reduce_fx="mean"`` (the default): the mean weighted like the loss (``w_i`` of the replicas that
  logged the name, renormalized; replicas of weight 0 left out), exact for a mean over what the
  loss weighting counts (samples, points, ...);
- integers (Python ``int`` or integer / bool tensors: counts and sizes such as ``len(labels)`` or
  ``(pred == y).sum()``) with no ``reduce_fx`` given: summed, exact for a count over the chunk, with
  a one-time warning saying so (``reduce_fx="sum"`` silences it; ``reduce_fx="max"`` logs a value
  that is the same in every replica, such as an epoch number, as is);
- ``"sum"``: the sum, exact for a sum or count over the chunk's samples or points;
- ``"max"`` / ``"min"``: the max / min, exact for a max / min over the chunk's samples or points
  (not for a mean: a one-time warning says so);
- any other callable is applied to the stacked values ``[k]``.

Values equal in every replica are logged as they are. Values of weight-0 replicas that are not
finite (a mean over nothing, e.g. every label ignored) are left out, so they never make a logged
value NaN; a mean with nothing left is 0. The ``batch_size`` given to Lightning (which weights
epoch-level means) is the sum of the replicas' ``batch_size`` arguments; without them Lightning infers it from the
whole batch, as it does on one device (a batch split in DataLoader workers: the number of its samples).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor
from torchmetrics import Metric

from lightning_sparse_dp.loss.values import is_loss_value
from lightning_sparse_dp.means import count_of

_warning_cache = WarningCache()
_LOG_SIGNATURE = inspect.signature(LightningModule.log)
#: ``self.log``'s options (its parameters but ``self``, ``name`` and ``value``), which keyword options are checked against
_LOG_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}
#: The names of a mean, as ``reduce_fx`` (``self.log``) and ``reduce_op`` (``Strategy.reduce``) spell it.
MEAN_NAMES = ("mean", "avg")
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
    count: int | None = None  # the elements the value is a mean over, when the step computed it as one (means.py)
    #: ``(how, path, the replica's metric, its update count then)`` when the value is what that metric's ``forward``
    #: (``how == "forward"``) or ``compute`` (``"compute"``) returned
    metric_value: tuple[str, str, Metric, int] | None = None


@dataclass(frozen=True)
class MetricRef:
    """A logged ``torchmetrics.Metric``, by its module path (e.g. ``"val_acc"`` for ``self.val_acc``)."""

    path: str


class LogRecorder:
    """Stands in for ``LightningModule.log`` on a replica and records the calls.

    Called as ``LightningModule.log`` is: ``recorder(name, value, prog_bar, logger, ...)``, options
    positional or by keyword (bound to ``LightningModule.log``'s own signature, so a misspelt option
    raises the ``TypeError`` it would raise there); the value is a number, a one-element tensor or a
    ``torchmetrics.Metric`` that is a submodule of the replica. Only the options given are recorded.

    A tensor that is the value a metric's ``forward`` or ``compute`` just returned (``self.log(name, self.acc(preds,
    y))``: the chunk's value, ``self.acc.compute()``: the chunk's, where one device's covers the epoch so far) is noted
    with its metric (:attr:`LogCall.metric_value`): :func:`reduce_log_calls` logs the root metric's merged value, one
    device's, in its place.

    Args:
        metrics: ``module path -> metric`` of the replica's metrics.
        module: the replica (its trainer tells a step that may not log, as Lightning's ``self.log`` reads it).

    Raises (Lightning's own exceptions and messages, at the call, as ``LightningModule.log`` raises them):
        ValueError: a value that is not a number, a tensor or a Metric; a tensor with more than one element.
        MisconfigurationException: logging where Lightning refuses it (a ``predict_step``), a metric that is not a
            submodule of the module (naming ``metric_attribute=``).
        TypeError: an option ``LightningModule.log`` does not take.
    """

    def __init__(self, metrics: dict[str, Metric] | None = None, module: Any = None) -> None:
        self.module = module
        self.calls: dict[str, LogCall] = {}
        self.metrics = metrics or {}
        self.metric_paths = {id(m): path for path, m in self.metrics.items()}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args or not _LOG_OPTIONS.issuperset(kwargs):  # positional options, or one LightningModule.log refuses
            bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs)  # its TypeError for a misspelt option
            kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        # Lightning's own checks and messages, in its order (lightning/pytorch/core/module.py, LightningModule.log)
        if not isinstance(value, (Tensor, numbers.Number, Metric)):
            raise ValueError(f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot be logged")
        trainer = getattr(self.module, "_trainer", None)
        if trainer is not None and getattr(trainer, "_results", True) is None:
            raise MisconfigurationException(
                "You are trying to `self.log()` but the loop's result collection is not registered"
                " yet. This is most likely because you are trying to log in a `predict` hook,"
                " but it doesn't support logging"
            )
        if isinstance(value, Metric):
            if id(value) not in self.metric_paths:
                raise MisconfigurationException(
                    "Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged."
                    f" You can fix this by calling `self.log({name}, ..., metric_attribute=name)` where `name` is one"
                    f" of {list(self.metrics)}"
                )
            value = MetricRef(self.metric_paths[id(value)])
        elif isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"`self.log({name}, {value})` was called, but the tensor must have a single element."
                f" You can try doing `self.log({name}, {value}.mean())`"
            )
        self.calls.pop(name, None)  # a later call with the same name replaces the earlier one, as in Lightning
        self.calls[name] = LogCall(name, value, kwargs, count_of(value), self._metric_value(value))

    def _metric_value(self, value: Any) -> tuple[str, str, Metric, int] | None:
        if not isinstance(value, Tensor):
            return None
        for path, m in self.metrics.items():
            attributes = m.__dict__
            for how, cache in (("forward", "_forward_cache"), ("compute", "_computed")):
                if attributes.get(cache) is value:
                    return how, path, m, m._update_count
        return None


def install_recorder(replica: Any, index: int, metrics: dict[str, Metric] | None = None) -> LogRecorder:
    """A new :class:`LogRecorder` as replica ``index``'s ``log``, for the step, and after the first replica a no-op
    ``print``: ``LightningModule.print`` prints on global rank 0, which every replica of one process is, and one device
    prints once per step. Touches that replica only, so it may run in the replica's own thread. Both attributes must be
    removed (:func:`remove_recorders`) before :func:`emit` logs through the root module, which is replica 0 itself when
    one chunk runs on the root device.

    ``metrics``: ``module path -> metric`` of the replica's metrics when the caller knows them (the metric copies it
    installed); else the replica's modules are searched.
    """
    if metrics is None:
        metrics = {name: m for name, m in replica.named_modules() if isinstance(m, Metric)}
    recorder = replica.log = LogRecorder(metrics, replica)
    if index > 0:
        replica.print = _no_print
    return recorder


def remove_recorders(replicas: Sequence[Any]) -> None:
    """The replicas' own ``log`` and ``print`` back (the instance attributes :func:`install_recorder` set removed)."""
    for replica in replicas:
        replica.__dict__.pop("log", None)
        replica.__dict__.pop("print", None)


def _reduce(values: Sequence[Tensor], weights: Sequence[float], reduce_fx: Any) -> Tensor:
    if reduce_fx in MEAN_NAMES or reduce_fx is torch.mean:
        first = values[0]
        dtype = first.dtype if first.dtype.is_floating_point else torch.float32
        total = float(sum(weights))
        if total == 0:
            return torch.zeros((), dtype=dtype, device=first.device)
        kept = [(v, w / total) for v, w in zip(values, weights) if w != 0]  # a weight-0 value (maybe NaN) adds nothing
        stacked = torch.stack([v.reshape(()) for v, _ in kept]).double()
        share = torch.tensor([w for _, w in kept], dtype=torch.float64, device=stacked.device)
        return (stacked * share).sum().to(dtype)
    stacked = torch.stack([v.reshape(()) for v in values])
    if isinstance(reduce_fx, str):
        if reduce_fx not in _NAMED:
            raise ValueError(f"reduce_fx={reduce_fx!r} is not supported; use 'mean', 'sum', 'max', 'min' or a callable.")
        reduce_fx = _NAMED[reduce_fx]
    return reduce_fx(stacked)


def _is_integer(value: Any) -> bool:
    if isinstance(value, Tensor):
        return not value.dtype.is_floating_point and not value.is_complex()
    return isinstance(value, numbers.Integral)


def _all_equal(values: Sequence[Tensor]) -> bool:
    return all(bool((v == values[0]).all()) for v in values[1:])


def reduce_log_calls(
    recorders: Sequence[LogRecorder],
    weights: Sequence[float],
    num_samples: int,
    device: torch.device,
    root: torch.nn.Module | None = None,
    losses: Sequence[Tensor | None] | None = None,
    warning_cache: WarningCache | None = None,
    exact: Callable[[list[int], list[Any]], Tensor | None] | None = None,
    infer_batch_size: bool = False,
) -> list[LogCall]:
    """Merge the calls of every replica into one call per name, in the order names were first logged.

    Args:
        recorders: one per replica, in replica order.
        weights: ``w_i`` of each replica (see :func:`lightning_sparse_dp.loss.weights.chunk_weights`).
        num_samples: samples in the whole batch, the ``batch_size`` of a call no replica gave one unless
            ``infer_batch_size``: then Lightning infers it from the whole batch, as one device's ``self.log`` does
            (``extract_batch_size``: the first tensor's length, the points of a dict batch of coordinates first).
        device: the root device; reduced values are put there.
        root: the root module, whose metrics stand for logged replica metrics.
        losses: each replica's step loss (:func:`lightning_sparse_dp.backward.loss_of` of its output); a logged
            value that is its replica's loss is reduced as the loss is (weighted mean).
        warning_cache: where one-time warnings go (a module-level cache when not given).
        exact: ``exact(replicas, values)``: the whole batch's value of a name, or ``None`` to reduce by
            the rules above (``loss_weighting="terms"``: a logged combination of captured losses).
    """
    warning_cache = _warning_cache if warning_cache is None else warning_cache
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
        if len(present) < len(recorders) and not all(_is_integer(c.value) for _, c in present):
            warning_cache.warn(
                f"sparse_dp: self.log({name!r}, ...) was called by {len(present)} of {len(recorders)} replicas (a branch on "
                "the chunk, e.g. `if len(batch['labels']) > k`): it is reduced over those replicas only, not over the "
                "whole batch as one device would compute it. Log it in every replica's step (with a weight of 0 where "
                "the chunk has nothing for it), or log a torchmetrics metric."
            )
        value = _metric_value(present, len(recorders), root)
        if value is None and exact is not None:
            value = exact([i for i, _ in present], [c.value for _, c in present])
        if value is None:
            value = _reduce_values(name, present, weights, losses, kwargs, device, warning_cache, num_samples)
        else:
            value = value.to(device)
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        if all(s is not None for s in sizes):  # the whole batch's size passed by every replica counts once
            kwargs["batch_size"] = num_samples if all(s == num_samples for s in sizes) else sum(sizes)
        elif infer_batch_size:  # Lightning infers it from the step's whole batch (its warning included), as on one device
            kwargs.pop("batch_size", None)
        else:
            kwargs["batch_size"] = num_samples
        merged.append(LogCall(name, value, kwargs))
    return merged


def _metric_value(present: list[tuple[int, LogCall]], replicas: int, root: torch.nn.Module | None) -> Tensor | None:
    """One device's value of a metric whose ``forward`` or ``compute`` value every replica logged, else ``None``.

    ``forward``: each replica's value what its copy of one metric returned from the step's only ``forward`` call of it
    (the copy's update count 1, the value still its ``_forward_cache``): one device's step calls it once on the whole
    batch, and the root metric's ``_forward_cache``, set from the replicas' merged states
    (:func:`~lightning_sparse_dp.metrics.merge_into_root`), is that call's value. ``compute``: each replica's value
    its copy's ``compute()`` after the step's updates of it (none after), as one device's ``compute`` in the step reads
    the epoch so far with the batch: the root metric's ``compute()`` once merged.
    """
    if root is None or len(present) != replicas:
        return None
    sources = [c.metric_value for _, c in present]
    if any(v is None for v in sources) or len({(how, path) for how, path, _, _ in sources}) != 1:  # type: ignore[misc]
        return None
    how, path = sources[0][0], sources[0][1]  # type: ignore[index]
    if how == "forward":
        if not all(m._update_count == 1 and m._forward_cache is c.value for (_, _, m, _), (_, c) in zip(sources, present)):  # type: ignore[misc]
            return None
        value = root.get_submodule(path)._forward_cache
    else:
        if not all(0 < count == m._update_count for _, _, m, count in sources):  # type: ignore[misc]
            return None
        value = root.get_submodule(path).compute()
    return value if isinstance(value, Tensor) and value.numel() == 1 else None


def _reduce_values(
    name: str,
    present: list[tuple[int, LogCall]],
    weights: Sequence[float],
    losses: Sequence[Tensor | None] | None,
    kwargs: dict[str, Any],
    device: torch.device,
    warning_cache: WarningCache,
    num_samples: int = 0,
) -> Tensor:
    """One logged value from the replicas' values of ``name`` (see the module docstring for the rules)."""
    values = [torch.as_tensor(c.value).to(device) for _, c in present]
    w = [weights[i] for i, _ in present]
    keep = [j for j, v in enumerate(values) if w[j] != 0 or bool(torch.isfinite(v).all())]
    if not keep:  # only weight-0 values that are not finite (a mean over nothing): nothing to log but 0
        return torch.zeros((), dtype=values[0].dtype if values[0].dtype.is_floating_point else torch.float32, device=device)
    present, values, w = [present[j] for j in keep], [values[j] for j in keep], [w[j] for j in keep]
    if len(values) == 1:
        return values[0].reshape(())
    reduce_fx = kwargs.get("reduce_fx", "mean")
    is_loss = losses is not None and all(is_loss_value(c.value, losses[i]) for i, c in present)
    if is_loss:
        reduce_fx = "mean"  # the loss (or its .item()) is a weighted mean, whatever Lightning reduces it by over an epoch
    elif "reduce_fx" not in kwargs and all(_is_integer(c.value) for _, c in present):
        warning_cache.warn(
            f"sparse_dp: self.log({name!r}, <integer>) from several replicas is logged as the sum over the replicas "
            "(the whole batch's count or size, when it is the chunk's). Pass reduce_fx='sum' to say so and silence "
            "this warning, or reduce_fx='max' for a value that is the same in every replica (e.g. an epoch number)."
        )
        reduce_fx = "sum"
    elif reduce_fx in ("max", "min", torch.max, torch.min) and any(v.dtype.is_floating_point for v in values):
        warning_cache.warn(
            f"sparse_dp: self.log({name!r}, ..., reduce_fx={getattr(reduce_fx, '__name__', reduce_fx)!r}) takes the "
            "max / min over the replicas' values: the whole batch's value only when each is a max / min over its "
            "chunk's samples or points. For a mean (e.g. a loss), log it with reduce_fx='mean' or log the loss "
            "tensor the step returns."
        )
    if reduce_fx in (*MEAN_NAMES, "max", "min", torch.mean, torch.max, torch.min) and _all_equal(values):
        return values[0].reshape(())  # the mean, max or min of equal values, without rounding
    if reduce_fx in (*MEAN_NAMES, torch.mean) and not is_loss:
        counts = [c.count for _, c in present]
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        if all(n is not None for n in counts):  # means the step computed: weighted by their own element counts
            return _reduce(values, [float(n) for n in counts], reduce_fx)  # type: ignore[arg-type]
        if all(isinstance(s, numbers.Number) for s in sizes) and not all(s == num_samples for s in sizes):
            return _reduce(values, [float(s) for s in sizes], reduce_fx)  # the chunks' own batch_size= counts
        if not all(_is_integer(c.value) for _, c in present):
            warning_cache.info(
                f"sparse_dp: self.log({name!r}, ...) differs between replicas and is not a mean the step computed with "
                "torch.mean / .mean() (e.g. a hand-made sum / count): it is reduced as a mean weighted by each replica's "
                "share of the loss weighting (samples or points), the whole batch's value only for a mean over those. "
                "For the whole batch's value log a torchmetrics metric, log value.mean() of the per-element values, or "
                "pass batch_size= the count it is a mean over."
            )
    return _reduce(values, w, reduce_fx)



def _no_print(*args: Any, **kwargs: Any) -> None:
    pass


def emit(module: Any, calls: Sequence[LogCall]) -> None:
    """Log ``calls`` through ``module.log`` (the real ``LightningModule.log``), from the calling thread."""
    for call in calls:
        module.log(call.name, call.value, **call.kwargs)


__all__ = [
    "MEAN_NAMES", "LogCall", "LogRecorder", "MetricRef", "emit", "install_recorder", "reduce_log_calls",
    "remove_recorders",
]
