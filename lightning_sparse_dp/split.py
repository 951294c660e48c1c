"""Split: one collated sparse batch into per-replica chunks of whole samples.

A MinkowskiEngine batch is collated by ``ME.utils.sparse_collate`` (or ``batched_coordinates``):
``coordinates`` is an integer tensor ``[N, D+1]`` whose column 0 is the batch index
``0..B-1`` (ME's convention, see ``MinkowskiEngine/utils/collation.py``), per-point tensors
(features, point labels) are ``[N, ...]`` and per-sample tensors (scene labels) are ``[B, ...]``.
:func:`split_batch` assigns whole samples to chunks, takes the rows of every tensor that belong to
each chunk (keeping sample order and point order inside a chunk), renumbers the batch index of each
chunk to ``0..b-1``, and returns a :class:`SplitPlan` that records the permutation so that
:func:`merge_chunks` can put per-sample or per-point results back into the original order.

Batch containers are traversed with ``torch.utils._pytree`` (dicts, lists, tuples, namedtuples).
``ME.SparseTensor`` / ``ME.TensorField`` leaves are not built here: a chunk holds a
:class:`SparseSpec` for them, which :mod:`lightning_sparse_dp.place` builds on its device.
Plain dense tensors ``[B, ...]`` with no coordinates anywhere are split along dim 0 as
``torch.nn.DataParallel`` does (but into the same whole-sample chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp._me import is_sparse_tensor, is_tensor_field

Role = Literal["coordinates", "points", "samples", "replicate"]
ROLES: tuple[str, ...] = ("coordinates", "points", "samples", "replicate")

#: Dict keys whose value is taken to be collated coordinates (as in ME's Lightning example).
COORDINATE_KEYS = frozenset({"coordinates", "coords", "coordinate", "coord"})


class BatchLayoutError(ValueError):
    """The batch cannot be split into whole-sample chunks as it is; the message says how to fix it."""


@dataclass
class SparseSpec:
    """A SparseTensor / TensorField still to be built on a device by :mod:`~lightning_sparse_dp.place`.

    Attributes:
        cls: ``ME.SparseTensor`` or ``ME.TensorField``.
        features: ``[n, C]`` features of the chunk (still on the source device).
        coordinates: ``[n, D+1]`` coordinates of the chunk, column 0 renumbered to ``0..b-1``
            (int32 for a SparseTensor, float for a TensorField, as ME stores them).
        kwargs: constructor keywords kept from the source tensor (``tensor_stride``,
            ``quantization_mode``, ``minkowski_algorithm``).
    """

    cls: type
    features: Tensor
    coordinates: Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SplitPlan:
    """Which samples and points went to which chunk; enough to undo the split.

    Attributes:
        num_samples: ``B``, samples in the whole batch.
        chunk_samples: per chunk, int64 ``[b_i]`` ids of its samples in the whole batch (ascending
            for the contiguous split).
        point_rows: per coordinate source (in the order found), per chunk, int64 ``[n_i]`` rows of
            that source's points in the whole batch. Empty for a dense batch.
        roles: per flattened leaf of the batch, the role it was split by.
        leaf_sources: per flattened leaf, the index of its coordinate source (-1 for none).
    """

    num_samples: int
    chunk_samples: list[Tensor]
    point_rows: list[list[Tensor]]
    roles: list[str] = field(default_factory=list)
    leaf_sources: list[int] = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_samples)

    @property
    def samples_per_chunk(self) -> list[int]:
        """Samples in each chunk, ``[num_chunks]``."""
        return [int(s.numel()) for s in self.chunk_samples]

    @property
    def points_per_chunk(self) -> list[int]:
        """Points of the first coordinate source in each chunk; samples for a dense batch."""
        if not self.point_rows:
            return self.samples_per_chunk
        return [int(r.numel()) for r in self.point_rows[0]]

    @property
    def num_points(self) -> int:
        return sum(self.points_per_chunk)


@dataclass
class _Source:
    """A set of points with a batch index: collated coordinates or a SparseTensor / TensorField."""

    name: str
    batch_index: Tensor  # int64 [N]
    rows: list[Tensor] = field(default_factory=list)  # per chunk


def _path_name(path: Sequence[Any]) -> str:
    """``batch['coordinates'][0]`` style name of a pytree key path, for error messages."""
    return "batch" + "".join(str(k) for k in path)


def _key_of(path: Sequence[Any]) -> Any:
    """The innermost dict key or sequence index of a pytree key path (None at the top)."""
    if not path:
        return None
    last = path[-1]
    for attr in ("key", "idx", "name"):
        if hasattr(last, attr):
            return getattr(last, attr)
    return None


def _layout_role(path: Sequence[Any], layout: Mapping[Any, str] | None) -> str | None:
    """Role the user gave for this leaf in ``layout`` (by innermost key/index or by path name)."""
    if not layout:
        return None
    for candidate in (_path_name(path), _key_of(path)):
        if candidate in layout:
            role = layout[candidate]
            if role not in ROLES:
                raise BatchLayoutError(f"layout[{candidate!r}] = {role!r}; use one of {ROLES}.")
            return role
    return None


def _is_leaf(x: Any) -> bool:
    return is_sparse_tensor(x) or is_tensor_field(x)


def _looks_like_collated_coordinates(t: Tensor) -> bool:
    """An integer ``[N, D+1]`` tensor whose column 0 is sorted and starts at 0, as sparse_collate makes."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        return False
    if t.dim() != 2 or t.shape[1] < 2 or t.shape[0] == 0:
        return False
    col = t[:, 0]
    return bool(col[0] == 0) and bool((col[1:] >= col[:-1]).all())


def _check_coordinates(t: Tensor, name: str) -> Tensor:
    """Validate collated coordinates and return their batch index as int64 ``[N]``."""
    if t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
        raise BatchLayoutError(
            f"{name} has dtype {t.dtype}, but coordinates must be integer [N, D+1] with the batch index in "
            "column 0. Quantize them first (ME.utils.sparse_quantize, then ME.utils.sparse_collate), or pass "
            "continuous coordinates as an ME.TensorField."
        )
    if t.dim() != 2 or t.shape[1] < 2:
        raise BatchLayoutError(
            f"{name} has shape {tuple(t.shape)}, but coordinates must be [N, D+1] with the batch index in "
            "column 0. Collate samples with ME.utils.sparse_collate or ME.utils.batched_coordinates, which "
            "prepend the batch column."
        )
    return t[:, 0].long()


def _check_batch_index(batch_index: Tensor, name: str) -> int:
    """Check that ``batch_index`` holds every sample ``0..B-1`` and return ``B``."""
    if batch_index.numel() == 0:
        raise BatchLayoutError(f"{name} is empty: the batch has no points. Filter out empty samples before collation.")
    low = int(batch_index.min())
    if low < 0:
        raise BatchLayoutError(
            f"{name} has a negative batch index ({low}) in column 0; column 0 must be the batch index 0..B-1. "
            "Collate with ME.utils.sparse_collate or ME.utils.batched_coordinates."
        )
    counts = torch.bincount(batch_index.cpu())
    missing = (counts == 0).nonzero().flatten().tolist()
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise BatchLayoutError(
            f"{name} has gaps in its batch indices (column 0): no points for sample(s) {shown} of 0..{counts.numel() - 1}. "
            "Batch indices must be contiguous 0..B-1 (is column 0 really the batch index?). Drop empty samples "
            "before collation, or collate with ME.utils.sparse_collate, which numbers samples 0..B-1."
        )
    return int(counts.numel())


def contiguous_assignment(num_samples: int, num_chunks: int) -> list[Tensor]:
    """Assign samples ``0..B-1`` to ``min(num_chunks, B)`` contiguous chunks of sizes differing by at most one.

    Same sizes as ``torch.tensor_split`` (the first ``B % k`` chunks get one sample more).

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids.

    Raises:
        ValueError: ``num_chunks < 1`` or ``num_samples < 1``.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    return list(torch.arange(num_samples).tensor_split(min(num_chunks, num_samples)))


def _renumber(coordinates: Tensor, rows: Tensor, sample_rank: Tensor, batch_index: Tensor) -> Tensor:
    """Rows of ``coordinates`` with column 0 replaced by each sample's position inside its chunk."""
    out = coordinates.index_select(0, rows.to(coordinates.device)).clone()
    out[:, 0] = sample_rank[batch_index[rows]].to(device=out.device, dtype=out.dtype)
    return out


def _sparse_kwargs(x: Any) -> dict[str, Any]:
    """Constructor keywords that a rebuilt SparseTensor / TensorField must keep from ``x``."""
    # a TensorField keeps its stride on its coordinate *field* map key (it has no coordinate_map_key)
    key = x.coordinate_field_map_key if is_tensor_field(x) else x.coordinate_map_key
    kwargs: dict[str, Any] = {"tensor_stride": key.get_tensor_stride(), "quantization_mode": x.quantization_mode}
    algorithm = getattr(x.coordinate_manager, "minkowski_algorithm", None)
    if algorithm is not None:
        kwargs["minkowski_algorithm"] = algorithm
    return kwargs


def split_batch(
    batch: Any,
    num_chunks: int,
    *,
    layout: Mapping[Any, str] | None = None,
    assignment: Callable[[int, int], list[Tensor]] | None = None,
) -> tuple[list[Any], SplitPlan]:
    """Split a collated batch into at most ``num_chunks`` chunks of whole samples.

    Args:
        batch: a tensor, ``ME.SparseTensor`` / ``ME.TensorField``, or dict / list / tuple /
            namedtuple of them (and of non-tensor values). Coordinates are found as
            (1) the ``C`` of SparseTensor / TensorField leaves, (2) dict values under a key in
            :data:`COORDINATE_KEYS` or given the role ``"coordinates"`` in ``layout``, else
            (3) integer ``[N, D+1]`` tensors whose column 0 is sorted and starts at 0 (what
            ``ME.utils.sparse_collate`` returns). Every other tensor of length ``N`` of a coordinate
            source is per-point, of length ``B`` per-sample; 0-dim tensors and non-tensors are
            given to every chunk unchanged. With no coordinates at all, every tensor is ``[B, ...]``.
        num_chunks: the number of replicas; a batch with fewer samples gets one chunk per sample.
        layout: optional roles that settle what cannot be told apart, e.g. per-point labels when
            ``N == B``: ``{"labels": "points"}``. Keys are dict keys, tuple indices or a leaf's path
            name as the errors print it (``"batch['x'][1]"``); roles are ``"coordinates"``,
            ``"points"``, ``"samples"`` and ``"replicate"``.
        assignment: ``(B, num_chunks) -> list of int64 sample-id tensors``, one per chunk; default
            :func:`contiguous_assignment`. Every sample must be in exactly one chunk.

    Returns:
        ``(chunks, plan)``: a list of batches with the input's structure (SparseTensor /
        TensorField leaves as :class:`SparseSpec`) and the :class:`SplitPlan`.

    Raises:
        BatchLayoutError: empty batch; coordinates that are not integer ``[N, D+1]``, have negative
            or non-contiguous batch indices; coordinate sources that disagree on ``B``; a tensor
            whose length is neither ``N`` nor ``B``; a tensor whose role is ambiguous (``N == B``);
            a batch with no tensor to split; an assignment that does not cover every sample once.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    leaves_with_path, spec = pytree.tree_flatten_with_path(batch, is_leaf=_is_leaf)
    paths = [p for p, _ in leaves_with_path]
    leaves = [x for _, x in leaves_with_path]
    names = [_path_name(p) for p in paths]
    roles: list[str | None] = [_layout_role(p, layout) for p in paths]

    # 1. coordinate sources
    sources: list[_Source] = []
    source_of_leaf: dict[int, _Source] = {}
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        if _is_leaf(leaf):
            coords = leaf.C
            batch_index = coords[:, 0].long() if coords.numel() else coords.new_zeros(0, dtype=torch.long)
            roles[i] = "coordinates"
        elif isinstance(leaf, Tensor) and (
            roles[i] == "coordinates"
            or (roles[i] is None and isinstance(_key_of(path), str) and _key_of(path).lower() in COORDINATE_KEYS)
        ):
            batch_index = _check_coordinates(leaf, names[i])
            roles[i] = "coordinates"
        else:
            continue
        src = _Source(names[i], batch_index)
        sources.append(src)
        source_of_leaf[i] = src
    if not sources:  # ME's sparse_collate tuple: find coordinates by their look
        for i, leaf in enumerate(leaves):
            if roles[i] is None and isinstance(leaf, Tensor) and _looks_like_collated_coordinates(leaf):
                src = _Source(names[i], leaf[:, 0].long())
                sources.append(src)
                source_of_leaf[i] = src
                roles[i] = "coordinates"

    # 2. the number of samples
    if sources:
        counts = {src.name: _check_batch_index(src.batch_index, src.name) for src in sources}
        num_samples = next(iter(counts.values()))
        if len(set(counts.values())) > 1:
            raise BatchLayoutError(
                f"coordinate sources disagree on the number of samples: {counts}. Every coordinate tensor in a "
                "batch must number the same samples 0..B-1; give the odd one the role 'replicate' in layout= "
                "if it is not part of the batch."
            )
    else:
        lengths = {names[i]: leaf.shape[0] for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf.dim() > 0
                   and roles[i] != "replicate"}
        if not lengths:
            raise BatchLayoutError(
                "the batch has no tensor to split (and no coordinates). A batch must hold collated coordinates "
                "[N, D+1], an ME.SparseTensor / ME.TensorField, or tensors [B, ...]."
            )
        num_samples = next(iter(lengths.values()))
        if len(set(lengths.values())) > 1:
            raise BatchLayoutError(
                f"dense batch tensors disagree on the batch size (dim 0): {lengths}. Without coordinates every tensor "
                "is split along dim 0 and must have the same length; give a tensor the role 'replicate' in layout= "
                "to pass it whole to every replica."
            )
        if num_samples == 0:
            raise BatchLayoutError("the batch is empty (dim 0 has size 0).")

    # 3. the chunks
    chunk_samples = (assignment or contiguous_assignment)(num_samples, num_chunks)
    chunk_samples = [torch.as_tensor(c, dtype=torch.long).flatten() for c in chunk_samples]
    chunk_samples = [c for c in chunk_samples if c.numel() > 0]
    k = len(chunk_samples)
    sample_to_chunk = torch.full((num_samples,), -1, dtype=torch.long)
    sample_rank = torch.empty(num_samples, dtype=torch.long)
    for j, ids in enumerate(chunk_samples):
        if bool((sample_to_chunk[ids] != -1).any()) or ids.unique().numel() != ids.numel():
            raise BatchLayoutError("the assignment puts a sample into more than one chunk.")
        sample_to_chunk[ids] = j
        sample_rank[ids] = torch.arange(ids.numel())
    if bool((sample_to_chunk == -1).any()):
        raise BatchLayoutError("the assignment leaves samples out of every chunk: every sample must go to one chunk.")

    for src in sources:
        batch_index = src.batch_index.cpu()
        chunk_of_point = sample_to_chunk[batch_index]
        order = torch.argsort(chunk_of_point, stable=True)
        src.rows = list(order.split(torch.bincount(chunk_of_point, minlength=k).tolist()))
        src.batch_index = batch_index

    # 4. the role of every other leaf
    for i, leaf in enumerate(leaves):
        if roles[i] is not None and roles[i] != "coordinates":
            if roles[i] == "points" and not sources:
                raise BatchLayoutError(f"layout gives {names[i]} the role 'points' but the batch has no coordinates.")
            continue
        if roles[i] == "coordinates":
            if i not in source_of_leaf:
                raise BatchLayoutError(f"layout gives {names[i]} the role 'coordinates' but it is not a tensor.")
            continue
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            roles[i] = "replicate"
            continue
        length = leaf.shape[0]
        point_match = [src for src in sources if src.batch_index.numel() == length]
        if k == 1 and (length == num_samples or point_match):
            roles[i] = "replicate"  # one chunk holds everything: no need to tell points from samples
            continue
        if point_match and length == num_samples:
            raise BatchLayoutError(
                f"{names[i]} has length {length}, which is both the number of points of {point_match[0].name} and the "
                f"number of samples, so it cannot be told whether it is per-point or per-sample. Say which with "
                f"SparseDataParallelStrategy(layout={{{_key_of(paths[i])!r}: 'points'}}) (or 'samples'), or with "
                "split_batch(..., layout=...)."
            )
        if len(point_match) > 1 and not all(torch.equal(point_match[0].batch_index, s.batch_index) for s in point_match):
            raise BatchLayoutError(
                f"{names[i]} has length {length}, the number of points of several coordinate sources "
                f"({', '.join(s.name for s in point_match)}) with different batch indices. Give it the role 'replicate' "
                "in layout=, or pass the sources separately."
            )
        if point_match:
            roles[i] = "points"
        elif length == num_samples:
            roles[i] = "samples"
        else:
            raise BatchLayoutError(
                f"{names[i]} has length {length} in dim 0, which matches neither the number of samples ({num_samples}) "
                + (f"nor the number of points ({', '.join(f'{s.name}: {s.batch_index.numel()}' for s in sources)})"
                   if sources else "")
                + ". Per-point tensors must have one row per coordinate row, per-sample tensors one row per sample; "
                "give it the role 'replicate' in layout= to pass it whole to every replica."
            )

    # 5. cut every leaf
    point_source: dict[int, _Source] = {}
    for i, leaf in enumerate(leaves):
        if roles[i] == "points":
            point_source[i] = next(s for s in sources if s.batch_index.numel() == leaf.shape[0])

    chunks_leaves: list[list[Any]] = [[] for _ in range(k)]
    for i, leaf in enumerate(leaves):
        role = roles[i]
        for j in range(k):
            if role == "replicate":
                piece = leaf
            elif role == "samples":
                piece = leaf.index_select(0, chunk_samples[j].to(leaf.device))
            elif role == "points":
                piece = leaf.index_select(0, point_source[i].rows[j].to(leaf.device))
            else:  # coordinates
                src = source_of_leaf[i]
                rows = src.rows[j]
                if _is_leaf(leaf):
                    coords = _renumber(leaf.C, rows, sample_rank, src.batch_index)
                    features = leaf.F.index_select(0, rows.to(leaf.F.device))
                    piece = SparseSpec(type(leaf), features, coords, _sparse_kwargs(leaf))
                else:
                    piece = _renumber(leaf, rows, sample_rank, src.batch_index)
            chunks_leaves[j].append(piece)

    chunks = [pytree.tree_unflatten(cl, spec) for cl in chunks_leaves]
    source_index = {id(s): n for n, s in enumerate(sources)}
    leaf_sources = [source_index[id((source_of_leaf.get(i) or point_source.get(i)))] if i in source_of_leaf or i in point_source
                    else -1 for i in range(len(leaves))]
    plan = SplitPlan(num_samples, chunk_samples, [s.rows for s in sources], [str(r) for r in roles], leaf_sources)
    return chunks, plan


def merge_chunks(pieces: Sequence[Tensor], order: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate per-chunk pieces and put their rows back into the original order.

    Args:
        pieces: per chunk, a tensor ``[n_i, ...]`` (rows along ``dim``).
        order: per chunk, int64 ``[n_i]`` original row ids of its rows, e.g. ``plan.chunk_samples`` for
            per-sample results or ``plan.point_rows[0]`` for per-point results.

    Returns:
        ``[sum n_i, ...]``: row ``r`` is the piece row whose original id is ``r``.

    Raises:
        ValueError: a piece's length differs from its order's.
    """
    for j, (p, o) in enumerate(zip(pieces, order, strict=True)):
        if p.shape[dim] != o.numel():
            raise ValueError(f"chunk {j} has {p.shape[dim]} rows but its plan has {o.numel()}.")
    merged = torch.cat(list(pieces), dim=dim)
    ids = torch.cat(list(order)).to(merged.device)
    inverse = torch.empty_like(ids)
    inverse[ids] = torch.arange(ids.numel(), device=ids.device)
    return merged.index_select(dim, inverse)


def merge_batch(chunks: Sequence[Any], plan: SplitPlan) -> Any:
    """Undo :func:`split_batch`: the whole batch from its chunks (the inverse the property tests check).

    ``SparseSpec`` leaves come back as ``(features, coordinates)`` with the original batch indices.
    """
    flat = [pytree.tree_flatten(c, is_leaf=lambda x: isinstance(x, SparseSpec) or _is_leaf(x)) for c in chunks]
    spec = flat[0][1]
    merged = []
    for i, role in enumerate(plan.roles):
        pieces = [f[0][i] for f in flat]
        if role == "replicate":
            merged.append(pieces[0])
        elif role == "samples":
            merged.append(merge_chunks(pieces, plan.chunk_samples))
        elif role == "points":
            merged.append(merge_chunks(pieces, plan.point_rows[plan.leaf_sources[i]]))
        else:
            rows = plan.point_rows[plan.leaf_sources[i]]

            def restore(c: Tensor, j: int) -> Tensor:
                c = c.clone()
                c[:, 0] = plan.chunk_samples[j].to(c.device)[c[:, 0].long()].to(c.dtype)
                return c

            if isinstance(pieces[0], SparseSpec):
                feats = merge_chunks([p.features for p in pieces], rows)
                coords = merge_chunks([restore(p.coordinates, j) for j, p in enumerate(pieces)], rows)
                merged.append((feats, coords))
            else:
                merged.append(merge_chunks([restore(p, j) for j, p in enumerate(pieces)], rows))
    return pytree.tree_unflatten(merged, spec)


__all__ = [
    "BatchLayoutError",
    "COORDINATE_KEYS",
    "ROLES",
    "SparseSpec",
    "SplitPlan",
    "contiguous_assignment",
    "merge_batch",
    "merge_chunks",
    "split_batch",
]
