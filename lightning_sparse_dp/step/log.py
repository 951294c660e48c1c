"""Log: the replicas' recorded ``self.log`` calls reduced and logged once, from the main thread.

After the step, :func:`reduce_log_calls` merges the replicas' calls (recorded by each replica's
:class:`~lightning_sparse_dp.replica.recorder.LogRecorder`) name by name and :func:`emit` logs them through the root
module; :func:`log_step` reduces them (stage ``log``) and the strategy's hub then emits them (stage ``emit``), as a
one-device step logs inside the step.

A ``torchmetrics.Metric`` logged from a replica (``self.log(name, self.acc)``) is logged as the root
module's metric of the same name, whose state :mod:`lightning_sparse_dp.replica.metric_merge` has merged; the value a
metric's ``forward`` returned (``self.log(name, self.acc(preds, y))``, the chunk's value) as the root metric's value
for the whole batch, when every replica logged it from the step's one ``forward`` call of that metric, and the value
its ``compute`` returned after the step's updates (``self.acc.compute()``) as the root metric's ``compute()``; a
number the step computed from such values (``self.recall(logits, y).mean()``, ``.sum()``, ``.max()``, ``100 * ...``) as
the same calls on the root metric's value (:mod:`~lightning_sparse_dp.replica.derived`), or, where they cannot be made
again (a mask from the chunk's labels), said once.

Reduction across replicas, and when it gives the one-device (whole-batch) value:

- under ``loss_weighting="terms"``, a value that is a combination of the step's captured losses
  (a term, the loss, a sum of terms) in every replica: its whole-batch value
  (:mod:`lightning_sparse_dp.loss.decide`), before any of the rules below;

- the step's loss itself (the tensor the step returns, ``self.log("loss", loss)``): the weighted
  mean the loss is gathered by, whatever ``reduce_fx`` says (``reduce_fx`` is Lightning's reduction
  over the steps of an epoch; a loss is a mean whatever it is later reduced by);
- ``reduce_fx="mean"`` (the default, or ``"avg"``: :data:`~lightning_sparse_dp.loss.means.MEAN_NAMES`): a mean the
  step computed with ``torch.mean`` / ``.mean()`` weighted by its element count (:mod:`lightning_sparse_dp.loss.means`),
  else by the replicas' own ``batch_size`` arguments where they are each chunk's count (not one constant), else the
  mean weighted like the loss (``w_i`` of the replicas that logged the name, renormalized; replicas of weight 0 left
  out), exact for a mean over what the loss weighting counts (samples, points, ...);
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
epoch-level means) is the sum of the replicas' ``batch_size`` arguments, or the one value they all passed where it is
not each chunk's count (the whole batch's, or a constant such as ``self.hparams.batch_size``:
:func:`~lightning_sparse_dp.step.log_memory.constant_batch_size`); without them Lightning infers it from the
whole batch, as it does on one device (a batch split in DataLoader workers: the number of its samples).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lightning_sparse_dp.loss.means import MEAN_NAMES
from lightning_sparse_dp.loss.step import log_fallback_message
from lightning_sparse_dp.loss.values import is_loss_value
from lightning_sparse_dp.replica.derived import metric_named, whole_batch_value
from lightning_sparse_dp.replica.recorder import Element, LogCall, LogRecorder, MetricRef, element_of
from lightning_sparse_dp.runtime.compat import forward_cache, update_count
from lightning_sparse_dp.runtime.process import SAID_ONCE as _WARNINGS
from lightning_sparse_dp.split.presplit import PreSplitBatch
from lightning_sparse_dp.step.log_memory import LogMemory

if TYPE_CHECKING:
    from lightning_sparse_dp.step.context import StepContext

_NAMED: dict[str, Callable[[Tensor], Tensor]] = {
    "sum": torch.sum,
    "max": torch.max,
    "min": torch.min,
}


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


def _chunk_counts(values: Sequence[Tensor], present: Sequence[tuple[int, Any]], chunk_samples: Sequence[int] | None,
                  chunk_points: Callable[[], Sequence[Sequence[int]]]) -> bool:
    """Whether the replicas' 0-dim values are each its chunk's number of samples, or of points of one point set."""
    if chunk_samples is None or any(v.dim() != 0 for v in values):
        return False
    counts = [chunk_samples, *chunk_points()]
    return any(all(i < len(c) and int(v) == c[i] for v, (i, _) in zip(values, present)) for c in counts)


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
    exact: Callable[[list[int], list[Any]], Tensor | str | None] | None = None,
    infer_batch_size: bool = False,
    batch_size: int | None = None,
    chunk_samples: Sequence[int] | None = None,
    chunk_points: Callable[[], Sequence[Sequence[int]]] = tuple,
    memory: LogMemory | None = None,
) -> list[LogCall]:
    """Merge the calls of every replica into one call per name, in the order names were first logged.

    Args:
        recorders: one per replica, in replica order.
        weights: ``w_i`` of each replica (see :func:`lightning_sparse_dp.loss.weights.chunk_weights`).
        num_samples: samples in the whole batch, the ``batch_size`` of a call no replica gave one unless
            ``infer_batch_size``: then Lightning infers it from the whole batch, as one device's ``self.log`` does
            (``extract_batch_size``: the first tensor's length, the points of a dict batch of coordinates first).
        batch_size: where Lightning cannot infer it (a batch split in DataLoader workers without its collated batch),
            the size it infers from the whole batch on one device (:attr:`PreSplitBatch.batch_size`), given to a call
            no replica gave one instead of ``num_samples``.
        device: the root device; reduced values are put there.
        root: the root module, whose metrics stand for logged replica metrics.
        losses: each replica's step loss (:func:`lightning_sparse_dp.step.backward.loss_of` of its output); a logged
            value that is its replica's loss is reduced as the loss is (weighted mean).
        warning_cache: where one-time warnings go (a module-level cache when not given).
        exact: ``exact(replicas, values)``: the whole batch's value of a name, or ``None`` to reduce by
            the rules above (``loss_weighting="terms"``: a logged combination of captured losses), or the reason (a
            ``str``) a combination of captured losses in every replica has no whole-batch value: said once
            (:func:`~lightning_sparse_dp.loss.step.log_fallback_message`), then reduced by the rules above.
        chunk_samples: each replica's samples (tells a ``batch_size=`` that is one constant, e.g.
            ``self.hparams.batch_size``, from each chunk's own count:
            :func:`~lightning_sparse_dp.step.log_memory.constant_batch_size`).
        chunk_points: gives, per point set, each replica's points (a ``batch_size=`` that is each chunk's point
            count); called only where needed.
        memory: the strategy's :class:`~lightning_sparse_dp.step.log_memory.LogMemory` (a fresh one when not given:
            this step alone).
    """
    warning_cache = _WARNINGS if warning_cache is None else warning_cache
    memory = LogMemory() if memory is None else memory
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
        said = False
        if value is None and root is not None and len(present) == len(recorders):  # (recall.mean(): derived.py)
            recipes = [c.derived for _, c in present]
            value = whole_batch_value(recipes, root, device, update_count, forward_cache)
            if isinstance(value, str):
                metric = metric_named(recipes)
                warning_cache.warn(
                    f"sparse_dp: self.log({name!r}, ...) is computed in the step from the value of {metric} {value}: "
                    "it cannot be recomputed from the metric's whole-batch value, so the replicas' chunk values are "
                    f"reduced instead, not one device's value. Log the metric object itself (self.log({name!r}, "
                    f"{metric}), with the reduction in the metric, e.g. average='macro'), or compute the number in "
                    f"on_train_epoch_end / on_validation_epoch_end from {metric}.compute()."
                )
                value, said = None, True
        if value is None and exact is not None:
            value = exact([i for i, _ in present], [c.value for _, c in present])
            if isinstance(value, str):  # losses the replicas called otherwise than one device (a loop stopped early)
                warning_cache.info(log_fallback_message("sparse_dp", name, value))
                value, said = None, True
        if value is None:
            value = _reduce_values(name, present, weights, losses, kwargs, device, warning_cache, num_samples,
                                   chunk_samples, chunk_points, memory, said)
        else:
            value = value.to(device)
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        if all(s is not None for s in sizes):  # one size passed by every replica (the batch's, a constant) counts once
            constant = memory.constant(name, sizes, [i for i, _ in present], num_samples, chunk_samples, chunk_points)
            kwargs["batch_size"] = constant if constant is not None else sum(sizes)
        elif infer_batch_size:  # Lightning infers it from the step's whole batch (its warning included), as on one device
            kwargs.pop("batch_size", None)
        else:
            kwargs["batch_size"] = num_samples if batch_size is None else batch_size
        merged.append(LogCall(name, value, kwargs))
    return merged


def _metric_value(present: list[tuple[int, LogCall]], replicas: int, root: torch.nn.Module | None) -> Tensor | None:
    """One device's value of a metric whose ``forward`` or ``compute`` value every replica logged, else ``None``.

    ``forward``: each replica's value what its copy of one metric returned from the step's only ``forward`` call of it
    (the copy's update count 1, the value still its ``_forward_cache``): one device's step calls it once on the whole
    batch, and the root metric's ``_forward_cache``, set from the replicas' merged states
    (:func:`~lightning_sparse_dp.replica.metric_merge.merge_into_root`), is that call's value. ``compute``: each replica's value
    its copy's ``compute()`` after the step's updates of it (none after), as one device's ``compute`` in the step reads
    the epoch so far with the batch: the root metric's ``compute()`` once merged.
    """
    if root is None or len(present) != replicas:
        return None
    sources = [c.metric_value for _, c in present]
    if any(v is None for v in sources) or len({(how, path) for how, path, _, _, _ in sources}) != 1:  # type: ignore[misc]
        return None
    how, path, element = sources[0][0], sources[0][1], sources[0][4]  # type: ignore[index]
    if any(s[4] != element for s in sources):  # type: ignore[index]
        return None
    if how == "forward":
        if not all(update_count(m) == 1 and _still(c.value, forward_cache(m), element)
                   for (_, _, m, _, _), (_, c) in zip(sources, present)):  # type: ignore[misc]
            return None
        value = forward_cache(root.get_submodule(path))
    else:
        if not all(0 < count == update_count(m) for _, _, m, count, _ in sources):  # type: ignore[misc]
            return None
        value = root.get_submodule(path).compute()
    if element is not None:  # one element of the value (a class's entry of a per-class value), as every replica took it
        index, shape = element
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            return None
        value = value.reshape(-1)[index]
    return value if isinstance(value, Tensor) and value.numel() == 1 else None


def _still(logged: Any, cached: Any, element: Element | None) -> bool:
    """Whether ``logged`` is still ``cached`` (the metric's last ``forward`` value), or its ``element``."""
    return cached is logged if element is None else element_of(logged, cached) == element


def _reduce_values(
    name: str,
    present: list[tuple[int, LogCall]],
    weights: Sequence[float],
    losses: Sequence[Tensor | None] | None,
    kwargs: dict[str, Any],
    device: torch.device,
    warning_cache: WarningCache,
    num_samples: int = 0,
    chunk_samples: Sequence[int] | None = None,
    chunk_points: Callable[[], Sequence[Sequence[int]]] = tuple,
    memory: LogMemory | None = None,
    said: bool = False,
) -> Tensor:
    """One logged value from the replicas' values of ``name`` (see the module docstring for the rules; ``memory``: the
    step's :class:`~lightning_sparse_dp.step.log_memory.LogMemory`, given by :func:`reduce_log_calls`, its one caller;
    ``said``: why the value is not the whole batch's was said already, so the lines guessing at a hand-made mean are
    not)."""
    assert memory is not None
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
    equal = _all_equal(values)  # read once: on a GPU each comparison waits for the device
    if is_loss:
        reduce_fx = "mean"  # the loss (or its .item()) is a weighted mean, whatever Lightning reduces it by over an epoch
    elif all(_is_integer(c.value) for _, c in present) and (
            "reduce_fx" not in kwargs or (reduce_fx in (*MEAN_NAMES, torch.mean) and (
                name in memory.counts or not equal or _chunk_counts(values, present, chunk_samples, chunk_points)))):
        if not equal:
            memory.counts.add(name)
        # a count of each chunk (log_dict passes reduce_fx="mean" for every value): the whole batch's is their sum
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
    if reduce_fx in (*MEAN_NAMES, "max", "min", torch.mean, torch.max, torch.min) and equal:
        return values[0].reshape(())  # the mean, max or min of equal values, without rounding
    if reduce_fx in (*MEAN_NAMES, torch.mean) and not is_loss:
        counts = [c.count for _, c in present]
        sizes = [c.kwargs.get("batch_size") for _, c in present]
        if all(n is not None for n in counts):  # means the step computed: weighted by their own element counts
            return _reduce(values, [float(n) for n in counts], reduce_fx)  # type: ignore[arg-type]
        per_chunk = memory.constant(name, sizes, [i for i, _ in present], num_samples, chunk_samples, chunk_points) is None
        if all(isinstance(s, numbers.Number) for s in sizes) and per_chunk:
            if not said:
                warning_cache.info(
                    f"sparse_dp: self.log({name!r}, ..., batch_size=<each chunk's count>) differs between replicas and "
                    "is not a mean the step computed with torch.mean / .mean(): it is reduced as a mean weighted by the "
                    "replicas' batch_size, the whole batch's value only for a mean over those (a hand-made correct / "
                    "len(labels) is; an F1 score, an IoU or a maximum is not). For the whole batch's value of such a "
                    "score log a torchmetrics metric (its state is merged as one device's)."
                )
            return _reduce(values, [float(s) for s in sizes], reduce_fx)  # the chunks' own batch_size= counts
        if not said and not all(_is_integer(c.value) for _, c in present):
            warning_cache.info(
                f"sparse_dp: self.log({name!r}, ...) differs between replicas and is not a mean the step computed with "
                "torch.mean / .mean() (e.g. a hand-made sum / count): it is reduced as a mean weighted by each replica's "
                "share of the loss weighting (samples or points), the whole batch's value only for a mean over those. "
                "For the whole batch's value log a torchmetrics metric, log value.mean() of the per-element values, or "
                "pass batch_size= the count it is a mean over."
            )
    return _reduce(values, w, reduce_fx)


def emit(module: Any, calls: Sequence[LogCall]) -> None:
    """Log ``calls`` through ``module.log`` (the real ``LightningModule.log``), from the calling thread."""
    for call in calls:
        module.log(call.name, call.value, **call.kwargs)


def log_step(step: StepContext, root: torch.device) -> list[LogCall]:
    """The replicas' ``self.log`` calls of the step (its recorders), reduced (stage ``log``, :func:`reduce_log_calls`;
    no ``batch_size`` given: Lightning infers it from the batch; for a batch split in workers, the size it infers from
    the collated batch, :attr:`PreSplitBatch.batch_size`), for the hub to log
    through Lightning's own ``self.log`` once (stage ``emit``, :func:`emit`), as a one-device step logs inside the step."""
    assert step.replica_state is not None and step.plan is not None and step.weights is not None
    batch = step.call.batch
    presplit = isinstance(batch, PreSplitBatch)
    if presplit and batch.batch_size is None and any(
        c.kwargs.get("batch_size") is None for rec in step.replica_state.recorders for c in rec.calls.values()
    ):
        step.call.warnings.warn(
            "sparse_dp: self.log(...) without batch_size= in a step whose batch was split in DataLoader workers "
            "without the batch size Lightning would infer from it (a PreSplitBatch of your own, without batch= or "
            f"batch_size=): it is given the batch's samples ({step.plan.num_samples}), where one device infers it from "
            "the batch (the first tensor's length: points, for coordinates first), so epoch-level means can differ "
            "from one device's. Pass batch_size= to self.log, or PreSplitBatch(..., batch_size=extract_batch_size(batch))."
        )
    with step.call.timer.stage("log"):
        return reduce_log_calls(
            step.replica_state.recorders, step.weights, step.plan.num_samples, root, step.call.module, step.losses,
            step.call.warnings,
            step.terms.log_reading if step.terms is not None else None,
            infer_batch_size=not presplit,
            batch_size=batch.batch_size if presplit else None,
            chunk_samples=[len(s) for s in step.plan.chunk_samples],
            chunk_points=lambda: step.plan.points_per_set,  # read where needed
            memory=step.call.logged,
        )


__all__ = ["emit", "log_step", "reduce_log_calls"]
