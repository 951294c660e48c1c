"""Attributes: what a step sets on the module's submodules, found on the replicas' copies of them.

A layer that notes what passes through it on itself (``self.last_attention = attn``, ``self.trans = matrix`` for a
regularizer, ``self.calls += 1``) does so on its replica's copy in a ``sparse_dp`` step: every step
(:meth:`~lightning_sparse_dp.step.replicate.Replicas.refresh_replica`) gives each copy its module's ``__dict__`` entries
again, so what the step set there is lost, and the module's layer never changes, where one device's does.
:class:`SubmoduleChanges` finds those attributes after each replica's step (in the replica's thread: one identity
comparison per followed entry, in C, once its copies were found clean) for
:class:`~lightning_sparse_dp.replica.changes.ModuleChanges`, which merges them into the module's submodules as it merges the
module's own attributes.

Followed: the plain ``__dict__`` entries of every submodule but the module itself (:class:`ModuleChanges` follows those)
and torchmetrics metrics and their insides (merged by :mod:`~lightning_sparse_dp.replica.metrics`); not torch's own entries of
a module, nor what the strategy itself sets on the copies (:data:`OWN_KEYS`). A layer's lists and short dicts, which
a refresh shares with its copies, get a copy per replica from :class:`~lightning_sparse_dp.replica.changes.ModuleChanges`
before the step (``self.history.append(x)`` changes the replica's own), merged as the module's own lists and dicts are.

Followed too: the ``__slots__`` of those submodules (:func:`slots_of`) that held a tensor when the replicas were built:
torch's pruning (``torch.nn.utils.prune``, Lightning's ``ModelPruning``) and ``weight_norm`` put an ME convolution's
``kernel`` there, a plain tensor that their forward pre-hook sets again (``kernel_orig * kernel_mask``) at every forward,
on the replica's layer in a step; pruning the layer changes its parameters, which builds the replicas anew. ME layers'
other slots hold their settings, which no step rebinds, and are not read. A refresh gives the copies their module's
followed slots again (:meth:`SubmoduleChanges.refresh_slots`); what a step set there is merged as the ``__dict__``
entries are (:meth:`SubmoduleChanges.value` reads either), a tensor of a replica's graph detached.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_
from typing import Any

from torch import Tensor, nn
from torchmetrics import Metric

from lightning_sparse_dp.replica.watch import ReplicaWatch

_MISSING = object()
_MINE, _THEIRS = object(), object()  # what a lookup of a missing key gives on a copy and on its module: never the same

#: ``__dict__`` keys that are not a step's: torch's own entries of every module, the mark
#: ``Module._replicate_for_data_parallel`` leaves on a copy, Lightning's device of a replica, and what the strategy sets
#: on the copies' synchronized batch-norm layers each step (:func:`~lightning_sparse_dp.syncbn.replicas.synchronized`)
OWN_KEYS = frozenset(nn.Module().__dict__) | {"_is_replica", "_device", "collective", "update_running_stats"}


@functools.cache
def slots_of(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, descriptor)`` of every ``__slots__`` attribute of ``cls`` and its bases (not ``__dict__`` and
    ``__weakref__``), each name once, with the descriptor attribute lookup finds (the most derived class's): what
    ``Module._replicate_for_data_parallel`` does not copy (ME's layers keep ``dimension``, ``kernel_generator``,
    ``conv``, ... there; a pruned ME convolution its ``kernel``). Empty for a class without slots."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in out and name in klass.__dict__:
                out[name] = klass.__dict__[name]
    return tuple(out.items())


def slot_value(descriptor: Any, obj: Any, default: Any = None) -> Any:
    """The value of the slot ``descriptor`` (:func:`slots_of`) of ``obj``; ``default`` where it holds none."""
    try:
        return descriptor.__get__(obj, type(obj))
    except AttributeError:
        return default


def remove_attribute(target: nn.Module, key: str) -> None:
    """``target``'s attribute ``key`` removed, from its ``__dict__`` or, where it is a slot (:func:`slots_of`), its
    slot; nothing where it has none."""
    if target.__dict__.pop(key, _MISSING) is not _MISSING:
        return
    descriptor = dict(slots_of(type(target))).get(key)
    if descriptor is not None and slot_value(descriptor, target, _MISSING) is not _MISSING:
        descriptor.__delete__(target)


def followed_modules(names: Sequence[str], modules: Sequence[nn.Module]) -> list[int]:
    """The indices of ``modules`` (a module's ``named_modules()``, the module itself first) whose attributes are
    followed: every submodule but those of torchmetrics metrics (the metric and what is inside it)."""
    metrics = [f"{name}." for name, m in zip(names, modules) if isinstance(m, Metric)]
    return [
        i for i, (name, m) in enumerate(zip(names, modules))
        if i > 0 and not isinstance(m, Metric) and not name.startswith(tuple(metrics))
    ]


class SubmoduleChanges:
    """The attributes a step set, replaced or removed on the replicas' copies of the module's submodules.

    Args:
        names: the qualified names of the module's ``named_modules()`` (``""`` for the module itself).
        sources: those modules, in the same order.
        copies: ``copies[r][i]``: replica ``r``'s copy of ``sources[i]``.
    """

    def __init__(self, names: Sequence[str], sources: Sequence[nn.Module], copies: Sequence[Sequence[nn.Module]]) -> None:
        self.names, self.sources, self.copies = list(names), list(sources), [list(c) for c in copies]
        self._followed = followed_modules(self.names, self.sources)
        self._theirs = [self.sources[i].__dict__ for i in self._followed]
        self._mine = [[c[i].__dict__ for i in self._followed] for c in self.copies]
        # per replica, once its copies held nothing of a step's: (their dicts, the module's, the keys, one entry per
        # followed key; the copies' entries in all), which the next steps compare in one pass; None until then
        self._clean: list[tuple[list[dict], list[dict], list[str], int] | None] = [None] * len(self.copies)
        # the followed entries of the module's submodules: (their dicts, keys, (module index, key) each, entries in all)
        self._entries: tuple[list[dict], list[str], list[tuple[int, str]], int] | None = None
        #: what else the replicas hold from step to step for their state (the module's entries listed, their trainer
        #: views and recorders), made anew with them
        self.watch = ReplicaWatch(len(self.copies))
        # the followed submodules' slots that held a tensor when the replicas were built (module index, name,
        # descriptor): a pruned ME convolution's kernel; none in an unpruned network (ME layers' other slots hold
        # their settings, which no step rebinds), so a step reads none
        self._slots = [
            (i, name, descriptor) for i in self._followed
            for name, descriptor in slots_of(type(self.sources[i]))
            if name not in OWN_KEYS and isinstance(slot_value(descriptor, self.sources[i]), Tensor)
        ]
        self._slot_at = {(i, name): descriptor for i, name, descriptor in self._slots}

    def value(self, module: nn.Module, i: int, key: str, default: Any) -> Any:
        """``module``'s (submodule ``i`` of the module, or a replica's copy of it) attribute ``key``: its ``__dict__``
        entry or, for a followed slot, the slot's value; ``default`` where it holds none."""
        descriptor = self._slot_at.get((i, key))
        return module.__dict__.get(key, default) if descriptor is None else slot_value(descriptor, module, default)

    def refresh_slots(self, r: int) -> None:
        """Replica ``r``'s copies given their module's slot values again (a refresh of ``__dict__`` entries does not
        reach slots), so that a step starts from the module's (a value it set between steps, one merged after the last
        step) and :meth:`changed` finds what the step set. Touches replica ``r`` only; run with its refresh."""
        copies, sources = self.copies[r], self.sources
        for i, _, descriptor in self._slots:
            value = slot_value(descriptor, sources[i], _MISSING)
            copy = copies[i]
            if slot_value(descriptor, copy, _MISSING) is not value:
                if value is _MISSING:
                    descriptor.__delete__(copy)
                else:
                    descriptor.__set__(copy, value)

    def changed(self, r: int) -> list[tuple[int, str]]:
        """``(module index, key)`` of every followed attribute replica ``r``'s copies hold other than their module's:
        set or replaced by the step (not the module's object), added, or removed, in their ``__dict__`` or their slots
        (:meth:`value` reads either). Reads replica ``r``'s copies only, so each replica's thread takes its own after
        its step. While they hold what they held when last found clean, this costs one identity comparison per
        followed entry and one count of their entries, in C (no Python call per entry), and one per slot."""
        out = self._changed_entries(r)
        if self._slots:
            copies, sources = self.copies[r], self.sources
            out.extend(
                (i, name) for i, name, descriptor in self._slots
                if slot_value(descriptor, copies[i], _MISSING) is not slot_value(descriptor, sources[i], _MISSING)
            )
        return out

    def _changed_entries(self, r: int) -> list[tuple[int, str]]:
        """:meth:`changed` of the ``__dict__`` entries."""
        mine = self._mine[r]
        clean = self._clean[r]
        if clean is not None:
            dicts, theirs, keys, entries = clean
            if sum(map(len, mine)) == entries and all(
                map(is_, map(dict.get, dicts, keys, repeat(_MINE)), map(dict.get, theirs, keys, repeat(_THEIRS)))
            ):
                return []
        out: list[tuple[int, str]] = []
        for i, d, source in zip(self._followed, mine, self._theirs):
            out.extend((i, k) for k, v in d.items() if k not in OWN_KEYS and source.get(k, _MISSING) is not v)
            out.extend((i, k) for k in source if k not in d and k not in OWN_KEYS)
        if not out:
            followed = [(d, source, k) for d, source in zip(mine, self._theirs) for k in d if k not in OWN_KEYS]
            self._clean[r] = (
                [d for d, _, _ in followed], [source for _, source, _ in followed], [k for _, _, k in followed],
                sum(map(len, mine)),
            )
        return out

    def containers(self) -> list[tuple[int, str]]:
        """``(module index, key)`` of every followed attribute of the module's submodules that is a list or a dict now
        (none in most networks). The followed entries are listed once and again when the submodules' entries change
        in number or lose one; each call then costs one type check per followed entry, in C."""
        listed = self._entries
        if listed is None or sum(map(len, self._theirs)) != listed[3] or not all(map(dict.__contains__, listed[0], listed[1])):
            entries = [(i, source, k) for i, source in zip(self._followed, self._theirs) for k in source if k not in OWN_KEYS]
            listed = self._entries = (
                [s for _, s, _ in entries], [k for _, _, k in entries], [(i, k) for i, _, k in entries],
                sum(map(len, self._theirs)),
            )
        dicts, keys, names, _ = listed
        return list(compress(names, map(isinstance, map(dict.get, dicts, keys), repeat((list, dict)))))

    def prune(self, r: int) -> None:
        """Replica ``r``'s copies rid of the entries their module no longer has (but :data:`OWN_KEYS`): one the module
        lost between steps (``del model.encoder.cache`` in a hook), which a refresh (``dict.update``) leaves on the
        copies and :meth:`changed` would take for one the step added. Run after the refresh, before the step."""
        for d, source in zip(self._mine[r], self._theirs):
            if len(d) > len(source) + 1:  # the copy's own mark, _is_replica, is one entry the module has not
                for k in [k for k in d if k not in source and k not in OWN_KEYS]:
                    del d[k]

    def name(self, i: int, key: str) -> str:
        """``self.<path>.<key>``: how messages name an attribute of submodule ``i``."""
        return f"self.{self.names[i]}.{key}"


__all__ = ["OWN_KEYS", "SubmoduleChanges", "followed_modules", "remove_attribute", "slot_value", "slots_of"]
