"""Indices: row indices into point sets, cut with their samples and re-based to each chunk's rows.

A registration network's batch (FCGF's ``collate_pair_fn`` style) holds two scans per sample, each a
coordinate source, and correspondences ``[K, 2]``: row ``k`` pairs row ``i`` of the first scan with row
``j`` of the second, as rows of the **collated** batch (each sample's own indices offset by the points
of the samples before it). Such a tensor has the role ``"indices"``: column ``c`` indexes the rows of
a coordinate source, and an optional column 0 holds the batch index. Each row goes to the chunk of the
sample its indexed points belong to; in the chunk, every index is re-based to the chunk's rows of its
source (and the batch column renumbered ``0..b-1``), so ``coordinates[correspondences[:, 0]]`` picks the
same points in a chunk as in the whole batch.

Which source each column indexes: ``layout={"correspondences": "indices:coords0,coords1"}`` names
them by key (``"batch"`` for a batch column, first only). Without names: as many columns as sources
-> column ``c`` indexes source ``c`` (in the order :mod:`.sources` found them); one column more -> the
first is the batch column; one source -> every column indexes it.

Indices that are each sample's own row numbers (not offset) need no re-basing: pass them as a
per-sample list of tensors, which travel with their samples unchanged.

A batch vector ``[K]`` or ``[K, 1]`` (each row the batch index of its sample: ``x.C[:, 0].long()`` kept in the batch, PyG's
``batch``) is an index tensor whose one column is the batch column, ``layout={"batch": "indices:batch"}``; a 1-D
integer tensor under a key that names a batch (not a scene or sample id, which a dataset's indices can equal by chance),
equal to a point set's batch column, is taken for one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_sparse_dp.split.leaves import key_of
from lightning_sparse_dp.split.records import BatchLayoutError, Leaf, Source, SplitPlan, replace

_OFFSET_HINT = (
    "Indices must be rows of the collated batch: each sample's row numbers offset by the points of the samples "
    "before it (as FCGF's collate_pair_fn does). Indices that are each sample's own row numbers need no re-basing: "
    "pass them as a per-sample list of tensors (one [k_i, c] tensor per sample)."
)


def _column_hint(leaf: Leaf, columns: tuple[int, ...], names: list[str]) -> str:
    """Where the columns' sources were taken in the order the batch's sources were found (no ``layout`` naming them,
    several sources): which source each column was read as, and how to name them."""
    read = [names[s] for s in columns if s >= 0]
    if leaf.refs or len(set(read)) < 2:
        return ""
    order = ",".join((["batch"] if columns[0] < 0 else []) + read)
    return (
        f" Its columns were read as rows of {', '.join(map(repr, read))}, in that order (the batch's coordinate sources "
        f"in the order they were found, a source named in layout= first); if another order is meant, name it: "
        f"layout={{{key_of(leaf.path)!r}: 'indices:{order}'}} with the sources in the columns' order."
    )


def _source_names(leaves: Sequence[Leaf], sources: Sequence[Source]) -> list[str]:
    return [str(key_of(leaves[s.leaf].path)) for s in sources]


def _columns(leaf: Leaf, num_columns: int, sources: Sequence[Source], names: list[str]) -> tuple[int, ...]:
    """The source of every column (-1: the batch column), from ``layout``'s names or by the rule."""
    fix = (
        f"Say which source each column indexes: layout={{{key_of(leaf.path)!r}: 'indices:"
        f"{','.join(names[:num_columns]) or 'coords0,coords1'}'}} (a leading 'batch' names a batch column)."
    )
    if leaf.refs:
        if len(leaf.refs) != num_columns:
            raise BatchLayoutError(
                f"layout names {len(leaf.refs)} source(s) for {leaf.name} ({', '.join(leaf.refs)}) but it has "
                f"{num_columns} column(s); name one per column. {fix}"
            )
        columns = []
        for c, ref in enumerate(leaf.refs):
            if ref == "batch" and c == 0:
                columns.append(-1)
            elif ref in names:
                columns.append(names.index(ref))
            else:
                raise BatchLayoutError(
                    f"layout names {ref!r} as a source of {leaf.name}, but the batch's coordinate sources are "
                    f"{', '.join(map(repr, names)) or '(none)'} ('batch' may name column 0 only)."
                )
        return tuple(columns)
    n = len(sources)
    if n == 0:
        raise BatchLayoutError(f"{leaf.name} holds row indices ('indices') but the batch has no coordinate source.")
    if num_columns == n:
        return tuple(range(n))
    if num_columns == n + 1:
        return (-1, *range(n))
    if n == 1:
        return (0,) * num_columns
    raise BatchLayoutError(
        f"{leaf.name} has {num_columns} index columns and the batch has {n} coordinate sources ({', '.join(names)}), "
        f"so which column indexes which cannot be told. {fix}"
    )


def resolve_indices(leaf: Leaf, leaves: Sequence[Leaf], sources: Sequence[Source]) -> Leaf:
    """``leaf`` (role ``"indices"``) with the source of every column and the sample of every row.

    Args:
        leaf: an integer tensor ``[K]`` or ``[K, c]`` of row indices.
        leaves: every leaf of the batch (for the sources' names).
        sources: the coordinate sources, with their batch indices.

    Raises:
        BatchLayoutError: not an integer tensor ``[K]`` / ``[K, c]``; columns that cannot be matched to
            sources; an index out of range of its source (``0..N-1``); a row whose indices belong to
            different samples, or to another sample than its batch column says.
    """
    x = leaf.value
    if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() not in (1, 2):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise BatchLayoutError(
            f"{leaf.name} has the role 'indices' but is {shape}; indices must be an integer tensor [K] or [K, c] of "
            "rows of the batch's coordinate sources."
        )
    values = (x if x.dim() == 2 else x[:, None]).long().cpu()
    names = _source_names(leaves, sources)
    columns = _columns(leaf, values.shape[1], sources, names)
    if values.shape[1] == 1 and columns[0] >= 0 and any(  # a batch vector named as row indices
            s.num_points == len(values) and torch.equal(values[:, 0], s.batch_index.cpu()) for s in sources):
        raise BatchLayoutError(
            f"{leaf.name} has the role 'indices', but its values are each point's sample (a point set's batch column), "
            f"not rows of a point set: give it the role 'indices:batch', layout={{{key_of(leaf.path)!r}: "
            "'indices:batch'}, which renumbers it to each chunk's samples."
        )
    if all(s < 0 for s in columns):
        if values.shape[1] == 1 and sources:  # a batch vector (PyG's ``batch``): each row's sample, renumbered per chunk
            return _batch_vector(leaf, values[:, 0], sources)
        raise BatchLayoutError(f"{leaf.name} has the role 'indices' but no column indexes a coordinate source.")
    samples: Tensor | None = None
    first = -1
    for c, s in enumerate(columns):
        if s < 0:
            continue
        idx, src = values[:, c], sources[s]
        bad = ((idx < 0) | (idx >= src.num_points)).nonzero().flatten()
        if bad.numel():
            k = int(bad[0])
            raise BatchLayoutError(
                f"{leaf.name}[{k}, {c}] = {int(idx[k])} is not a row of {src.name}, which has {src.num_points} points "
                f"(rows 0..{src.num_points - 1}; {bad.numel()} index(es) out of range in this column). {_OFFSET_HINT}"
                + _column_hint(leaf, columns, names)
            )
        own = src.batch_index[idx]
        if samples is None:
            samples, first = own, c
            continue
        differ = (own != samples).nonzero().flatten()
        if differ.numel():
            k = int(differ[0])
            raise BatchLayoutError(
                f"row {k} of {leaf.name} pairs a point of sample {int(samples[k])} (column {first}) with a point of "
                f"sample {int(own[k])} (column {c}); every row must stay inside one sample. {_OFFSET_HINT}"
                + _column_hint(leaf, columns, names)
            )
    assert samples is not None
    if columns[0] < 0:
        differ = (values[:, 0] != samples).nonzero().flatten()
        if differ.numel():
            k = int(differ[0])
            raise BatchLayoutError(
                f"row {k} of {leaf.name} says sample {int(values[k, 0])} in its batch column (column 0) but indexes "
                f"points of sample {int(samples[k])}. {_OFFSET_HINT}" + _column_hint(leaf, columns, names)
            )
    return replace(leaf, columns=columns, row_samples=samples)


def _batch_vector(leaf: Leaf, samples: Tensor, sources: Sequence[Source]) -> Leaf:
    """``leaf`` (``[K]``, the role ``"indices:batch"``) as a batch vector: each row the sample it belongs to, cut with
    that sample and renumbered to its position in the chunk (``x.C[:, 0].long()`` kept in the batch, PyG's ``batch``).

    Raises:
        BatchLayoutError: a value that is no sample of the batch (``0..B-1``).
    """
    num_samples = int(sources[0].batch_index.max()) + 1 if sources[0].num_points else 0
    bad = ((samples < 0) | (samples >= num_samples)).nonzero().flatten()
    if bad.numel():
        k = int(bad[0])
        raise BatchLayoutError(
            f"{leaf.name}[{k}] = {int(samples[k])} is not a sample of the batch (0..{num_samples - 1}); the role "
            "'indices:batch' takes a batch vector: each row the batch index of the sample it belongs to."
        )
    return replace(leaf, columns=(-1,), row_samples=samples)


def check_sample_lists(leaf: Leaf, leaves: Sequence[Leaf], sources: Sequence[Source]) -> None:
    """Check a per-sample list of index tensors (each sample's own row numbers, ``[k_b]`` or ``[k_b, c]``):
    every index of sample ``b`` in range of sample ``b``'s points of its column's source.

    Raises:
        BatchLayoutError: an index out of range of its sample's points (the message says which).
    """
    names = _source_names(leaves, sources)
    for b, x in enumerate(leaf.value):
        if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dim() not in (1, 2) or not sources:
            continue
        values = (x if x.dim() == 2 else x[:, None]).long().cpu()
        for c, s in enumerate(_columns(leaf, values.shape[1], sources, names)):
            if s < 0:
                continue
            count = int(sources[s].counts[b]) if sources[s].counts is not None else sources[s].num_points
            bad = ((values[:, c] < 0) | (values[:, c] >= count)).nonzero().flatten()
            if bad.numel():
                k = int(bad[0])
                raise BatchLayoutError(
                    f"{leaf.name}[{b}][{k}, {c}] = {int(values[k, c])} is not a row of sample {b} of {sources[s].name}, "
                    f"which has {count} points there. A per-sample list holds each sample's own row numbers "
                    f"(0..{count - 1} here); indices into the collated batch belong in one tensor [K, c] instead."
                )


def _positions(src: Source, j: int) -> Tensor:
    """int64 ``[N]``: each row of ``src``'s chunk ``j`` its position in the chunk, -1 elsewhere."""
    rows = src.rows[j]
    position = torch.full((src.num_points,), -1, dtype=torch.long)
    position[rows] = torch.arange(rows.numel())
    return position


def index_rows(leaf: Leaf, samples: Tensor) -> Tensor:
    """int64 ``[k_j]``: the rows of index tensor ``leaf`` that go to the chunk of ``samples``, in order."""
    assert leaf.row_samples is not None
    return torch.isin(leaf.row_samples, samples).nonzero().flatten()


def cut_indices(leaf: Leaf, sources: Sequence[Source], j: int, samples: Tensor, index_in_chunk: Tensor) -> Tensor:
    """Chunk ``j``'s rows of index tensor ``leaf``, re-based to the chunk's rows (batch column renumbered)."""
    x = leaf.value
    keep = index_rows(leaf, samples)
    out = (x if x.dim() == 2 else x[:, None]).index_select(0, keep.to(x.device)).clone()
    for c, s in enumerate(leaf.columns):
        if s < 0:
            assert leaf.row_samples is not None
            new = index_in_chunk[leaf.row_samples[keep]]
        else:
            new = _positions(sources[s], j)[out[:, c].long().cpu()]
        out[:, c] = new.to(device=out.device, dtype=out.dtype)
    return out if x.dim() == 2 else out[:, 0]


def merge_indices(pieces: Sequence[Tensor], i: int, plan: SplitPlan) -> list[Tensor]:
    """Chunks' pieces of index leaf ``i`` with their indices back in the whole batch's rows (not yet reordered)."""
    restored = []
    for j, piece in enumerate(pieces):
        cols = piece if piece.dim() == 2 else piece[:, None]
        out = cols.clone()
        for c, s in enumerate(plan.index_columns[i]):
            table = plan.chunk_samples[j] if s < 0 else plan.point_rows[s][j]
            out[:, c] = table.to(out.device)[cols[:, c].long()].to(out.dtype)
        restored.append(out if piece.dim() == 2 else out[:, 0])
    return restored


__all__ = ["check_sample_lists", "cut_indices", "index_rows", "merge_indices", "resolve_indices"]
