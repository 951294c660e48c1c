"""Gather: per-replica step outputs to the root device, as one output.

A step's loss must be the loss of the whole batch. Replica ``i`` returns the mean loss over its
chunk; with weights ``w_i = n_i / sum_j n_j`` (``n_i`` what the loss of chunk ``i`` is a mean over:
its samples, its points, or what a callable counts, e.g. its points whose label is not
``ignore_index``) the gathered loss ``sum_i w_i * loss_i`` is exactly the mean over the whole batch,
uneven chunks included (PL 1.x "dp" averaged chunks equally: Lightning issue #681). A chunk with
nothing to count (``n_i = 0``, e.g. every label ignored) has weight 0: its loss, often NaN (a mean
over nothing), is replaced by 0 and adds nothing, so it never turns the gathered loss into NaN.

Other outputs are combined leaf by leaf (:func:`gather_outputs`), by the role ``output_layout``
gives them or, failing that, by their lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_sparse_dp.split import SparseSpec, SplitPlan, leaf_predicate, merge_chunks, merge_rows

LOSS_WEIGHTINGS: tuple[str, ...] = ("auto", "samples", "points", "equal")
#: Roles for step outputs in ``output_layout`` (see :func:`gather_outputs`).
OUTPUT_ROLES: tuple[str, ...] = ("samples", "points", "sum", "mean", "cat", "list")

_warnings = WarningCache()


def check_loss_weighting(loss_weighting: Any) -> None:
    """Raise ``ValueError`` unless ``loss_weighting`` is one of :data:`LOSS_WEIGHTINGS` or a callable."""
    if not callable(loss_weighting) and loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(
            f"loss_weighting={loss_weighting!r}; use one of {LOSS_WEIGHTINGS} or a callable chunk -> number."
        )


def resolve_auto(plan: SplitPlan) -> tuple[str, str]:
    """What ``loss_weighting="auto"`` means for the batch of ``plan``: ``(weighting, reason)``.

    The rule: ``"samples"`` when the batch has a per-sample tensor (a scene label ``[B]``: a loss
    averaged over samples); else ``"points"`` when it has a per-point target (an integer tensor
    ``[N]``, or a floating-point one besides the features: a loss averaged over points, as in ME's
    segmentation examples); else ``"samples"``. Per-sample lists of names or paths do not count.
    The names come from :attr:`SplitPlan.sample_tensors` / :attr:`SplitPlan.point_targets`.
    The rule reads the batch, not the loss: a per-sample loss on a batch with per-point labels it
    does not use needs ``"samples"`` given explicitly.
    """
    if plan.sample_tensors:
        return "samples", f"the batch has per-sample tensor(s) {', '.join(plan.sample_tensors)}"
    if plan.point_targets:
        return "points", f"the batch has per-point target(s) {', '.join(plan.point_targets)} and no per-sample tensor"
    return "samples", "the batch has neither per-sample tensors nor per-point targets"


def _unbuilt(chunk: Any) -> Any:
    """A split chunk as the step would see it: a whole-batch SparseSpec becomes its source tensor."""
    return apply_to_collection(chunk, SparseSpec, lambda s: s.source if s.source is not None else s)


def _callable_count(fn: Callable[[Any], Any], chunk: Any, j: int) -> float:
    value = fn(_unbuilt(chunk))
    try:
        count = float(value.item() if isinstance(value, Tensor) else value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"loss_weighting callable returned {value!r} for chunk {j}; it must return a number (or a one-element "
            "tensor): what the chunk's loss is a mean over, e.g. (chunk['labels'] != ignore_index).sum()."
        ) from err
    if not np.isfinite(count) or count < 0:
        raise ValueError(
            f"loss_weighting callable returned {count} for chunk {j}; a count must be finite and >= 0."
        )
    return count


def chunk_counts(plan: SplitPlan, chunks: Sequence[Any], loss_weighting: str | Callable[[Any], Any]) -> list[float]:
    """The un-normalized count ``n_i`` of every chunk; the loss weights are ``n_i / sum_j n_j``.

    Args:
        plan: the split of this step (``plan.num_chunks == len(chunks)``).
        chunks: the chunks, as the replicas' steps get them (placed), or as :func:`split_batch`
            returns them (a whole-batch ``SparseSpec`` is then handed to a callable as its source
            tensor). Only a callable looks at them.
        loss_weighting: ``"samples"`` (samples per chunk), ``"points"`` (points of the first
            coordinate source), ``"equal"`` (1 each), ``"auto"`` (one of these by the rule of
            :func:`resolve_auto`), or a callable ``fn(chunk) -> number`` (a Python number or a
            one-element tensor), e.g. ``lambda c: (c["labels"] != 255).sum()`` for a
            cross-entropy with ``ignore_index=255``.

    Returns:
        ``[num_chunks]`` floats ``>= 0``.

    Raises:
        ValueError: an unknown ``loss_weighting``; a callable that returns a negative or non-finite count.
        TypeError: a callable that returns something other than a number.
    """
    check_loss_weighting(loss_weighting)
    if callable(loss_weighting):
        if len(chunks) != plan.num_chunks:
            raise ValueError(f"{len(chunks)} chunks for a plan of {plan.num_chunks}.")
        return [_callable_count(loss_weighting, c, j) for j, c in enumerate(chunks)]
    if loss_weighting == "auto":
        loss_weighting = resolve_auto(plan)[0]
    if loss_weighting == "samples":
        return [float(n) for n in plan.samples_per_chunk]
    if loss_weighting == "points":
        return [float(n) for n in plan.points_per_chunk]
    return [1.0] * plan.num_chunks


def chunk_weights(plan: SplitPlan, loss_weighting: str | Callable[[Any], Any], chunks: Sequence[Any] | None = None) -> list[float]:
    """Weights ``w_i = n_i / sum_j n_j`` of the chunks of ``plan`` (``n_i`` from :func:`chunk_counts`).

    ``"auto"`` is ``"samples"`` when the batch has a per-sample tensor, else ``"points"`` when it has
    a per-point target, else ``"samples"`` (:func:`resolve_auto`). When every count is 0 (nothing in
    the batch to count) every weight is 0.

    Args:
        plan, loss_weighting: as for :func:`chunk_counts`.
        chunks: needed for a callable ``loss_weighting``.

    Raises:
        ValueError: as :func:`chunk_counts`, or a callable ``loss_weighting`` without ``chunks``.
    """
    if callable(loss_weighting) and chunks is None:
        raise ValueError("a callable loss_weighting needs the chunks: chunk_weights(plan, fn, chunks).")
    counts = chunk_counts(plan, chunks if chunks is not None else [None] * plan.num_chunks, loss_weighting)
    total = sum(counts)
    return [c / total if total > 0 else 0.0 for c in counts]


def step_weights(
    plan: SplitPlan, chunks: Sequence[Any], loss_weighting: str | Callable[[Any], Any], infos: WarningCache | None = None
) -> list[float]:
    """:func:`chunk_weights` for a step, saying once what ``"auto"`` chose (:func:`say_auto_choice`),
    and once (warning) when the batch has nothing to count (every weight 0: the loss is 0)."""
    infos = _warnings if infos is None else infos
    weights = chunk_weights(plan, loss_weighting, chunks)
    say_auto_choice(plan, loss_weighting, infos)
    if not any(weights):
        infos.warn(
            "sparse_dp: no chunk of a batch has anything to count for the loss weighting (every count is 0, e.g. "
            "every label is ignore_index): the step's loss is 0 and its gradients are 0, where one device would "
            "give NaN."
        )
    return weights


def say_auto_choice(
    plan: SplitPlan, loss_weighting: str | Callable[[Any], Any], infos: WarningCache, strategy: str = "sparse_dp"
) -> None:
    """For ``loss_weighting="auto"``, say once (rank-zero info through ``infos``) what it chose and why."""
    if loss_weighting != "auto":
        return
    choice, reason = resolve_auto(plan)
    infos.info(
        f"{strategy}: loss_weighting='auto' weights each {'replica' if strategy == 'sparse_dp' else 'rank'}'s loss by "
        f"its {choice} ({choice!r}): {reason}. Pass loss_weighting= 'samples', 'points' or a callable chunk -> count "
        "(e.g. points whose label is not ignore_index) to the strategy to choose."
    )


def zeroed(v: Tensor) -> Tensor:
    """``0 * v`` with NaN / inf replaced first: exactly 0, still in ``v``'s graph, zero gradient."""
    return torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0) * 0.0


def weighted_sum(values: Sequence[Tensor], weights: Sequence[float], device: torch.device) -> Tensor:
    """``sum_i weights[i] * values[i]`` on ``device``, differentiable through every value.

    A value of weight 0 adds an exact 0 (its NaN or inf, e.g. a mean over no points, does not
    propagate), and stays in the graph so that every replica's backward runs.
    """
    out = None
    for v, w in zip(values, weights, strict=True):
        v = v.to(device)
        term = v * w if w != 0 else zeroed(v)
        out = term if out is None else out + term
    assert out is not None
    return out


def _lengths(values: list[Any]) -> list[int] | None:
    if all(isinstance(v, Tensor) and v.dim() > 0 for v in values):
        return [v.shape[0] for v in values]
    if all(isinstance(v, np.ndarray) and v.ndim > 0 or type(v) in (list, tuple) for v in values):
        return [len(v) for v in values]
    return None


def _point_rows(plan: SplitPlan, lengths: list[int]) -> list[Tensor] | None:
    for rows in plan.point_rows:
        if lengths == [r.numel() for r in rows]:
            return rows
    return None


def _guess_role(name: str, key: Any, values: list[Any], plan: SplitPlan, warnings: WarningCache) -> str:
    """The role of an output leaf that ``output_layout`` does not name, from its lengths; warns when unsure.

    ``name`` is the leaf's printed path (``output['hist']``), ``key`` the key to suggest for ``output_layout``.
    """
    first = values[0]
    if isinstance(first, Tensor) and first.dim() == 0:
        return "mean"
    lengths = _lengths(values)
    if lengths is None:
        return "first" if _comparable(values) else "list"
    samples = lengths == plan.samples_per_chunk
    points = _point_rows(plan, lengths) is not None
    same = plan.num_chunks > 1 and len(set(lengths)) == 1
    if samples or points:
        role = "samples" if samples else "points"
        if same:
            warnings.warn(
                f"sparse_dp: step output {name} has the same length ({lengths[0]}) in every chunk, which is also each "
                f"chunk's number of {role}: it is taken as per-{role[:-1]} rows and merged in the original order. If it "
                f"is a value of fixed size (e.g. a histogram), say how to combine it: SparseDataParallelStrategy("
                f"output_layout={{{key!r}: 'sum'}}) (roles {', '.join(OUTPUT_ROLES)}); name it "
                f"'{role}' to silence this warning."
            )
        return role
    if not isinstance(first, Tensor):
        return "first" if _comparable(values) else "list"
    if same:
        warnings.warn(
            f"sparse_dp: step output {name} has the same length ({lengths[0]}) in every chunk, matching neither the "
            "chunks' samples nor their points: it is concatenated in chunk order. If it is a value of fixed size (e.g. "
            f"a histogram), say how to combine it: SparseDataParallelStrategy(output_layout={{{key!r}: 'sum'}}) "
            f"(roles {', '.join(OUTPUT_ROLES)}); name it 'cat' to silence this warning."
        )
    return "cat"


def _gather_leaf(name: str, values: list[Any], role: str, plan: SplitPlan, weights: Sequence[float], device: torch.device) -> Any:
    tensors = [isinstance(v, Tensor) for v in values]
    if any(tensors) and not all(tensors):
        raise TypeError(
            f"step output {name}: replica(s) {[i for i, t in enumerate(tensors) if t]} returned a tensor and "
            f"replica(s) {[i for i, t in enumerate(tensors) if not t]} returned "
            f"{', '.join(sorted({type(v).__name__ for v in values if not isinstance(v, Tensor)}))}; every replica's "
            "step must return the same kind of value."
        )
    on_device = [v.to(device) for v in values] if all(tensors) else values
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
            return torch.cat(on_device)
        if isinstance(values[0], np.ndarray):
            return np.concatenate(values)
        return type(values[0])(x for v in values for x in v)
    lengths = _lengths(values)
    if role == "samples":
        if lengths != plan.samples_per_chunk:
            raise ValueError(
                f"output_layout gives step output {name} the role 'samples' but its lengths {lengths} are not the "
                f"chunks' numbers of samples {plan.samples_per_chunk}."
            )
        return merge_rows(on_device, plan.chunk_samples)
    rows = _point_rows(plan, lengths) if lengths is not None else None
    if rows is None:
        raise ValueError(
            f"output_layout gives step output {name} the role 'points' but its lengths {lengths} are not the chunks' "
            f"numbers of points {plan.points_per_chunk}."
        )
    return merge_chunks(on_device, rows) if all(tensors) else merge_rows(values, rows)


def _comparable(values: list[Any]) -> bool:
    try:
        return all(bool(v == values[0]) for v in values[1:])
    except Exception:
        return False


def _output_key(path: Sequence[Any]) -> Any:
    """The innermost dict key / index of an output leaf, else its printed path."""
    last = path[-1] if path else None
    key = next((getattr(last, a) for a in ("key", "idx", "name") if hasattr(last, a)), None)
    return _output_name(path) if key is None else key


def _output_role(path: Sequence[Any], output_layout: Mapping[Any, str] | None) -> str | None:
    if not output_layout:
        return None
    for candidate in (_output_name(path), _output_key(path)):
        if candidate is not None and candidate in output_layout:
            role = output_layout[candidate]
            if role not in OUTPUT_ROLES:
                raise ValueError(f"output_layout[{candidate!r}] = {role!r}; use one of {OUTPUT_ROLES}.")
            return role
    return None


def _output_name(path: Sequence[Any]) -> str:
    return "output" + "".join(str(k) for k in path)


def _check_none(outputs: Sequence[Any]) -> None:
    nones = [i for i, o in enumerate(outputs) if o is None]
    if nones and len(nones) < len(outputs):
        others = [i for i in range(len(outputs)) if i not in nones]
        raise ValueError(
            f"replica(s) {nones} returned None from the step and replica(s) {others} returned an output. On one "
            "device, a training_step that returns None skips the whole step; with sparse_dp each replica sees only "
            "its chunk, so they must agree: the step is skipped only when every replica returns None. Decide on the "
            "whole batch (e.g. in on_before_batch_transfer), or return a loss in every chunk: for a chunk with nothing "
            "to learn from, a loss of 0 that is still in the graph, or give it weight 0 with "
            "SparseDataParallelStrategy(loss_weighting=fn)."
        )


def gather_outputs(
    outputs: Sequence[Any],
    plan: SplitPlan,
    weights: Sequence[float],
    device: torch.device,
    output_layout: Mapping[Any, str] | None = None,
    warnings: WarningCache | None = None,
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
    - ``"list"``: the list of the replicas' values, in chunk order.

    A leaf it does not name is combined by these rules: a 0-dim tensor (a loss, a metric) is a
    ``"mean"``; a tensor or list whose lengths are the chunks' numbers of samples is ``"samples"``,
    else of points ``"points"``; other tensors are ``"cat"``; equal non-tensors give the value,
    differing ones the list. When every chunk gives the same length (a fixed leading dimension that
    may or may not be per-sample), a warning says which rule was taken and how to name the role.
    ``None`` from every replica gives ``None``. Warnings go through ``warnings`` (each once).

    Raises:
        ValueError: some replicas returned ``None`` and others an output (the message says what
            skipping a step means with replicas); outputs of different structure; an unknown role,
            or a role whose lengths do not fit.
        TypeError: a leaf that is a tensor in some replicas and not in others.
    """
    if all(o is None for o in outputs):
        return None
    _check_none(outputs)
    flat = [pytree.tree_flatten_with_path(o, is_leaf=leaf_predicate()) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(
                f"replica {i} returned an output of another structure than replica 0 ({s} vs {spec}); every replica's "
                "step must return the same kind of output."
            )
    leaves = []
    for n, (path, _) in enumerate(flat[0][0]):
        values = [f[0][n][1] for f in flat]
        name = _output_name(path)
        cache = _warnings if warnings is None else warnings
        role = _output_role(path, output_layout) or _guess_role(name, _output_key(path), values, plan, cache)
        leaves.append(_gather_leaf(name, values, role, plan, weights, device))
    return pytree.tree_unflatten(leaves, spec)


def step_losses(outputs: Sequence[Any]) -> list[Tensor | None]:
    """The loss of each replica's output: the output itself when a tensor, else its ``"loss"`` entry."""
    losses = []
    for o in outputs:
        if isinstance(o, Mapping):
            o = o.get("loss")
        losses.append(o if isinstance(o, Tensor) else None)
    return losses


__all__ = [
    "LOSS_WEIGHTINGS",
    "OUTPUT_ROLES",
    "check_loss_weighting",
    "chunk_counts",
    "chunk_weights",
    "gather_outputs",
    "resolve_auto",
    "step_losses",
    "step_weights",
    "weighted_sum",
    "zeroed",
]
