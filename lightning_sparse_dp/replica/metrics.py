"""Metrics: each replica's own empty copies of the module's torchmetrics metrics for a step, kept for the run.

A replica is a shallow copy of the module, so a ``torchmetrics.Metric`` in it would share (and race on) the root
metric's state, or lose its update (PL 1.x "dp": Lightning issue #4353); its ``update`` and ``compute`` are even
instance attributes bound to the root metric. Before the step every replica therefore gets its own empty copy of each
metric (``Metric.clone`` of an empty template, so the root's accumulated state is never copied) for the step
(:meth:`ReplicaMetrics.step_copies`, each replica's installed in its own thread by :meth:`StepMetrics.install`); after
it, the copies' states are merged into the root's metrics
(:func:`~lightning_sparse_dp.replica.metric_merge.merge_into_root`, one
:class:`~lightning_sparse_dp.replica.metric_merge.MetricReplicas` per root metric) and the replicas get their own metric
modules back.

The copies, and the empty copy in which the merge combines the replicas' states for the whole batch's ``forward`` value,
are made once and kept for the run (``Metric.clone`` deep-copies, which costs far more than emptying a copy:
docs/benchmarks.md, "Costs of the step's parts"): each step empties those used since (:func:`reset_metric`,
torchmetrics' ``reset`` done in place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.aggregation import BaseAggregator

from lightning_sparse_dp.loss.observer import outside_capture
from lightning_sparse_dp.replica.derived import noting_value
from lightning_sparse_dp.replica.metric_merge import MetricReplicas, merge_into_root, metric_levels
from lightning_sparse_dp.replica.metric_updates import (
    CHUNK_COLUMN,
    HANDED,
    RESET,
    BatchColumns,
    StepResets,
    UpdateCalls,
    plain_tensors,
)
from lightning_sparse_dp.runtime.compat import RESET_ATTRIBUTES, computed, forward_cache, state_defaults, update_count
from lightning_sparse_dp.split import SplitPlan


def reset_metric(metric: Metric) -> None:
    """``metric.reset()``, cheaper for metrics that keep torchmetrics' own ``reset``.

    torchmetrics' ``reset`` sets every tensor state to a fresh clone of its default through the modules'
    ``__setattr__``, one Python call per state. Here the tensor states, the metric's own since the last
    reset (a merge into the root builds new tensors for the root), are copied back to their defaults in
    place with one fused ``torch._foreach_copy_``, list states are cleared, and the other attributes
    ``reset`` sets are set directly. Anything else (an overridden ``reset``, a state whose shape, dtype or
    device changed, that needs a gradient, or an inference tensor outside inference mode: a state made in a
    validation or predict step, which Lightning runs in ``torch.inference_mode``, cannot be updated in place
    in a training step) goes through ``metric.reset()``, which makes new tensors.
    """
    if type(metric).reset is not Metric.reset:
        metric.reset()
        return
    inference = torch.is_inference_mode_enabled()
    attributes = metric.__dict__
    states, defaults, lists = [], [], []
    for name, default in state_defaults(metric).items():
        current = attributes.get(name)
        if isinstance(default, torch.Tensor):
            if not (
                isinstance(current, torch.Tensor)
                and current.shape == default.shape
                and current.dtype == default.dtype
                and current.device == default.device
                and not current.requires_grad
                and (inference or not current.is_inference())  # made in a validation / predict step's inference mode
            ):
                metric.reset()
                return
            states.append(current)
            defaults.append(default)
        elif isinstance(current, list):
            lists.append(current)
        else:
            metric.reset()
            return
    if states:
        torch._foreach_copy_(states, defaults)
    for state in lists:
        state.clear()
    attributes.update(RESET_ATTRIBUTES)


class ReplicaMetrics:
    """Empty copies of a module's metrics for the replicas of each step.

    Each root metric gets one copy per replica index, device and the root's ``dtype`` (``set_dtype``), made on first
    use (``Metric.clone`` of an empty template, so the root's accumulated state is never copied) and kept for the run; every
    step resets it (:func:`reset_metric`, far cheaper than a new copy) before handing it to the replica,
    unless no ``update``, ``forward`` or ``compute`` ran on it since its last reset (the validation metric
    in a training step): torchmetrics counts every ``update`` in ``_update_count``.
    """

    def __init__(self) -> None:
        self._templates: dict[tuple[int, torch.dtype], Metric] = {}
        self._copies: dict[tuple[int, int, torch.device, torch.dtype], Metric] = {}
        # (structure, the root's metrics, each replica's (parent module, attribute) per metric by id(replica))
        self._found: tuple[object, list[tuple[str, Metric]], dict[int, list[tuple[nn.Module, str]]]] | None = None
        self.none = StepMetrics(self, [], {}, [], [])  # the copies of a step without metrics: none
        #: the structure (see :meth:`step_copies`) of a root found to have no metric: a step of it needs none of
        #: :meth:`step_copies` (:meth:`none_for`)
        self.empty_for: object = None

    def _template(self, metric: Metric) -> Metric:
        template = self._templates.get((id(metric), metric.dtype))
        if template is None:
            template = metric.clone()
            template.reset()
            self._templates[(id(metric), metric.dtype)] = template
        return template

    def _copy(self, metric: Metric, index: int, device: torch.device) -> Metric:
        key = (id(metric), index, device, metric.dtype)  # set_dtype on the root (in setup, a callback) makes new copies
        copy = self._copies.get(key)
        if copy is None:
            copy = self._template(metric).clone()
            if device != metric.device:
                copy.to(device)
            if index >= 0:  # a replica's: update and forward run outside the step's loss capture (terms.outside_capture)
                copy.update = BatchColumns(outside_capture(copy.update), copy)
                # their values noted, for what the step computes from them (derived.py: recall.mean())
                copy.forward = noting_value(outside_capture(copy.forward), "forward", copy)
                copy.compute = noting_value(copy.compute, "compute", copy)
                for _, level in metric_levels(copy):  # an aggregator's updates' values (a wrapper's inner one's too,
                    if isinstance(level, BaseAggregator):  # MinMaxMetric(MeanMetric())), for the whole batch's (metric_merge)
                        level.update = UpdateCalls(level.update)
                    StepResets(level)  # a reset the step makes, which one device's metric makes too (metric_merge)
            self._copies[key] = copy
        elif any(update_count(m) or computed(m) is not None or forward_cache(m) is not None for _, m in metric_levels(copy)):
            # else no update, forward or compute ran on it (or a metric inside it: MinMaxMetric counts only its
            # inner metric's updates) since its reset: it is still empty
            for _, level in reversed(metric_levels(copy)):
                reset_metric(level)
                calls = level.__dict__.get("update")
                if isinstance(calls, UpdateCalls):
                    calls.calls.clear()
        if index >= 0:  # what its compute() may set outside its states (MinMaxMetric's min_val), to find after the step
            for _, level in metric_levels(copy):
                level.__dict__[HANDED] = plain_tensors(level)
                level.__dict__[RESET] = False  # not reset in the step yet (its own reset above is no step's)
        return copy

    @contextmanager
    def step_copies(
        self, root: nn.Module, replicas: list[nn.Module], devices: list[torch.device], structure: object = None,
        plan: SplitPlan | None = None, value_of: Callable[[list[Any]], Tensor | None] | None = None,
    ) -> Iterator[StepMetrics]:
        """One step's metric copies, each replica's installed by :meth:`StepMetrics.install` (in its own thread).

        When the body ends without an exception the copies' states are merged into the root's
        metrics (:func:`merge_into_root`); either way the replicas get back the metric modules they
        had. Nothing is installed when ``replicas`` is ``[root]`` or ``root`` has no metric (one empty
        :class:`StepMetrics`, kept for the run, stands for them). ``structure``: an object that is
        replaced whenever ``root``'s module tree changes (the strategy's persistent replicas); while
        it is the same, the root's metrics and their parent modules in each replica are not looked up again (no
        ``named_modules`` walk or ``get_submodule`` per step). ``plan``: the step's split, which puts the entries the
        replicas' metrics concatenate back in the batch's order (:func:`merge_into_root`); ``value_of``: the whole
        batch's value of the replicas' values of a number (the step's
        :meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`), for aggregation metrics updated with one number
        per chunk (:func:`~lightning_sparse_dp.replica.metric_updates.whole_batch_updates`).

        Raises:
            RuntimeError: from :func:`merge_into_root`.
        """
        if len(replicas) == 1 and replicas[0] is root:
            yield self.none
            return
        if structure is not None and self._found is not None and self._found[0] is structure:
            _, found, slots_of = self._found
        else:
            found = [(name, m) for name, m in root.named_modules() if isinstance(m, Metric)]
            # the outermost metrics only: a wrapper's inner metrics (ClasswiseWrapper, MinMaxMetric, MetricTracker) are
            # copied with it and merged level by level (merge_into_root), never swapped on their own
            found = [(n, m) for n, m in found if not any(n.startswith(f"{outer}.") for outer, _ in found if outer != n)]
            slots_of = {}
            self._found = None if structure is None else (structure, found, slots_of)
        if not found:  # no metric: nothing to install, merge or give back
            self.empty_for = structure
            yield self.none
            return
        step = StepMetrics(self, found, slots_of, replicas, devices, plan)
        try:
            yield step
            merge_into_root(step.merged, plan, value_of)
        finally:
            step.uninstall()


class StepMetrics:
    """One step's copies of the root's metrics (:meth:`ReplicaMetrics.step_copies`), installed replica by replica.

    Attributes:
        merged: one :class:`MetricReplicas` per root metric; ``replicas[i]`` is replica ``i``'s copy once
            :meth:`install` ran for it (``None`` before).
    """

    def __init__(
        self, owner: ReplicaMetrics, found: list[tuple[str, Metric]], slots_of: dict[int, list[tuple[nn.Module, str]]],
        replicas: list[nn.Module], devices: list[torch.device], plan: SplitPlan | None = None,
    ) -> None:
        self._owner, self._slots_of, self._replicas, self._devices = owner, slots_of, replicas, devices
        self._plan = plan  # each replica's chunk's batch column, for its copies' updates (BatchColumns)
        self._paths = [name.rpartition(".") for name, _ in found]
        count = len(replicas)
        # -1: the batch's scratch metric (the whole batch's forward value)
        self.merged = [MetricReplicas(name, m, [None] * count, partial(owner._copy, m, -1, m.device)) for name, m in found]
        self._previous: list[list[tuple[nn.Module, str, nn.Module]]] = [[] for _ in range(count)]

    def install(self, index: int) -> None:
        """Replica ``index``'s empty copies in place of its metrics; touches that replica only (any thread).

        Copies are made and reset outside inference mode, also in a validation / predict step (Lightning runs them in
        torch.inference_mode): inference tensors could not be updated in place in a later training step.
        """
        if not self.merged:
            return
        replica, device = self._replicas[index], self._devices[index]
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext():
            slots = self._slots_of.get(id(replica))
            if slots is None:  # each metric's parent in this replica (its own module: the child slot set directly)
                slots = self._slots_of[id(replica)] = [(replica.get_submodule(parent), attr) for parent, _, attr in self._paths]
            previous = self._previous[index]
            column = self._batch_column(index)
            for entry, (parent, attr) in zip(self.merged, slots):
                copy = self._owner._copy(entry.root, index, device)
                copy.__dict__[CHUNK_COLUMN] = None if column is None else (column, entry.name)
                previous.append((parent, attr, parent._modules[attr]))
                parent._modules[attr] = copy
                entry.replicas[index] = copy

    def _batch_column(self, index: int) -> Tensor | None:
        """Replica ``index``'s chunk's batch column (int64 ``[n_i]``: its points' sample ids ``0..b_i-1`` in order, of
        the first point set), where the chunk holds two samples or more (one sample's is all zeros, as a target may be)."""
        plan = self._plan
        if plan is None or not plan.sample_points or index >= len(plan.chunk_samples):
            return None
        samples = plan.chunk_samples[index]
        if samples.numel() < 2 or torch.equal(samples.cpu(), torch.arange(samples.numel())):
            return None  # one sample (its column all zeros, as a target may be), or the batch's ids already
        return plan.batch_column(index)

    def copies(self, index: int) -> dict[str, Metric]:
        """``module path -> copy`` of replica ``index``'s installed copies and of the metrics inside them."""
        return {
            f"{m.name}.{path}" if path else m.name: sub
            for m in self.merged
            for path, sub in metric_levels(m.replicas[index])  # type: ignore[arg-type]  # installed: not None
        }

    def uninstall(self) -> None:
        """Every replica's own metric modules back (calling thread, after the step)."""
        for previous in self._previous:
            for parent, attr, module in previous:
                parent._modules[attr] = module
            previous.clear()


__all__ = ["MetricReplicas", "ReplicaMetrics", "StepMetrics", "reset_metric"]
