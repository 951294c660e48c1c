"""Loss weighting: the weights ``w_i`` that make the replicas' losses one loss, the whole batch's.

A step's loss must be the loss of the whole batch. Replica ``i`` returns the mean loss over its
chunk; with weights ``w_i = n_i / sum_j n_j`` (``n_i`` what the loss of chunk ``i`` is a mean over:
its samples, its points, or what a callable counts, e.g. its points whose label is not
``ignore_index``) the gathered loss ``sum_i w_i * loss_i`` is exactly the mean over the whole batch,
uneven chunks included (PL 1.x "dp" averaged chunks equally: Lightning issue #681). A chunk with
nothing to count (``n_i = 0``, e.g. every label ignored) has weight 0: its loss, often NaN (a mean
over nothing), is replaced by 0 and adds nothing, so it never turns the gathered loss into NaN.

The default, ``"terms"``, weights each of torch's mean-reduced losses the step calls by its own
share instead (:mod:`lightning_sparse_dp.loss.decide`); the per-replica weights here are then those of
``"auto"``, used for the other outputs and logged values, and for the loss when the step's loss is not
a combination of such terms.

The gather (:func:`lightning_sparse_dp.step.gather.gather_outputs`) sums the losses with these weights
(:func:`weighted_sum`) and merges the other outputs; ``sparse_ddp`` scales each rank's loss by the
same counts (:mod:`lightning_sparse_dp.strategies.sparse_ddp`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_sparse_dp.runtime.process import SAID_ONCE as _warning_cache
from lightning_sparse_dp.split import SparseSpec, SplitPlan

#: ``loss_weighting`` names; ``"terms"`` is the default (:mod:`lightning_sparse_dp.loss.decide`).
LOSS_WEIGHTINGS: tuple[str, ...] = ("terms", "auto", "samples", "points", "equal")
#: the warning of a batch with nothing to count (every weight 0), said once
NOTHING_TO_COUNT = (
    "sparse_dp: no chunk of a batch has anything to count for the loss weighting (every count is 0, e.g. every label "
    "is ignore_index): the step's loss is 0 and its gradients are 0, where one device would give NaN."
)


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


def counting_example(plan: SplitPlan, ignore_index: int = 255) -> str:
    """A ``loss_weighting`` callable for the batch of ``plan``, as a message suggests it: counting the labeled entries
    of its first per-point target, else of its first per-sample tensor, reached as the chunk holds it (``chunk[1]`` in
    a tuple batch, ``chunk['labels']`` in a dict); ``chunk['labels']`` where the batch names neither."""
    names = plan.point_targets or plan.sample_tensors
    target = names[0].replace("batch", "chunk", 1) if names and names[0].startswith("batch") else "chunk['labels']"
    return f"lambda chunk: ({target} != {ignore_index}).sum()"


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
            coordinate source), ``"equal"`` (1 each), ``"auto"`` and ``"terms"`` (one of these by the
            rule of :func:`resolve_auto`; ``"terms"`` weights captured losses term by term on top), or a callable
            ``fn(chunk) -> number`` (a Python number or a
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
    return _named_counts(plan, resolve_auto(plan)[0] if loss_weighting in ("auto", "terms") else loss_weighting)


def _named_counts(plan: SplitPlan, kind: str) -> list[float]:
    """The counts of a named weighting once ``"auto"`` / ``"terms"`` is resolved: ``"samples"``, ``"points"`` or
    ``"equal"``."""
    if kind == "samples":
        return [float(n) for n in plan.samples_per_chunk]
    if kind == "points":
        return [float(n) for n in plan.points_per_chunk]
    return [1.0] * plan.num_chunks


def chunk_weights(
    plan: SplitPlan, loss_weighting: str | Callable[[Any], Any], chunks: Sequence[Any] | None = None
) -> list[float]:
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
    return _shares(chunk_counts(plan, chunks if chunks is not None else [None] * plan.num_chunks, loss_weighting))


def _shares(counts: Sequence[float]) -> list[float]:
    """``n_i / sum_j n_j`` of each count; every share 0 when the counts sum to 0."""
    total = sum(counts)
    return [c / total if total > 0 else 0.0 for c in counts]


def _said_empty(weights: list[float], warning_cache: WarningCache) -> list[float]:
    """``weights``, said once (:data:`NOTHING_TO_COUNT`) when every one is 0."""
    if not any(weights):
        warning_cache.warn(NOTHING_TO_COUNT)
    return weights


def step_weights(
    plan: SplitPlan,
    chunks: Sequence[Any],
    loss_weighting: str | Callable[[Any], Any],
    warning_cache: WarningCache | None = None,
) -> list[float]:
    """:func:`chunk_weights` for a step, saying once what ``"auto"`` chose (:func:`say_auto_choice`),
    and once (warning) when the batch has nothing to count (every weight 0: the loss is 0)."""
    warning_cache = _warning_cache if warning_cache is None else warning_cache
    weights = chunk_weights(plan, loss_weighting, chunks)
    say_auto_choice(plan, loss_weighting, warning_cache)
    return _said_empty(weights, warning_cache)


class HeldWeighting:
    """A strategy's named ``loss_weighting`` (``"terms"``, ``"samples"``, ``"points"``, ``"equal"``) checked
    (:func:`check_loss_weighting`) and resolved (:func:`resolve_auto` for ``"terms"``) once, and reused while it holds:
    the same ``loss_weighting`` object and a batch with the same per-sample tensors and per-point targets (what the
    resolution reads). Else, and for ``"auto"`` (which says its choice) and a callable (which counts each chunk),
    :func:`step_weights` derives the weights in full.
    """

    def __init__(self) -> None:
        self._held: tuple[Any, tuple[str, ...], tuple[str, ...], str] | None = None  # (weighting, names..., kind)

    def step_weights(
        self, plan: SplitPlan, chunks: Sequence[Any], loss_weighting: str | Callable[[Any], Any],
        warning_cache: WarningCache,
    ) -> list[float]:
        """As :func:`step_weights` (the same weights, warning and errors), ``[plan.num_chunks]`` floats.

        Raises:
            ValueError, TypeError: as :func:`chunk_counts` (an unknown ``loss_weighting``, a callable's bad count).
        """
        held = self._held
        if held is None or held[0] is not loss_weighting or held[1] != plan.sample_tensors or held[2] != plan.point_targets:
            if callable(loss_weighting) or loss_weighting == "auto" or loss_weighting not in LOSS_WEIGHTINGS:
                return step_weights(plan, chunks, loss_weighting, warning_cache)  # raises for an unknown one
            kind = resolve_auto(plan)[0] if loss_weighting == "terms" else loss_weighting
            held = self._held = (loss_weighting, plan.sample_tensors, plan.point_targets, kind)
        return _said_empty(_shares(_named_counts(plan, held[3])), warning_cache)


def say_auto_choice(
    plan: SplitPlan,
    loss_weighting: str | Callable[[Any], Any],
    warning_cache: WarningCache,
    strategy: str = "sparse_dp",
) -> None:
    """For ``loss_weighting="auto"``, say once (rank-zero info through ``warning_cache``) what it chose and why."""
    if loss_weighting != "auto":
        return
    choice, reason = resolve_auto(plan)
    warning_cache.info(
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


__all__ = [
    "HeldWeighting",
    "LOSS_WEIGHTINGS",
    "NOTHING_TO_COUNT",
    "check_loss_weighting",
    "chunk_counts",
    "chunk_weights",
    "resolve_auto",
    "say_auto_choice",
    "step_weights",
    "weighted_sum",
    "zeroed",
]
