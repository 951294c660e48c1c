"""Merge: per-chunk results back into the batch's order, and a split batch back into the batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp.split.indices import merge_indices
from lightning_sparse_dp.split.leaves import leaf_predicate
from lightning_sparse_dp.split.records import Role, SparseSpec, SplitPlan


def _inverse_order(lengths: Sequence[int], order: Sequence[Tensor]) -> Tensor:
    """The inverse permutation of the concatenated ``order``, after checking each piece's length against it.

    Raises:
        ValueError: a piece's length differs from its order's.
    """
    for j, (n, o) in enumerate(zip(lengths, order, strict=True)):
        if n != o.numel():
            raise ValueError(f"chunk {j} has {n} rows but its plan has {o.numel()}.")
    ids = torch.cat(list(order))
    inverse = torch.empty_like(ids)
    inverse[ids] = torch.arange(ids.numel(), device=ids.device)
    return inverse


def merge_chunks(pieces: Sequence[Tensor], order: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate per-chunk pieces and put their rows back into the original order.

    Args:
        pieces: per chunk, a tensor ``[n_i, ...]`` (rows along ``dim``).
        order: per chunk, int64 ``[n_i]`` original row ids of its rows, e.g. ``plan.chunk_samples`` for
            per-sample results or ``plan.point_rows[0]`` for per-point results.

    Returns:
        ``[sum n_i, ...]``: row ``r`` is the piece row whose original id is ``r``, on the first piece's device
        (pieces of replicas on other GPUs are moved there).

    Raises:
        ValueError: a piece's length differs from its order's.
    """
    inverse = _inverse_order([p.shape[dim] for p in pieces], order)
    device = pieces[0].device
    merged = torch.cat([p if p.device == device else p.to(device) for p in pieces], dim=dim)
    return merged.index_select(dim, inverse.to(merged.device))


def merge_rows(pieces: Sequence[Any], order: Sequence[Tensor]) -> Any:
    """:func:`merge_chunks` for tensors, numpy arrays, lists and tuples (per-sample names, paths, ids).

    Raises:
        ValueError: a piece's length differs from its order's.
    """
    if isinstance(pieces[0], Tensor):
        return merge_chunks(pieces, order)
    inverse = _inverse_order([len(p) for p in pieces], order)
    if isinstance(pieces[0], np.ndarray):
        return np.concatenate(list(pieces))[inverse.numpy()]
    rows = [x for p in pieces for x in p]
    return type(pieces[0])(rows[r] for r in inverse.tolist())


def restore_batch_indices(coordinates: Tensor, samples: Tensor) -> Tensor:
    """Chunk coordinates (int ``[n_i, D+1]``, column 0 the chunk's batch index ``0..b_i-1``) with column 0 back to the
    whole batch's sample ids (``samples``: the chunk's, ``plan.chunk_samples[i]``); a copy."""
    out = coordinates.clone()
    out[:, 0] = samples.to(out.device)[out[:, 0].long()].to(out.dtype)
    return out


def _merge_coordinates(pieces: list[Any], i: int, plan: SplitPlan) -> Any:
    rows = plan.point_rows[plan.leaf_sources[i]]
    if isinstance(pieces[0], SparseSpec):
        feats = merge_chunks([p.features for p in pieces], rows)
        coords = merge_chunks([restore_batch_indices(p.coordinates, s) for p, s in zip(pieces, plan.chunk_samples)], rows)
        return feats, coords
    return merge_chunks([restore_batch_indices(p, s) for p, s in zip(pieces, plan.chunk_samples)], rows)


#: One merge handler per role, the inverse of :data:`~lightning_sparse_dp.split.cut.CUTS`:
#: ``handler(pieces, leaf position, plan) -> the leaf of the whole batch``.
MERGES: dict[Role, Callable[[list[Any], int, SplitPlan], Any]] = {
    Role.COORDINATES: _merge_coordinates,
    Role.POINTS: lambda pieces, i, plan: merge_chunks(pieces, plan.point_rows[plan.leaf_sources[i]]),
    Role.SAMPLES: lambda pieces, i, plan: merge_rows(pieces, plan.chunk_samples),
    Role.REPLICATE: lambda pieces, i, plan: pieces[0],
    Role.INDICES: lambda pieces, i, plan: merge_chunks(merge_indices(pieces, i, plan), plan.index_rows[i]),
}


def merge_batch(chunks: Sequence[Any], plan: SplitPlan) -> Any:
    """Undo :func:`~lightning_sparse_dp.split.split_batch`: the whole batch from its chunks (the inverse the property
    tests check).

    ``SparseSpec`` leaves come back as ``(features, coordinates)`` with the original batch indices.
    """
    flat = [pytree.tree_flatten(c, is_leaf=leaf_predicate(lambda x: isinstance(x, SparseSpec))) for c in chunks]
    spec = flat[0][1]
    merged = [MERGES[Role(role)]([f[0][i] for f in flat], i, plan) for i, role in enumerate(plan.roles)]
    return pytree.tree_unflatten(merged, spec)


__all__ = ["MERGES", "merge_batch", "merge_chunks", "merge_rows", "restore_batch_indices"]
