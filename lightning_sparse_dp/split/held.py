"""Held layouts: the split's decisions about a batch's structure, made once and reused while they hold.

:func:`~lightning_sparse_dp.split.plan_split` reads a batch in two kinds of steps. Some depend only on its structure:
the flattening (:mod:`.leaves`: the pytree spec, every leaf's path, name and ``layout`` entry), which leaves are
coordinate sources (:mod:`.sources`' finding) and every other leaf's role and source (:mod:`.roles`), and which
tensors are targets. The others read its values: each source's batch column checked and counted, the samples
assigned, the rows cut. A training loop gives batches of one structure step after step, so the strategy keeps a
:class:`HeldLayouts` (one per strategy, passed in its split options as ``layouts``) and the first kind is made once.

Where it is held: in the strategy's object, keyed on the batch's structure (its container type and keys for a
batch of one level, else its pytree spec) and its leaves' kinds (a tensor's type, dtype and dimensions, another
leaf's type), and the ``layout``; not process-wide. A held layout is read for a batch only when every premise of
its decisions holds again, checked per batch without the derivation:

- the key is equal (structure, kinds, ``layout``);
- each source's batch column passes :func:`~.sources.check_coordinates` / :func:`~.sources.check_batch_index`,
  and the sources number the same samples ``B``;
- every leaf whose role the derivation read off its length has the same match again: its length equal to ``B`` or
  not, and equal to each source's points ``N`` or not, as when derived (so no new ``N == B`` ambiguity, and every
  per-point or per-sample leaf still has its role's length).

Only decisions that read nothing but the structure are held, or whose reading of values is done again per batch: a
layout is held only when every coordinate source was found by its kind or name (an ME tensor, a ``COORDINATE_KEYS``
key, the role ``"coordinates"``) and no other leaf could have been one by its values (an integer matrix, a tensor
under a key that names coordinates, a numpy array of numbers), or every source was an integer tensor found by its
look (``sparse_collate``'s tuple; then every tensor whose look the derivation read is read again, the same tensors
must look like coordinates, and a source that may be one row per sample is refused as the derivation refuses it);
no leaf holds row indices (``"indices"``, per-sample index lists: their checks read values), no
leaf's length matched several sources, and the batch was cut into several chunks (no role left ``"replicate"``
for one chunk). Any failing premise, or a batch whose check raises, takes the full derivation for that batch,
which raises the same errors as without a held layout.

One decision is kept across batches rather than per batch: a list or tuple passed whole at a batch whose samples it
did not number (class names) stays whole at a later batch whose samples it happens to number, a short last batch
(:meth:`HeldLayouts.keep_whole`, said once), as one device's step gets it whole.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp.runtime.me import is_me_tensor
from lightning_sparse_dp.runtime.process import SAID_ONCE
from lightning_sparse_dp.split.leaves import key_of, tensor_lists
from lightning_sparse_dp.split.records import (
    COORDINATE_KEYS,
    BatchLayoutError,
    Leaf,
    Role,
    Source,
    names_coordinates,
    names_indices,
)
from lightning_sparse_dp.split.sources import (
    check_batch_index,
    check_coordinates,
    looks_like_collated_coordinates,
    refuse_ambiguous,
)

#: the most layouts a :class:`HeldLayouts` keeps (a fit's training and validation loaders, the exactness check's copy)
HELD = 8


@dataclass(frozen=True)
class Held:
    """One batch structure's decisions.

    Attributes:
        leaves: per leaf, ``(path, name, role, source, refs)`` as the roles left it.
        sources: per coordinate source, ``(name, leaf)``; ``me``: whether that leaf is an ME tensor.
        matches: per leaf, ``None`` (a role that reads no length) or its length's match, ``(== B, (== N_s, ...))``.
        looks: the leaves whose look (:func:`~.sources.looks_like_collated_coordinates`) is read per batch, when the
            sources were found by it; ``look_sources``: those of them that looked alike (the sources' leaves).
        point_targets, sample_tensors: the plan's target names (:func:`~.roles.targets`).
    """

    leaves: tuple[tuple[Any, str, str, int, tuple[str, ...]], ...]
    sources: tuple[tuple[str, int], ...]
    me: tuple[bool, ...]
    matches: tuple[tuple[bool, tuple[bool, ...]] | None, ...]
    spec: Any
    point_targets: tuple[str, ...]
    sample_tensors: tuple[str, ...]
    looks: tuple[int, ...] = ()
    look_sources: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Read:
    """A held layout read for one batch: what :func:`~lightning_sparse_dp.split.plan_split`'s derivation would give.

    Attributes:
        leaves: the batch's :class:`~.records.Leaf` records with their roles; ``spec``: its pytree spec.
        sources: its coordinate sources with their batch indices and points per sample (``counts``).
        num_samples: ``B``.
    """

    leaves: tuple[Leaf, ...]
    spec: Any
    sources: tuple[Source, ...]
    num_samples: int
    point_targets: tuple[str, ...]
    sample_tensors: tuple[str, ...]


class HeldLayouts:
    """The batch layouts one strategy holds (at most :data:`HELD`), by batch structure and leaf kinds.

    :meth:`read` gives a held layout's decisions for a batch whose premises hold (the module docstring), else
    ``None``; :meth:`hold` keeps a derivation's decisions when they read nothing but the structure. ``derived`` counts
    the derivations held (for tests and diagnostics).
    """

    def __init__(self) -> None:
        self._held: dict[Any, Held] = {}
        self._layout: dict[Any, str] | None = None
        self.derived = 0
        #: lists and tuples passed whole at a batch whose samples they did not number (a constant list: class names),
        #: by name: ``(their length, the batch's samples)`` then (:meth:`keep_whole`)
        self.whole: dict[str, tuple[int, int]] = {}

    def keep_whole(self, flat: tuple[Leaf, ...], leaves: tuple[Leaf, ...], num_samples: int) -> tuple[Leaf, ...]:
        """``leaves`` (roles resolved; ``flat``: their roles from ``layout`` only), where a list or tuple the derivation
        made per-sample because it has as many entries as this batch's samples, and that was passed whole at an earlier
        batch whose samples it did not number, is passed whole again (said once): a constant list (class names) whose
        length a batch's size happens to equal (a short last batch) is no per-sample list, and one device's step gets it
        whole. Lists passed whole are noted."""
        out = []
        for given, leaf in zip(flat, leaves):
            x = leaf.value
            if given.role is not None or type(x) not in (list, tuple):
                out.append(leaf)
                continue
            if leaf.role == Role.REPLICATE:
                self.whole.setdefault(leaf.name, (len(x), num_samples))
            elif leaf.role == Role.SAMPLES and leaf.name in self.whole:
                length, samples = self.whole[leaf.name]
                SAID_ONCE.info(
                    f"split_batch: {leaf.name} has as many entries as this batch's samples ({num_samples}), but it had "
                    f"{length} where a batch had {samples}: it is passed whole again, a list that is not per-sample "
                    "(class names). If it is per-sample, give it the role 'samples': "
                    f"layout={{{key_of(leaf.path)!r}: 'samples'}}; if it is constant, 'replicate' silences this."
                )
                leaf = replace(leaf, role=Role.REPLICATE)
            out.append(leaf)
        return tuple(out)

    def _key(self, batch: Any, layout: Mapping[Any, str] | None) -> tuple[Any, list[Any]]:
        """The batch's key (structure and leaf kinds) and its leaves' values."""
        if (dict(layout) if layout else None) != self._layout:  # another layout: nothing held stands
            self._held.clear()
            self._layout = dict(layout) if layout else None
        values = None
        if type(batch) in (dict, list, tuple):  # one level of tensors (ME's collations): no pytree walk
            values = list(batch.values()) if type(batch) is dict else list(batch)
            structure: Any = (type(batch), tuple(batch) if type(batch) is dict else len(batch))
        if values is None or not all(type(x) is Tensor or is_me_tensor(x) for x in values):
            values, structure = pytree.tree_flatten(batch, is_leaf=tensor_lists(layout))
        kinds = tuple(
            (type(x), x.dtype, x.dim()) if isinstance(x, Tensor) else (type(x), x.dtype, x.ndim)
            if isinstance(x, np.ndarray) else type(x)
            for x in values
        )
        return (structure, kinds), values

    def read(self, batch: Any, layout: Mapping[Any, str] | None, batch_sizes: Collection[int] | None = None) -> Read | None:
        """The held decisions for ``batch`` with its values, or ``None``: none held for its key, or a premise fails
        (then the caller derives everything, raising what the derivation raises). ``batch_sizes`` as
        :func:`~.sources.find_sources` takes them (for sources found by their look)."""
        key, values = self._key(batch, layout)
        held = self._held.get(key)
        if held is None:
            return None
        if held.looks and [i for i in held.looks if looks_like_collated_coordinates(values[i])] != held.look_sources:
            return None  # another tensor looks like coordinates, or a source no longer does
        sources = []
        try:
            for (name, i), me in zip(held.sources, held.me):
                x = values[i]
                if held.looks:  # found by its look: its batch column as find_sources takes it, and the same refusal
                    refuse_ambiguous(Leaf(held.leaves[i][0], name, x), batch_sizes)
                    batch_index = x[:, 0].long().cpu()
                else:
                    batch_index = (x.C[:, 0].long() if me else check_coordinates(x, name)).cpu()
                sources.append(Source(name, i, batch_index, check_batch_index(batch_index, name)))
        except BatchLayoutError:
            return None
        num_samples = int(sources[0].counts.numel())
        points = [int(s.batch_index.numel()) for s in sources]
        for s in sources[1:]:
            if int(s.counts.numel()) != num_samples:
                return None
        for x, match in zip(values, held.matches):
            if match is not None:
                length = len(x) if not isinstance(x, Tensor) else int(x.shape[0])
                if match != (length == num_samples, tuple(length == n for n in points)):
                    return None
        leaves = tuple(Leaf(p, name, x, role, source, refs) for (p, name, role, source, refs), x in zip(held.leaves, values))
        return Read(leaves, held.spec, tuple(sources), num_samples, held.point_targets, held.sample_tensors)

    def hold(
        self, batch: Any, layout: Mapping[Any, str] | None, flat: tuple[Leaf, ...], leaves: tuple[Leaf, ...], spec: Any,
        sources: tuple[Source, ...], num_samples: int, targets: tuple[tuple[str, ...], tuple[str, ...]],
    ) -> None:
        """Keep a derivation's decisions for ``batch`` (cut into several chunks) when they read only its structure.

        Args:
            flat: the leaves as flattened (roles from ``layout`` only); ``leaves``: with every role resolved.
            sources: the coordinate sources, with their batch indices; ``num_samples``: ``B``.
            targets: ``(point_targets, sample_tensors)`` of the plan.
        """
        found = _structural(flat, leaves, sources, num_samples)
        if found is None:
            return
        matches, looks = found
        key, _ = self._key(batch, layout)
        if len(self._held) >= HELD:
            self._held.clear()
        self._held[key] = Held(
            leaves=tuple((leaf.path, leaf.name, leaf.role, leaf.source, leaf.refs) for leaf in leaves),
            sources=tuple((s.name, s.leaf) for s in sources),
            me=tuple(is_me_tensor(leaves[s.leaf].value) for s in sources),
            matches=matches, spec=spec, point_targets=targets[0], sample_tensors=targets[1], looks=looks,
            look_sources=[s.leaf for s in sources] if looks else [],
        )
        self.derived += 1


def _structural(
    flat: tuple[Leaf, ...], leaves: tuple[Leaf, ...], sources: tuple[Source, ...], num_samples: int,
) -> tuple[tuple[tuple[bool, tuple[bool, ...]] | None, ...], tuple[int, ...]] | None:
    """Per leaf, the length match its role was read off (``None``: none read), and the leaves whose look is read
    again per batch (empty unless the sources were found by their look), when the derivation's decisions are held by
    the module docstring's rules; else ``None``."""
    if not sources:
        return None
    named = [
        before.role == Role.COORDINATES or is_me_tensor(before.value)
        or (before.role is None and isinstance(key_of(before.path), str) and key_of(before.path).lower() in COORDINATE_KEYS)
        for before in flat
    ]
    by_look = not named[sources[0].leaf]
    if any(named[s.leaf] == by_look for s in sources):
        return None  # sources found by their names and by their look: which look-alikes joined read their values
    looks = tuple(  # every tensor find_sources asks whether it looks like coordinates (sources.py, rule 3)
        i for i, leaf in enumerate(flat)
        if by_look and leaf.role is None and isinstance(leaf.value, Tensor) and leaf.value.dim() == 2
        and leaf.value.dtype != torch.bool and not leaf.value.is_complex()
    )
    if by_look and (
        any(flat[s.leaf].value.dtype.is_floating_point for s in sources)
        or [i for i in looks if looks_like_collated_coordinates(flat[i].value)] != [s.leaf for s in sources]
    ):
        return None  # floating-point look-alikes (decided by their rows), or look-alikes left aside
    points = [s.num_points for s in sources]
    matches: list[tuple[bool, tuple[bool, ...]] | None] = []
    for before, after in zip(flat, leaves):
        x, key = before.value, key_of(before.path)
        if after.role == Role.COORDINATES:
            matches.append(None)
            continue
        if after.role == Role.INDICES or (names_indices(key) and type(x) in (list, tuple)):
            return None  # row indices: checked against their sources' values
        if before.role is None and isinstance(x, Tensor) and (
            names_coordinates(key) or (not by_look and x.dim() == 2 and not x.dtype.is_floating_point and not x.is_complex())
        ):
            return None  # could be a coordinate source by its values (rules 2 and 3 of sources.py)
        if before.role is None and isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype.kind in "iuf":
            return None  # could look like coordinates (refused by its values)
        has_length = (isinstance(x, (Tensor, np.ndarray)) and x.ndim > 0) or type(x) in (list, tuple)
        if before.role in (Role.SAMPLES, Role.REPLICATE) or not has_length:
            matches.append(None)
            continue
        length = int(x.shape[0]) if isinstance(x, (Tensor, np.ndarray)) else len(x)
        match = tuple(length == n for n in points)
        if sum(match) > 1:
            return None  # several sources of its length: their batch indices decided
        matches.append((length == num_samples, match))
    return tuple(matches), looks


__all__ = ["HELD", "Held", "HeldLayouts", "Read"]
