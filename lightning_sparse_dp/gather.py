"""Gather: per-replica step outputs to the root device, as one output.

A step's loss must be the loss of the whole batch. Replica ``i`` returns the mean loss over its
chunk; with weights ``w_i = n_i / sum_j n_j`` (``n_i`` samples, or points, of chunk ``i``) the
gathered loss ``sum_i w_i * loss_i`` is exactly the mean over the whole batch, uneven chunks
included (PL 1.x "dp" averaged chunks equally: Lightning issue #681).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp.split import SplitPlan, merge_chunks

LossWeighting = Literal["samples", "points", "equal"]
LOSS_WEIGHTINGS: tuple[str, ...] = ("samples", "points", "equal")


def chunk_weights(plan: SplitPlan, loss_weighting: str) -> list[float]:
    """Weights ``w_i`` (summing to 1) of the chunks of ``plan``.

    Args:
        plan: the split of this step.
        loss_weighting: ``"samples"`` (``n_i`` = samples in chunk ``i``; exact for a per-sample mean
            loss), ``"points"`` (``n_i`` = points of the first coordinate source; exact for a
            per-point mean loss) or ``"equal"`` (``1/k``, what ``nn.DataParallel`` users average by).

    Raises:
        ValueError: an unknown ``loss_weighting``.
    """
    if loss_weighting == "samples":
        counts = plan.samples_per_chunk
    elif loss_weighting == "points":
        counts = plan.points_per_chunk
    elif loss_weighting == "equal":
        counts = [1] * plan.num_chunks
    else:
        raise ValueError(f"loss_weighting={loss_weighting!r}; use one of {LOSS_WEIGHTINGS}.")
    total = float(sum(counts))
    return [c / total for c in counts]


def weighted_sum(values: Sequence[Tensor], weights: Sequence[float], device: torch.device) -> Tensor:
    """``sum_i weights[i] * values[i]`` on ``device``, differentiable through every value."""
    out = None
    for v, w in zip(values, weights, strict=True):
        term = v.to(device) * w
        out = term if out is None else out + term
    assert out is not None
    return out


def _gather_leaf(values: list[Any], plan: SplitPlan, weights: Sequence[float], device: torch.device) -> Any:
    first = values[0]
    if not isinstance(first, Tensor):
        return first if _comparable(values) else values
    if not all(isinstance(v, Tensor) for v in values):
        raise TypeError("replicas returned a tensor in some chunks and a non-tensor in others for the same output.")
    if first.dim() == 0:
        return weighted_sum(values, weights, device)
    lengths = [v.shape[0] for v in values]
    if lengths == plan.samples_per_chunk:
        return merge_chunks([v.to(device) for v in values], plan.chunk_samples)
    for rows in plan.point_rows:
        if lengths == [r.numel() for r in rows]:
            return merge_chunks([v.to(device) for v in values], rows)
    return torch.cat([v.to(device) for v in values])


def _comparable(values: list[Any]) -> bool:
    try:
        return all(bool(v == values[0]) for v in values[1:])
    except Exception:
        return False


def gather_outputs(outputs: Sequence[Any], plan: SplitPlan, weights: Sequence[float], device: torch.device) -> Any:
    """One step output from the replicas' outputs.

    Leaf by leaf over the outputs' common structure (a tensor, or dict / list / tuple of them,
    e.g. ``{"loss": ..., "preds": ...}``):

    - 0-dim tensors (losses, metrics): ``sum_i w_i * x_i`` on ``device`` (gradients flow);
    - tensors ``[b_i, ...]`` per sample: concatenated in the original sample order;
    - tensors ``[n_i, ...]`` per point: concatenated in the original point order;
    - other tensors: concatenated along dim 0 in chunk order;
    - equal non-tensors: the value; differing non-tensors: the list of them, in chunk order;
    - ``None`` from every replica: ``None``.

    Raises:
        ValueError: replicas returned outputs of different structure (e.g. one returned ``None``).
    """
    if all(o is None for o in outputs):
        return None
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for i, (_, s) in enumerate(flat[1:], start=1):
        if s != spec:
            raise ValueError(
                f"replica {i} returned an output of another structure than replica 0 ({s} vs {spec}); every replica's "
                "step must return the same kind of output."
            )
    leaves = [_gather_leaf([f[0][n] for f in flat], plan, weights, device) for n in range(len(flat[0][0]))]
    return pytree.tree_unflatten(leaves, spec)


__all__ = ["LOSS_WEIGHTINGS", "chunk_weights", "gather_outputs", "weighted_sum"]
