"""Merge: per-chunk results back into the batch's order, and a split batch back into the batch.

For the gather of step outputs and the merge of metric states: :func:`row_order` tells which of the batch's rows
per-chunk rows of given lengths are (the chunks' samples, else the points of a coordinate source with those points per
chunk), and :func:`coordinates_back` gives coordinates that a step returned (``x.C``) the batch's sample ids back in
column 0.
"""

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


def point_source(plan: SplitPlan, lengths: list[int]) -> int | None:
    """The first coordinate source whose points per chunk are ``lengths`` (one per chunk), or ``None``: which
    ``plan.point_rows`` put rows of those lengths back in batch order."""
    found = point_sources(plan, lengths)
    return found[0] if found else None


def point_sources(plan: SplitPlan, lengths: list[int]) -> list[int]:
    """Every coordinate source whose points per chunk are ``lengths``, less those that put rows back in the order of
    one listed before (equal ``plan.point_rows``): more than one where several point sets have as many points in
    every chunk but other rows (a registration pair whose scans' sizes differ by sample and add up alike)."""
    found: list[int] = []
    for source, rows in enumerate(plan.point_rows):
        if lengths == [r.numel() for r in rows] and not any(
            all(torch.equal(a, b) for a, b in zip(plan.point_rows[f], rows)) for f in found
        ):
            found.append(source)
    return found


def coordinates_back(values: list[Tensor], plan: SplitPlan, rows: str, source: int = 0, known: bool = False) -> list[Tensor]:
    """The replicas' tensor outputs with the batch's sample ids in column 0 where they are coordinates of their chunks;
    ``values`` as they are otherwise.

    A step that returns coordinates (``x.C``, ``batch["coordinates"]``) returns its chunk's, whose column 0 counts the
    chunk's samples ``0..b_i-1``; one device returns the batch's ``0..B-1``. Taken as coordinates: int32, int64 or
    floating ``[m_i, D+1]`` tensors (ME's ``.C``, ``x.C.long()``, a TensorField's ``.C`` with its integral batch
    column; ``D+1`` the columns of a coordinate source of the batch,
    ``plan.coordinate_columns``, so that an int32 ``(prediction, label)`` pair is not) whose column 0 holds, in every
    chunk, each of the chunk's ``b_i`` samples as many times as ``rows`` says: ``"points"``, its points in coordinate
    source ``source`` (``plan.sample_points``: a stride-1 tensor's ``.C``, the batch's coordinates); ``"samples"``,
    once (a globally pooled tensor's ``.C``); ``"cat"``, at least once (a strided tensor's ``.C``, concatenated in
    chunk order, each row still beside its features). Mapped through ``plan.chunk_samples[i]``
    (:func:`~lightning_sparse_dp.split.merge.restore_batch_indices`). A per-point integer vector that is the batch
    column alone (``x.C[:, 0]``) is mapped too where it holds the chunk's points' ids as the chunk orders them.
    ``known``: the values are an ME tensor's ``.C`` (coordinates by construction), so ``"cat"`` takes them with any
    sample missing too (a pruned tensor with no rows left of a sample, or of a whole chunk), their column 0 in
    ``0..b_i-1``.
    """
    widths = set(plan.coordinate_columns) if rows != "points" else set(plan.coordinate_columns[source : source + 1])
    if len(values) != len(plan.chunk_samples):
        return values
    if rows == "points" and (source >= len(plan.sample_points) or plan.sample_points[source].numel() == 0):
        return values
    if all(v.dim() == 1 and v.dtype in _INTEGERS for v in values):  # x.C[:, 0]: the batch column alone
        return _batch_columns_back(values, plan, rows, source)
    if all(v.dim() == 2 and v.shape[1] == 1 and v.dtype in _INTEGERS for v in values):  # x.C[:, :1]
        columns = [v[:, 0] for v in values]
        back = _batch_columns_back(columns, plan, rows, source)
        return values if back is columns else [b[:, None] for b in back]
    if not all(v.dim() == 2 and v.shape[1] in widths and _coordinate_dtype(v) for v in values):
        return values
    for v, samples in zip(values, plan.chunk_samples):
        if v.is_floating_point() and v.numel() and not bool((v[:, 0] == v[:, 0].round()).all()):
            return values  # a TensorField's continuous coordinates keep an integral batch column
        column = v[:, 0].long()
        if column.numel() == 0 and known:  # a chunk with no rows left: nothing of it to map
            continue
        if column.numel() == 0 or int(column.min()) < 0 or int(column.max()) >= samples.numel():
            return values
        found = torch.bincount(column, minlength=samples.numel()).cpu()
        if rows == "points":
            expected = plan.sample_points[source][samples].cpu()
        elif rows == "samples":
            expected = torch.ones_like(found)
        else:
            expected = found if known else found.clamp(min=1)
        if not torch.equal(found, expected):
            return values
    return [restore_batch_indices(v, samples) for v, samples in zip(values, plan.chunk_samples)]


_INTEGERS = (torch.int32, torch.int64)


def _coordinate_dtype(v: Tensor) -> bool:
    """Coordinates' dtypes: ME's int32, an int64 copy (``x.C.long()``), a TensorField's floating ones."""
    return v.dtype in _INTEGERS or v.is_floating_point()


def _batch_columns_back(values: list[Tensor], plan: SplitPlan, rows: str, source: int) -> list[Tensor]:
    """Integer vectors that are, in every chunk, a batch column as the chunk holds it, with the batch's sample ids:
    per point (``rows="points"``), its points' ids in runs ``0..b_i-1`` in order (``x.C[:, 0]`` of a stride-1 tensor);
    concatenated (``"cat"``), ids in order with every sample present (``x.C[:, 0]`` of a strided or quantized tensor);
    ``values`` as they are otherwise (a per-point class prediction is no such run). Per-sample vectors are left: one
    id per sample, ``0..b_i-1``, cannot be told from per-sample classes."""
    if rows not in ("points", "cat") or all(len(samples) < 2 for samples in plan.chunk_samples):
        return values  # one sample a chunk: its column is all zeros, as a per-point prediction of class 0 is
    out = []
    for i, (v, samples) in enumerate(zip(values, plan.chunk_samples)):
        ids = v.long()
        if rows == "points":
            column = plan.batch_column(i, source)
            runs = v.numel() == column.numel() and torch.equal(ids, column.to(v.device))
        else:
            runs = v.numel() > 0 and int(ids.min()) >= 0 and int(ids.max()) < len(samples) and bool(
                (ids[1:] >= ids[:-1]).all()) and bool((torch.bincount(ids, minlength=len(samples)) > 0).all())
        if not runs:
            return values
        out.append(samples.to(v.device)[ids].to(v.dtype))
    return out


def points_back(values: list[Tensor], plan: SplitPlan, sources: Sequence[int]) -> tuple[int | None, list[Tensor]]:
    """Of ``sources`` (:func:`point_sources` of the values' lengths), the one whose samples' points the values' batch
    column counts, and the values with the batch's sample ids (:func:`coordinates_back`): coordinates tell their point
    set. Values that are not such coordinates (features, a set none counts): the first source, the values as they are."""
    for source in sources:
        restored = coordinates_back(values, plan, "points", source)
        if restored is not values:
            return source, restored
    return (sources[0] if sources else None), values


def row_order(plan: SplitPlan, lengths: list[int]) -> Sequence[Tensor] | None:
    """Per chunk, the batch's ids of rows of the given ``lengths`` (one per chunk): its samples
    (``plan.chunk_samples``) when they are the chunks' numbers of samples, else a coordinate source's points
    (``plan.point_rows``) when they are its points per chunk; ``None`` for neither."""
    if lengths == plan.samples_per_chunk:
        return plan.chunk_samples
    source = point_source(plan, lengths)
    return None if source is None else plan.point_rows[source]


__all__ = [
    "MERGES", "coordinates_back", "merge_batch", "merge_chunks", "merge_rows", "point_source", "point_sources", "points_back",
    "restore_batch_indices", "row_order",
]
