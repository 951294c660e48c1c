"""Container merge: the replicas' copies of one of the module's lists or dicts merged into it, in place, as one
device's step leaves it (:class:`~lightning_sparse_dp.replica.changes.ModuleChanges` is made of it: the rules are in
that module's docstring).

- a dict (:meth:`ContainerMerge._merge_dict`): each key the replicas set or removed merged as an attribute is, a key
  some replicas added (a per-sample key) added with their value, the lists and dicts in it merged likewise;
- a list (:meth:`ContainerMerge._merge_list`): the ``j``-th entry every replica appended merged into one appended entry,
  the lists and dicts in a short list merged likewise; a list replaced or changed in place, or appended to in different
  numbers, said;
- where the module's own hooks ran once on the module during a manual step (``bases``: the containers as the
  replicas' copies were made from them), what the hooks changed stands (:meth:`ContainerMerge._untouched`), and an entry
  both they and the replicas changed is said.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.replica import snapshot
from lightning_sparse_dp.replica.watch import MISSING as _MISSING


class ContainerMerge:
    """The list and dict merges of :class:`~lightning_sparse_dp.replica.changes.ModuleChanges`, which gives them
    ``bases`` (``id -> (container, its shallow copy)``), the value rules (``_combined``, ``_chunk_count``,
    ``_say_chunk_count``) and ``_to_root``."""

    bases: dict[int, tuple[Any, Any]]
    _combined: Callable[..., Any]
    _chunk_count: Callable[..., Any]
    _say_chunk_count: Callable[..., None]
    _to_root: Callable[[Any], Any]

    def _base(self, container: Any) -> Any:
        """The shallow copy of the module's ``container`` the replicas' copies were made from, where the module's own
        hooks ran in the step (:meth:`once_on_module`); else ``None`` (the container is as they found it)."""
        kept = self.bases.get(id(container))
        return kept[1] if kept is not None and kept[0] is container else None

    def _untouched(self, value: Any, given: Any, depth: int = 0) -> bool:
        """Whether a replica's ``value`` of an entry is what it was given, ``given`` (the module's entry as its copy
        was made): the same object, or its copy (:func:`~.snapshot.copy_nested`) with every entry untouched."""
        if value is given:
            return True
        base = self._base(given)
        if base is None or type(value) is not type(given) or depth > snapshot.DEPTH or len(value) != len(base):
            return False
        if isinstance(base, dict):
            return all(k in value and self._untouched(dict.__getitem__(value, k), v, depth + 1) for k, v in base.items())
        return all(self._untouched(v, g, depth + 1) for v, g in zip(value, base))

    def _say_both_changed(self, entry: str, warning_cache: WarningCache) -> None:
        warning_cache.warn(
            f"sparse_dp: {entry} was changed both by the module's own hooks (on_before_backward / on_after_backward, "
            "run once on the module in a manual step) and by the replicas' steps: the module gets the replicas' "
            "change, merged, which one device's step may have ordered otherwise. Change it in one of the two."
        )

    def _merge_container(
        self, name: str, before: Any, values: list[Any], combine: Callable[[list[Any]], Any], warning_cache: WarningCache,
        depth: int,
    ) -> None:
        """The replicas' copies ``values`` of the module's list or dict ``before``, as their steps left them, merged
        into ``before`` in place (``name``: its path, for the warnings)."""
        if isinstance(before, dict):
            self._merge_dict(name, before, values, combine, warning_cache, depth)
        else:
            self._merge_list(name, before, values, combine, warning_cache, depth)

    def _nested(self, before: Any, values: list[Any], depth: int) -> bool:
        """Whether ``values`` are the replicas' own copies of the container ``before`` (made by
        :func:`~.snapshot.copy_nested`)."""
        if depth > snapshot.DEPTH or not snapshot.is_container(before):
            return False
        return all(type(v) is type(before) and v is not before for v in values)

    def _merge_dict(
        self, name: str, before: dict, values: list[Any], combine: Callable[[list[Any]], Any], warning_cache: WarningCache,
        depth: int,
    ) -> None:
        """A dict: each key the replicas set or removed, as attributes are (:meth:`merge`); a key some replicas added
        (a per-sample key: its replica's) added with their value; the lists and dicts in it merged likewise, in
        place."""
        base = self._base(before)  # where the module's hooks ran: the dict the copies were made from
        keys = list(dict.fromkeys([*before, *(base or ()), *(k for v in values for k in v)]))
        for key in keys:
            mine = dict.get(before, key, _MISSING)  # dict.get: a defaultdict makes no entry
            given = mine if base is None else dict.get(base, key, _MISSING)
            theirs = [dict.get(v, key, _MISSING) for v in values]
            entry = f"{name}[{key!r}]"
            if given is not mine:  # the module's hooks set, added or removed it: theirs stands unless a replica's step
                if all(self._untouched(v, given) for v in theirs):  # changed it too
                    continue
                self._say_both_changed(entry, warning_cache)
            if self._nested(mine, theirs, depth + 1):
                self._merge_container(entry, mine, theirs, combine, warning_cache, depth + 1)
                continue
            setters = [v for v in theirs if v is not given]
            if not setters:
                continue
            if len(setters) == len(theirs) and _MISSING not in setters:  # set by every replica
                self._say_chunk_count(entry, theirs, [given] * len(theirs), warning_cache)
                value = self._combined(entry, theirs, combine, warning_cache)
            elif given is _MISSING and (len(setters) == 1 or snapshot.all_same(setters)):  # added by some: theirs
                value = setters[0]
            elif all(v is _MISSING for v in theirs):  # removed by every replica
                value = _MISSING
            else:
                warning_cache.warn(
                    f"sparse_dp: {entry} was set or removed by some replicas' steps only, or added with different values "
                    "(a branch on the chunk): the module gets what the first did. Change it in every replica's step, "
                    "from the whole batch's values."
                )
                value = setters[0]
            if value is _MISSING:
                before.pop(key, None)
            else:
                before[key] = self._to_root(value)

    def _merge_list(
        self, name: str, before: list, values: list[Any], combine: Callable[[list[Any]], Any], warning_cache: WarningCache,
        depth: int,
    ) -> None:
        """A list: the ``j``-th entry every replica appended merged into one appended entry (:meth:`_combined`); the
        lists and dicts in a short list (:data:`SHORT`) merged likewise, in place."""
        lists = [v for v in values if type(v) is type(before)]
        given = self._base(before)  # where the module's hooks ran: the list the copies were made from
        base = len(before) if given is None else len(given)
        kept = len(lists) == len(values) and all(len(v) >= base for v in lists)
        for j, mine in enumerate(before[:base] if kept and len(before) >= base else ()):
            was = mine if given is None else given[j]
            theirs = [v[j] for v in lists]
            if was is not mine and all(self._untouched(v, was) for v in theirs):
                continue  # set by the module's hooks alone
            if was is mine and len(before) <= snapshot.SHORT and self._nested(mine, theirs, depth + 1):
                self._merge_container(f"{name}[{j}]", mine, theirs, combine, warning_cache, depth + 1)
            elif any(v is not was for v in theirs):
                kept = False
        added = [v[base:] if type(v) is type(before) else [] for v in values]
        counts = {len(a) for a in added}
        if base != len(before) and counts != {0}:  # appended to by the step and the module's hooks: in which order?
            kept = False
        if not kept:
            warning_cache.warn(
                f"sparse_dp: {name} (a list) was replaced or changed in place by the replicas' steps: only entries "
                "appended to it are merged back into the module's list."
            )
        if counts == {0}:
            return
        if len(counts) > 1:
            warning_cache.warn(
                f"sparse_dp: the replicas' steps appended different numbers of entries to {name} "
                f"({[len(a) for a in added]}): the module's list gets each replica's entries in replica order, not one "
                "device's entries."
            )
            for a in added:
                before.extend(self._to_root(a))
            return
        entry = f"the entry appended to {name}"
        for j in range(counts.pop()):
            appended = [a[j] for a in added]
            if self._chunk_count(appended, [0] * len(appended)) is not None:  # len(labels) over equal chunks
                warning_cache.warn(
                    f"sparse_dp: {entry} is one number in every replica's step, which is also each chunk's number of "
                    "samples or points: the replicas agree, so the module gets that value, as DDP keeps rank 0's, where "
                    "one device's step, if it counts the batch, appends the whole batch's count. Count from the whole "
                    "batch in on_*_batch_end (or return the count from the step with output_layout={key: 'sum'})."
                )
            before.append(self._combined(entry, appended, combine, warning_cache, appended=True))


__all__ = ["ContainerMerge"]
