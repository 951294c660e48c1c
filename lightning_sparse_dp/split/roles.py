"""Roles: what every leaf that is not coordinates is, per point (of which source), per sample or whole.

A tensor of length ``N`` (a coordinate source's points) is per-point, of length ``B`` per-sample; a
list / tuple / numpy array of length ``B`` is per-sample; 0-dim tensors and other values go whole to
every chunk (``"replicate"``). ``layout=`` settles what lengths cannot (``N == B``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sparse_dp.runtime.process import SAID_ONCE as _warning_cache
from lightning_sparse_dp.split.indices import check_sample_lists, resolve_indices
from lightning_sparse_dp.split.leaves import is_me_tensor, key_of
from lightning_sparse_dp.split.records import BatchLayoutError, Leaf, Role, Source, names_indices, replace
from lightning_sparse_dp.split.sources import looks_like_collated_coordinates


def resolve_roles(
    leaves: tuple[Leaf, ...], sources: tuple[Source, ...], num_samples: int, num_chunks: int
) -> tuple[Leaf, ...]:
    """The leaves, each with a role: points (and its source), samples, indices (:mod:`.indices`) or replicate.

    With one chunk nothing is cut, so a leaf whose role cannot be told apart (``N == B``, or a length
    that matches nothing) is passed whole (``"replicate"``) instead of raising.

    Raises:
        BatchLayoutError: a role in ``layout`` the leaf cannot have; a length that is both ``N`` and
            ``B``, or neither (naming an empty last sample when that is the likely cause, and the role
            that fits: ``'coordinates'`` for a tensor with a batch column of its own, ``'indices'`` for
            integer rows); a length shared by sources of different batch indices (``layout``
            ``'points:<source>'`` settles it); a numpy array with one row per point; index tensors that
            do not fit their sources (:func:`~.indices.resolve_indices`).
    """
    return tuple(_resolve(leaf, leaves, sources, num_samples, num_chunks) for leaf in leaves)


def _resolve(leaf: Leaf, leaves: tuple[Leaf, ...], sources: tuple[Source, ...], num_samples: int, num_chunks: int) -> Leaf:
    role, x = leaf.role, leaf.value
    if role == Role.COORDINATES:
        return leaf
    if role == Role.INDICES:
        return resolve_indices(leaf, leaves, sources)
    if role == Role.SAMPLES and not _has_length(x):
        raise BatchLayoutError(f"layout gives {leaf.name} the role 'samples' but it has no length.")
    if role is not None and role != Role.POINTS:
        return leaf
    not_points = f"layout gives {leaf.name} the role 'points' but it is not a tensor [N, ...]."
    if isinstance(x, np.ndarray) or type(x) in (list, tuple):
        if role == Role.POINTS:
            raise BatchLayoutError(not_points)
        sequence_role = _sequence_role(leaf, sources, num_samples)
        if sequence_role == Role.SAMPLES and names_indices(key_of(leaf.path)) and any(isinstance(e, Tensor) for e in x):
            check_sample_lists(leaf, leaves, sources)
        return replace(leaf, role=sequence_role)
    if not isinstance(x, Tensor) or x.dim() == 0:
        if role == Role.POINTS:
            raise BatchLayoutError(not_points)
        return replace(leaf, role=Role.REPLICATE)
    length = x.shape[0]
    matches = [n for n, src in enumerate(sources) if src.num_points == length]
    if leaf.refs:  # layout={"normals": "points:target_coordinates"}: the source is named
        names = [str(key_of(leaves[src.leaf].path)) for src in sources]
        if leaf.refs[0] not in names or len(leaf.refs) > 1:
            raise BatchLayoutError(
                f"layout gives {leaf.name} the role 'points:{','.join(leaf.refs)}', but the batch's coordinate sources "
                f"are {', '.join(map(repr, names)) or '(none)'}: name one of them."
            )
        matches = [n for n in matches if names[n] == leaf.refs[0]]
        if not matches:
            raise BatchLayoutError(
                f"layout gives {leaf.name} the role 'points:{leaf.refs[0]}' but its length {length} is not the number "
                f"of points of {leaf.refs[0]} ({sources[names.index(leaf.refs[0])].num_points})."
            )
    whole = partial(replace, leaf, role=Role.REPLICATE)  # one chunk holds everything: nothing to tell apart
    if role == Role.POINTS:
        if not matches:
            raise BatchLayoutError(
                f"layout gives {leaf.name} the role 'points' but its length {length} is the number of points of "
                "no coordinate source in the batch."
            )
    elif matches and length == num_samples:
        if num_chunks == 1:
            return whole()
        raise BatchLayoutError(
            f"{leaf.name} has length {length}, which is both the number of points of "
            f"{sources[matches[0]].name} and the number of samples, so it cannot be told whether it is per-point "
            f"or per-sample. Say which with SparseDataParallelStrategy(layout={{{key_of(leaf.path)!r}: "
            "'points'}) (or 'samples'), or with split_batch(..., layout=...)."
        )
    elif length == num_samples:
        return replace(leaf, role=Role.SAMPLES)
    elif not matches:
        if num_chunks == 1:
            return whole()
        raise BatchLayoutError(
            f"{leaf.name} has length {length} in dim 0, which matches neither the number of samples "
            f"({num_samples}) nor the number of points "
            f"({', '.join(f'{s.name}: {s.num_points}' for s in sources) or 'no coordinates'}). "
            + (_sample_list_hint(leaf, leaves, num_samples) or (
                ("" if _numbers_samples(x, num_samples) else _empty_sample_hint(sources, length, num_samples))
                + _unmatched_hint(leaf, num_samples, leaves)))
        )
    first = sources[matches[0]].batch_index
    if any(not torch.equal(first, sources[n].batch_index) for n in matches[1:]):
        matches = _same_number(leaf, leaves, sources, matches)
    if any(not torch.equal(sources[matches[0]].batch_index, sources[n].batch_index) for n in matches[1:]):
        if num_chunks == 1:
            return whole()
        raise BatchLayoutError(
            f"{leaf.name} has length {length}, the number of points of several coordinate sources "
            f"({', '.join(sources[n].name for n in matches)}) with different batch indices, so which point set it "
            f"belongs to cannot be told. Name it: SparseDataParallelStrategy(layout={{{key_of(leaf.path)!r}: "
            f"'points:{key_of(leaves[sources[matches[0]].leaf].path)}'}}) (or split_batch(..., layout=...))."
        )
    if (  # a point set's batch column under a name for one (``original_batch``, PyG's ``batch``): a batch vector
        num_chunks > 1 and role is None and (x.dim() == 1 or (x.dim() == 2 and x.shape[1] == 1))
        and not x.dtype.is_floating_point and x.dtype != torch.bool and _NAMES_BATCH.search(str(key_of(leaf.path)))
        and torch.equal(x.reshape(-1).long().cpu(), sources[matches[0]].batch_index.cpu())
    ):
        return resolve_indices(replace(leaf, role=Role.INDICES, refs=("batch",)), leaves, sources)
    if (
        num_chunks > 1
        and role is None
        and not x.dtype.is_floating_point
        and x.dtype != torch.bool
        and _NAMES_INDICES_TOO.search(str(key_of(leaf.path)))
    ):
        _warning_cache.warn(
            f"split_batch: {leaf.name} is an integer tensor under a key that names indices, split as per-point values of "
            f"{sources[matches[0]].name} (its length is that set's number of points), so its values are not re-based "
            "to each chunk's rows. If it holds row indices into a point set (FCGF's negatives, a neighbor list), give "
            f"it the role 'indices' naming the set its values are rows of: layout={{{key_of(leaf.path)!r}: "
            f"'indices:{key_of(leaves[sources[matches[0]].leaf].path)}'}} (the point sets: "
            f"{', '.join(repr(key_of(leaves[s.leaf].path)) for s in sources)}; ME.utils.sparse_quantize's inverse map "
            "holds rows of the voxels, its unique map rows of the original points); if it is per-point data, "
            f"layout={{{key_of(leaf.path)!r}: 'points'}} says so and silences this."
        )
    return replace(leaf, role=Role.POINTS, source=matches[0])


#: keys that name a batch vector (each point's sample), taken for one where it equals a point set's batch column
_NAMES_BATCH = re.compile(r"batch", re.IGNORECASE)  # not scene / sample ids: a dataset's indices can equal 0..B-1
#: keys that name indices but are not taken for them without ``layout`` (``corr``, ``match``, ``pair`` are: records.py)
_NAMES_INDICES_TOO = re.compile(  # sparse_quantize's maps too: inverse_map, unique_map
    r"neg|idx|index|indices|neighbo|knn|anchor|inverse|unique|(^|_)maps?$|(^|_)pos(itive)?s?(_|$|\d)", re.IGNORECASE
)


def _same_number(leaf: Leaf, leaves: tuple[Leaf, ...], sources: tuple[Source, ...], matches: list[int]) -> list[int]:
    """Of sources of the same length, the one whose key carries the same number as the leaf's
    (``feats0`` -> ``coords0``, ``sinput1_F`` -> ``sinput1_C``), when exactly one does; else all of them."""
    number = re.findall(r"\d+", str(key_of(leaf.path)))
    same = [n for n in matches if number and re.findall(r"\d+", str(key_of(leaves[sources[n].leaf].path))) == number]
    return same if len(same) == 1 else matches


def _steps(leaf: Leaf) -> list[Any]:
    """``leaf``'s path as its keys and indices (``["inverse_maps", 0]``)."""
    return [getattr(k, "key", getattr(k, "idx", None)) for k in leaf.path]


def _sample_list_hint(leaf: Leaf, leaves: tuple[Leaf, ...], num_samples: int) -> str:
    """The fix for a tensor that is an entry of a list with one entry per sample (each sample's own inverse map, its
    labels: ``batch["inverse_maps"][b]``), else ``""``."""
    steps = _steps(leaf)
    if len(steps) < 2 or not isinstance(steps[-1], int) or not isinstance(steps[-2], str):
        return ""
    siblings = sum(1 for other in leaves if other.path[:-1] == leaf.path[:-1])
    if siblings != num_samples:
        return ""
    return (
        f"It is entry {steps[-1]} of the list under {steps[-2]!r}, which has one entry per sample ({num_samples}): if "
        f"each entry is its sample's own (its inverse map, its labels, in its own rows), give the list the role "
        f"'samples', SparseDataParallelStrategy(layout={{{steps[-2]!r}: 'samples'}}), and each entry goes with its "
        "sample as it is. "
    )


def _unmatched_hint(leaf: Leaf, num_samples: int, leaves: tuple[Leaf, ...] = ()) -> str:
    """The fix for a tensor whose length matches nothing: the role that fits what it looks like, or the coordinates
    of its point set where the batch holds them under a key that names no coordinates."""
    x, key = leaf.value, key_of(leaf.path)
    for other in leaves:
        y = other.value
        if (other is not leaf and other.role is None and isinstance(y, Tensor) and y.dim() == 2
                and y.shape[0] == x.shape[0] and _numbers_samples(y, num_samples)):
            return (
                f"{other.name} has as many rows and looks like the coordinates of its point set (column 0 numbering "
                f"the batch's samples): give it the role 'coordinates', SparseDataParallelStrategy(layout="
                f"{{{key_of(other.path)!r}: 'coordinates'}}), and {leaf.name} is cut with that set's points. "
            )
    steps = _steps(leaf)
    for i in range(len(steps) - 1, 0, -1):  # inside a list of dicts under a key: one entry per sample (targets)
        if isinstance(steps[i], int) and i + 1 < len(steps) and isinstance(steps[i - 1], str):
            return (
                f"It sits in the list under {steps[i - 1]!r}, whose entries look like one per sample (detection "
                f"targets): give the list the role 'samples', SparseDataParallelStrategy(layout={{{steps[i - 1]!r}: "
                "'samples'}), and each sample's entry goes with its sample. "
            )
    integer = not x.dtype.is_floating_point and x.dtype != torch.bool
    if x.dim() == 2 and (looks_like_collated_coordinates(x) or _numbers_samples(x, num_samples)):
        samples = int(x[:, 0].max()) + 1
        return (
            f"It looks like coordinates of a point set of its own (column 0 a batch index numbering {samples} samples"
            f"{'' if samples == num_samples else f', where the batch has {num_samples}'}): give it the role "
            f"'coordinates', SparseDataParallelStrategy(layout={{{key!r}: 'coordinates'}}), and it is split by its "
            "own batch column with the same samples as the rest of the batch. "
        )
    indices = (
        f"If it holds row indices into point sets (e.g. correspondences), give it the role 'indices': "
        f"layout={{{key!r}: 'indices'}}. "
        if integer and x.dim() <= 2
        else ""
    )
    other_set = (
        "If it is per-point data of a point set the batch has no coordinates for (labels of the original points, "
        "which ME.utils.sparse_quantize(..., return_index=True, return_inverse=True) maps to the voxels), put "
        "that set's coordinates in the batch (ME.utils.batched_coordinates of the original points): it is then cut "
        "with its samples, and the inverse map takes the role 'indices:<the voxels' coordinates key>'. "
        if x.dim() <= 2
        else ""
    )
    return (
        "Per-point tensors must have one row per point of a coordinate source, per-sample tensors one row per "
        f"sample. {indices}{other_set}Only a value that is not per-sample data (a constant every replica needs whole, e.g. "
        f"a class-weight table) may take the role 'replicate' (layout={{{key!r}: 'replicate'}}); per-sample data "
        "passed whole would train every replica on every sample."
    )


def _numbers_samples(x: Tensor, num_samples: int) -> bool:
    """Whether ``x`` is ``[M, D+1]`` whose column 0 holds whole numbers that are every sample ``0..B-1`` and nothing
    else, in any order (coordinates whose batch column is not sorted: a target set collated sample by sample out of
    order), with more rows than samples."""
    if x.dim() != 2 or x.shape[1] < 2 or x.shape[0] <= num_samples or x.dtype == torch.bool or x.is_complex():
        return False
    column = x[:, 0]
    if x.dtype.is_floating_point and not bool((column == column.floor()).all()):
        return False
    found = torch.unique(column.long())
    return found.numel() == num_samples and int(found[0]) == 0 and int(found[-1]) == num_samples - 1


def _has_length(x: Any) -> bool:
    return (isinstance(x, (Tensor, np.ndarray)) and x.ndim > 0) or type(x) in (list, tuple)


def _sequence_role(leaf: Leaf, sources: tuple[Source, ...], num_samples: int) -> str:
    """A list / tuple / numpy array: per-sample when its length is ``B``, else passed whole.

    A numpy array with one row per point is refused: ME needs tensors.
    """
    x = leaf.value
    length = len(x) if not isinstance(x, np.ndarray) or x.ndim > 0 else -1
    if length == num_samples:
        if leaf.role is None and type(x) in (list, tuple) and x and isinstance(x[0], (Mapping, list, tuple)):
            _warning_cache.info(  # records (dicts, tuples) as many as the samples: per-sample metadata, or a list of
                f"split_batch: {leaf.name} holds {length} entries, as many as the batch's samples: it is cut with its "
                "samples, as per-sample metadata (img_metas, targets). If it is not per-sample (augmentation "
                "configs, per-class entries), give it the role 'replicate': "
                f"layout={{{key_of(leaf.path)!r}: 'replicate'}} (or 'samples' to silence this)."
            )  # configs whose count equals B by chance: said, once per name
        return Role.SAMPLES
    if type(x) in (list, tuple) and any(isinstance(e, Tensor) for e in x):
        raise BatchLayoutError(
            f"{leaf.name} is a per-sample list of {length} tensors, but the batch has {num_samples} samples: give one "
            "tensor per sample (in batch order), or collate them into one tensor (indices offset by the points of "
            "the samples before, with the role 'indices')."
        )
    if isinstance(x, np.ndarray) and any(src.num_points == length for src in sources):
        raise BatchLayoutError(
            f"{leaf.name} is a numpy array with one row per point ({length}); convert it with torch.as_tensor(...) in "
            "the collate function (ME.utils.sparse_collate does so): it is then split with its points."
        )
    hint = _empty_sample_hint(sources, length, num_samples) if leaf.role is None else ""
    if hint:  # a per-sample list (names, paths) beside coordinates that lost their last samples: said, not guessed
        _warning_cache.warn(
            f"split_batch: {leaf.name} has {length} entries where the batch's coordinates number {num_samples} "
            f"samples: it is passed whole to every replica, as a list that is not per-sample. {hint}If it is not "
            f"per-sample (class names), layout={{{key_of(leaf.path)!r}: 'replicate'}} says so and silences this."
        )
    return Role.REPLICATE


def _empty_sample_hint(sources: tuple[Source, ...], length: int, num_samples: int) -> str:
    """Words for a per-sample tensor longer than ``B``: the last samples had no points."""
    if not sources or not num_samples < length < min(src.num_points for src in sources):
        return ""
    missing = length - num_samples
    return (
        f"If the batch has {length} samples, the last {missing} of them ha{'s' if missing == 1 else 've'} no points "
        f"(the batch index numbers only samples 0..{num_samples - 1}, which have points): an empty sample cannot be "
        "split or fed to ME. Drop empty samples before collation (in the Dataset or the collate function). "
    )


def targets(leaves: tuple[Leaf, ...], sources: tuple[Source, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the per-point targets and of the per-sample tensors of the batch (see
    :class:`~lightning_sparse_dp.split.records.SplitPlan`).

    A coordinate source's first floating-point per-point tensor is its features, not a target (an ME
    tensor carries its own features).
    """
    point_targets, sample_tensors = [], []
    features_seen: set[int] = set()
    for leaf in leaves:
        if not isinstance(leaf.value, Tensor):
            continue
        if leaf.role == Role.SAMPLES:
            sample_tensors.append(leaf.name)
        elif leaf.role == Role.POINTS:
            is_features = (
                leaf.value.dtype.is_floating_point
                and not is_me_tensor(leaves[sources[leaf.source].leaf].value)
                and leaf.source not in features_seen
            )
            if is_features:
                features_seen.add(leaf.source)
            else:
                point_targets.append(leaf.name)
    return tuple(point_targets), tuple(sample_tensors)


__all__ = ["resolve_roles", "targets"]
