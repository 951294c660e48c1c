"""Split: one collated sparse batch into per-replica chunks of whole samples.

A MinkowskiEngine batch is collated by ``ME.utils.sparse_collate`` (or ``batched_coordinates``):
``coordinates`` is a tensor ``[N, D+1]`` (int32, or float32 with ``dtype=torch.float32`` as ME's
examples collate) whose column 0 is the batch index ``0..B-1`` (ME's convention, see
``MinkowskiEngine/utils/collation.py``), per-point tensors
(features, point labels) are ``[N, ...]`` and per-sample tensors (scene labels) are ``[B, ...]``.
:func:`split_batch` assigns whole samples to chunks, takes the rows of every tensor that belong to
each chunk (keeping sample order and point order inside a chunk), renumbers the batch index of each
chunk to ``0..b-1``, and returns a :class:`SplitPlan` that records the permutation so that
:func:`merge_chunks` can put per-sample or per-point results back into the original order.

Batch containers are traversed with ``torch.utils._pytree`` (dicts, lists, tuples, namedtuples);
a list / tuple of non-tensors under a dict key (per-sample names, paths) and a numpy array are
leaves, split like per-sample tensors when their length is ``B``.
``ME.SparseTensor`` / ``ME.TensorField`` leaves are not built here: a chunk holds a
:class:`SparseSpec` for them, which :mod:`lightning_sparse_dp.place` builds on its device.
Plain dense tensors ``[B, ...]`` with no coordinates anywhere are split along dim 0 as
``torch.nn.DataParallel`` does (but into the same whole-sample chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
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
        source: the whole source tensor when the chunk is the whole batch; placing it on the device
            it already lives on reuses it instead of building it again.
    """

    cls: type
    features: Tensor
    coordinates: Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: Any = None


@dataclass
class SplitPlan:
    """Which samples and points went to which chunk; enough to undo the split.

    Attributes:
        num_samples: ``B``, samples in the whole batch.
        chunk_samples: per chunk, int64 ``[b_i]`` ids of its samples in the whole batch (ascending
            for the contiguous split).
        point_rows: per coordinate source (in the order found), per chunk, int64 ``[n_i]`` rows of
            that source's points in the whole batch. Empty for a dense batch.
        roles: per flattened leaf of the batch, the role it was split by (with one chunk, leaves
            whose role cannot be told apart are ``"replicate"``).
        leaf_sources: per flattened leaf, the index of its coordinate source (-1 for none).
        point_targets: names of per-point tensors that are not a coordinate source's features
            (integer labels, or a floating-point tensor after the features), e.g. ``["batch['labels']"]``.
        sample_tensors: names of per-sample tensors (not per-sample lists of names or paths).
            These two settle ``loss_weighting="auto"`` (:func:`lightning_sparse_dp.gather.resolve_auto`).
    """

    num_samples: int
    chunk_samples: list[Tensor]
    point_rows: list[list[Tensor]]
    roles: list[str] = field(default_factory=list)
    leaf_sources: list[int] = field(default_factory=list)
    point_targets: list[str] = field(default_factory=list)
    sample_tensors: list[str] = field(default_factory=list)

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
    batch_index: Tensor  # int64 [N], on the CPU
    rows: list[Tensor] = field(default_factory=list)  # per chunk, int64 [n_j]
    counts: Tensor | None = None  # int64 [B], points per sample


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


def _is_atom(x: Any) -> bool:
    """Not a tensor, array or container: a string, number, path, ``None`` or other plain object."""
    return not isinstance(x, (Tensor, Mapping, list, tuple, np.ndarray)) and not _is_leaf(x)


def is_sequence_leaf(x: Any) -> bool:
    """A plain ``list`` / ``tuple`` of non-tensors (scene names, file paths, ids) or a numpy array.

    Under a dict key these are per-sample data when their length is the number of samples ``B``
    (split like per-sample tensors); the split does not descend into them.
    """
    if isinstance(x, np.ndarray):
        return True
    return type(x) in (list, tuple) and all(_is_atom(v) for v in x)


def leaf_predicate(extra: Callable[[Any], bool] | None = None) -> Callable[[Any], bool]:
    """``is_leaf`` for ``torch.utils._pytree``: ME tensors, and sequence leaves that are dict values.

    pytree asks about a node before its children, so a dict marks its values that are
    :func:`is_sequence_leaf` and they are then taken whole. ``extra`` marks more leaves.
    """
    marked: set[int] = set()

    def is_leaf(x: Any) -> bool:
        if _is_leaf(x) or isinstance(x, np.ndarray) or id(x) in marked or (extra is not None and extra(x)):
            return True
        if isinstance(x, Mapping):
            marked.update(id(v) for v in x.values() if is_sequence_leaf(v))
        return False

    return is_leaf


def _take(leaf: Any, ids: Tensor) -> Any:
    """Rows ``ids`` (int64 ``[b]``) of a tensor, numpy array, list or tuple, keeping its type."""
    if isinstance(leaf, Tensor):
        return leaf.index_select(0, ids.to(leaf.device))
    if isinstance(leaf, np.ndarray):
        return leaf[ids.numpy()]
    return type(leaf)(leaf[i] for i in ids.tolist())


def _looks_like_collated_coordinates(t: Tensor) -> bool:
    """A ``[N, D+1]`` tensor whose column 0 is sorted and starts at 0, as sparse_collate makes.

    Integer, or floating point (``sparse_collate(..., dtype=torch.float32)``, as ME's examples
    collate) with column 0 going up in steps of 0 or 1 (a batch index without gaps).
    """
    if t.dtype == torch.bool or t.is_complex():
        return False
    if t.dim() != 2 or t.shape[1] < 2 or t.shape[0] == 0:
        return False
    col = t[:, 0]
    if t.dtype.is_floating_point:  # stricter: whole numbers 0, 1, 2, ... in steps of 0 or 1, as a batch index is
        steps = col[1:] - col[:-1]
        return bool(col[0] == 0) and bool(((steps == 0) | (steps == 1)).all())
    return bool(col[0] == 0) and bool((col[1:] >= col[:-1]).all())


def _check_coordinates(t: Tensor, name: str) -> Tensor:
    """Validate collated coordinates and return their batch index as int64 ``[N]``.

    Integer or floating-point coordinates (ME's ``SparseTensor`` floors float coordinates, a
    ``TensorField`` keeps them continuous); column 0, the batch index, must hold whole numbers.
    """
    if t.is_complex() or t.dtype == torch.bool:
        raise BatchLayoutError(
            f"{name} has dtype {t.dtype}, but coordinates must be an integer or floating-point tensor [N, D+1] with "
            "the batch index in column 0. Collate samples with ME.utils.sparse_collate."
        )
    if t.dim() != 2 or t.shape[1] < 2:
        raise BatchLayoutError(
            f"{name} has shape {tuple(t.shape)}, but coordinates must be [N, D+1] with the batch index in "
            "column 0. Collate samples with ME.utils.sparse_collate or ME.utils.batched_coordinates, which "
            "prepend the batch column."
        )
    col = t[:, 0]
    if t.dtype.is_floating_point:
        bad = ~torch.isfinite(col) | (col != col.round())
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise BatchLayoutError(
                f"{name} has dtype {t.dtype} and a batch index (column 0) that is not a whole number "
                f"({float(col[row])!r} in row {row}). Column 0 must be the batch index 0..B-1 (floating-point "
                "coordinates are fine, but their batch column must hold whole numbers); collate with "
                "ME.utils.sparse_collate, which prepends it."
            )
    return col.long()


def _check_batch_index(batch_index: Tensor, name: str) -> Tensor:
    """Check that ``batch_index`` holds every sample ``0..B-1``; return the points per sample ``[B]``."""
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
    return counts


def _chunk_count(sample_sizes: Tensor, num_chunks: int) -> tuple[int, int]:
    """``(B, min(num_chunks, B))``, or a ValueError for ``num_chunks < 1`` or no samples."""
    num_samples = int(sample_sizes.numel())
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    if num_samples < 1:
        raise ValueError("there are no samples to assign.")
    return num_samples, min(num_chunks, num_samples)


def contiguous_assignment(sample_sizes: Tensor, num_chunks: int) -> list[Tensor]:
    """Assign samples ``0..B-1`` to ``min(num_chunks, B)`` contiguous chunks of sizes differing by at most one.

    Same sizes as ``torch.tensor_split`` (the first ``B % k`` chunks get one sample more); the
    number of points is not looked at.

    Args:
        sample_sizes: int64 ``[B]``, points per sample (only its length is used).
        num_chunks: ``k``.

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids.

    Raises:
        ValueError: ``num_chunks < 1`` or no samples.
    """
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    return list(torch.arange(num_samples).tensor_split(k))


def balanced_assignment(sample_sizes: Tensor, num_chunks: int) -> list[Tensor]:
    """Assign whole samples to ``min(num_chunks, B)`` chunks so that their point counts are even.

    Greedy longest processing time first (R. L. Graham, "Bounds on multiprocessing timing
    anomalies", SIAM J. Appl. Math. 17(2), 1969; at most 4/3 - 1/(3k) times the optimal largest
    chunk): samples in decreasing size, each to the chunk with the fewest points so far (the lowest
    index on ties). Deterministic; sample ids ascend inside each chunk, so sample order is kept.

    Args:
        sample_sizes: int64 ``[B]``, points per sample.
        num_chunks: ``k``.

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids; every chunk has at least one sample.

    Raises:
        ValueError: ``num_chunks < 1`` or no samples.
    """
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    sizes = sample_sizes.tolist()
    order = sorted(range(num_samples), key=lambda i: (-sizes[i], i))
    loads = [0] * k
    members: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        j = min(range(k), key=lambda c: (loads[c], c))
        loads[j] += sizes[i]
        members[j].append(i)
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members]


#: The named assignments of :func:`split_batch`.
ASSIGNMENTS: dict[str, Callable[[Tensor, int], list[Tensor]]] = {
    "contiguous": contiguous_assignment,
    "balanced": balanced_assignment,
}


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
    assignment: str | Callable[[Tensor, int], list[Tensor]] = "contiguous",
    min_points: int = 1,
) -> tuple[list[Any], SplitPlan]:
    """Split a collated batch into at most ``num_chunks`` chunks of whole samples.

    Args:
        batch: a tensor, ``ME.SparseTensor`` / ``ME.TensorField``, or dict / list / tuple /
            namedtuple of them (and of non-tensor values). Coordinates are found as
            (1) the ``C`` of SparseTensor / TensorField leaves, (2) dict values under a key in
            :data:`COORDINATE_KEYS` or given the role ``"coordinates"`` in ``layout``, else
            (3) integer ``[N, D+1]`` tensors whose column 0 is sorted and starts at 0 (what
            ``ME.utils.sparse_collate`` returns), or, when there is none, a floating-point one that
            is the batch's first tensor, goes up 0, 1, 2, ... in column 0 and has a tensor of as many
            rows beside it (``sparse_collate(..., dtype=torch.float32)``). Coordinates may be
            integer or float16/32/64 (column 0 must hold whole numbers); their dtype and values are
            kept in every chunk. Every other tensor of length ``N`` of a coordinate source is
            per-point, of length ``B`` per-sample; a list / tuple of non-tensors under a dict key
            (scene names, file paths) or a numpy array of length ``B`` is per-sample; 0-dim tensors
            and other non-tensors are given to every chunk unchanged. With no coordinates at all,
            every tensor is ``[B, ...]``.
        num_chunks: the number of replicas; a batch with fewer samples gets one chunk per sample.
        layout: optional roles that settle what cannot be told apart, e.g. per-point labels when
            ``N == B``: ``{"labels": "points"}``. Keys are dict keys, tuple indices or a leaf's path
            name as the errors print it (``"batch['x'][1]"``); roles are ``"coordinates"``,
            ``"points"``, ``"samples"`` and ``"replicate"``. A key that matches no leaf is an error.
        assignment: ``"contiguous"`` (:func:`contiguous_assignment`, the default), ``"balanced"``
            (:func:`balanced_assignment`: even point counts) or a callable
            ``(points per sample int64 [B], num_chunks) -> list of int64 sample-id tensors``.
            Every sample must be in exactly one chunk.
        min_points: the fewest points (samples, for a dense batch) a chunk may have when it can be
            helped: while a chunk has fewer, the batch is split into one chunk less (batch norm
            per replica needs more than one value per channel; the strategy asks for 2 then).

    Returns:
        ``(chunks, plan)``: a list of batches with the input's structure (SparseTensor /
        TensorField leaves as :class:`SparseSpec`) and the :class:`SplitPlan`.

    Raises:
        BatchLayoutError: empty batch; coordinates that are not ``[N, D+1]`` tensors (numpy
            arrays included), have a batch column that is not whole numbers, negative or
            non-contiguous batch indices; coordinate sources that disagree on ``B``; a tensor whose
            length is neither ``N`` nor ``B`` (an empty last sample is named); a tensor whose role is
            ambiguous (``N == B``); a numpy array with one row per point; samples that were not
            collated; a batch with no tensor to split; a ``layout`` key that matches nothing; an
            assignment that does not cover every sample once.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    flat, spec = pytree.tree_flatten_with_path(batch, is_leaf=leaf_predicate())
    t = _Leaves(flat, layout)
    _find_sources(t)
    num_samples = _count_samples(t)
    if num_chunks == 1 or num_samples == 1:  # one chunk: the whole batch, in order
        chunk_samples, sample_rank = [torch.arange(num_samples)], torch.arange(num_samples)
        for src in t.sources:
            src.rows = [torch.arange(src.batch_index.numel())]
    else:
        sizes = t.sources[0].counts if t.sources else torch.ones(num_samples, dtype=torch.long)
        chunk_samples, sample_to_chunk, sample_rank = _assign(sizes, num_chunks, assignment)
        while len(chunk_samples) > 1 and min(int(sizes[c].sum()) for c in chunk_samples) < min_points:
            chunk_samples, sample_to_chunk, sample_rank = _assign(sizes, len(chunk_samples) - 1, assignment)
        for src in t.sources:
            chunk_of_point = sample_to_chunk[src.batch_index]
            order = torch.argsort(chunk_of_point, stable=True)
            src.rows = list(order.split(torch.bincount(chunk_of_point, minlength=len(chunk_samples)).tolist()))
    k = len(chunk_samples)
    _resolve_roles(t, num_samples, k)

    chunks = []
    for j in range(k):
        pieces = [_cut(t, i, j, chunk_samples[j], sample_rank, whole=k == 1) for i in range(len(t.leaves))]
        chunks.append(pytree.tree_unflatten(pieces, spec))
    point_targets, sample_tensors = _targets(t)
    plan = SplitPlan(
        num_samples,
        chunk_samples,
        [s.rows for s in t.sources],
        [str(r) for r in t.roles],
        t.source,
        point_targets,
        sample_tensors,
    )
    return chunks, plan


def _targets(t: _Leaves) -> tuple[list[str], list[str]]:
    """Names of the per-point targets and of the per-sample tensors of the batch (see :class:`SplitPlan`)."""
    point_targets, sample_tensors = [], []
    features_seen: set[int] = set()  # coordinate sources whose features (first float per-point tensor) were seen
    for i, (leaf, role) in enumerate(zip(t.leaves, t.roles)):
        if not isinstance(leaf, Tensor):
            continue
        if role == "samples":
            sample_tensors.append(t.names[i])
        elif role == "points":
            src = t.source[i]
            is_features = (
                leaf.dtype.is_floating_point
                and not _is_leaf(t.leaves[t.sources_leaf[src]])  # an ME tensor carries its own features
                and src not in features_seen
            )
            if is_features:
                features_seen.add(src)
            else:
                point_targets.append(t.names[i])
    return point_targets, sample_tensors


class _Leaves:
    """The flattened batch and what the split learns about each leaf."""

    def __init__(self, flat: list[tuple[Any, Any]], layout: Mapping[Any, str] | None) -> None:
        self.paths = [p for p, _ in flat]
        self.leaves = [x for _, x in flat]
        self.names = [_path_name(p) for p in self.paths]
        self.roles: list[str | None] = [_layout_role(p, layout) for p in self.paths]
        self.source = [-1] * len(self.leaves)  # index into self.sources, for coordinates and per-point leaves
        self.sources: list[_Source] = []
        self.sources_leaf: list[int] = []  # per source, the index of its leaf
        if layout:
            known = {k for p in self.paths for k in (_path_name(p), _key_of(p))}
            unknown = [key for key in layout if key not in known]
            if unknown:
                keys = sorted({repr(_key_of(p)) for p in self.paths if _key_of(p) is not None})
                raise BatchLayoutError(
                    f"layout names {', '.join(map(repr, unknown))}, which matches nothing in the batch. The batch has "
                    f"the keys / indices {', '.join(keys) or '(none)'} (leaves: {', '.join(self.names)}); name a leaf "
                    "by its key or index, or by its path as printed here."
                )

    def add_source(self, i: int, batch_index: Tensor) -> None:
        self.roles[i] = "coordinates"
        self.source[i] = len(self.sources)
        self.sources_leaf.append(i)
        self.sources.append(_Source(self.names[i], batch_index.cpu()))


def _find_sources(t: _Leaves) -> None:
    """Mark the coordinate leaves of ``t`` and record their batch indices."""
    for i, (path, leaf) in enumerate(zip(t.paths, t.leaves)):
        key = _key_of(path)
        named = t.roles[i] == "coordinates" or (
            t.roles[i] is None and isinstance(key, str) and key.lower() in COORDINATE_KEYS
        )
        if _is_leaf(leaf):
            t.add_source(i, leaf.C[:, 0].long())
        elif isinstance(leaf, Tensor) and named:
            t.add_source(i, _check_coordinates(leaf, t.names[i]))
        elif named and (isinstance(leaf, np.ndarray) or t.roles[i] == "coordinates"):
            raise BatchLayoutError(
                f"{t.names[i]} holds coordinates but is a {_kind(leaf)}, not a torch tensor. Convert it with "
                "torch.as_tensor(...) in the collate function, or collate samples with ME.utils.sparse_collate, "
                "which returns tensors [N, D+1] with the batch index in column 0."
            )
    for i, leaf in enumerate(t.leaves):  # coordinates left as numpy arrays would go whole to every replica
        if t.roles[i] is None and isinstance(leaf, np.ndarray) and leaf.dtype.kind in "iuf":
            if _looks_like_collated_coordinates(torch.from_numpy(leaf)):
                raise BatchLayoutError(
                    f"{t.names[i]} looks like collated coordinates [N, D+1] but is a numpy array, not a torch tensor. "
                    "Convert it with torch.as_tensor(...) in the collate function, or collate samples with "
                    "ME.utils.sparse_collate, which returns tensors."
                )
    if not t.sources:  # ME's sparse_collate tuple: find coordinates by their look (integer first, else float)
        candidates = [
            i
            for i, leaf in enumerate(t.leaves)
            if t.roles[i] is None and isinstance(leaf, Tensor) and _looks_like_collated_coordinates(leaf)
        ]
        parents = [_path_name(t.paths[i][:-1]) for i in candidates if t.paths[i] and hasattr(t.paths[i][-1], "idx")]
        if len(parents) != len(set(parents)):  # several in one list: per-sample coordinates, not collated
            raise BatchLayoutError(_uncollated_hint(t))
        integer = [i for i in candidates if not t.leaves[i].dtype.is_floating_point]
        for i in integer or _float_coordinates(t, candidates):
            t.add_source(i, t.leaves[i][:, 0].long())


def _kind(x: Any) -> str:
    return "numpy array" if isinstance(x, np.ndarray) else type(x).__name__


def _float_coordinates(t: _Leaves, candidates: list[int]) -> list[int]:
    """Float look-alike coordinates, more strictly (a float features tensor can look alike): the first
    tensor of the batch, when another tensor has as many rows (``sparse_collate``'s tuple order)."""
    tensors = [i for i, x in enumerate(t.leaves) if isinstance(x, Tensor)]
    if not candidates or candidates[0] != tensors[0]:
        return []
    n = t.leaves[candidates[0]].shape[0]
    return candidates[:1] if any(t.leaves[i].dim() > 0 and t.leaves[i].shape[0] == n for i in tensors[1:]) else []


def _agreed(values: dict[str, int], problem: str, fix: str) -> int:
    """The one value of ``values``, or a BatchLayoutError naming the problem and the fix."""
    if len(set(values.values())) > 1:
        raise BatchLayoutError(f"{problem}: {values}. {fix}")
    return next(iter(values.values()))


def _count_samples(t: _Leaves) -> int:
    """``B``: from the batch indices of the coordinate sources, else from dim 0 of the dense tensors."""
    if t.sources:
        for src in t.sources:
            src.counts = _check_batch_index(src.batch_index, src.name)
        return _agreed(
            {src.name: int(src.counts.numel()) for src in t.sources},
            "coordinate sources disagree on the number of samples",
            "Every coordinate tensor in a batch must number the same samples 0..B-1; give the odd one the role "
            "'replicate' in layout= if it is not part of the batch.",
        )
    lengths = {
        t.names[i]: leaf.shape[0]
        for i, leaf in enumerate(t.leaves)
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and t.roles[i] != "replicate"
    }
    if not lengths:
        raise BatchLayoutError(
            "the batch has no tensor to split (and no coordinates). A batch must hold collated coordinates "
            "[N, D+1], an ME.SparseTensor / ME.TensorField, or tensors [B, ...]." + _numpy_hint(t)
        )
    if len(set(lengths.values())) > 1:
        raise BatchLayoutError(
            f"dense batch tensors disagree on the batch size (dim 0): {lengths}. " + (_uncollated_hint(t) or (
                "Without coordinates every tensor is split along dim 0 and must have the same length; give a tensor "
                "the role 'replicate' in layout= to pass it whole to every replica." + _numpy_hint(t)
            ))
        )
    num_samples = next(iter(lengths.values()))
    if num_samples == 0:
        raise BatchLayoutError(
            "the batch is empty (dim 0 has size 0): there are no samples to split. Drop empty samples and batches "
            "before they reach the Trainer (in the Dataset, the sampler or the collate function)."
        )
    return num_samples


def _numpy_hint(t: _Leaves) -> str:
    arrays = [t.names[i] for i, x in enumerate(t.leaves) if isinstance(x, np.ndarray) and x.ndim > 1]
    if not arrays:
        return ""
    return (
        f" {', '.join(arrays)} {'is a numpy array' if len(arrays) == 1 else 'are numpy arrays'}: convert coordinates, "
        "features and labels with torch.as_tensor(...) in the collate function, or collate samples with "
        "ME.utils.sparse_collate."
    )


def _uncollated_hint(t: _Leaves) -> str:
    """A hint when the tensors that disagree are the elements of one list / tuple: samples not collated."""
    parents: dict[str, int] = {}
    for i, (path, leaf) in enumerate(zip(t.paths, t.leaves)):
        if isinstance(leaf, Tensor) and path and hasattr(path[-1], "idx"):
            parent = _path_name(path[:-1])
            parents[parent] = parents.get(parent, 0) + 1
    lists = [p for p, n in parents.items() if n > 1]
    if not lists:
        return ""
    return (
        f"{lists[0]} looks like a list of per-sample tensors that were not collated. Collate samples into one batch "
        "with ME.utils.sparse_collate(coordinates, features, labels) (coordinates [N, D+1] with the batch index in "
        "column 0) or ME.utils.batched_coordinates, e.g. as the DataLoader's collate_fn."
    )


def _assign(
    sizes: Tensor, num_chunks: int, assignment: str | Callable[[Tensor, int], list[Tensor]]
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Chunks' sample ids, each sample's chunk ``[B]`` and its position inside the chunk ``[B]``."""
    if isinstance(assignment, str):
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment={assignment!r}; use one of {sorted(ASSIGNMENTS)} or a callable.")
        assignment = ASSIGNMENTS[assignment]
    num_samples = int(sizes.numel())
    chunk_samples = assignment(sizes, num_chunks)
    chunk_samples = [torch.as_tensor(c, dtype=torch.long).flatten() for c in chunk_samples]
    chunk_samples = [c for c in chunk_samples if c.numel() > 0]
    sample_to_chunk = torch.full((num_samples,), -1, dtype=torch.long)
    sample_rank = torch.empty(num_samples, dtype=torch.long)
    for j, ids in enumerate(chunk_samples):
        if bool((sample_to_chunk[ids] != -1).any()) or ids.unique().numel() != ids.numel():
            raise BatchLayoutError("the assignment puts a sample into more than one chunk.")
        sample_to_chunk[ids] = j
        sample_rank[ids] = torch.arange(ids.numel())
    if bool((sample_to_chunk == -1).any()):
        raise BatchLayoutError("the assignment leaves samples out of every chunk: every sample must go to one chunk.")
    return chunk_samples, sample_to_chunk, sample_rank


def _resolve_roles(t: _Leaves, num_samples: int, num_chunks: int) -> None:
    """Give every leaf that is not coordinates a role: points (of which source), samples or replicate.

    With one chunk nothing is cut, so a leaf whose role cannot be told apart (``N == B``, or a length
    that matches nothing) is passed whole (``"replicate"``) instead of raising.
    """
    for i, leaf in enumerate(t.leaves):
        role = t.roles[i]
        if role == "coordinates":
            continue
        if role == "samples" and not _has_length(leaf):
            raise BatchLayoutError(f"layout gives {t.names[i]} the role 'samples' but it has no length.")
        if role is not None and role != "points":
            continue
        if _is_sequence_data(leaf):
            if role == "points":
                raise BatchLayoutError(f"layout gives {t.names[i]} the role 'points' but it is not a tensor [N, ...].")
            _resolve_sequence(t, i, leaf, num_samples)
            continue
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            if role == "points":
                raise BatchLayoutError(f"layout gives {t.names[i]} the role 'points' but it is not a tensor [N, ...].")
            t.roles[i] = "replicate"
            continue
        length = leaf.shape[0]
        matches = [n for n, src in enumerate(t.sources) if src.batch_index.numel() == length]
        if role == "points":
            if not matches:
                raise BatchLayoutError(
                    f"layout gives {t.names[i]} the role 'points' but its length {length} is the number of points of "
                    "no coordinate source in the batch."
                )
        elif matches and length == num_samples:
            if num_chunks == 1:
                t.roles[i] = "replicate"  # one chunk holds everything: no need to tell points from samples
                continue
            raise BatchLayoutError(
                f"{t.names[i]} has length {length}, which is both the number of points of "
                f"{t.sources[matches[0]].name} and the number of samples, so it cannot be told whether it is per-point "
                f"or per-sample. Say which with SparseDataParallelStrategy(layout={{{_key_of(t.paths[i])!r}: "
                "'points'}) (or 'samples'), or with split_batch(..., layout=...)."
            )
        elif not matches and length == num_samples:
            t.roles[i] = "samples"
            continue
        elif not matches:
            if num_chunks == 1:
                t.roles[i] = "replicate"
                continue
            raise BatchLayoutError(
                f"{t.names[i]} has length {length} in dim 0, which matches neither the number of samples "
                f"({num_samples}) nor the number of points "
                f"({', '.join(f'{s.name}: {s.batch_index.numel()}' for s in t.sources) or 'no coordinates'}). "
                + _empty_sample_hint(t, length, num_samples)
                + "Per-point tensors must have one row per coordinate row, per-sample tensors one row per sample; give "
                "it the role 'replicate' in layout= to pass it whole to every replica."
            )
        first = t.sources[matches[0]].batch_index
        if any(not torch.equal(first, t.sources[n].batch_index) for n in matches[1:]):
            if num_chunks == 1:
                t.roles[i] = "replicate"
                continue
            raise BatchLayoutError(
                f"{t.names[i]} has length {length}, the number of points of several coordinate sources "
                f"({', '.join(t.sources[n].name for n in matches)}) with different batch indices. Give it the role "
                "'replicate' in layout=, or pass the sources separately."
            )
        t.roles[i] = "points"
        t.source[i] = matches[0]


def _has_length(x: Any) -> bool:
    return (isinstance(x, (Tensor, np.ndarray)) and x.ndim > 0) or type(x) in (list, tuple)


def _is_sequence_data(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x) in (list, tuple)


def _resolve_sequence(t: _Leaves, i: int, leaf: Any, num_samples: int) -> None:
    """A list / tuple / numpy array: per-sample when its length is ``B``, else passed whole.

    A numpy array with one row per point is refused: ME needs tensors.
    """
    length = len(leaf) if not isinstance(leaf, np.ndarray) or leaf.ndim > 0 else -1
    if length == num_samples:
        t.roles[i] = "samples"
        return
    if isinstance(leaf, np.ndarray) and any(src.batch_index.numel() == length for src in t.sources):
        raise BatchLayoutError(
            f"{t.names[i]} is a numpy array with one row per point ({length}); convert it with torch.as_tensor(...) in "
            "the collate function (ME.utils.sparse_collate does so), or give it the role 'replicate' in layout=."
        )
    t.roles[i] = "replicate"


def _empty_sample_hint(t: _Leaves, length: int, num_samples: int) -> str:
    """Words for a per-sample tensor longer than ``B``: the last samples had no points."""
    if not t.sources or not num_samples < length < min(src.batch_index.numel() for src in t.sources):
        return ""
    missing = length - num_samples
    return (
        f"If the batch has {length} samples, the last {missing} of them ha{'s' if missing == 1 else 've'} no points "
        f"(the batch index numbers only samples 0..{num_samples - 1}, which have points): an empty sample cannot be "
        "split or fed to ME. Drop empty samples before collation (in the Dataset or the collate function). "
    )


def _cut(t: _Leaves, i: int, j: int, samples: Tensor, sample_rank: Tensor, whole: bool) -> Any:
    """Leaf ``i``'s piece for chunk ``j`` (whose sample ids are ``samples``); ``whole``: the only chunk."""
    leaf, role = t.leaves[i], t.roles[i]
    if whole and _is_leaf(leaf):  # batch indices are already 0..B-1 in order: nothing to cut or renumber
        return SparseSpec(type(leaf), leaf.F, leaf.C, _sparse_kwargs(leaf), source=leaf)
    if role == "replicate" or whole:
        return leaf
    if role == "samples":
        return _take(leaf, samples)
    src = t.sources[t.source[i]]
    rows = src.rows[j]
    if role == "points":
        return leaf.index_select(0, rows.to(leaf.device))
    if _is_leaf(leaf):
        coordinates = _renumber(leaf.C, rows, sample_rank, src.batch_index)
        return SparseSpec(type(leaf), leaf.F.index_select(0, rows.to(leaf.F.device)), coordinates, _sparse_kwargs(leaf))
    return _renumber(leaf, rows, sample_rank, src.batch_index)


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


def merge_rows(pieces: Sequence[Any], order: Sequence[Tensor]) -> Any:
    """:func:`merge_chunks` for tensors, numpy arrays, lists and tuples (per-sample names, paths, ids).

    Raises:
        ValueError: a piece's length differs from its order's.
    """
    if isinstance(pieces[0], Tensor):
        return merge_chunks(pieces, order)
    for j, (p, o) in enumerate(zip(pieces, order, strict=True)):
        if len(p) != o.numel():
            raise ValueError(f"chunk {j} has {len(p)} rows but its plan has {o.numel()}.")
    ids = torch.cat(list(order))
    inverse = torch.empty_like(ids)
    inverse[ids] = torch.arange(ids.numel())
    if isinstance(pieces[0], np.ndarray):
        return np.concatenate(list(pieces))[inverse.numpy()]
    rows = [x for p in pieces for x in p]
    return type(pieces[0])(rows[r] for r in inverse.tolist())


def merge_batch(chunks: Sequence[Any], plan: SplitPlan) -> Any:
    """Undo :func:`split_batch`: the whole batch from its chunks (the inverse the property tests check).

    ``SparseSpec`` leaves come back as ``(features, coordinates)`` with the original batch indices.
    """
    flat = [
        pytree.tree_flatten(c, is_leaf=leaf_predicate(lambda x: isinstance(x, SparseSpec))) for c in chunks
    ]
    spec = flat[0][1]
    merged = []
    for i, role in enumerate(plan.roles):
        pieces = [f[0][i] for f in flat]
        if role == "replicate":
            merged.append(pieces[0])
        elif role == "samples":
            merged.append(merge_rows(pieces, plan.chunk_samples))
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
    "ASSIGNMENTS",
    "balanced_assignment",
    "contiguous_assignment",
    "is_sequence_leaf",
    "leaf_predicate",
    "merge_batch",
    "merge_rows",
    "merge_chunks",
    "split_batch",
]
