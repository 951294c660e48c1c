"""Sources: find the coordinate sources of a batch, check them, and count its samples ``B``.

A coordinate source is a set of points with a batch index (ME's convention: column 0 of collated
coordinates ``[N, D+1]``, ``0..B-1``, see ``MinkowskiEngine/utils/collation.py``). A batch may hold
several (a completion network's input and complete shape, a registration network's two scans); every
one of them is found:

1. the ``C`` of an ``ME.SparseTensor`` / ``ME.TensorField``; a dict value under a
   :data:`~lightning_sparse_dp.split.records.COORDINATE_KEYS` key or given the role ``"coordinates"``
   (checked strictly: anything else there is an error);
2. a dict value under a key that names coordinates
   (:func:`~lightning_sparse_dp.split.records.names_coordinates`: ``target_coordinates``, ``coords0``,
   ``xyz1``...) that looks like collated coordinates (:func:`looks_like_collated_coordinates`);
3. any other integer tensor ``[M, D+1]`` that looks like collated coordinates: when 1. and 2. found
   none, every one (``sparse_collate``'s tuple; else floating-point ones by the stricter rules of
   :func:`_float_coordinates` and :func:`_collated_points`: one float tensor ``[N, 1 + D + k]`` holding batch
   index, coordinates and per-point values is collated points when it has more rows than the samples it numbers);
   a look-alike with as many rows as the DataLoader's ``batch_size`` and more rows than samples could be either,
   and is refused (:func:`refuse_ambiguous`); when they found some, those whose column 0 numbers the same ``B``
   samples ``0..B-1`` as the first source and that have more rows than samples (``sinput1_C`` beside
   ``sinput0_C``; a per-sample integer tensor ``[B, c]`` whose column 0 happens to read 0..B-1 is not one).

Integer tensors ``[K, c]`` under a key that names indices
(:func:`~lightning_sparse_dp.split.records.names_indices`: ``correspondences``, ``matches``) are
never sources: they get the role ``"indices"`` (:mod:`.indices`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sparse_dp.split.leaves import is_me_tensor, key_of, list_parent, numpy_hint, path_name, uncollated_hint
from lightning_sparse_dp.split.records import (
    COORDINATE_KEYS,
    BatchLayoutError,
    Leaf,
    Role,
    Source,
    names_coordinates,
    names_indices,
    numpy_readable,
    replace,
)


def looks_like_collated_coordinates(t: Tensor) -> bool:
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


def check_coordinates(t: Tensor, name: str) -> Tensor:
    """Validate collated coordinates ``[N, D+1]`` and return their batch index as int64 ``[N]``.

    Integer or floating-point coordinates (ME's ``SparseTensor`` floors float coordinates, a
    ``TensorField`` keeps them continuous); column 0, the batch index, must hold whole numbers.

    Raises:
        BatchLayoutError: a bool / complex dtype, a shape other than ``[N, D+1]``, or a batch column
            that is not whole numbers.
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
    if numpy_readable(t) and not t.dtype.is_floating_point:  # a numpy view and one cast, no torch op per call
        return torch.from_numpy(t.numpy()[:, 0].astype(np.int64))
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


def check_batch_index(batch_index: Tensor, name: str) -> Tensor:
    """Check that ``batch_index`` (int64 ``[N]``) holds every sample ``0..B-1``; return the points per sample ``[B]``.

    Raises:
        BatchLayoutError: no points, a negative batch index, or samples with no points (gaps).
    """
    if batch_index.numel() == 0:
        raise BatchLayoutError(f"{name} is empty: the batch has no points. Filter out empty samples before collation.")
    index = batch_index.detach().cpu().numpy()  # numpy: less overhead per call than torch ops on small arrays
    try:
        table = np.bincount(index).astype(np.int64, copy=False)  # refuses a negative entry itself
    except ValueError:
        low = int(index.min())
        if low >= 0:
            raise
        raise BatchLayoutError(
            f"{name} has a negative batch index ({low}) in column 0; column 0 must be the batch index 0..B-1. "
            "Collate with ME.utils.sparse_collate or ME.utils.batched_coordinates."
        ) from None
    counts = torch.from_numpy(table)
    if np.count_nonzero(table) < table.size:  # a sample with no points (count_nonzero: faster than .all())
        missing = np.flatnonzero(table == 0).tolist()
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise BatchLayoutError(
            f"{name} has gaps in its batch indices (column 0): no points for sample(s) {shown} of 0..{counts.numel() - 1}. "
            "Batch indices must be contiguous 0..B-1. A sample with no points (an empty scan, a crop that kept none) "
            "keeps its index under ME.utils.sparse_collate and ME.utils.batched_coordinates, which number samples by "
            "their place in the list: drop such samples in the Dataset or in the collate function before collating "
            "(e.g. samples = [s for s in samples if len(s[0]) > 0]). If column 0 is not the batch index, the tensor is "
            "not coordinates: name the batch's coordinates in the strategy's layout=."
        )
    return counts


def _as_source(leaves: list[Leaf], sources: list[Source], i: int, batch_index: Tensor) -> None:
    leaves[i] = replace(leaves[i], role=Role.COORDINATES, source=len(sources))
    sources.append(Source(leaves[i].name, i, batch_index.cpu()))


def find_sources(
    leaves: tuple[Leaf, ...], batch_sizes: Collection[int] | None = None
) -> tuple[tuple[Leaf, ...], tuple[Source, ...]]:
    """The leaves with their coordinate leaves marked (role ``"coordinates"``) and index tensors named as
    such (role ``"indices"``), and the sources found (the module docstring gives the rules, in order).

    ``batch_sizes``: the ``batch_size`` of the DataLoaders the batch may come from (``None`` or empty: unknown), the
    evidence that tells a tensor of one row per sample from collated points when its look cannot.

    Raises:
        BatchLayoutError: coordinates that are numpy arrays or not ``[N, D+1]`` tensors (see
            :func:`check_coordinates`), a list of per-sample coordinate tensors (not collated), or a tensor found by
            its look alone that may be either collated points or one row per sample (:func:`refuse_ambiguous`).
    """
    out, sources = list(leaves), []
    for i, leaf in enumerate(leaves):
        key = key_of(leaf.path)
        named = leaf.role == Role.COORDINATES or (leaf.role is None and isinstance(key, str) and key.lower() in COORDINATE_KEYS)
        if is_me_tensor(leaf.value):
            _as_source(out, sources, i, leaf.value.C[:, 0].long())
        elif isinstance(leaf.value, Tensor) and named:
            _as_source(out, sources, i, check_coordinates(leaf.value, leaf.name))
        elif named and (isinstance(leaf.value, np.ndarray) or leaf.role == Role.COORDINATES):
            raise BatchLayoutError(
                f"{leaf.name} holds coordinates but is a {_kind(leaf.value)}, not a torch tensor. Convert it with "
                "torch.as_tensor(...) in the collate function, or collate samples with ME.utils.sparse_collate, "
                "which returns tensors [N, D+1] with the batch index in column 0."
            )
        elif leaf.role is None and _integer_matrix(leaf.value) and names_indices(key):
            out[i] = replace(leaf, role=Role.INDICES)
    for i, leaf in enumerate(out):  # more coordinate tensors under names that say so: target_coordinates, coords1
        x = leaf.value
        if leaf.role is None and isinstance(x, Tensor) and names_coordinates(key_of(leaf.path)):
            if looks_like_collated_coordinates(x):
                _as_source(out, sources, i, x[:, 0].long())
    for leaf in out:  # coordinates left as numpy arrays would go whole to every replica
        x = leaf.value
        if leaf.role is None and isinstance(x, np.ndarray) and x.dtype.kind in "iuf":
            if looks_like_collated_coordinates(torch.from_numpy(x)):
                raise BatchLayoutError(
                    f"{leaf.name} looks like collated coordinates [N, D+1] but is a numpy array, not a torch tensor. "
                    "Convert it with torch.as_tensor(...) in the collate function, or collate samples with "
                    "ME.utils.sparse_collate, which returns tensors."
                )
    candidates = [
        i
        for i, leaf in enumerate(out)
        if leaf.role is None and isinstance(leaf.value, Tensor) and looks_like_collated_coordinates(leaf.value)
    ]
    if not sources:  # ME's sparse_collate tuple: find coordinates by their look (integer first, else float)
        parents = [p for p in (list_parent(out[i]) for i in candidates) if p is not None]
        if len(parents) != len(set(parents)):  # several in one list: per-sample coordinates, not collated
            raise BatchLayoutError(uncollated_hint(out))
        samples = _per_sample_entries(out, candidates)
        if samples is not None:  # batch[k][0] for every k: a list of samples, each with its own coordinates
            raise BatchLayoutError(
                f"{samples} looks like a list of samples that were not collated (each entry holds its own coordinates "
                "[n_i, D], whose first column would be read as a batch index). Collate them into one batch with "
                "ME.utils.sparse_collate(coordinates, features, labels) as the DataLoader's collate_fn (coordinates "
                "[N, D+1] with the batch index in column 0), then the step gets them collated as one device's does."
            )
        integer = [i for i in candidates if not out[i].value.dtype.is_floating_point]
        found = integer or _float_coordinates(out, candidates) or _collated_points(out, candidates)
        for i in found:
            refuse_ambiguous(out[i], batch_sizes)
            _as_source(out, sources, i, out[i].value[:, 0].long())
    else:  # beside named sources: integer look-alikes numbering the same samples 0..B-1, with more rows than samples;
        # a float one only with a source's rows and its very batch index (a float copy of its coordinates, moved: a
        # target shape), which no features column is (other float ones are refused by name: resolve_roles)
        num_samples = int(sources[0].batch_index.max()) + 1 if candidates and sources[0].num_points else 0
        for i in candidates:
            x = out[i].value
            batch_index = x[:, 0].long()
            own = not x.dtype.is_floating_point or any(
                s.num_points == x.shape[0] and torch.equal(batch_index, s.batch_index) for s in sources
            )
            if own and x.shape[0] > num_samples and _numbers_samples(batch_index, num_samples):
                _as_source(out, sources, i, batch_index)
    return tuple(out), tuple(sources)


def _per_sample_entries(leaves: list[Leaf], candidates: list[int]) -> str | None:
    """The name of a list / tuple whose entries each hold a coordinates look-alike at the same place (``batch[k][0]``
    for every ``k``: samples a ``collate_fn=lambda x: x`` left uncollated), else ``None``."""
    paths = [leaves[i].path for i in candidates]
    by_shape: dict[tuple, set[Any]] = {}
    for path in paths:
        for j, step in enumerate(path):
            idx = getattr(step, "idx", None)
            if isinstance(idx, int):
                by_shape.setdefault((j, tuple(path[:j]), tuple(path[j + 1 :])), set()).add(idx)
    for (j, prefix, _), indices in by_shape.items():
        if len(indices) < 2:
            continue
        # an entry's own label (a 0-dim tensor, a number) beside its coordinates: a sample, where two collated point
        # sets in a list ([(coords0, feats0, labels0), (coords1, ...)]) hold per-sample tensors [B] instead
        inside = [leaf.value for leaf in leaves if len(leaf.path) > j and tuple(leaf.path[:j]) == prefix]
        if any((isinstance(v, Tensor) and v.dim() == 0) or isinstance(v, (int, float)) for v in inside):
            return path_name(prefix)
    return None


def _integer_matrix(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dim() == 2 and not x.dtype.is_floating_point and x.dtype != torch.bool


def _numbers_samples(batch_index: Tensor, num_samples: int) -> bool:
    """``batch_index`` holds every sample ``0..num_samples-1`` and nothing else."""
    if num_samples == 0 or int(batch_index.min()) < 0 or int(batch_index.max()) != num_samples - 1:
        return False
    return bool((torch.bincount(batch_index.cpu(), minlength=num_samples) > 0).all())


def _kind(x: Any) -> str:
    return "numpy array" if isinstance(x, np.ndarray) else type(x).__name__


def _float_coordinates(leaves: list[Leaf], candidates: list[int]) -> list[int]:
    """Float look-alike coordinates, more strictly (a float features tensor can look alike): the first
    tensor of the batch, when another tensor has as many rows (``sparse_collate``'s tuple order)."""
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf.value, Tensor)]
    if not candidates or candidates[0] != tensors[0]:
        return []
    n = leaves[candidates[0]].value.shape[0]
    others = [leaves[i].value for i in tensors[1:]]
    return candidates[:1] if any(x.dim() > 0 and x.shape[0] == n for x in others) else []


def _collated_points(leaves: list[Leaf], candidates: list[int]) -> list[int]:
    """Float look-alike coordinates that are collated points on their own (a module's ``collate_fn`` making one
    tensor ``[N, 1 + D + k]``: batch index, coordinates, then per-point values such as time or label): more rows
    than the samples column 0 numbers (it goes 0, 1, 2, ... in steps of 0 or 1, one run per sample, so some sample
    has several rows; a tensor of one row per sample has exactly as many), every such tensor numbering the same
    samples, and every other tensor of the batch one row per point of one of them or per sample (a tensor of
    another length means the batch is not so collated: it is left to the dense rules, which say what disagrees)."""
    numbered = {i: int(leaves[i].value[-1, 0]) + 1 for i in candidates}  # sorted from 0 in steps of 0 or 1: B - 1 last
    found = [i for i in candidates if leaves[i].value.dtype.is_floating_point and leaves[i].value.shape[0] > numbered[i]]
    if not found or len({numbered[i] for i in found}) > 1:
        return []
    num_samples = numbered[found[0]]
    lengths = {num_samples, *(int(leaves[i].value.shape[0]) for i in found)}
    for k, leaf in enumerate(leaves):
        x = leaf.value
        if k not in found and isinstance(x, Tensor) and x.dim() > 0 and int(x.shape[0]) not in lengths:
            return []
    return found


def refuse_ambiguous(leaf: Leaf, batch_sizes: Collection[int] | None) -> None:
    """Refuse a tensor taken for collated coordinates by its look alone when the DataLoader says its rows may be the
    batch's samples: as many rows as a loader's ``batch_size`` and more rows than the samples its column 0 numbers.

    Raises:
        BatchLayoutError: naming the entry and the two ``layout`` roles that settle it.
    """
    x = leaf.value
    rows = int(x.shape[0])
    if not batch_sizes or rows not in batch_sizes:  # the usual case: no coincidence, nothing read from the tensor
        return
    num_samples = int(x[-1, 0]) + 1  # a look-alike's column 0 is sorted from 0: its last value is B - 1
    if rows <= num_samples:
        return
    key = key_of(leaf.path)
    key = "batch" if key is None else key
    raise BatchLayoutError(
        f"{leaf.name} [{rows}, {x.shape[1]}] could be collated points (its column 0 reads as a batch index "
        f"0..{num_samples - 1}, one run per sample) or one row per sample (it has {rows} rows, the DataLoader's "
        f"batch_size), and a split cuts the two differently. Say which in the strategy's layout=: "
        f"{{{key!r}: 'coordinates'}} (cut by the batch index in column 0) or {{{key!r}: 'samples'}} (one row per sample)."
    )


def count_samples(
    leaves: tuple[Leaf, ...], sources: tuple[Source, ...], batch_sizes: Collection[int] | None = None,
) -> tuple[int, tuple[Source, ...]]:
    """``B`` and the sources with their points per sample: from the batch indices of the coordinate
    sources, else from dim 0 of the dense tensors.

    Raises:
        BatchLayoutError: bad batch indices (:func:`check_batch_index`), sources or dense tensors that
            disagree on ``B``, no tensor to split, or an empty batch; lists of per-sample tensors that were not
            collated (:func:`~lightning_sparse_dp.split.leaves.uncollated_hint`) whose tensors have more rows than
            any of the loaders' ``batch_sizes`` (fixed-size point clouds: their rows are points, not samples, and
            would be cut through every sample).
    """
    if sources:
        sources = tuple(replace(s, counts=check_batch_index(s.batch_index, s.name)) for s in sources)
        samples = {s.name: int(s.counts.numel()) for s in sources}
        if len(set(samples.values())) > 1:
            first = sources[0]
            odd = [s for s in sources if samples[s.name] != samples[first.name]]
            # sources inside sub-batches (a path below the top level), each set of them under its own top-level entry
            tops = {s.name: path_name(leaves[s.leaf].path[:1]) if len(leaves[s.leaf].path) > 1 else None for s in sources}
            if None not in tops.values() and all(tops[s.name] != tops[first.name] for s in odd):
                raise BatchLayoutError(
                    f"the batch holds batches of different numbers of samples under {tops[first.name]} and "
                    f"{tops[odd[0].name]} ({samples}): several loaders' batches in one (a CombinedLoader of loaders "
                    "with different batch_size?). The split cuts one set of samples into chunks of whole samples; give "
                    "the loaders one batch_size (sample j of each then goes to the same replica), or train on them "
                    "one after another."
                )
            raise BatchLayoutError(
                f"coordinate sources disagree on the number of samples: {samples}. Every coordinate tensor of a batch "
                f"must number the same samples 0..B-1 in column 0 (collate each point set of the batch's samples with "
                f"ME.utils.batched_coordinates / sparse_collate, the samples in the same order). If {odd[0].name} is "
                "not coordinates with a batch column, say what it is in layout=: "
                f"{{{key_of(leaves[odd[0].leaf].path)!r}: 'points'}} (one row per point of another source), "
                "'indices' (row indices into point sets) or 'samples'."
            )
        return next(iter(samples.values())), sources
    lengths = {  # dense tensors, and lists given the role 'samples' (one entry per sample)
        leaf.name: leaf.value.shape[0] if isinstance(leaf.value, Tensor) else len(leaf.value)
        for leaf in leaves
        if (isinstance(leaf.value, Tensor) and leaf.value.dim() > 0 and leaf.role != Role.REPLICATE)
        or (leaf.role == Role.SAMPLES and type(leaf.value) in (list, tuple))
    }
    if not lengths:
        raise BatchLayoutError(
            "the batch has no tensor to split (and no coordinates). A batch must hold collated coordinates "
            "[N, D+1], an ME.SparseTensor / ME.TensorField, or tensors [B, ...]." + numpy_hint(leaves)
        )
    if len(set(lengths.values())) > 1:
        raise BatchLayoutError(
            f"dense batch tensors disagree on the batch size (dim 0): {lengths}. " + (uncollated_hint(leaves) or (
                "Without coordinates every tensor is split along dim 0 and must have one row per sample. A tensor "
                "that is not per-sample data (a constant every replica needs whole, e.g. a class-weight table) may "
                "take the role 'replicate' in layout=; per-sample data passed whole would train every replica on "
                "every sample." + numpy_hint(leaves)
            ))
        )
    num_samples = next(iter(lengths.values()))
    hint = uncollated_hint(leaves) if batch_sizes and num_samples > max(batch_sizes) else ""
    if hint:
        raise BatchLayoutError(
            f"dense batch tensors have {num_samples} rows each, more than the DataLoader's batch_size "
            f"({max(batch_sizes)}), so their rows are not samples and would be cut through every sample. {hint} Or "
            "give each list the role 'samples' in layout= (one entry per sample)."
        )
    if num_samples == 0:
        raise BatchLayoutError(
            "the batch is empty (dim 0 has size 0): there are no samples to split. Drop empty samples and batches "
            "before they reach the Trainer (in the Dataset, the sampler or the collate function)."
        )
    return num_samples, sources


__all__ = ["check_batch_index", "check_coordinates", "count_samples", "find_sources", "looks_like_collated_coordinates",
           "refuse_ambiguous"]
