"""Watch: what a step's state follows of the module and its replicas, derived once and reused while it holds.

Every step :class:`~lightning_sparse_dp.replica.changes.ModuleChanges` sorts the module's ``__dict__`` entries by what
the step's state does with them (followed or not, lists and short dicts each replica gets a copy of, tensors whose
in-place changes are said, plain objects whose public attributes are compared), and each replica gets a view of the
trainer and a ``self.log`` recorder. Those depend only on the module and its replicas, not on the batch: the persistent
replicas hold them in a :class:`ReplicaWatch` (made with their
:class:`~lightning_sparse_dp.replica.attributes.SubmoduleChanges`, so replicas rebuilt for a changed module start a new
one), and a step reuses them while their premise holds:

- the :class:`Listing` of the module's entries (:func:`list_entries`), while the module's ``__dict__`` has the same keys
  in the same order, the same objects under the keys that are not the library's (:func:`~.snapshot.library_keys`), and
  its followed dicts on the same side of :data:`~.snapshot.SHORT` (:meth:`ReplicaWatch.listed`: one pass in C, no Python
  call per entry); an attribute added, removed or replaced (by a hook, a callback, the step itself) lists them again;
- what the containers hold (their sizes and tensors, :func:`container_marks`) is read every step, as it changes;
- a replica's trainer view (:func:`~lightning_sparse_dp.replica.effects.trainer_view`), while its trainer is the same
  object of the same class (a new trainer gets a new view);
- a replica's :class:`~lightning_sparse_dp.replica.recorder.LogRecorder`, emptied each step, where the module has no
  torchmetrics metric (else each step's recorder is made with the step's metric copies; whether it has metrics is
  :class:`~lightning_sparse_dp.replica.metrics.ReplicaMetrics`'s, kept while the replicas are, and a step without them
  makes, installs and merges no copies).

After the step, the copies of the module's lists and dicts that no replica's step touched are given back without a
merge (:func:`untouched_copies`: the full merge would find nothing either).

Without a watch (the module itself as the one replica, replicas made by hand) each step derives them anew, by the same
functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Any

from torch import Tensor

from lightning_sparse_dp.replica import snapshot

MISSING = object()  #: an entry a dict does not hold

#: what makes a copied container's entries worth a walk (:func:`~.snapshot.copy_nested`, :func:`~.snapshot.nested_sizes`,
#: :func:`~.snapshot.nested_tensors` find something in them)
_NESTED = (list, dict, Tensor)


@dataclass(eq=False)
class Listing:
    """The module's followed ``__dict__`` entries, sorted (:func:`list_entries`).

    Attributes:
        keys: the ``__dict__``'s keys when listed, in their order; ``user``: those not the library's, ``values`` their
            objects then; ``dicts``: the followed dicts, ``short`` whether each had at most
            :data:`~.snapshot.SHORT` entries (what :func:`~.snapshot.is_copied` decides by).
        before: the followed entries (:func:`~.snapshot.followed`), ``key -> value``.
        containers: their keys that each replica gets its own copy of (:func:`~.snapshot.is_copied`).
        marked: their keys, in order, of the tensors and the containers (whose tensors and sizes each step reads).
        objects: their keys of the user's plain objects (:func:`~.snapshot.is_plain_object`).
    """

    keys: tuple[str, ...]
    user: list[str]
    values: list[Any]
    dicts: list[dict]
    short: list[bool]
    before: dict[str, Any]
    containers: list[str]
    marked: list[str]
    objects: list[str]



def list_entries(entries: dict[str, Any]) -> Listing:
    """The :class:`Listing` of a module's ``__dict__`` ``entries``: the derivation every step made before the watch,
    made where no :class:`ReplicaWatch` holds one or its premise failed (an attribute the step sets every step lists
    them every step), by :mod:`~.snapshot`'s rules (:func:`~.snapshot.is_copied`, :func:`~.snapshot.is_plain_object`)
    for the followed entries."""
    library, short = snapshot.library_keys(), snapshot.SHORT
    user = [k for k in entries if k not in library]
    before = snapshot.followed(entries)
    copied = {k for k, v in before.items() if snapshot.is_copied(v)}
    dicts = [v for v in before.values() if isinstance(v, dict)]
    return Listing(
        keys=tuple(entries), user=user, values=[entries[k] for k in user], dicts=dicts,
        short=[len(d) <= short for d in dicts], before=before,
        containers=[k for k in before if k in copied],
        marked=[k for k, v in before.items() if isinstance(v, Tensor) or k in copied],
        objects=[k for k, v in before.items() if snapshot.is_plain_object(v)],
    )


def container_marks(
    listing: Listing,
) -> tuple[dict[str, list[tuple[Any, int]]], list[tuple[str, Tensor, int | Tensor | None]], set[str]]:
    """What a step reads of the listed containers and tensors as it finds them: each copied container's sizes
    (:func:`~.snapshot.nested_sizes`, by ``self.<key>``), the tensors (and those in the copied containers) with their
    marks (:func:`~.snapshot.tensor_mark`; :func:`~.snapshot.nested_tensors`), and the keys of the flat lists and dicts,
    whose copy is ``.copy()``: those that :func:`~.snapshot.copy_nested` copies alone, with no list, dict or tensor in
    them that a copy, a size or a version follows (a longer list's entries are never followed; found in C)."""
    sizes: dict[str, list[tuple[Any, int]]] = {}
    versions: list[tuple[str, Tensor, int | Tensor | None]] = []
    flat: set[str] = set()
    before = listing.before
    for key in listing.marked:
        value, name = before[key], f"self.{key}"
        if isinstance(value, Tensor):
            versions.append((name, value, snapshot.tensor_mark(value)))
        elif len(value) > snapshot.SHORT or not any(
            map(isinstance, value.values() if isinstance(value, dict) else value, repeat(_NESTED))
        ):
            sizes[name] = [(value, len(value))]
            if type(value) in (list, dict):
                flat.add(key)
        else:
            sizes[name] = list(snapshot.nested_sizes(value))
            versions.extend((n, t, snapshot.tensor_mark(t)) for n, t in snapshot.nested_tensors(value, name))
    return sizes, versions, flat


def untouched_copies(before: dict[str, Any], keys: list[str], replicas: Sequence[Any], entered: list[dict[str, Any]]) -> set[str]:
    """The ``keys`` of the module's lists and dicts (``before``: its followed entries) whose copies every replica's
    step left as it was given them (``entered``: each replica's entries as its step found them): the same object,
    holding the module's entries, the same objects in the same number. Nothing of them is merged (the full merge would
    find nothing either); the replicas get the module's objects back."""
    out = set()
    for key in keys:
        mine = before[key]
        for replica, given in zip(replicas, entered):
            copy = given.get(key, MISSING)
            if replica.__dict__.get(key, MISSING) is not copy or type(copy) is not type(mine) or len(copy) != len(mine):
                break
            if isinstance(mine, dict):
                if not all(map(is_, map(copy.get, mine, repeat(MISSING)), mine.values())):
                    break
            elif not all(map(is_, copy, mine)):
                break
        else:
            out.add(key)
    return out


class ReplicaWatch:
    """What the persistent replicas hold from step to step for their state (see the module docstring).

    Args:
        count: the number of replicas.

    Attributes:
        listing: the module's :class:`Listing` (``None`` until a step lists it).
        views: per replica, ``(trainer, its class, the view)`` last given (``None`` before).
        recorders: per replica, the recorder it was last given where the module had no metric (``None`` before).
    """

    def __init__(self, count: int) -> None:
        self.listing: Listing | None = None
        self.views: list[tuple[Any, type, Any] | None] = [None] * count
        self.recorders: list[Any] = [None] * count

    def listed(self, entries: dict[str, Any]) -> Listing:
        """The module's :class:`Listing` for this step (``entries``: its ``__dict__`` now): the one held while it holds
        (the same keys in the same order, the same objects under the user's keys, the followed dicts on the same side
        of :data:`~.snapshot.SHORT`: one pass in C), else listed again (:func:`list_entries`) and held."""
        held = self.listing
        if (
            held is not None
            and held.keys == tuple(entries)
            and all(map(is_, map(entries.__getitem__, held.user), held.values))
            and list(map(snapshot.SHORT.__ge__, map(len, held.dicts))) == held.short
        ):
            return held
        listing = self.listing = list_entries(entries)
        return listing


__all__ = ["MISSING", "Listing", "ReplicaWatch", "container_marks", "list_entries", "untouched_copies"]
