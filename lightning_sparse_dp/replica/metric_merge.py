"""Metric merge: the replicas' metric states merged into the root's metrics, as one update with the whole batch.

After the step, :func:`merge_into_root` merges the states of the replicas' copies (one :class:`MetricReplicas` per root
metric) into the root metric with ``Metric.merge_state`` (torchmetrics >= 1.1), in replica order (:func:`merge_states`;
a wrapper's inner metrics likewise, innermost first), so the root ends the step in the state one update with the whole
batch gives. When replicas called ``forward`` (which returns the batch value), the root's ``_forward_cache`` is set to
the whole batch's value, which is what Lightning logs for ``self.log(name, metric)`` on step: the replicas' states
merged into an empty copy of the metric kept for the run (``MetricReplicas.scratch``). Where every state is a sum, the
root then gets that copy's states in one addition, as torchmetrics' own ``forward`` adds the batch's state to the
accumulated one (``_reduce_states``: global + batch).

The entries that the replicas' copies appended to a concatenated list state (``dist_reduce_fx="cat"``: ``CatMetric``,
AUROC's predictions) are first put in the order one device appends them (:func:`in_batch_order`: per-sample or per-point
rows of the chunks in the batch's order; other entries stay in replica order, said once).

An aggregation metric (torchmetrics' ``MeanMetric``, ``SumMetric``, ``MaxMetric``, ``MinMetric``, ``CatMetric``) that
every replica updated with one value of its chunk per call (``self.val_loss(loss)``, an accuracy), where one device
updates it once with the whole batch's value, gets those updates instead
(:func:`~lightning_sparse_dp.replica.metric_updates.whole_batch_updates`), not the replicas' merged; what the copies
set outside their states is said (:func:`~lightning_sparse_dp.replica.metric_updates.say_plain_changes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import BaseAggregator
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from lightning_sparse_dp.replica.metric_updates import RESET, say_plain_changes, whole_batch_updates
from lightning_sparse_dp.runtime.compat import (
    forward_cache,
    own_reduce_states,
    reduce_states,
    set_step_results,
    state_defaults,
    state_reduction,
    update_count,
)
from lightning_sparse_dp.runtime.process import SAID_ONCE as _cache
from lightning_sparse_dp.split import SplitPlan, merge_chunks, merge_rows
from lightning_sparse_dp.split.merge import row_order


@dataclass
class MetricReplicas:
    """A root metric and its copies in the replicas (replica order).

    ``scratch``: gives an empty metric like ``root`` (on its device) in which :func:`merge_into_root` combines
    the replicas' states for the whole batch's ``forward`` value; ``None``: a ``root.clone()`` each time.
    """

    name: str
    root: Metric
    replicas: list[Metric]
    scratch: Callable[[], Metric] | None = None


def in_batch_order(entry: MetricReplicas, plan: SplitPlan) -> None:
    """The entries that this step's replica copies appended to each of their concatenated list states, put in the
    order one device's step appends them, all in the first copy's list (the others' emptied), so that the merge
    (which concatenates the lists in replica order) gives the root one device's list.

    Entry ``j`` of every copy (each copy has ``k`` entries) that is per-sample or per-point rows of its chunk (its
    first dimension the chunk's samples or points: ``CatMetric.update(preds)``) becomes one entry, the rows in the
    batch's order (:func:`~lightning_sparse_dp.split.merge_chunks`, as step outputs are merged); else copies with one
    entry per sample of their chunk (``MeanAveragePrecision``'s per-image boxes) give those entries in sample order
    (:func:`~lightning_sparse_dp.split.merge_rows`). Lists that are neither (a value per ``update`` over the chunk)
    stay in replica order, said once: what ``compute()`` reads in them is in another order, or of another number of
    entries, than one device's.
    """
    root, copies = entry.root, entry.replicas
    for name in state_defaults(root):
        if state_reduction(root, name) is not dim_zero_cat:
            continue
        lists = [m.__dict__.get(name) for m in copies]  # type: ignore[union-attr]  # every copy updated
        if not all(type(x) is list for x in lists) or not any(lists):
            continue
        merged = _ordered(lists, [update_count(m) for m in copies], plan)  # type: ignore[arg-type,union-attr]
        if merged is None:
            _cache.info(
                f"sparse_dp: the entries the replicas' copies of metric {entry.name!r} appended to its list state "
                f"{name!r} are neither per-sample nor per-point rows of their chunks: the metric gets them in replica "
                "order, which an order-free metric (AUROC, mAP, a sum) does not mind but its compute() reads in another "
                "order, or number, than one device's."
            )
            continue
        device = copies[0].device  # type: ignore[union-attr]
        copies[0].__dict__[name] = [e.to(device) if isinstance(e, Tensor) else e for e in merged]  # type: ignore[union-attr]
        for m in copies[1:]:
            m.__dict__[name] = []  # type: ignore[union-attr]


def _ordered(lists: list[list[Any]], counts: list[int], plan: SplitPlan) -> list[Any] | None:
    """One device's entries from the replicas' (see :func:`in_batch_order`; ``counts``: each copy's updates), or
    ``None``. Entries are taken for rows of one update each only where every copy has one entry per update (as
    ``CatMetric`` appends): per-sample entries that happen to have as many rows as their chunk has samples are not."""
    k = len(lists[0])
    if all(len(x) == k == c for x, c in zip(lists, counts)):
        merged = []
        for pieces in zip(*lists):
            lengths = [p.shape[0] if isinstance(p, Tensor) and p.dim() > 0 else -1 for p in pieces]
            order = row_order(plan, lengths)
            if order is None:
                break
            merged.append(merge_chunks(list(pieces), order))
        else:
            return merged
    if [len(x) for x in lists] == plan.samples_per_chunk:
        return list(merge_rows(lists, plan.chunk_samples))
    return None


def merge_states(target: Metric, sources: list[Metric]) -> bool:
    """``for m in sources: target.merge_state(m)``, with one fused add per source where that gives the same states.

    The fused path (``torch._foreach_add``: one call per source, not one per state) takes
    metrics that keep torchmetrics' own ``merge_state`` and whose states are all tensors summed across
    processes (``dist_reduce_fx="sum"``), of one shape, dtype and device in ``target`` and every source:
    torchmetrics' ``_reduce_states`` sets each such state to ``incoming + local``, a new tensor, and so does this
    (IEEE addition commutes: the same values). Anything else goes through ``merge_state``, which raises its
    ``RuntimeError`` for metrics with ``full_state_update=True`` (or not set) or ``dist_sync_on_step=True``, unless
    every state is reduced by a sum, mean, max, min or concatenation: those are merged by that reduction
    (:func:`_merge_one`), as torchmetrics' own sync across processes merges them under DDP.

    Concatenated states (``dist_reduce_fx="cat"``) are set after the merges to the target's entries followed by each
    source's in order (:func:`_cat_states`), as one device appends them: ``merge_state`` puts the incoming entries
    first (``_reduce_states``: ``global + local``, the accumulated ones first in ``forward``), so each merged replica
    went before the steps and the replicas merged before it.

    States reduced by a mean across processes (``dist_reduce_fx="mean"``, e.g. the ``data_range`` that
    ``PeakSignalNoiseRatio(data_range=...)`` keeps) are set after the merges to the mean of ``target``'s and the
    sources' values weighted by their update counts (:func:`_mean_states`): ``merge_state`` weights them with
    ``target``'s update count alone, which the merge does not advance (torchmetrics' ``forward`` advances it
    first), so it left ``0 / 0 = nan`` in a target not updated before.

    Returns:
        whether the states were added fused (every state a sum).
    """
    counts = [update_count(m) for m in sources]
    sources = [_on_device_of(target, m) for m in sources]
    summed = _summed_states(target, sources)
    if summed is None:
        means = _mean_states(target, sources, counts)  # before merge_state changes the target's
        appended = _cat_states(target, sources)
        for m in sources:
            _merge_one(target, m)
        target.__dict__.update(means)
        target.__dict__.update(appended)
        return False
    names, states, incoming = summed
    for theirs in incoming:
        states = torch._foreach_add(theirs, states)  # incoming + local, as _reduce_states; new tensors
    target.__dict__.update(zip(names, states))  # metric states are plain attributes (as reset_metric sets them)
    return True


def _on_device_of(target: Metric, source: Metric) -> Metric | dict[str, Any]:
    """``source``, or, when it lives on another device than ``target`` (a replica on another GPU), its state moved to
    ``target``'s device as a dict (``Metric.merge_state`` takes either): torchmetrics' merge adds, concatenates or
    stacks the two states, which needs one device."""
    if source.device == target.device:  # Metric.device follows .to(): the replicas' copies are moved so (_copy)
        return source
    device = target.device
    return {n: apply_to_collection(getattr(source, n), Tensor, lambda t: t.to(device)) for n in state_defaults(target)}


def _state_of(source: Metric | dict[str, Any], name: str) -> Any:
    """State ``name`` of a source of a merge: a metric, or a metric's states as a dict (:func:`_on_device_of`)."""
    return source[name] if isinstance(source, dict) else getattr(source, name)


def _mean_states(target: Metric, sources: list[Metric | dict[str, Any]], counts: list[int]) -> dict[str, Tensor]:
    """``target``'s tensor states reduced by a mean (``dim_zero_mean``), each merged with the sources' as the mean
    over every update they count: ``(n * v + sum_i c_i * v_i) / (n + sum_i c_i)`` with ``n`` and ``v`` the target's
    update count and value (left out where ``n = 0``: an empty metric's default), ``c_i`` and ``v_i`` source ``i``'s.

    That is torchmetrics' running mean of such a state over ``forward`` calls (``Metric._reduce_states``:
    ``((n - 1) * global + local) / n`` after the count is advanced) taken over all the replicas' calls, and, over
    processes, what its ``dist_reduce_fx="mean"`` stands for; a state no update changes (a constant such as
    ``data_range``) keeps its value exactly. A floating state keeps its dtype; any other becomes float32, as
    torchmetrics' ``.float()`` makes it.
    """
    names = [
        n for n in state_defaults(target)
        if state_reduction(target, n) is dim_zero_mean and isinstance(getattr(target, n), Tensor)
    ]
    if not names:
        return {}
    n = update_count(target)
    total = n + sum(counts)
    if total <= 0:
        return {}
    out = {}
    for name in names:
        values = [(c, _state_of(m, name)) for c, m in zip(counts, sources) if c > 0]
        if n > 0:
            values.insert(0, (n, getattr(target, name)))
        weighted = [v * c if v.is_floating_point() else v.float() * c for c, v in values]
        out[name] = torch.stack(weighted).sum(0) / total if len(weighted) > 1 else weighted[0] / total
    return out


#: the reductions torchmetrics' ``Metric._reduce_states`` (and its sync across processes) applies by name
_REDUCTIONS = (dim_zero_sum, dim_zero_mean, dim_zero_max, dim_zero_min, dim_zero_cat)


def _merge_one(target: Metric, source: Metric | dict[str, Any]) -> None:
    """``target.merge_state(source)``; for a metric ``merge_state`` refuses (``full_state_update=True`` or not set,
    ``dist_sync_on_step=True``: ``MaxMetric``, ``MeanAveragePrecision``, a custom metric without the flag) whose every
    state is reduced by a sum, mean, max, min or concatenation, ``Metric._reduce_states`` itself, the reduction that
    torchmetrics' sync across processes applies to it whatever the flags (so DDP's result; the flag tells ``forward``
    how to compute the batch value, not how states combine).

    Raises:
        RuntimeError: from ``merge_state`` (a refused metric with a state reduced by ``None`` or a function of its own).
        ValueError: ``source`` is a metric of another class.
    """
    refused = target.full_state_update or target.full_state_update is None or target.dist_sync_on_step
    if not (refused and all(state_reduction(target, n) in _REDUCTIONS for n in state_defaults(target))):
        target.merge_state(source)
        return
    if isinstance(source, Metric):
        if not isinstance(source, type(target)):
            raise ValueError(f"expected a {type(target).__name__} to merge, got a {type(source).__name__}.")
        source = source.metric_state
    reduce_states(target, source)


def _cat_states(target: Metric, sources: list[Metric | dict[str, Any]]) -> dict[str, Any]:
    """``target``'s concatenated states (``dim_zero_cat``: lists, or tensors concatenated on dimension 0), each
    followed by the sources' in source order."""
    out: dict[str, Any] = {}
    for name in state_defaults(target):
        if state_reduction(target, name) is not dim_zero_cat:
            continue
        mine = getattr(target, name)
        theirs = [_state_of(m, name) for m in sources]
        if type(mine) is list and all(type(t) is list for t in theirs):
            out[name] = mine + [e for t in theirs for e in t]
        elif isinstance(mine, Tensor) and all(isinstance(t, Tensor) for t in theirs):
            out[name] = torch.cat([mine, *theirs])
    return out


def _summed_states(
    target: Metric, sources: list[Metric | dict[str, Any]]
) -> tuple[list[str], list[Tensor], list[list[Tensor]]] | None:
    """``(state names, target's states, each source's states)`` when :func:`merge_states` may add them fused, else ``None``
    (a source is a metric of ``target``'s type, or the state of one as a dict: :func:`_on_device_of`)."""
    if not sources:
        return None
    names = list(state_defaults(target))
    if not (
        type(target).merge_state is Metric.merge_state
        and not own_reduce_states(target)
        and target.full_state_update is False
        and not target.dist_sync_on_step
        and all(isinstance(m, dict) or type(m) is type(target) for m in sources)
        and all(state_reduction(target, n) is dim_zero_sum for n in names)
    ):
        return None
    states = [getattr(target, n) for n in names]
    incoming = [[_state_of(m, n) for n in names] for m in sources]
    same_kind = all(isinstance(t, Tensor) and not t.requires_grad for t in states) and all(
        isinstance(x, Tensor) and x.shape == t.shape and x.dtype == t.dtype and x.device == t.device
        for theirs in incoming
        for x, t in zip(theirs, states)
    )
    return (names, states, incoming) if same_kind else None


def metric_levels(metric: Metric) -> list[tuple[str, Metric]]:
    """``metric`` (path ``""``) and the metrics inside it (a wrapper's), by module path, outermost first."""
    if not metric._modules:
        return [("", metric)]
    return [(path, m) for path, m in metric.named_modules() if isinstance(m, Metric)]


def merge_into_root(
    metrics: list[MetricReplicas], plan: SplitPlan | None = None, value_of: Callable[[list[Any]], Tensor | None] | None = None,
) -> None:
    """Merge each replica metric's state into its root metric (see the module docstring), and likewise each metric
    inside it into the root's (a wrapper's: ``ClasswiseWrapper``, ``MinMaxMetric``, ``MetricTracker``), innermost
    first, so that a root wrapper's ``compute`` reads its inner metrics merged.

    With the step's ``plan``, the entries the replicas' copies appended to a list state that is concatenated
    (``dist_reduce_fx="cat"``: ``CatMetric``, AUROC's predictions) are first put in the order one device appends them
    (:func:`in_batch_order`). With ``value_of`` (the step's
    :meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`), an aggregation metric updated with one number of
    each chunk gets the whole batch's updates (:func:`~lightning_sparse_dp.replica.metric_updates.whole_batch_updates`).

    Raises:
        RuntimeError: a metric updated in replicas whose state cannot be merged (``full_state_update=True`` or
            ``dist_sync_on_step=True`` with a state reduced by ``None`` or a function of its own: :func:`_merge_one`);
            says which metric and what to do.
    """
    for entry in metrics:
        copies = [m for m in entry.replicas if m is not None]
        levels = metric_levels(entry.root)
        forward = any(forward_cache(m) is not None for c in copies for _, m in metric_levels(c))  # a wrapper's or inside it
        batch = None  # the whole batch's states (a forward call's value), when a replica called forward
        if forward:
            if entry.scratch is not None:
                batch = entry.scratch()
            else:
                batch = entry.root.clone()
                batch.reset()
        for path, root in levels:  # reset in the step (the user's reset(), a wrapper's forward), as on one device: the
            if any((m.get_submodule(path) if path else m).__dict__.get(RESET) for m in copies):  # root too, outermost
                root.reset()  # first and before any merge (a wrapper's reset resets its inner metrics)
        merged: set[int] = set()  # the states merged so far (their _defaults), innermost first
        for path, root in reversed(levels):  # innermost first: a wrapper's compute reads its inner metrics merged
            if id(state_defaults(root)) in merged:  # a wrapper whose states are its inner metric's (ClasswiseWrapper):
                set_step_results(root, result=None)  # merged once, there; its compute() reads them again
                continue
            merged.add(id(state_defaults(root)))
            subs = [m.get_submodule(path) if path else m for m in copies]
            name = f"{entry.name}.{path}" if path else entry.name
            try:
                _merge_level(
                    MetricReplicas(name, root, subs, None if path else entry.scratch), plan,
                    None if batch is None else batch.get_submodule(path), value_of,
                )
            except RuntimeError as err:
                raise RuntimeError(
                    f"the torchmetrics metric {name!r} ({type(root).__name__}) was updated in sparse_dp replicas but "
                    f"its state cannot be merged across them ({err}; a state reduced by None or a function of its "
                    "own). Update it outside the step, from the gathered outputs (on_validation_batch_end, ...), or "
                    "give its states a reduction the merge applies: dist_reduce_fx='sum', 'mean', 'max', 'min' or "
                    "'cat' (a list of tensors)."
                ) from err


def _merge_level(
    entry: MetricReplicas, plan: SplitPlan | None, batch: Metric | None,
    value_of: Callable[[list[Any]], Tensor | None] | None = None,
) -> None:
    """One metric's replicas merged into its root (``entry.replicas``: the updated and the others), through ``batch``
    (an empty metric like the root) when a replica called ``forward``: the root's ``_forward_cache`` becomes the
    whole batch's value. An aggregation metric updated with one number per chunk gets the whole batch's updates
    instead (:func:`~lightning_sparse_dp.replica.metric_updates.whole_batch_updates`), made on ``batch`` or an empty
    metric from ``entry.scratch``."""
    say_plain_changes(entry, [m for m in entry.replicas if m is not None])  # a wrapper may count no update of its own
    updated = [m for m in entry.replicas if m is not None and update_count(m) > 0]
    if not updated:
        return
    wholes = None
    if value_of is not None and plan is not None and len(updated) == plan.num_chunks > 1 and isinstance(
        entry.root, BaseAggregator
    ):
        wholes = whole_batch_updates(entry, updated, value_of)
    if wholes is not None:  # one device's updates, made on an empty metric that the root then merges
        target = batch if batch is not None else (entry.scratch() if entry.scratch is not None else _empty(entry.root))
        for whole in wholes:
            target.update(whole.to(target.device) if isinstance(whole, Tensor) else whole)
        if batch is not None and any(forward_cache(m) is not None for m in updated):
            set_step_results(entry.root, forward=target.compute())
        merge_states(entry.root, [target])
        set_step_results(entry.root, count=update_count(entry.root) + len(wholes), result=None)
        return
    if plan is not None and len(updated) == plan.num_chunks > 1:
        in_batch_order(entry, plan)
    total = sum(update_count(m) for m in updated)
    sources = updated
    if batch is not None and any(forward_cache(m) is not None for m in updated):
        if merge_states(batch, updated):  # sums: the root gets the batch's, as forward's global + batch
            sources = [batch]
        set_step_results(batch, count=total)
        set_step_results(entry.root, forward=batch.compute())
    merge_states(entry.root, sources)
    # plain attributes (torchmetrics' __init__ sets them), set as nn.Module.__setattr__ ends up setting them; the
    # count advances by the root replica's updates: one device's where every replica updates alike (once a step), and
    # otherwise (an update per sample of the chunk) what Lightning's DDP rank 0 counts, as its metric's own
    first = entry.replicas[0]
    set_step_results(entry.root, count=update_count(entry.root) + (0 if first is None else update_count(first)),
                     result=None)


def _empty(root: Metric) -> Metric:
    """An empty metric like ``root`` (a clone, reset)."""
    empty = root.clone()
    empty.reset()
    return empty


__all__ = ["MetricReplicas", "in_batch_order", "merge_into_root", "merge_states", "metric_levels"]
