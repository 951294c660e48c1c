"""Leaves: a batch flattened into :class:`~lightning_sparse_dp.split.records.Leaf` records, and back.

Batch containers are traversed with ``torch.utils._pytree`` (dicts, lists, tuples, namedtuples);
``ME.SparseTensor`` / ``ME.TensorField`` are leaves, and so are a list / tuple of non-tensors under a
dict key or beside tensors in a list / tuple (per-sample names, paths, labels) and a numpy array: :func:`is_sequence_leaf`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils._pytree as pytree
from torch import Tensor

from lightning_sparse_dp.runtime.me import is_me_tensor
from lightning_sparse_dp.runtime.process import ONE_LEVEL_LAYOUTS as _ONE_LEVEL
from lightning_sparse_dp.split.records import ROLES, ROLES_WITH_SOURCES, BatchLayoutError, Leaf, Role, names_indices


def _is_atom(x: Any) -> bool:
    """Not a tensor, array or container: a string, number, path, ``None`` or other plain object."""
    return not isinstance(x, (Tensor, Mapping, list, tuple, np.ndarray)) and not is_me_tensor(x)


def _plain(v: Any) -> bool:
    """A plain value, or a list / tuple / dict of plain values (one level)."""
    if isinstance(v, Mapping):
        return all(_is_atom(e) for e in v.values())
    return _is_atom(v) or (type(v) in (list, tuple) and all(_is_atom(e) for e in v))


def _record(x: Any) -> bool:
    """One sample's metadata: a dict of plain values (:func:`_plain`: also lists, tuples and dicts of them) and tensors
    of at most one dimension (``img_metas``' entries, ``{"label": tensor(3), "aug": {"scale": 0.5}}``), or a list /
    tuple of plain values (``[name, scale, [k, k]]``)."""
    if isinstance(x, Mapping):
        return all(_plain(v) or (isinstance(v, Tensor) and v.dim() <= 1) for v in x.values())
    return type(x) in (list, tuple) and all(_plain(v) for v in x)


def is_sequence_leaf(x: Any) -> bool:
    """A plain ``list`` / ``tuple`` of non-tensors (scene names, file paths, ids), of per-sample records
    (:func:`_record`: dicts of plain values or small tensors, tuples of plain values), or a numpy array.

    Under a dict key these are per-sample data when their length is the number of samples ``B``
    (split like per-sample tensors); the split does not descend into them.
    """
    if isinstance(x, np.ndarray):
        return True
    if type(x) not in (list, tuple):
        return False
    return all(_is_atom(v) for v in x) or (len(x) > 0 and all(_record(v) for v in x))


def leaf_predicate(extra: Callable[[Any], bool] | None = None) -> Callable[[Any], bool]:
    """``is_leaf`` for ``torch.utils._pytree``: ME tensors, and sequence leaves that are values of a dict or a NamedTuple,
    or entries of a list / tuple that holds tensors or a dict (``ME.utils.batch_sparse_collate``'s ``(coordinates,
    features, labels)`` with the labels a list of ints; a collate function's ``(batch_dict, names)``).

    pytree asks about a node before its children, so a dict (or such a list / tuple) marks its values that are
    :func:`is_sequence_leaf` and they are then taken whole. ``extra`` marks more leaves.
    """
    marked: set[int] = set()

    def is_leaf(x: Any) -> bool:
        if is_me_tensor(x) or isinstance(x, np.ndarray) or id(x) in marked or (extra is not None and extra(x)):
            return True
        if isinstance(x, Mapping) or (isinstance(x, tuple) and hasattr(x, "_fields")):  # a dict, a NamedTuple
            marked.update(id(v) for v in (x.values() if isinstance(x, Mapping) else x) if is_sequence_leaf(v))
        elif type(x) in (list, tuple) and any(isinstance(v, (Tensor, Mapping)) or is_me_tensor(v) for v in x):
            marked.update(id(v) for v in x if is_sequence_leaf(v))  # beside tensors, or a dict: (batch, names)
        return False

    return is_leaf


def path_name(path: Sequence[Any], root: str = "batch") -> str:
    """``batch['coordinates'][0]`` style name of a pytree key path (``root`` first), for messages and layouts."""
    return root + "".join(str(k) for k in path)


def key_of(path: Sequence[Any]) -> Any:
    """The innermost dict key or sequence index of a pytree key path (None at the top)."""
    if not path:
        return None
    last = path[-1]
    for attr in ("key", "idx", "name"):
        if hasattr(last, attr):
            return getattr(last, attr)
    return None


def layout_entry(path: Sequence[Any], layout: Mapping[Any, Any] | None, root: str = "batch") -> tuple[Any, Any] | None:
    """``(key, value)`` of the entry of ``layout`` (the split's ``layout``, or ``output_layout``) that names a
    pytree leaf: by its path name (``batch['labels']``, :func:`path_name`) first, else its innermost key /
    index (:func:`key_of`); ``None`` when none does."""
    for candidate in (path_name(path, root), key_of(path)) if layout else ():
        if candidate is not None and candidate in layout:
            return candidate, layout[candidate]
    return None


def _layout_role(path: Sequence[Any], layout: Mapping[Any, str] | None) -> tuple[Role | None, tuple[str, ...]]:
    """Role the user gave for this leaf in ``layout`` (:func:`layout_entry`), and the source names after its
    colon (``"indices:coords0,coords1"`` -> ``("indices", ("coords0", "coords1"))``)."""
    entry = layout_entry(path, layout)
    if entry is None:
        return None, ()
    candidate, value = entry
    role, _, refs = str(value).partition(":")
    if role not in ROLES or (refs and role not in ROLES_WITH_SOURCES):
        raise BatchLayoutError(
            f"layout[{candidate!r}] = {value!r}; use one of {ROLES} ('points' and 'indices' may name their "
            "coordinate source(s) after a colon: 'points:target_coordinates', 'indices:coords0,coords1', "
            "'indices:batch,coords0,coords1')."
        )
    return Role(role), tuple(r.strip() for r in refs.split(",")) if refs else ()


def tensor_lists(layout: Mapping[Any, str] | None) -> Callable[[Any], bool]:
    """:func:`leaf_predicate`, and a dict value that is a list / tuple of tensors is one leaf (a per-sample
    list, one tensor per sample) when its key names indices (``correspondences``: each sample's own row
    numbers) or ``layout`` gives that key the role ``"samples"``; so is a list / tuple of dicts (detection targets,
    ``[{"boxes": [k_i, 7], "labels": [k_i]}, ...]``) that ``layout`` gives the role ``"samples"``."""
    marked: set[int] = set()
    base = leaf_predicate(lambda x: id(x) in marked)

    def is_leaf(x: Any) -> bool:
        if isinstance(x, Mapping):
            for key, v in x.items():
                listed = type(v) in (list, tuple) and len(v) > 0
                tensors = listed and all(isinstance(e, Tensor) for e in v)
                named = layout is not None and layout.get(key) == "samples"
                if (tensors and (names_indices(key) or named)) or (listed and named and all(isinstance(e, Mapping) for e in v)):
                    marked.add(id(v))
        return base(x)

    return is_leaf


def _values(batch: dict | list | tuple) -> Any:
    return batch.values() if type(batch) is dict else batch


def _leaf(path: tuple[Any, ...], value: Any, role: str | None, refs: tuple[str, ...]) -> Leaf:
    return Leaf(path, path_name(path), value, role, refs=refs)


#: (container type, its keys or length) -> ``(spec, paths, names)`` of a one-level batch (:func:`_one_level`)


def _one_level(batch: dict | list | tuple) -> tuple[Any, tuple[tuple[Any, ...], ...], tuple[str, ...]]:
    """A one-level batch's pytree spec, its leaves' key paths and names: the same structure step after step, so
    made once per structure (``torch.utils._pytree``'s flatten runs in Python; a TreeSpec is immutable) and kept
    (at most 64 structures). A dict flattens in its keys' order, as ``_pytree``'s does."""
    key = (type(batch), tuple(batch) if type(batch) is dict else len(batch))
    found = _ONE_LEVEL.get(key)
    if found is None:
        spec = pytree.tree_flatten(batch)[1]
        entries = [pytree.MappingKey(k) for k in batch] if type(batch) is dict else map(pytree.SequenceKey, range(len(batch)))
        paths = tuple((entry,) for entry in entries)
        found = (spec, paths, tuple(path_name(p) for p in paths))
        if len(_ONE_LEVEL) >= 64:
            _ONE_LEVEL.clear()
        _ONE_LEVEL[key] = found
    return found


def flatten(batch: Any, layout: Mapping[Any, str] | None) -> tuple[tuple[Leaf, ...], Any]:
    """The leaves of ``batch`` (roles from ``layout`` where it names them) and its pytree spec.

    Raises:
        BatchLayoutError: a ``layout`` key that matches no leaf (the message lists the keys there are),
            or a role not in :data:`~lightning_sparse_dp.split.records.ROLES`.
    """
    if type(batch) in (dict, list, tuple) and all(type(x) is Tensor or is_me_tensor(x) for x in _values(batch)):
        # one level of tensors (ME's collations: a dict, or sparse_collate's tuple): the same leaves, paths and spec
        # as the general walk below, the spec and paths of a structure seen before taken again (_one_level)
        spec, paths, names = _one_level(batch)
        if not layout:
            return tuple(Leaf(p, n, x) for p, n, x in zip(paths, names, _values(batch))), spec
        flat = list(zip(paths, _values(batch)))
    else:
        flat, spec = pytree.tree_flatten_with_path(batch, is_leaf=tensor_lists(layout))
    leaves = tuple(_leaf(tuple(p), x, *_layout_role(p, layout)) for p, x in flat)
    if layout:
        known = {k for leaf in leaves for k in (leaf.name, key_of(leaf.path))}
        unknown = [key for key in layout if key not in known]
        if unknown:
            keys = sorted({repr(key_of(leaf.path)) for leaf in leaves if key_of(leaf.path) is not None})
            raise BatchLayoutError(
                f"layout names {', '.join(map(repr, unknown))}, which matches nothing in the batch. The batch has "
                f"the keys / indices {', '.join(keys) or '(none)'} (leaves: {', '.join(leaf.name for leaf in leaves)}); "
                "name a leaf by its key or index, or by its path as printed here."
            )
    return leaves, spec


def list_parent(leaf: Leaf) -> str | None:
    """The name of the list / tuple a tensor leaf is an element of, else None."""
    if isinstance(leaf.value, Tensor) and leaf.path and hasattr(leaf.path[-1], "idx"):
        return path_name(leaf.path[:-1])
    return None


def numpy_hint(leaves: tuple[Leaf, ...] | list[Leaf]) -> str:
    """What the leaves of a batch without a tensor to split hold instead: numpy arrays, or a dataclass."""
    kept = [leaf for leaf in leaves if dataclasses.is_dataclass(leaf.value) and not isinstance(leaf.value, type)]
    if kept:
        return (
            f" {kept[0].name} is a dataclass ({type(kept[0].value).__name__}), which the split does not open: hold the "
            "batch in a dict or a NamedTuple (the collate function's return), or split it yourself (split_fn=)."
        )
    arrays = [leaf.name for leaf in leaves if isinstance(leaf.value, np.ndarray) and leaf.value.ndim > 1]
    if not arrays:
        return ""
    return (
        f" {', '.join(arrays)} {'is a numpy array' if len(arrays) == 1 else 'are numpy arrays'}: convert coordinates, "
        "features and labels with torch.as_tensor(...) in the collate function, or collate samples with "
        "ME.utils.sparse_collate."
    )


def uncollated_hint(leaves: tuple[Leaf, ...] | list[Leaf]) -> str:
    """A hint when the tensors that disagree are the elements of one list / tuple: samples not collated."""
    parents: dict[str, int] = {}
    for leaf in leaves:
        parent = list_parent(leaf)
        if parent is not None:
            parents[parent] = parents.get(parent, 0) + 1
    lists = [p for p, n in parents.items() if n > 1]
    if not lists:
        return ""
    return (
        f"{lists[0]} looks like a list of per-sample tensors that were not collated. Collate samples into one batch "
        "with ME.utils.sparse_collate(coordinates, features, labels) (coordinates [N, D+1] with the batch index in "
        "column 0) or ME.utils.batched_coordinates, e.g. as the DataLoader's collate_fn."
    )


__all__ = [
    "flatten", "is_me_tensor", "is_sequence_leaf", "key_of", "layout_entry", "leaf_predicate", "list_parent",
    "numpy_hint", "path_name", "tensor_lists", "uncollated_hint",
]
