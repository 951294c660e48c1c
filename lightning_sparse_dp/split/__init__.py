"""Split: one collated sparse batch into per-replica chunks of whole samples, and back.

A MinkowskiEngine batch is collated by ``ME.utils.sparse_collate`` (or ``batched_coordinates``):
``coordinates`` is a tensor ``[N, D+1]`` (int32, or float32 with ``dtype=torch.float32`` as ME's
examples collate) whose column 0 is the batch index ``0..B-1`` (ME's convention, see
``MinkowskiEngine/utils/collation.py``), per-point tensors (features, point labels) are ``[N, ...]``
and per-sample tensors (scene labels) are ``[B, ...]``. :func:`split_batch` assigns whole samples to
chunks, takes the rows of every tensor that belong to each chunk (keeping sample order and point
order inside a chunk), renumbers the batch index of each chunk to ``0..b-1``, and returns a
:class:`SplitPlan` that records the permutation so that :func:`merge_chunks` can put per-sample or
per-point results back into the original order. Plain dense tensors ``[B, ...]`` with no
coordinates anywhere are split along dim 0 as ``torch.nn.DataParallel`` does (but into the same
whole-sample chunks).

The steps of :func:`split_batch`, one file each, in data-path order:

- :mod:`.leaves`: the batch flattened into :class:`~.records.Leaf` records (``torch.utils._pytree``;
  ME tensors, per-sample lists of names and numpy arrays are leaves), and the ``layout`` roles;
- :mod:`.sources`: the coordinate sources found and checked, the number of samples ``B`` counted;
- :mod:`.assign`: whole samples assigned to chunks (``"balanced"``, ``"contiguous"`` or a callable);
- :mod:`.roles`: every other leaf given a role: per point, per sample, or whole to every chunk;
- :mod:`.indices`: row-index tensors (correspondences) tied to their samples, re-based per chunk;
- :mod:`.cut`: each leaf's piece for each chunk, batch index renumbered;
- :mod:`.held`: the decisions of the steps above that read only the batch's structure, held by the strategy and
  reused for a batch of the same structure while they hold (:class:`~.held.HeldLayouts`);
- :mod:`.merge`: the inverse, for outputs (:func:`merge_chunks`, :func:`merge_rows`) and whole batches
  (:func:`merge_batch`);
- :mod:`.records`: the immutable records these pass on, :class:`SplitPlan` and :class:`SparseSpec`.

Beside them, :mod:`.presplit`: the split done in DataLoader worker processes (:class:`~.presplit.PreSplitCollate`),
whose chunks reach the step as a :class:`~.presplit.PreSplitBatch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from functools import partial
from operator import getitem
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp.split.assign import (
    ASSIGNMENTS,
    Assignment,
    assign,
    balanced_assignment,
    check_num_chunks,
    contiguous_assignment,
    resolve_assignment,
)
from lightning_sparse_dp.split.cut import CUTS, Piece, cut
from lightning_sparse_dp.split.held import HeldLayouts
from lightning_sparse_dp.split.indices import index_rows
from lightning_sparse_dp.split.leaves import flatten
from lightning_sparse_dp.split.merge import merge_batch, merge_chunks, merge_rows
from lightning_sparse_dp.split.records import (
    COORDINATE_KEYS,
    ROLES,
    BatchLayoutError,
    ChunkRows,
    Role,
    Source,
    SparseSpec,
    SplitPlan,
    names_coordinates,
    names_indices,
    replace,
)
from lightning_sparse_dp.split.roles import resolve_roles, targets
from lightning_sparse_dp.split.sources import count_samples, find_sources


def split_batch(
    batch: Any,
    num_chunks: int,
    *,
    layout: Mapping[Any, str] | None = None,
    assignment: str | Assignment = "balanced",
    min_points: int = 1,
    batch_sizes: Collection[int] | None = None,
) -> tuple[list[Any], SplitPlan]:
    """Split a collated batch into at most ``num_chunks`` chunks of whole samples.

    Args:
        batch: a tensor, ``ME.SparseTensor`` / ``ME.TensorField``, or dict / list / tuple /
            namedtuple of them (and of non-tensor values). Coordinates are found as
            (1) the ``C`` of SparseTensor / TensorField leaves, (2) dict values under a key in
            :data:`COORDINATE_KEYS` or given the role ``"coordinates"`` in ``layout``, (3) dict values
            under a key that names coordinates (:func:`names_coordinates`: contains ``coord``, or
            ``xyz<digits>``) that look like collated coordinates, (4) integer ``[N, D+1]`` tensors
            whose column 0 is sorted and starts at 0 (what ``ME.utils.sparse_collate`` returns): every
            one when (1)-(3) found none, else those numbering the same ``B`` samples; or, when there is
            none at all, a floating-point one that is the batch's first tensor, goes up 0, 1, 2, ... in
            column 0 and has a tensor of as many rows beside it (``sparse_collate(..., dtype=torch.float32)``),
            or, failing that, floating-point ones that go up so and have more rows than the samples they
            number (one tensor ``[N, 1 + D + k]`` of batch index, coordinates and per-point values, which a
            module's own ``collate_fn`` makes: cut by column 0, the other columns travel with their rows).
            Every source is split by its own batch column with the same samples per chunk. Coordinates
            may be integer or float16/32/64 (column 0 must hold whole numbers); their dtype and values are
            kept in every chunk. Every other tensor of length ``N`` of a coordinate source is
            per-point (of that source; ``layout`` ``"points:<key>"`` settles equal lengths), of length
            ``B`` per-sample; integer tensors ``[K, c]`` under a key naming indices
            (:func:`names_indices`: ``correspondences``, ``matches``, ``pairs``) or given the role
            ``"indices"`` are row indices into the sources, cut with their samples and re-based to each
            chunk's rows (:mod:`.indices`); a list / tuple of tensors under such a key is per-sample; a list / tuple of
            non-tensors under a dict key
            (scene names, file paths) or a numpy array of length ``B`` is per-sample; 0-dim tensors
            and other non-tensors are given to every chunk unchanged. With no coordinates at all,
            every tensor is ``[B, ...]``.
        num_chunks: the number of replicas; a batch with fewer samples gets one chunk per sample.
        layout: optional roles that settle what cannot be told apart, e.g. per-point labels when
            ``N == B``: ``{"labels": "points"}``. Keys are dict keys, tuple indices or a leaf's path
            name as the errors print it (``"batch['x'][1]"``); roles are ``"coordinates"``,
            ``"points"`` (``"points:<source key>"``), ``"samples"``, ``"indices"``
            (``"indices:<source key>,..."``, ``"batch"`` first for a batch column) and ``"replicate"``.
            A key that matches no leaf is an error.
        assignment: ``"balanced"`` (:func:`balanced_assignment`, the default, as the strategies':
            even point counts), ``"contiguous"`` (:func:`contiguous_assignment`: consecutive samples)
            or a callable ``(points per sample int64 [B], num_chunks) -> list of int64 sample-id
            tensors``. Every sample must be in exactly one chunk.
        min_points: the fewest points (samples, for a dense batch) a chunk may have when it can be
            helped: while a chunk has fewer, the batch is split into one chunk less (batch norm
            per replica needs more than one value per channel; the strategy asks for 2 then).
        batch_sizes: the ``batch_size`` of the DataLoaders the batch may come from (``None``: unknown): a
            tensor found by its look alone (rule 4) with as many rows as one of them and more rows than the
            samples its column 0 numbers may be one row per sample, and is refused rather than guessed.

    Returns:
        ``(chunks, plan)``: a list of batches with the input's structure (SparseTensor /
        TensorField leaves as :class:`SparseSpec`) and the :class:`SplitPlan`.

    Raises:
        ValueError: ``num_chunks < 1``, or an unknown assignment name.
        BatchLayoutError: empty batch; coordinates that are not ``[N, D+1]`` tensors (numpy
            arrays included), have a batch column that is not whole numbers, negative or
            non-contiguous batch indices; coordinate sources that disagree on ``B``; indices out of
            range of their source or pairing points of different samples; a tensor whose
            length is neither ``N`` nor ``B`` (an empty last sample is named); a tensor whose role is
            ambiguous (``N == B``); a numpy array with one row per point; samples that were not
            collated; a batch with no tensor to split; a ``layout`` key that matches nothing; an
            assignment that does not cover every sample once.
    """
    cutters, plan = plan_split(
        batch, num_chunks, layout=layout, assignment=assignment, min_points=min_points, batch_sizes=batch_sizes
    )
    chunks = [cut_chunk() for cut_chunk in cutters]
    return chunks, dataclasses.replace(plan, point_rows=tuple(tuple(rows) for rows in plan.point_rows))


def plan_split(
    batch: Any,
    num_chunks: int,
    *,
    layout: Mapping[Any, str] | None = None,
    assignment: str | Assignment = "balanced",
    min_points: int = 1,
    batch_sizes: Collection[int] | None = None,
    layouts: HeldLayouts | None = None,
) -> tuple[list[Callable[[], Any]], SplitPlan]:
    """:func:`split_batch`'s decisions, its cuts left for later: ``cutters[j]()`` returns chunk ``j``.

    Everything that reads the whole batch runs here (finding the coordinate sources, checking them, assigning
    samples, resolving every leaf's role, the plan); a cutter only takes chunk ``j``'s rows of each leaf
    (:mod:`.cut`), reads the batch and writes nothing shared, so the cutters can run in the replicas' own
    threads, each at once with the others (the strategy's per-replica scatter). Arguments, plan and errors as
    :func:`split_batch`'s: every error is raised here, none by a cutter.

    ``layouts`` (a :class:`~.held.HeldLayouts`, the strategy's): the decisions that depend only on the batch's
    structure (the flattening, the coordinate sources, every leaf's role, the targets) are taken from it while their
    premises hold for ``batch`` (:mod:`.held`), and kept there when derived; only the values are read then (each
    source's batch column checked and counted, samples assigned, rows cut). ``None``: everything derived, as
    :func:`split_batch` does.

    Returns:
        ``(cutters, plan)``: one callable per chunk, ``plan.num_chunks`` of them, and the :class:`SplitPlan`, whose
        ``point_rows`` hold a :class:`~.records.ChunkRows` per source (a sequence of tensors, not a tuple: each chunk's
        rows are made by its cutter, or where first read; ``tuple(rows)`` makes the tuple ``split_batch`` returns).
    """
    check_num_chunks(num_chunks)
    held = None if layouts is None else layouts.read(batch, layout, batch_sizes)
    if held is not None:  # the structure's decisions held: only the values read (split/held.py)
        leaves, spec, sources, num_samples = held.leaves, held.spec, held.sources, held.num_samples
    elif _is_sample_list(batch) and layout is None:
        chunks, plan = _split_sample_list(batch, num_chunks, assignment)
        return [partial(getitem, chunks, j) for j in range(len(chunks))], plan
    else:
        flat, spec = flatten(batch, layout)
        leaves, sources = find_sources(flat, batch_sizes)
        num_samples, sources = count_samples(leaves, sources, batch_sizes)
    if num_chunks == 1 or num_samples == 1:  # one chunk: the whole batch, in order
        chunk_samples, index_in_chunk = [torch.arange(num_samples)], torch.arange(num_samples)
        sources = tuple(replace(s, rows=(torch.arange(s.num_points),)) for s in sources)
    else:
        chunk_samples, index_in_chunk, sources = _assign_points(sources, num_samples, num_chunks, assignment, min_points)
    k = len(chunk_samples)
    if held is not None:
        point_targets, sample_tensors = held.point_targets, held.sample_tensors
    else:
        resolved = resolve_roles(leaves, sources, num_samples, k)
        leaves = resolved if layouts is None or k < 2 else layouts.keep_whole(leaves, resolved, num_samples)
        point_targets, sample_tensors = targets(leaves, sources)
        if layouts is not None and k > 1:
            layouts.hold(batch, layout, flat, leaves, spec, sources, num_samples, (point_targets, sample_tensors))
    cutters = [partial(_cut_chunk, leaves, spec, sources, j, chunk_samples[j], index_in_chunk, k == 1) for j in range(k)]
    indexed = [i for i, leaf in enumerate(leaves) if leaf.role == Role.INDICES]
    plan = SplitPlan(
        num_samples=num_samples,
        chunk_samples=tuple(chunk_samples),
        point_rows=tuple(s.rows for s in sources),
        roles=tuple(str(leaf.role) for leaf in leaves),
        leaf_sources=tuple(leaf.source for leaf in leaves),
        point_targets=point_targets,
        sample_tensors=sample_tensors,
        index_rows={i: tuple(index_rows(leaves[i], c) for c in chunk_samples) for i in indexed},
        index_columns={i: leaves[i].columns for i in indexed},
        sample_points=tuple(s.counts for s in sources),
        # the columns D+1 of each source: collated coordinates [N, D+1], or a SparseTensor's / TensorField's C
        coordinate_columns=tuple(
            int((x if isinstance(x, Tensor) else x.C).shape[-1]) for x in (leaves[s.leaf].value for s in sources)
        ),
    )
    return cutters, plan


def _cut_chunk(
    leaves: tuple, spec: pytree.TreeSpec, sources: tuple[Source, ...], j: int, samples: Tensor, index_in_chunk: Tensor,
    whole: bool,
) -> Any:
    """Chunk ``j``: every leaf's piece (:func:`.cut.cut`: its role's handler, one :class:`~.cut.Piece` for the chunk)
    in the batch's structure."""
    if whole:
        return pytree.tree_unflatten([cut(leaf, sources, j, samples, index_in_chunk, True) for leaf in leaves], spec)
    piece = Piece(sources, j, samples, index_in_chunk)
    return pytree.tree_unflatten([CUTS[leaf.role](leaf, piece) for leaf in leaves], spec)


def _is_sample_list(batch: Any) -> bool:
    """A batch that is a non-empty list or tuple of samples holding no tensor or array (ints, strings, ids):
    ``default_collate`` of such items gives a tensor, so this is a collate function's list of samples."""
    if type(batch) not in (list, tuple) or not batch:
        return False
    leaves = pytree.tree_leaves(batch)
    return not any(isinstance(x, Tensor) or hasattr(x, "__array__") for x in leaves)


def _split_sample_list(batch: list | tuple, num_chunks: int, assignment: str | Assignment) -> tuple[list[Any], SplitPlan]:
    """A list (tuple) of ``B`` samples with no tensor: chunks of whole entries, each weighing 1, as a dense batch."""
    sizes = torch.ones(len(batch), dtype=torch.long)
    chunk_samples, _, _ = assign(sizes, min(num_chunks, len(batch)), assignment)
    chunks = [type(batch)(batch[i] for i in ids.tolist()) for ids in chunk_samples]
    return chunks, SplitPlan(num_samples=len(batch), chunk_samples=tuple(chunk_samples), roles=(Role.SAMPLES,))


def _assign_points(
    sources: tuple[Source, ...], num_samples: int, num_chunks: int, assignment: str | Assignment, min_points: int
) -> tuple[list[Tensor], Tensor, tuple[Source, ...]]:
    """Chunks' sample ids, each sample's position in its chunk, and the sources with their rows per chunk.

    Samples are weighed by their points in every coordinate source together (a completion network
    convolves its input and generates up to its target shape; a registration network runs both scans),
    1 each for a dense batch; while a chunk has fewer than ``min_points`` points of the first source,
    one chunk less is tried.
    """
    if not sources:
        sizes = torch.ones(num_samples, dtype=torch.long)
    else:  # one source (the common case): its counts as they are, no addition
        sizes = sources[0].counts if len(sources) == 1 else sum(s.counts for s in sources)
    first = sources[0].counts if sources else sizes
    assert isinstance(sizes, Tensor) and first is not None
    chunk_samples, sample_to_chunk, index_in_chunk = assign(sizes, num_chunks, assignment)
    first_counts = first.numpy()  # numpy sums: a chunk's points without a torch op per chunk
    short = min_points > 1 and int(first_counts.min()) < min_points  # else every chunk (a sample or more) has enough
    while short and len(chunk_samples) > 1 and min(int(first_counts[c.numpy()].sum()) for c in chunk_samples) < min_points:
        chunk_samples, sample_to_chunk, index_in_chunk = assign(sizes, len(chunk_samples) - 1, assignment)
    chunk_of_sample = sample_to_chunk.numpy()
    # each chunk's rows in ascending order, made where first needed (its cut, in its replica's thread: ChunkRows)
    k = len(chunk_samples)
    return chunk_samples, index_in_chunk, tuple(
        Source(s.name, s.leaf, s.batch_index, s.counts, ChunkRows(chunk_of_sample[s.batch_index.numpy()], k)) for s in sources
    )


__all__ = [
    "ASSIGNMENTS",
    "BatchLayoutError",
    "COORDINATE_KEYS",
    "HeldLayouts",
    "ROLES",
    "Role",
    "SparseSpec",
    "SplitPlan",
    "balanced_assignment",
    "check_num_chunks",
    "contiguous_assignment",
    "merge_batch",
    "merge_chunks",
    "merge_rows",
    "names_coordinates",
    "names_indices",
    "plan_split",
    "resolve_assignment",
    "split_batch",
]
