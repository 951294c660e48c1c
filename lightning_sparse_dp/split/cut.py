"""Cut: each leaf's piece for one chunk, the batch index renumbered to ``0..b-1`` inside the chunk.

Rows keep their order (sample order and point order inside a chunk). ``ME.SparseTensor`` /
``ME.TensorField`` leaves are not built here: a chunk holds a :class:`~lightning_sparse_dp.split.records.SparseSpec`,
which :mod:`lightning_sparse_dp.step.scatter` builds on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_sparse_dp.runtime.me import is_tensor_field
from lightning_sparse_dp.split.indices import cut_indices
from lightning_sparse_dp.split.leaves import is_me_tensor
from lightning_sparse_dp.split.records import Leaf, Role, Source, SparseSpec, numpy_readable


def take_rows(value: Any, ids: Tensor) -> Any:
    """Rows ``ids`` (int64 ``[b]``) of a tensor, numpy array, list or tuple, keeping its type."""
    if isinstance(value, Tensor):
        return value.index_select(0, ids.to(value.device))
    if isinstance(value, np.ndarray):
        return value[ids.numpy()]
    return type(value)(value[i] for i in ids.tolist())


def _renumber(coordinates: Tensor, rows: Tensor, index_in_chunk: Tensor, batch_index: Tensor) -> Tensor:
    """Rows of ``coordinates`` with column 0 replaced by each sample's position inside its chunk."""
    if numpy_readable(coordinates):  # np.take: cut on the CPU without torch ops
        picked = rows.numpy()
        taken = np.take(coordinates.numpy(), picked, axis=0)  # a new array: renumbered in place
        taken[:, 0] = np.take(index_in_chunk.numpy(), np.take(batch_index.numpy(), picked))  # cast to its dtype
        return torch.from_numpy(taken)
    out = coordinates.index_select(0, rows.to(coordinates.device))  # a new tensor: renumbered in place
    out[:, 0] = index_in_chunk[batch_index[rows]].to(device=out.device, dtype=out.dtype)
    return out


def sparse_kwargs(x: Any) -> dict[str, Any]:
    """Constructor keywords that a rebuilt SparseTensor / TensorField must keep from ``x``."""
    # a TensorField keeps its stride on its coordinate *field* map key (it has no coordinate_map_key)
    key = x.coordinate_field_map_key if is_tensor_field(x) else x.coordinate_map_key
    kwargs: dict[str, Any] = {"tensor_stride": key.get_tensor_stride(), "quantization_mode": x.quantization_mode}
    algorithm = getattr(x.coordinate_manager, "minkowski_algorithm", None)
    if algorithm is not None:
        kwargs["minkowski_algorithm"] = algorithm
    return kwargs


class Piece(NamedTuple):
    """What a role's cut handler gets for one leaf and chunk ``j``: the batch's coordinate sources (with their rows
    per chunk), int64 ``[b_j]`` ids of the chunk's samples, and int64 ``[B]`` each sample's position inside its
    chunk (its batch index there)."""

    sources: tuple[Source, ...]
    j: int
    samples: Tensor
    index_in_chunk: Tensor


def _cut_points(leaf: Leaf, p: Piece) -> Any:
    x = leaf.value
    return x.index_select(0, p.sources[leaf.source].rows[p.j].to(x.device))


def _cut_coordinates(leaf: Leaf, p: Piece) -> Any:
    x, src = leaf.value, p.sources[leaf.source]
    rows = src.rows[p.j]
    if is_me_tensor(x):
        coordinates = _renumber(x.C, rows, p.index_in_chunk, src.batch_index)
        return SparseSpec(type(x), x.F.index_select(0, rows.to(x.F.device)), coordinates, sparse_kwargs(x),
                          manager=id(x.coordinate_manager))
    return _renumber(x, rows, p.index_in_chunk, src.batch_index)


#: One cut handler per role: ``handler(leaf, piece) -> leaf's piece for the chunk``.
CUTS: dict[Role, Callable[[Leaf, Piece], Any]] = {
    Role.COORDINATES: _cut_coordinates,
    Role.POINTS: _cut_points,
    Role.SAMPLES: lambda leaf, p: take_rows(leaf.value, p.samples),
    Role.REPLICATE: lambda leaf, p: leaf.value,
    Role.INDICES: lambda leaf, p: cut_indices(leaf, p.sources, p.j, p.samples, p.index_in_chunk),
}


def cut(leaf: Leaf, sources: tuple[Source, ...], j: int, samples: Tensor, index_in_chunk: Tensor, whole: bool) -> Any:
    """``leaf``'s piece for chunk ``j``, by its role's handler (:data:`CUTS`).

    Args:
        sources: the batch's coordinate sources, with their rows per chunk.
        samples: int64 ``[b_j]`` ids of chunk ``j``'s samples.
        index_in_chunk: int64 ``[B]``, each sample's position inside its chunk: its batch index there.
        whole: chunk ``j`` is the only chunk (the whole batch, nothing to cut or renumber).
    """
    x = leaf.value
    if whole and is_me_tensor(x):  # batch indices are already 0..B-1 in order
        return SparseSpec(type(x), x.F, x.C, sparse_kwargs(x), source=x, manager=id(x.coordinate_manager))
    if whole:
        return x
    return CUTS[leaf.role](leaf, Piece(sources, j, samples, index_in_chunk))


__all__ = ["CUTS", "Piece", "cut", "sparse_kwargs", "take_rows"]
