"""Metric updates: what the replicas' copies of a torchmetrics metric did in a step beyond their states.

The merge (:mod:`~lightning_sparse_dp.replica.metric_merge`) merges the copies' states; two things a state does not
carry are read here:

- the arguments of each ``update`` of an aggregation metric's copy (:class:`UpdateCalls`): where every replica updated
  it with one number of its chunk (``self.val_loss(loss)``), one device updates it once with the whole batch's number,
  which :func:`whole_batch_updates` gives (the value of the step's losses or of a mean it computed, the sum of integer
  counts) for the merge to make those updates instead of merging the replicas' (an unweighted mean of the chunks'
  losses, as Lightning's DDP ranks' synchronized states give);
- the public tensor attributes a copy's ``compute`` or ``forward`` set in the step (``MinMaxMetric``'s bounds), which
  stay on the copy: said once (:func:`say_plain_changes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import MaxMetric, MinMetric, SumMetric

from lightning_sparse_dp.runtime.compat import state_defaults, update_count
from lightning_sparse_dp.runtime.process import SAID_ONCE as _cache

if TYPE_CHECKING:
    from lightning_sparse_dp.replica.metric_merge import MetricReplicas


class UpdateCalls:
    """A replica copy's ``update`` (an aggregation metric's), noting each call's arguments since the copy was handed out
    for a step (:func:`whole_batch_updates` reads them; the copy's owner clears them)."""

    def __init__(self, update: Callable[..., Any]) -> None:
        self.update = update
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.update(*args, **kwargs)


#: the attribute of a replica's copy holding ``(its chunk's batch column, the metric's name)`` for the step
CHUNK_COLUMN = "_lsdp_chunk_column"


class BatchColumns:
    """A replica copy's ``update``, saying once when an argument is the chunk's batch column (its points' sample ids
    ``0..b-1`` in order, ``x.C[:, 0]``, as ``metric.__dict__[CHUNK_COLUMN]`` holds it for the step): each replica
    numbers its samples from 0, so ids of different chunks meet in the metric's state (a retrieval metric's
    ``indexes`` group them as one query), where one device's are the batch's ``0..B-1``."""

    def __init__(self, update: Callable[..., Any], metric: Metric) -> None:
        self.update, self.metric = update, metric

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        held = self.metric.__dict__.get(CHUNK_COLUMN)
        if held is not None:
            column, name = held
            for v in (*args, *kwargs.values()):
                if (isinstance(v, Tensor) and v.dim() == 1 and v.numel() == column.numel()
                        and v.dtype in (torch.int32, torch.int64) and torch.equal(v.long(), column.to(v.device))):
                    _cache.warn(
                        f"sparse_dp: the torchmetrics metric {name!r} was updated with the chunk's batch column (its "
                        "points' sample ids 0..b-1, x.C[:, 0]): each replica numbers its samples from 0, so ids of "
                        "different chunks meet in the metric's state (a retrieval metric's indexes= group them as one "
                        "query), where one device's are the batch's 0..B-1. Pass ids of the whole batch: put them in "
                        "the batch in on_before_batch_transfer (batch['point_sample_ids'] = coordinates[:, 0]), which "
                        "the split cuts with the points and leaves as they are (under a key naming a batch, e.g. "
                        "'batch_ids', it is taken for a batch vector and renumbered; layout={key: 'points'} keeps it)."
                    )
                    break
        return self.update(*args, **kwargs)


#: the attribute of a replica's copy (each level) holding :func:`plain_tensors` as the copy was handed out for a step
HANDED = "_lsdp_handed_out"
#: the attribute of a replica's copy (each level) set when the step reset it (:class:`StepResets`)
RESET = "_lsdp_reset_in_step"


class StepResets:
    """A replica copy's ``reset`` and ``forward`` (each level's), noting in ``metric.__dict__[RESET]`` a ``reset`` that
    the step made and that no ``forward`` of the metric itself undoes: one device's metric lost its accumulated state
    there (``self.acc.reset()`` in the step; ``MinMaxMetric``'s ``forward`` resets its inner metric), so the root
    metric is reset before the copies are merged into it
    (:func:`~lightning_sparse_dp.replica.metric_merge.merge_into_root`). torchmetrics' own ``forward`` resets the
    metric, updates it with the batch alone and puts the accumulated states back (``Metric._forward_reduce_state_update``,
    ``_forward_full_state_update``): that reset is not noted. The copy's owner clears the note when it hands the copy out.
    """

    def __init__(self, metric: Metric) -> None:
        self.metric, self.own_reset, self.own_forward, self.forwarding = metric, metric.reset, metric.forward, 0
        metric.reset, metric.forward = self.reset, self.forward  # instance attributes, as torchmetrics' update is

    def reset(self) -> None:
        if not self.forwarding:
            self.metric.__dict__[RESET] = True
        self.own_reset()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.forwarding += 1
        try:
            return self.own_forward(*args, **kwargs)
        finally:
            self.forwarding -= 1


def plain_tensors(metric: Metric) -> dict[str, int]:
    """``name -> id`` of the public tensor attributes of ``metric`` that are not states (``MinMaxMetric``'s
    ``min_val`` / ``max_val``, which its ``compute`` sets): what a merge of states does not carry."""
    states = state_defaults(metric)
    return {k: id(v) for k, v in vars(metric).items() if isinstance(v, Tensor) and k[:1] != "_" and k not in states}


def say_plain_changes(entry: MetricReplicas, copies: list[Metric]) -> None:
    """Say once where a replica's copy set public tensor attributes that are not states in the step (its ``compute``
    or ``forward`` ran there: ``MinMaxMetric``'s ``min_val``): they stay on the copy, so the root metric's are not one
    device's."""
    changed = sorted({k for m in copies for k, i in plain_tensors(m).items() if m.__dict__.get(HANDED, {}).get(k) != i})
    said = f"sparse_dp metric attributes: {entry.name}"  # once per metric, whichever attributes a step set
    if changed and said not in _cache:
        _cache.add(said)
        _cache.warn(
            f"sparse_dp: the replicas' copies of the torchmetrics metric {entry.name!r} ({type(entry.root).__name__}) "
            f"set {', '.join(changed)} in the step (its compute() or forward ran there), which are not metric states: "
            "they stay on the copies, and the module's metric keeps its own, not one device's. Call compute() on the "
            "module's metric outside the step (on_train_epoch_end, on_validation_epoch_end), or update it in the step "
            "and log the metric object."
        )


def _scalar(value: Any) -> bool:
    """One number: a Python int or float (not a bool), or a 0-dim tensor that is not a bool (a ``[1]`` tensor is a row
    per sample or point of a chunk that holds one: its rows, merged as rows)."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return not value.is_floating_point() if isinstance(value, Tensor) else isinstance(value, int)


def whole_batch_updates(
    entry: MetricReplicas, updated: list[Metric], value_of: Callable[[list[Any]], Tensor | None],
) -> list[Any] | None:
    """The whole batch's value of each ``update`` the replicas made of an aggregation metric (``entry.root`` a torchmetrics
    ``BaseAggregator``), when every replica called it alike with one number of its chunk each time (no other
    argument): integers (counts) their sum, as ``self.log`` sums integers; others ``value_of``'s (the step's
    :meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`: the value of its losses, or of a mean it computed),
    else, one value in every replica, that value. ``None`` where the replicas' merged updates are kept: other updates
    (per-row values, a ``weight=``); a ``MaxMetric`` / ``MinMetric`` of integers, or a ``MaxMetric`` / ``MinMetric`` /
    ``SumMetric`` of a value ``value_of`` cannot tell (a max, min or sum over the chunk, which the merge takes as one
    device's); for a ``MeanMetric`` or ``CatMetric`` such a value is said once (the merge is what DDP's ranks give)."""
    noted = [getattr(m.__dict__.get("update"), "calls", None) for m in updated]
    if any(c is None for c in noted):
        return None
    # the updates its state holds: those since its last reset (a wrapper's forward resets its inner metric and updates
    # it again, MinMaxMetric(MeanMetric())'s), as many as it counts
    calls = [c[max(len(c) - update_count(m), 0):] for c, m in zip(noted, updated)]  # type: ignore[arg-type]
    if len({len(c) for c in calls}) != 1:
        return None
    extreme = isinstance(entry.root, (MaxMetric, MinMetric))  # a max / min of the chunk's is one device's, merged
    wholes = []
    for entries in zip(*calls):  # type: ignore[call-overload]
        if any(kwargs or len(args) != 1 or not _scalar(args[0]) for args, kwargs in entries):
            return None
        values = [args[0] for args, _ in entries]
        same = len({float(v) for v in values}) == 1
        if all(_is_integer(v) for v in values):  # counts, summed as self.log sums integers; a max / min of ints merged
            if extreme:
                return None
            wholes.append(sum(values[1:], values[0]))
        elif same and isinstance(entry.root, SumMetric):  # equal sums of the chunks' (hits.sum()): their sum, as merged
            return None
        else:
            whole = value_of(values)
            if whole is None and same:  # one value in every replica that no rule reads: that value
                whole = values[0]
            if whole is None and (extreme or isinstance(entry.root, SumMetric)):
                return None  # a max, min or sum of the chunk's (logits.max(), hits.sum()): the merge is one device's
            if whole is None:
                _cache.warn(
                    f"sparse_dp: the torchmetrics metric {entry.name!r} ({type(entry.root).__name__}) was updated with "
                    "one value per replica (each its chunk's, e.g. a hand-made ratio or a maximum), where one device "
                    "updates it once with the whole batch's: its state is the replicas' updates merged, as Lightning's "
                    "DDP ranks' are synchronized, not one device's. Update it with values of the chunk's rows (a loss "
                    "with reduction='none', per-sample hits), or with a mean computed by torch.mean / .mean() or a "
                    "loss of torch's, which the strategy reduces as one device's."
                )
                return None
            wholes.append(whole)
    return wholes


__all__ = ["HANDED", "UpdateCalls", "plain_tensors", "say_plain_changes", "whole_batch_updates"]
