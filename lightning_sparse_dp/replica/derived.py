"""Derived: numbers a replica's step computes from a metric's value (``self.recall(logits, y).mean()``), recomputed
from the root metric's whole-batch value.

A per-class metric value reduced in the step (``.mean()``, ``.sum()``, ``.max()``, ``.nanmean()``, ``100 * ...``,
``value[mask].mean()``) is, in each replica, that reduction of the chunk's value; averaging those over the replicas is
not one device's number, but applying the same calls to the root metric's merged value is. The value a replica
metric's ``forward`` or ``compute`` returns is noted as a root (:func:`noting_value`, on the replicas' metric copies);
from then on the thread's :class:`~lightning_sparse_dp.loss.observer.StepObserver` notes every torch call that takes a
noted tensor (:func:`note_derived`), with its other arguments. :func:`recipe_of` reads a logged tensor's calls back to
the metric's value (a :class:`Recipe`), and :func:`replay` applies them to the root metric's value, where
:func:`same_recipe` finds every replica's calls the same and their other tensors (a mask) equal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_sparse_dp.runtime.process import STEP_OBSERVER as _local

T = TypeVar("T")

#: a table entry's mark of a tensor changed in place (``v *= 100``) or written by ``out=``: not recomputed
CHANGED = "changed in place"


#: the in-place operators' methods (``v *= 100``: ``Tensor.__imul__``)
_INPLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


@dataclass(frozen=True)
class Root:
    """A metric's ``forward`` (``how == "forward"``) or ``compute`` (``"compute"``) value."""

    how: str
    metric: Metric


@dataclass(frozen=True)
class Call:
    """``func(*args, **kwargs)``: in the step's table, a call with noted tensors among its arguments; in a
    :class:`Recipe`, with nodes for arguments."""

    func: Any
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Leaf:
    """In a :class:`Recipe`: the metric value it starts from (``path`` the metric's module path, ``count`` its update
    count when logged)."""

    how: str
    path: str
    metric: Metric
    tensor: Tensor
    count: int


@dataclass(frozen=True)
class Const:
    """In a :class:`Recipe`: an argument not computed from a metric's value (a number, a mask)."""

    value: Any


@dataclass(frozen=True)
class Recipe:
    """How a logged tensor was computed from metric values: ``node`` a :class:`Leaf`, a :class:`Const` or a
    :class:`Call` whose arguments are nodes (lists and tuples of them); ``why`` (with ``node`` ``None``): why it
    cannot be recomputed."""

    node: Any
    why: str | None = None


def noting_value(fn: Callable[..., T], how: str, metric: Metric) -> Callable[..., T]:
    """``fn`` (a replica metric's ``forward`` or ``compute``) whose tensor result is noted as a :class:`Root` in the
    calling thread's step observer (its :attr:`~lightning_sparse_dp.loss.observer.StepObserver.derived`); without an
    observer in the thread it just calls ``fn``."""

    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> T:
        out = fn(*args, **kwargs)
        active = getattr(_local, "active", None)
        if active is not None and isinstance(out, Tensor):
            active.derived[id(out)] = (out, Root(how, metric))
        return out

    return noted


def _noted(table: dict[int, tuple[Tensor, Any]], x: Any) -> bool:
    if isinstance(x, Tensor):
        entry = table.get(id(x))
        return entry is not None and entry[0] is x
    if isinstance(x, (list, tuple)):
        return any(_noted(table, v) for v in x)
    return False


def note_derived(table: dict[int, tuple[Tensor, Any]], func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Note ``out = func(*args, **kwargs)`` in ``table`` (``id -> (tensor, Root | Call | CHANGED)``) when an argument
    is a noted tensor: a tensor ``out`` as that :class:`Call`, or as :data:`CHANGED` where the call wrote into an
    argument (an in-place method, ``out=``), which marks that argument too."""
    if not (any(_noted(table, a) for a in args) or any(_noted(table, v) for v in kwargs.values())):
        return
    name = getattr(func, "__name__", "")
    inplace = "out" in kwargs or name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
    if inplace:
        for a in args:
            if isinstance(a, Tensor):
                table[id(a)] = (a, CHANGED)
    if isinstance(out, Tensor) and (inplace or not any(a is out for a in args)):  # (v.contiguous() is v: as it was)
        table[id(out)] = (out, CHANGED if inplace else Call(func, args, dict(kwargs)))


def recipe_of(value: Tensor, table: dict[int, tuple[Tensor, Any]], paths: dict[int, str],
              count: Callable[[Metric], int], current: Callable[[Root], Any]) -> Recipe | None:
    """How ``value`` was computed from metric values (``table``: :func:`note_derived`'s), else ``None`` (not from one).

    ``paths``: ``id(metric) -> module path`` of the replica's metrics; ``count(metric)``: its update count;
    ``current(root)``: the metric's value now (its forward cache, its cached ``compute()``), which a root must still be.
    A value from a metric that is not the replica's, or was updated or changed since, is a :class:`Recipe` saying why.
    """
    if not _noted(table, value):
        return None
    why: list[str] = []

    def read(x: Any) -> Any:
        if isinstance(x, (list, tuple)) and _noted(table, x):
            return [read(v) for v in x] if isinstance(x, list) else tuple(read(v) for v in x)
        if not isinstance(x, Tensor) or not _noted(table, x):
            return Const(x)
        node = table[id(x)][1]
        if node is CHANGED:
            why.append("a tensor changed in place (v *= 100) or written with out=")
            return None
        if isinstance(node, Root):
            if id(node.metric) not in paths:
                why.append("a metric that is not one of the module's own")
                return None
            if current(node) is not x:
                why.append(f"a value of the metric's {node.how} that a later call replaced")
                return None
            return Leaf(node.how, paths[id(node.metric)], node.metric, x, count(node.metric))
        return Call(node.func, read(node.args), {k: read(v) for k, v in node.kwargs.items()})

    node = read(value)
    return Recipe(None, why[0]) if why else Recipe(node)


def leaves(node: Any) -> list[Leaf]:
    """The :class:`Leaf` nodes of a recipe's ``node``."""
    if isinstance(node, Leaf):
        return [node]
    if isinstance(node, Call):
        return leaves(node.args) + leaves(list(node.kwargs.values()))
    if isinstance(node, (list, tuple)):
        return [leaf for v in node for leaf in leaves(v)]
    return []


def same_recipe(a: Any, b: Any) -> bool:
    """Whether two replicas' recipe nodes are the same calls on the same metrics' values of the same kind, with equal
    other arguments (tensors of one shape and dtype holding the same values, numbers equal)."""
    if isinstance(a, Leaf) or isinstance(b, Leaf):
        return isinstance(a, Leaf) and isinstance(b, Leaf) and (a.how, a.path) == (b.how, b.path)
    if isinstance(a, Const) or isinstance(b, Const):
        if not (isinstance(a, Const) and isinstance(b, Const)) or type(a.value) is not type(b.value):
            return False
        x, y = a.value, b.value
        if isinstance(x, Tensor):
            return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y.to(x.device)))
        try:
            return bool(x == y)
        except Exception:  # noqa: BLE001 - a value that cannot be compared is not known to be the same
            return False
    if isinstance(a, Call) or isinstance(b, Call):
        return isinstance(a, Call) and isinstance(b, Call) and a.func is b.func and same_recipe(a.args, b.args) and (
            a.kwargs.keys() == b.kwargs.keys() and all(same_recipe(a.kwargs[k], b.kwargs[k]) for k in a.kwargs))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_recipe(x, y) for x, y in zip(a, b))
    return False


def replay(node: Any, value_of: Callable[[Leaf], Any], device: torch.device) -> Any:
    """A recipe's ``node`` computed again with each :class:`Leaf` replaced by ``value_of(leaf)`` (the root metric's
    value) and its other tensors moved to ``device``, without gradients."""
    if isinstance(node, Leaf):
        return value_of(node)
    if isinstance(node, Const):
        return node.value.to(device) if isinstance(node.value, Tensor) else node.value
    if isinstance(node, Call):
        args = replay(node.args, value_of, device)
        kwargs = {k: replay(v, value_of, device) for k, v in node.kwargs.items()}
        with torch.no_grad():
            return node.func(*args, **kwargs)
    return type(node)(replay(v, value_of, device) for v in node)  # a list or tuple of nodes




def whole_batch_value(recipes: list[Recipe | None], root: torch.nn.Module, device: torch.device,
                      count: Callable[[Metric], int], forward: Callable[[Metric], Any]) -> Tensor | str | None:
    """One device's value of a name every replica logged as computed from metric values (``recipes``, one per
    replica, :func:`recipe_of`'s): the same calls on ``root``'s metrics' values (merged from the replicas': the
    ``forward`` cache, ``compute()``); ``None`` where no replica's value is computed from a metric's, else the reason
    (a ``str``) it cannot be recomputed. ``count`` / ``forward``: a metric's update count / forward cache now.

    A ``forward`` value must be its replica metric's only forward of the step (one device calls it once, on the whole
    batch), a ``compute()`` value the metric's after every update of the step.
    """
    if all(r is None for r in recipes):
        return None
    if any(r is None for r in recipes):
        return "only some replicas computed it from the metric's value"
    why = next((r.why for r in recipes if r.why is not None), None)  # type: ignore[union-attr]
    if why is not None:
        return f"from {why}"
    first = recipes[0].node  # type: ignore[union-attr]
    if not all(same_recipe(first, r.node) for r in recipes[1:]):  # type: ignore[union-attr]
        return "with other values that differ between the replicas (e.g. a mask or weights from the chunk's labels)"
    for r in recipes:
        for leaf in leaves(r.node):  # type: ignore[union-attr]
            if leaf.how == "forward" and not (count(leaf.metric) == 1 and forward(leaf.metric) is leaf.tensor):
                return "with the metric called more than once in the step"
            if leaf.how == "compute" and not 0 < leaf.count == count(leaf.metric):
                return "before later updates of the metric in the step"
    values: dict[tuple[str, str], Any] = {}

    def value_of(leaf: Leaf) -> Any:
        key = (leaf.how, leaf.path)
        if key not in values:
            metric = root.get_submodule(leaf.path)
            values[key] = forward(metric) if leaf.how == "forward" else metric.compute()
        return values[key]

    try:
        value = replay(first, value_of, device)
    except Exception as error:  # noqa: BLE001 - said, and reduced by the usual rules
        return f"with calls that fail on the whole batch's value ({type(error).__name__}: {error})"
    if not isinstance(value, Tensor) or value.numel() != 1:
        return "with calls that give no single number on the whole batch's value"
    return value


def metric_named(recipes: list[Recipe | None]) -> str:
    """``self.<path>`` of the first metric whose value a replica's recipe starts from, else ``a metric``."""
    for r in recipes:
        if r is not None and r.node is not None:
            found = leaves(r.node)
            if found:
                return f"self.{found[0].path}"
    return "a metric"


__all__ = ["CHANGED", "Call", "Const", "Leaf", "Recipe", "Root", "leaves", "metric_named", "note_derived",
           "noting_value", "recipe_of", "replay", "same_recipe", "whole_batch_value"]
