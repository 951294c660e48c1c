"""Forms: how a tensor of the step was computed from its captured terms (:mod:`~lightning_sparse_dp.loss.capture`).

Sums, differences, products and quotients by numbers (or by tensors that need no gradient: a scheduled
coefficient), negation, copies and conversions keep a tensor a linear combination ``sum_k c_k L_k`` of the
step's terms (:class:`Form` holds the ``c_k``); a stack of one-element losses keeps one combination per entry,
which its ``mean()`` / ``sum()`` combine; any other operation on a term marks the result as not linear, with
the reason (:func:`follow`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from torch import Tensor

_SAME = frozenset({
    "detach", "clone", "float", "double", "half", "bfloat16", "to", "type", "reshape", "view", "squeeze",
    "unsqueeze", "flatten", "contiguous", "positive", "cpu", "cuda", "requires_grad_",
})


_SCALAR_SAME = frozenset({"sum", "mean", "nansum", "nanmean"})  # of a one-element tensor: itself


_ADD = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})


_SUB = frozenset({"sub", "sub_", "subtract", "__sub__", "__isub__"})


_RSUB = frozenset({"__rsub__", "rsub"})


_MUL = frozenset({"mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__"})


_DIV = frozenset({"div", "div_", "divide", "true_divide", "__truediv__", "__itruediv__"})


_NEG = frozenset({"neg", "neg_", "negative", "__neg__"})


_IGNORED = frozenset({"__get__", "__set__", "item", "tolist", "size", "dim", "numel", "backward", "register_hook",
                      "retain_grad", "__format__", "__repr__", "__bool__", "__float__", "__len__"})


class Form:
    """How a tensor of the step was computed from its terms: ``coeffs`` ``{k: c_k}``, or ``None`` and ``why`` not.

    A 1-dim tensor stacked from losses (``torch.stack(losses)``) has ``elements``: the coefficients of each
    of its entries (``coeffs`` is then ``None`` and ``why`` says what a non-reducing use of it means). ``counted``:
    the terms whose coefficient holds a division by a count of the chunk (``loss.sum() / mask.sum()``, see
    :func:`follow`'s ``is_count``).
    """

    __slots__ = ("tensor", "coeffs", "why", "elements", "counted")

    def __init__(
        self, tensor: Tensor, coeffs: dict[int, float] | None, why: str | None = None,
        elements: list[dict[int, float]] | None = None, counted: frozenset[int] = frozenset(),
    ) -> None:
        self.tensor, self.coeffs, self.why, self.elements, self.counted = tensor, coeffs, why, elements, counted


def _number(x: Any) -> float | str:
    """``x`` as a coefficient, or why it cannot be one."""
    if isinstance(x, numbers.Number) and not isinstance(x, complex):
        return float(x)
    if isinstance(x, Tensor):
        if x.requires_grad:
            return "multiplies it by a tensor that requires grad (a learned coefficient)"
        if x.numel() != 1:
            return f"multiplies it by a tensor of shape {tuple(x.shape)}"
        return float(x)
    return f"combines it with a {type(x).__name__}"


def _combine(a: dict[int, float], b: dict[int, float], beta: float) -> dict[int, float]:
    out = dict(a)
    for k, c in b.items():
        out[k] = out.get(k, 0.0) + beta * c
    return out


def follow(
    forms: dict[int, Form], func: Any, args: tuple, kwargs: dict, out: Tensor, is_count: Callable[[Any], bool] | None = None
) -> None:
    """Record in ``forms`` how ``out = func(*args, **kwargs)`` combines the terms its arguments were computed from.
    ``is_count(x)``: whether a divisor ``x`` is a count of the chunk (its terms are then noted in ``Form.counted``)."""
    name = getattr(func, "__name__", "")
    of = [forms.get(id(a)) if isinstance(a, Tensor) else None for a in args]
    if isinstance(args[0] if args else None, (list, tuple)):
        if any(isinstance(t, Tensor) and id(t) in forms for t in args[0]):
            forms[id(out)] = stacked(forms, name, args, kwargs, out)
        return
    if not any(of) or name in _IGNORED:
        return
    stacked_form = next((f for f in of if f is not None and f.elements is not None), None)
    if stacked_form is not None:
        forms[id(out)] = reduced(name, args, kwargs, of, stacked_form, out)
        return
    bad = next((f for f in of if f is not None and f.coeffs is None), None)
    if bad is not None:
        forms[id(out)] = Form(out, None, bad.why)
        return
    coeffs = linear(name, args, kwargs, of, out)
    if not isinstance(coeffs, dict):
        forms[id(out)] = Form(out, None, coeffs)
        return
    counted = frozenset().union(*(f.counted for f in of if f is not None))
    if name in _DIV and is_count is not None and len(args) > 1 and of[0] is not None and is_count(args[1]):
        counted |= frozenset(of[0].coeffs or ())  # divided by a count of the chunk
    forms[id(out)] = Form(out, coeffs, None, counted=counted & coeffs.keys() if counted else counted)


def stacked(forms: dict[int, Form], name: str, args: tuple, kwargs: dict, out: Tensor) -> Form:
    """``torch.stack(losses)`` (dim 0) of one-element tensors computed from terms: a form per entry."""
    entries = [forms.get(id(t)) if isinstance(t, Tensor) else None for t in args[0]]
    why = f"it applies {name} to a list holding a loss"
    if name != "stack" or kwargs.get("dim", args[1] if len(args) > 1 else 0) not in (0, -out.dim()):
        return Form(out, None, why)
    if any(e is None or e.coeffs is None or e.tensor.numel() != 1 for e in entries) or out.dim() != 1:
        bad = next((e.why for e in entries if e is not None and e.coeffs is None and e.why), None)
        return Form(out, None, bad or why)
    return Form(out, None, "it uses a stack of losses other than by its mean or sum", [dict(e.coeffs) for e in entries])  # type: ignore[union-attr, arg-type]


def reduced(name: str, args: tuple, kwargs: dict, forms: list[Form | None], stacked: Form, out: Tensor) -> Form:
    """A use of a stack of losses: its ``mean()`` / ``sum()`` is a combination, a product by a number a stack."""
    elements = stacked.elements or []
    if forms[0] is stacked and len([f for f in forms if f is not None]) == 1:
        if name in _SCALAR_SAME and len(args) == 1 and not kwargs and out.numel() == 1:
            coeffs: dict[int, float] = {}
            for e in elements:
                coeffs = _combine(coeffs, e, 1.0 / len(elements) if name in ("mean", "nanmean") else 1.0)
            return Form(out, coeffs)
        factor = _number(args[1]) if len(args) > 1 and name in _MUL | _DIV else "no"
        if not isinstance(factor, str) and out.shape == stacked.tensor.shape and "rounding_mode" not in kwargs:
            f = factor if name in _MUL else 1.0 / factor
            return Form(out, None, stacked.why, [{k: c * f for k, c in e.items()} for e in elements])
    return Form(out, None, stacked.why)


def linear(name: str, args: tuple, kwargs: dict, forms: list[Form | None], out: Tensor) -> dict[int, float] | str:
    """The coefficients of ``out = name(*args)``, or why it is not a linear function of the terms."""
    first = forms[0].coeffs if forms[0] is not None else None
    other = forms[1].coeffs if len(forms) > 1 and forms[1] is not None else None
    if name in _SAME or (name in _SCALAR_SAME and out.numel() == 1 and len(args) == 1 and not kwargs):
        return dict(first) if first is not None and len([f for f in forms if f]) == 1 else f"it applies {name} to it"
    if name in _NEG:
        return {k: -c for k, c in (first or {}).items()}
    if name in _ADD | _SUB | _RSUB:
        alpha = _number(kwargs.get("alpha", 1))
        if isinstance(alpha, str):
            return f"it adds it with alpha that {alpha}"
        if name in _RSUB:  # other - alpha * self
            return _combine(other or {}, first or {}, -alpha)
        return _combine(first or {}, other or {}, -alpha if name in _SUB else alpha)
    if name in _MUL:
        if first is not None and other is not None:
            return "it multiplies two losses"
        factor = _number(args[1] if first is not None else args[0]) if len(args) > 1 else "multiplies it"
        if isinstance(factor, str):
            return f"it {factor}"
        return {k: c * factor for k, c in (first if first is not None else other).items()}
    if name in _DIV and first is not None and other is None and "rounding_mode" not in kwargs and len(args) > 1:
        factor = _number(args[1])
        if isinstance(factor, str):
            return f"it divides it by a value that {factor.replace('multiplies it by ', '')}"
        return {k: c / factor for k, c in first.items()}
    return f"it applies {name} to it"


__all__ = ["Form", "follow", "linear", "reduced", "stacked"]
