"""Records: what a split produces (:class:`SplitPlan`, :class:`SparseSpec`) and what it learns on the way.

:class:`Leaf` and :class:`Source` are immutable: each step of :func:`~lightning_sparse_dp.split.split_batch`
returns new records (:func:`replace`) instead of changing shared state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, overload

import numpy as np
import torch
from torch import Tensor


class Role(StrEnum):
    """What a leaf of a batch is, which decides how it is cut into chunks and merged back (``split/cut.py`` and
    ``split/merge.py`` hold one handler per role, :data:`~lightning_sparse_dp.split.cut.CUTS` and
    :data:`~lightning_sparse_dp.split.merge.MERGES`; ``split/roles.py`` finds each leaf's). A ``str``: ``layout=``
    gives roles by these names, and ``Role.POINTS == "points"``.

    - ``COORDINATES``: collated coordinates ``[N, D+1]``, column 0 the batch index (a source of points);
    - ``POINTS``: per point of a source ``[N, ...]``; ``SAMPLES``: per sample ``[B, ...]`` or a list of ``B``;
    - ``REPLICATE``: the same in every chunk; ``INDICES``: row indices into the sources (correspondences).

    ``"points"`` and ``"indices"`` may name their coordinate source(s) after a colon in ``layout``:
    ``"points:target_coordinates"``, ``"indices:coords0,coords1"`` (``"indices:batch,coords0,coords1"`` when
    column 0 is a batch index).
    """

    COORDINATES = "coordinates"
    POINTS = "points"
    SAMPLES = "samples"
    REPLICATE = "replicate"
    INDICES = "indices"


#: The roles' names, for messages and ``layout`` checks.
ROLES: tuple[str, ...] = tuple(r.value for r in Role)
#: Roles that may name their coordinate source(s) after a colon in ``layout``.
ROLES_WITH_SOURCES = frozenset({Role.POINTS, Role.INDICES})

#: Dict keys whose value is always taken to be collated coordinates (as in ME's Lightning example):
#: a tensor under one of them that is not ``[N, D+1]`` with a batch column is an error.
COORDINATE_KEYS = frozenset({"coordinates", "coords", "coordinate", "coord"})

_COORDINATE_NAME = re.compile(r".*coord.*|xyz\d*", re.IGNORECASE)
_INDEX_NAME = re.compile(r".*(corr|match|pair).*", re.IGNORECASE)


def names_coordinates(key: Any) -> bool:
    """A dict key that names coordinates: it contains ``coord`` (``coordinates``, ``coords0``,
    ``target_coordinates``, ``sinput0_coords``) or is ``xyz`` with optional digits (``xyz``, ``xyz1``);
    case-insensitive. A tensor under such a key is a coordinate source when it looks like collated
    coordinates (``[M, D+1]``, column 0 a batch index starting at 0 in ascending order)."""
    return isinstance(key, str) and _COORDINATE_NAME.fullmatch(key) is not None


def names_indices(key: Any) -> bool:
    """A dict key that names row indices into point sets: it contains ``corr``, ``match`` or ``pair``
    (``correspondences``, ``matches``, ``pos_pairs``), case-insensitive. An integer tensor ``[K, c]``
    under such a key has the role ``"indices"`` unless ``layout`` says otherwise."""
    return isinstance(key, str) and _INDEX_NAME.fullmatch(key) is not None


class BatchLayoutError(ValueError):
    """The batch cannot be split into whole-sample chunks as it is; the message says how to fix it."""


@dataclass
class SparseSpec:
    """A SparseTensor / TensorField still to be built on a device by :mod:`~lightning_sparse_dp.step.scatter`.

    Attributes:
        cls: ``ME.SparseTensor`` or ``ME.TensorField``.
        features: ``[n, C]`` features of the chunk (still on the source device).
        coordinates: ``[n, D+1]`` coordinates of the chunk, column 0 renumbered to ``0..b-1``
            (int32 for a SparseTensor, float for a TensorField, as ME stores them).
        kwargs: constructor keywords kept from the source tensor (``tensor_stride``,
            ``quantization_mode``, ``minkowski_algorithm``).
        source: the whole source tensor when the chunk is the whole batch; placing it on the device
            it already lives on reuses it instead of building it again.
        manager: the source tensor's coordinate manager's ``id``: the specs of a batch's tensors that shared one
            manager (a completion network's input and target) are built on one manager again
            (:func:`~lightning_sparse_dp.step.scatter.build_specs`); ``None``: a manager of its own.
    """

    cls: type
    features: Tensor
    coordinates: Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: Any = None
    manager: int | None = None


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """Which samples and points went to which chunk; enough to undo the split.

    Attributes:
        num_samples: ``B``, samples in the whole batch.
        chunk_samples: per chunk, int64 ``[b_i]`` ids of its samples in the whole batch (ascending
            inside each chunk).
        point_rows: per coordinate source (in the order found), per chunk, int64 ``[n_i]`` rows of
            that source's points in the whole batch. Empty for a dense batch.
        roles: per flattened leaf of the batch, the role it was split by (with one chunk, leaves
            whose role cannot be told apart are ``"replicate"``).
        leaf_sources: per flattened leaf, the index of its coordinate source (-1 for none).
        point_targets: names of per-point tensors that are not a coordinate source's features
            (integer labels, or a floating-point tensor after the features), e.g. ``("batch['labels']",)``.
        sample_tensors: names of per-sample tensors (not per-sample lists of names or paths).
            These two settle ``loss_weighting="auto"`` (:func:`lightning_sparse_dp.loss.weights.resolve_auto`).
        index_rows: per flattened leaf of role ``"indices"`` (by its position), per chunk, int64
            ``[k_j]`` rows of the index tensor that went to the chunk.
        index_columns: per such leaf, the coordinate source of each column (-1: the batch column).
        sample_points: per coordinate source, int64 ``[B]`` the points of each sample (empty for a dense batch).
        coordinate_columns: per coordinate source, its coordinates' columns ``D+1`` (batch index and ``D`` spatial).
    """

    num_samples: int
    chunk_samples: tuple[Tensor, ...]
    point_rows: tuple[Sequence[Tensor], ...] = ()
    roles: tuple[str, ...] = ()
    leaf_sources: tuple[int, ...] = ()
    point_targets: tuple[str, ...] = ()
    sample_tensors: tuple[str, ...] = ()
    index_rows: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    index_columns: dict[int, tuple[int, ...]] = field(default_factory=dict)
    sample_points: tuple[Tensor, ...] = ()
    coordinate_columns: tuple[int, ...] = ()

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
    def points_per_set(self) -> list[list[int]]:
        """Per coordinate source, the points of each chunk (``[sources][num_chunks]``; empty for a dense batch)."""
        return [[int(r.numel()) for r in rows] for rows in self.point_rows]

    def counts_each_chunk(self, count: float) -> bool:
        """Whether ``count`` is every chunk's number of samples, or every chunk's number of points of one coordinate
        source: a count of the chunk that chunks of equal sizes make one number in every replica (``len(labels)``)."""
        return any(all(n == count for n in c) for c in (self.samples_per_chunk, *self.points_per_set))

    def batch_column(self, chunk: int, source: int = 0) -> Tensor:
        """Chunk ``chunk``'s batch index as the chunk holds it: int64 ``[n_i]`` on the CPU, its points of coordinate
        source ``source`` numbered by their sample in the chunk, ``0..b_i-1`` in runs (``x.C[:, 0]`` of a stride-1
        tensor of the chunk)."""
        samples = self.chunk_samples[chunk]
        return torch.repeat_interleave(torch.arange(samples.numel()), self.sample_points[source][samples].cpu())


@dataclass(frozen=True)
class Leaf:
    """One flattened leaf of a batch and what the split knows of it.

    Attributes:
        path: its ``torch.utils._pytree`` key path.
        name: ``batch['coordinates'][0]`` style name, for messages and :class:`SplitPlan`.
        value: the leaf itself.
        role: one of :data:`ROLES`, or ``None`` while not known.
        source: index of its coordinate source (coordinates and per-point leaves), else -1.
        refs: the source names ``layout`` gave after the role's colon (``"points:coords1"``).
        columns: for ``"indices"``, the coordinate source of each column (-1: the batch column).
        row_samples: for ``"indices"``, int64 ``[K]`` the sample of each row (on the CPU).
    """

    path: tuple[Any, ...]
    name: str
    value: Any
    role: str | None = None
    source: int = -1
    refs: tuple[str, ...] = ()
    columns: tuple[int, ...] = ()
    row_samples: Tensor | None = None


@dataclass(frozen=True)
class Source:
    """A set of points with a batch index: collated coordinates or a SparseTensor / TensorField.

    Attributes:
        name: its leaf's name.
        leaf: index of its leaf.
        batch_index: int64 ``[N]`` batch index of every point, on the CPU.
        counts: int64 ``[B]`` points per sample (once counted).
        rows: per chunk, int64 ``[n_j]`` rows of the chunk's points (once assigned; a :class:`ChunkRows`).
    """

    name: str
    leaf: int
    batch_index: Tensor
    counts: Tensor | None = None
    rows: Sequence[Tensor] = ()

    @property
    def num_points(self) -> int:
        return int(self.batch_index.numel())


class ChunkRows(Sequence[Tensor]):
    """Per chunk, the rows (int64 ``[n_j]``, ascending) of one coordinate source's points that belong to it, each
    chunk's made at its first use: in the strategies, the chunk's cut in its replica's thread makes it, beside the
    other chunks' (:func:`~lightning_sparse_dp.split.plan_split`), instead of the calling thread making them all.
    A read-only sequence as the tuple it stands for (two threads making one chunk's rows make equal tensors), and
    pickled as that tuple (a DataLoader worker's :class:`SplitPlan`).

    Args:
        chunk_of_point: int64 ``[N]``, each point's chunk.
        num_chunks: ``k``.
    """

    __slots__ = ("_chunk_of_point", "_rows")

    def __init__(self, chunk_of_point: np.ndarray, num_chunks: int) -> None:
        self._chunk_of_point = chunk_of_point
        self._rows: list[Tensor | None] = [None] * num_chunks

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, j: int) -> Tensor: ...
    @overload
    def __getitem__(self, j: slice) -> tuple[Tensor, ...]: ...
    def __getitem__(self, j: int | slice) -> Tensor | tuple[Tensor, ...]:
        if isinstance(j, slice):
            return tuple(self[i] for i in range(len(self._rows))[j])
        rows = self._rows[j]
        if rows is None:  # one comparison pass per chunk (numpy's flatnonzero: faster than torch.nonzero here)
            rows = self._rows[j] = torch.from_numpy(np.flatnonzero(self._chunk_of_point == (j % len(self._rows))))
        return rows

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (tuple(self),)

    def __repr__(self) -> str:
        return f"ChunkRows({tuple(self)!r})"


def replace(record: Any, **changes: Any) -> Any:
    """A copy of ``record`` (a :class:`Leaf` or :class:`Source`) with ``changes``: ``dataclasses.replace``'s result.

    A shallow copy of the instance dict with the fields changed, at about a sixth of ``dataclasses.replace``'s
    cost (which calls ``__init__`` with every field; a split makes 7 or more per batch). Valid for these
    records: plain dataclasses with no ``__post_init__``, ``InitVar`` or ``init=False`` field.

    Raises:
        TypeError: a name that is not a field of ``record``.
    """
    fields = type(record).__dataclass_fields__
    for name in changes:
        if name not in fields:
            raise TypeError(f"{type(record).__name__} has no field {name!r}")
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new


#: Dtypes whose CPU tensors the split reads through numpy (``Tensor.numpy()``, a view; ``np.take``: about 0.6 of the
#: torch ops' time at a thousand rows, and no torch op per call).
NUMPY_DTYPES = frozenset({torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64})


def numpy_readable(t: Tensor) -> bool:
    """Whether the split may read ``t`` through numpy: a plain CPU tensor (no subclass, whose torch functions must
    run) that needs no gradient, of a dtype in :data:`NUMPY_DTYPES`."""
    return t.is_cpu and type(t) is Tensor and t.dtype in NUMPY_DTYPES and not t.requires_grad


__all__ = [
    "BatchLayoutError",
    "COORDINATE_KEYS",
    "ChunkRows",
    "Leaf",
    "NUMPY_DTYPES",
    "ROLES",
    "ROLES_WITH_SOURCES",
    "Role",
    "Source",
    "SparseSpec",
    "SplitPlan",
    "names_coordinates",
    "names_indices",
    "numpy_readable",
    "replace",
]
