"""Recorder: each replica's ``self.log`` calls recorded in its own thread, for the log stage to log once.

Lightning's result collection takes no locks and moves a logged value to the device of whoever logs, so replicas must
never log into it from their threads (PL 1.x "dp" logged on-step values from whichever GPU wrote last, Lightning issue
#9839). While the replicas run the step, :func:`install_recorder` gives each a :class:`LogRecorder` in place of its
``log`` method (``log_dict`` goes through ``log``), and every replica after the first a no-op ``print`` (one device
prints once per step); :func:`remove_recorders` takes both away before the step's calls are reduced and logged through
the root module (:mod:`lightning_sparse_dp.step.log`).

A recorder checks each call as ``LightningModule.log`` does, with Lightning's exceptions and messages, and records it as
a :class:`LogCall`: with the element count of a mean the step computed
(:func:`~lightning_sparse_dp.loss.means.count_of`); a logged ``torchmetrics.Metric`` by its module path
(:class:`MetricRef`); a tensor that a metric's ``forward`` or ``compute`` just returned with that metric, so that the
root metric's merged value can be logged in its place, and one the step computed from such values with how it did
(:mod:`~lightning_sparse_dp.replica.derived`), so that the same calls on the root metric's value can be.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torchmetrics import Metric

from lightning_sparse_dp.loss.means import count_of
from lightning_sparse_dp.replica.derived import Recipe, recipe_of
from lightning_sparse_dp.runtime.compat import (
    computed,
    current_hook,
    forward_cache,
    results_of,
    trainer_of,
    update_count,
)
from lightning_sparse_dp.runtime.process import STEP_OBSERVER as _observer

_LOG_SIGNATURE = inspect.signature(LightningModule.log)

#: One element of a tensor: its flat index and the tensor's shape
Element = tuple[int, tuple[int, ...]]


#: ``self.log``'s options (its parameters but ``self``, ``name`` and ``value``), which keyword options are checked against
_LOG_OPTIONS = frozenset(_LOG_SIGNATURE.parameters) - {"self", "name", "value"}


@dataclass
class LogCall:
    """One ``self.log(name, value, **kwargs)`` call."""

    name: str
    value: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    count: int | None = None  # the elements the value is a mean over, when the step computed it as one (means.py)
    #: ``(how, path, the replica's metric, its update count then, element)`` when the value is what that metric's
    #: ``forward`` (``how == "forward"``) or ``compute`` (``"compute"``) returned (``element`` ``None``), or one element
    #: of it (``element``: its flat index and the value's shape: ``acc[c]`` of a per-class value, a
    #: ``ClasswiseWrapper``'s entries)
    metric_value: tuple[str, str, Metric, int, Element | None] | None = None
    #: how the value was computed from metric values (``self.recall(logits, y).mean()``), when it was
    derived: Recipe | None = None


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
    with its metric (:attr:`LogCall.metric_value`): :func:`~lightning_sparse_dp.step.log.reduce_log_calls` logs the
    root metric's merged value, one
    device's, in its place.

    Args:
        metrics: ``module path -> metric`` of the replica's metrics.
        module: the replica (its trainer tells a step that may not log, as Lightning's ``self.log`` reads it).

    Raises (Lightning's own exceptions and messages, at the call, as ``LightningModule.log`` raises them):
        ValueError: a value that is not a number, a tensor or a Metric; a tensor with more than one element.
        MisconfigurationException: logging where Lightning refuses it (a ``predict_step``), a metric that is not a
            submodule of the module (naming ``metric_attribute=``, or asking for an attribute when the module has no
            metric), one name logged twice in the step with different options.
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
        trainer = trainer_of(self.module)
        if trainer is not None and results_of(trainer) is None:
            raise MisconfigurationException(
                "You are trying to `self.log()` but the loop's result collection is not registered"
                " yet. This is most likely because you are trying to log in a `predict` hook,"
                " but it doesn't support logging"
            )
        if isinstance(value, Metric):
            value = MetricRef(self._metric_path(name, value, kwargs.get("metric_attribute")))
        elif isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                f"`self.log({name}, {value})` was called, but the tensor must have a single element."
                f" You can try doing `self.log({name}, {value}.mean())`"
            )
        earlier = self.calls.pop(name, None)  # a later call with the same name replaces the earlier one, as in Lightning
        if earlier is not None and _metadata(earlier.kwargs) != _metadata(kwargs):  # ...with the same arguments
            fx = current_hook(self.module) or "the step"
            raise MisconfigurationException(
                f"You called `self.log({name}, ...)` twice in `{fx}` with different arguments. This is not allowed"
            )
        metric_value = self._metric_value(value) if self.metrics else None  # (a value a metric gave)
        derived = self._derived(value) if self.metrics and metric_value is None else None  # (computed from one)
        self.calls[name] = LogCall(name, value, kwargs, count_of(value), metric_value, derived)

    def _metric_path(self, name: str, metric: Metric, attribute: str | None) -> str:
        """The module path of a logged metric (``metric_attribute`` when given), or Lightning's refusal."""
        if attribute is not None and attribute in self.metrics:
            return attribute
        if not self.metrics:
            raise MisconfigurationException(
                "Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged."
                " You can fix this by setting an attribute for the metric in your `LightningModule`."
            )
        if id(metric) not in self.metric_paths:
            raise MisconfigurationException(
                "Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged."
                f" You can fix this by calling `self.log({name}, ..., metric_attribute=name)` where `name` is one"
                f" of {list(self.metrics)}"
            )
        return self.metric_paths[id(metric)]

    def _metric_value(self, value: Any) -> tuple[str, str, Metric, int, Element | None] | None:
        if not isinstance(value, Tensor):
            return None
        for path, m in self.metrics.items():
            for how, cached in (("forward", forward_cache(m)), ("compute", computed(m))):
                if cached is value:
                    return how, path, m, update_count(m), None
        for path, m in self.metrics.items():  # one element of such a value (a per-class value indexed or unbound)
            for how, cached in (("forward", forward_cache(m)), ("compute", computed(m))):
                index = element_of(value, cached)
                if index is not None:
                    return how, path, m, update_count(m), index
        return None

    def _derived(self, value: Any) -> Recipe | None:
        """How ``value`` was computed from the values of the replica's metrics (:mod:`.derived`), else ``None``."""
        active = getattr(_observer, "active", None)
        if active is None or not active.derived or not isinstance(value, Tensor) or value.requires_grad:
            return None
        return recipe_of(value, active.derived, self.metric_paths, update_count,
                         lambda root: forward_cache(root.metric) if root.how == "forward" else computed(root.metric))


def element_of(value: Tensor, whole: Any) -> Element | None:
    """``(flat index, whole.shape)`` when ``value`` is a one-element view of one element of the contiguous tensor
    ``whole`` (``whole[c]``, an entry of ``whole.unbind()``: what ``ClasswiseWrapper`` makes of a per-class metric
    value), else ``None``."""
    if not isinstance(whole, Tensor) or value._base is None or value.numel() != 1 or not whole.is_contiguous():
        return None
    if value._base is not whole and value._base is not whole._base:
        return None
    if value.dtype != whole.dtype or value.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
        return None
    index = value.storage_offset() - whole.storage_offset()
    return (index, tuple(whole.shape)) if 0 <= index < whole.numel() else None


def _metadata(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's options as Lightning's result collection compares two calls of one name (``_Metadata``: every option
    of ``LightningModule.log`` with its default, but the value and ``batch_size``)."""
    bound = _LOG_SIGNATURE.bind(None, "", None, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value", "batch_size")}


def no_print(*args: Any, **kwargs: Any) -> None:
    """``print`` of a replica after the first (and of the exactness check's copies): prints nothing."""


def install_recorder(
    replica: Any, index: int, metrics: dict[str, Metric] | None = None, recorder: LogRecorder | None = None,
) -> LogRecorder:
    """A new :class:`LogRecorder` as replica ``index``'s ``log``, for the step, and after the first replica a no-op
    ``print``: ``LightningModule.print`` prints on global rank 0, which every replica of one process is, and one device
    prints once per step. Touches that replica only, so it may run in the replica's own thread. Both attributes must be
    removed (:func:`remove_recorders`) before :func:`~lightning_sparse_dp.step.log.emit` logs through the root
    module, which is replica 0 itself when
    one chunk runs on the root device.

    ``metrics``: ``module path -> metric`` of the replica's metrics when the caller knows them (the metric copies it
    installed); else the replica's modules are searched. ``recorder``: this replica's recorder of an earlier step,
    made with these ``metrics``, given again with no calls instead of a new one.
    """
    if recorder is not None and recorder.module is replica:
        recorder.calls = {}
    else:
        if metrics is None:
            metrics = {name: m for name, m in replica.named_modules() if isinstance(m, Metric)}
        recorder = LogRecorder(metrics, replica)
    replica.log = recorder
    if index > 0:
        replica.print = no_print
    return recorder


def remove_recorders(replicas: Sequence[Any]) -> None:
    """The replicas' own ``log`` and ``print`` back (the instance attributes :func:`install_recorder` set removed)."""
    for replica in replicas:
        replica.__dict__.pop("log", None)
        replica.__dict__.pop("print", None)


__all__ = ["LogCall", "LogRecorder", "MetricRef", "install_recorder", "no_print", "remove_recorders"]
