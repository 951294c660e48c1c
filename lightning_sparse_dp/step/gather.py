"""Gather: the replicas' step outputs combined on the root device into the output one device returns.

Leaf by leaf (:func:`gather_outputs`): a loss or metric (0-dim) is the weighted mean
(:func:`~lightning_sparse_dp.loss.weights.weighted_sum`), per-sample and per-point rows are merged back into the batch's
order, other tensors concatenated; ``output_layout`` names a role (:data:`OUTPUT_ROLES`) where lengths cannot tell.
Per-sample sequences (a list or tuple with one entry per sample of the replica's chunk, as
``SparseTensor.decomposed_features`` returns, or a list of ``(coordinates, features)`` pairs) are concatenated in sample
order into the length-``B`` sequence one device returns (:func:`per_sample_nodes`). Coordinates among the outputs
(``x.C``, ``batch["coordinates"]``) get the batch's sample ids back in column 0
(:func:`~lightning_sparse_dp.split.merge.coordinates_back`), and ``ME.SparseTensor`` outputs become one SparseTensor of
the batch (:func:`merge_sparse`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_sparse_dp.loss.weights import weighted_sum
from lightning_sparse_dp.runtime.me import ME
from lightning_sparse_dp.runtime.process import SAID_ONCE as _warning_cache
from lightning_sparse_dp.split import SparseSpec, SplitPlan, merge_chunks, merge_rows
from lightning_sparse_dp.split.leaves import key_of, leaf_predicate
from lightning_sparse_dp.split.merge import coordinates_back, point_sources, points_back
from lightning_sparse_dp.step.output_roles import (
    comparable,
    guess_role,
    lengths_of,
    output_key,
    output_role,
    per_sample_nodes,
    printed,
)
from lightning_sparse_dp.step.returned import merged_entry, returned_entries
from lightning_sparse_dp.step.scatter import build_sparse
from lightning_sparse_dp.step.skipped import SKIPPED_STEP_HELP


def merge_sparse(values: list[Any], plan: SplitPlan, device: torch.device) -> Any:
    """The replicas' ``ME.SparseTensor`` outputs (a predict step's ``return self(x)``) as one SparseTensor of the whole
    batch on ``device``, as one device returns it (``ME.TensorField`` outputs, ``out.slice(field)``, as one TensorField
    likewise); ``None`` where their rows cannot be placed (tensor strides that
    differ, coordinates that are not their chunks', see :func:`coordinates_back`).

    Its coordinates carry the batch's sample ids in column 0; its rows are in the batch's point order where each
    chunk's are its points (a stride-1 tensor of the input's coordinates: one device's rows), in sample order where
    one per sample (after global pooling), else in chunk order (a strided or generated tensor: the same rows as one
    device's, in another order, ME's being its coordinate map's). Built by
    :func:`~lightning_sparse_dp.step.scatter.build_sparse` (a coordinate manager of its own on ``device``, with the
    replicas' ``tensor_stride``); features keep their autograd graph.
    """
    cls = type(values[0])
    strides = {tuple(v.tensor_stride) for v in values} if cls is ME.SparseTensor else {()}
    if len(strides) != 1 or any(type(v) is not cls for v in values):
        return None
    coordinates, features = [v.C for v in values], [v.F for v in values]
    lengths = [c.shape[0] for c in coordinates]
    source, restored = points_back(coordinates, plan, point_sources(plan, lengths))  # the set their batch column counts
    if source is not None:
        merged = [merge_chunks(restored, plan.point_rows[source]), merge_chunks(features, plan.point_rows[source])]
    elif lengths == plan.samples_per_chunk:
        restored = coordinates_back(coordinates, plan, "samples")
        merged = [merge_chunks(restored, plan.chunk_samples), merge_chunks(features, plan.chunk_samples)]
    else:
        restored = coordinates_back(coordinates, plan, "cat", known=True)  # a sample may have no rows left (pruned)
        first = features[0].device
        merged = [torch.cat([c.to(first) for c in restored]), torch.cat([f.to(first) for f in features])]
    if restored is coordinates:
        return None
    stride = {"tensor_stride": list(strides.pop())} if cls is ME.SparseTensor else {}
    spec = SparseSpec(cls=cls, features=merged[1], coordinates=merged[0], kwargs=stride)
    return build_sparse(spec, device)


def _gather_leaf(
    path: Sequence[Any], values: list[Any], role: str, plan: SplitPlan, weights: Sequence[float], device: torch.device
) -> Any:
    if role == "sequence":  # one entry per sample: the chunks' entries in sample order, on the root device
        moved = [apply_to_collection(v, Tensor, lambda t: t.to(device)) for v in values]
        return merge_rows(moved, plan.chunk_samples)
    if role not in ("list", "first") and any(type(v) in (ME.SparseTensor, ME.TensorField) for v in values):
        raise ValueError(
            f"step output {printed(path)} is an ME {type(values[0]).__name__}, which the role {role!r} cannot combine. "
            "Without an output_layout entry the replicas' tensors come back as one of the whole batch (its rows in the "
            f"batch's order); 'list' gives the replicas' tensors; or return its .F / .C to combine them as tensors."
        )
    tensors = [isinstance(v, Tensor) for v in values]
    if any(tensors) and not all(tensors):
        raise TypeError(
            f"step output {printed(path)}: replica(s) {[i for i, t in enumerate(tensors) if t]} returned a tensor and "
            f"replica(s) {[i for i, t in enumerate(tensors) if not t]} returned "
            f"{', '.join(sorted({type(v).__name__ for v in values if not isinstance(v, Tensor)}))}; every replica's "
            "step must return the same kind of value."
        )
    on_device = [v.to(device) for v in values] if all(tensors) else values
    if role in ("samples", "points", "cat") and all(tensors) and len({v.shape[1:] for v in values}) > 1:
        shapes = ', '.join(str(tuple(v.shape)) for v in values)
        if all(v.dim() == 2 and v.shape[0] == v.shape[1] == n for v, n in zip(values, plan.samples_per_chunk)):
            raise ValueError(  # [b, b]: between the chunk's samples (a similarity), which no merge makes the batch's
                f"step output {printed(path)} is a [samples, samples] matrix of each replica's chunk ({shapes}): "
                "one device's step returns it between every two samples of the whole batch (a similarity, a distance "
                "matrix), which the chunks' do not hold. Return what it is computed from per sample (the embeddings) "
                "and compute it in on_*_batch_end(outputs, batch, batch_idx), which gets the gathered outputs."
            )
        raise ValueError(
            f"step output {printed(path)} has rows of different shapes in the replicas' chunks "
            f"({shapes}): one device's step returns one tensor of the whole "
            "batch's shape, which no merge of the chunks' gives (x.dense() sizes its grid by the chunk's coordinates). "
            "Give it a fixed shape (x.dense(shape=..., min_coordinate=...)), or name its role 'list' to get the "
            f"replicas' tensors: SparseDataParallelStrategy(output_layout={{{output_key(path)!r}: 'list'}})."
        )
    if role == "first":
        return values[0]
    if role == "list":
        return list(on_device)
    if role == "mean":
        if not all(tensors):
            total = sum(w for w in weights)
            return sum(w * v for w, v in zip(weights, values) if w != 0) / total if total else 0.0
        return weighted_sum(on_device, weights, device)
    if role == "sum":
        out = on_device[0]
        for v in on_device[1:]:
            out = out + v
        return out
    if role == "cat":
        if all(tensors):
            return torch.cat(coordinates_back(on_device, plan, "cat"))
        if isinstance(values[0], np.ndarray):
            return np.concatenate(values)
        return type(values[0])(x for v in values for x in v)
    lengths = lengths_of(values)
    if role == "samples":
        if lengths != plan.samples_per_chunk:
            raise ValueError(
                f"output_layout gives step output {printed(path)} the role 'samples' but its lengths {lengths} are not the "
                f"chunks' numbers of samples {plan.samples_per_chunk}."
            )
        return merge_rows(coordinates_back(on_device, plan, "samples") if all(tensors) else on_device, plan.chunk_samples)
    found = point_sources(plan, lengths) if lengths is not None else []
    source, restored = points_back(on_device, plan, found) if all(tensors) else (found[0] if found else None, on_device)
    if source is None:
        raise ValueError(
            f"output_layout gives step output {printed(path)} the role 'points' but its lengths {lengths} are not the chunks' "
            f"numbers of points {plan.points_per_chunk}."
        )
    rows = plan.point_rows[source]
    return merge_chunks(restored, rows) if all(tensors) else merge_rows(values, rows)


def _check_none(outputs: Sequence[Any]) -> None:
    nones = [i for i, o in enumerate(outputs) if o is None]
    if nones and len(nones) < len(outputs):
        others = [i for i in range(len(outputs)) if i not in nones]
        err = ValueError(
            f"replica(s) {nones} returned None and replica(s) {others} an output; a step is skipped only when every "
            f"replica returns None. {SKIPPED_STEP_HELP}"
        )
        raise err


def gather_outputs(
    outputs: Sequence[Any],
    plan: SplitPlan,
    weights: Sequence[float],
    device: torch.device,
    output_layout: Mapping[Any, str] | None = None,
    warning_cache: WarningCache | None = None,
    say_lists: bool = True,
    value_of: Callable[[list[Tensor]], Tensor | None] | None = None,
    exact_loss: bool = True,
    inputs: Sequence[Any] | None = None,
    layout: Mapping[Any, str] | None = None,
) -> Any:
    """One step output from the replicas' outputs.

    Leaf by leaf over the outputs' common structure (a tensor, or dict / list / tuple of them,
    e.g. ``{"loss": ..., "preds": ...}``; a list / tuple of non-tensors under a dict key, e.g. scene
    names, is one leaf). A leaf is combined by the role ``output_layout`` gives it (by dict key,
    index, or path name such as ``"output['hist']"``):

    - ``"mean"``: ``sum_i w_i * x_i`` on ``device`` (gradients flow; weight-0 chunks add 0);
    - ``"sum"``: ``sum_i x_i`` (e.g. a histogram or a count over the chunk);
    - ``"samples"`` / ``"points"``: per-sample / per-point rows, merged in the original order;
    - ``"cat"``: concatenated along dim 0 in chunk order;
    - ``"list"``: the list of the replicas' values, in chunk order; ``"first"``: the root replica's value (a constant);
    - ``"fixed"`` (a list / tuple): a fixed structure, combined entry by entry, never per-sample.

    First, lists and tuples with one entry per sample of their chunk (:func:`per_sample_nodes` gives the
    rule: lengths equal to the chunks' numbers of samples, entries alike) are concatenated in sample
    order into the length-``B`` sequence one device returns, entries moved to ``device`` and otherwise
    untouched: ``SparseTensor.decomposed_features`` / ``decomposed_coordinates``, a list of
    ``(coordinates, features)`` pairs, per-sample dicts, tensors of any (variable) shape.

    A leaf it does not name is combined by these rules: an ``ME.SparseTensor`` is one SparseTensor of the batch
    (:func:`merge_sparse`; the list of the replicas' otherwise, said); a 0-dim tensor (a loss, a metric) is a
    ``"mean"``; a tensor or list whose lengths are the chunks' numbers of samples is ``"samples"``,
    else of points ``"points"``; other tensors are ``"cat"``; equal non-tensors give the value,
    differing ones the list (said once, unless not ``say_lists``: a caller with its own word for it). When
    every chunk gives the same length (a fixed leading dimension that may or may not be per-sample), a
    warning says which rule was taken and how to name the role.
    ``None`` from every replica gives ``None``. Warnings go through ``warning_cache`` (each once).

    ``value_of`` (the step's :meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`, under
    ``loss_weighting="terms"``): the whole batch's value of a 0-dim floating-point leaf other than the loss whose
    replicas' values differ, where it is a combination of the step's captured losses or a mean each replica computed
    (an accuracy written with ``.mean()``), else ``None``. Such a leaf is that value (its gradient the weighted
    mean's); one it cannot tell is the weighted mean, said once (as ``self.log`` says a value it cannot reduce as one
    device's). ``exact_loss``: the outputs' loss (a bare tensor, or the ``"loss"`` key) is the step's own, made the
    whole batch's before (:meth:`~lightning_sparse_dp.loss.step.StepTerms.exact_outputs`), so ``value_of`` skips it;
    ``False`` for values that are not the step's output (what a step appended to a list of the module), whose
    ``"loss"`` is a leaf like any other.

    ``inputs`` (the replicas' chunks, made) and ``layout`` (the split's): a leaf that is, in every replica, its
    chunk's tensor at one place of the batch (an entry the step returns) is merged by the role the split cut that
    place by (:mod:`~lightning_sparse_dp.step.returned`), unless ``output_layout`` names its role.

    Raises:
        ValueError: some replicas returned ``None`` and others an output (the message says what
            skipping a step means with replicas); outputs of different structure; an unknown role,
            or a role whose lengths do not fit.
        TypeError: a leaf that is a tensor in some replicas and not in others.
    """
    if all(o is None for o in outputs):
        return None
    _check_none(outputs)
    cache = _warning_cache if warning_cache is None else warning_cache
    combine = partial(
        _combine, plan=plan, weights=weights, device=device, output_layout=output_layout, cache=cache, say_lists=say_lists,
        value_of=value_of, exact_loss=exact_loss,
    )
    if all(type(o) is Tensor for o in outputs):  # a bare loss (the common step): one leaf, path (), no walk
        return combine((), list(outputs), False)
    sequences = per_sample_nodes(outputs, plan, output_layout, cache)
    is_leaf = leaf_predicate(lambda x: id(x) in sequences)
    flat = [pytree.tree_flatten_with_path(o, is_leaf=is_leaf) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(
                f"replica {i} returned an output of another structure than replica 0 ({s} vs {spec}); every replica's "
                "step must return the same kind of output."
            )
    places = returned_entries(inputs, plan, layout) if inputs is not None and plan.roles else None
    leaves = []
    for n, (path, _) in enumerate(flat[0][0]):
        values = [f[0][n][1] for f in flat]
        entry = None
        if places is not None and output_role(path, output_layout) is None:
            entry = merged_entry(values, places, plan)
        leaves.append(combine(path, values, id(values[0]) in sequences) if entry is None else entry.to(device))
    return pytree.tree_unflatten(leaves, spec)


def _combine(
    path: Sequence[Any], values: list[Any], sequence: bool, *, plan: SplitPlan, weights: Sequence[float],
    device: torch.device, output_layout: Mapping[Any, str] | None, cache: WarningCache, say_lists: bool = True,
    value_of: Callable[[list[Tensor]], Tensor | None] | None = None, exact_loss: bool = True,
) -> Any:
    """One output leaf from the replicas' ``values`` at ``path``: by its role (a per-sample ``sequence``, else
    ``output_layout``'s, else :func:`guess_role`'s), :func:`_gather_leaf`; a 0-dim value other than the loss (with
    ``exact_loss``) as :func:`gather_outputs` says for ``value_of``."""
    role = "sequence" if sequence else output_role(path, output_layout)
    if role is None and all(type(v) in (ME.SparseTensor, ME.TensorField) for v in values):
        merged = merge_sparse(values, plan, device)
        if merged is not None:
            return merged
    guessed = role in (None, "fixed")
    if guessed:
        role = guess_role(path, values, plan, cache, say_lists)
    merged = _gather_leaf(path, values, role, plan, weights, device)
    the_loss = exact_loss and (not path or key_of(path) == "loss")  # made the whole batch's already
    if guessed and role == "mean" and value_of is not None and not the_loss and merged.is_floating_point():
        if not comparable(values):
            value = value_of(values)
            if value is not None:  # the whole batch's value, the weighted mean's gradient (none from a chunk whose
                value = value.to(merged)  # mean is over nothing, NaN: the batch's value without it)
                return torch.where(torch.isnan(merged), value, merged + (value - merged).detach())
            cache.warn(
                f"sparse_dp: step output {printed(path)} differs between the replicas and is not a combination of the means the "
                "step computed with torch.mean / .mean() or torch's losses (e.g. a maximum, a hand-made ratio): it is "
                "the replicas' values weighted as the loss, which is one device's only for a mean over what the loss "
                f"averages. Log it with self.log, return what it is made of, or name its role: "
                f"SparseDataParallelStrategy(output_layout={{{output_key(path)!r}: 'sum'}}) adds the replicas' values "
                "(a float sum over the chunk's rows: y.double().sum()), 'mean' takes the weighted mean; either silences "
                "this warning."
            )
    return merged


__all__ = ["gather_outputs", "merge_sparse"]
