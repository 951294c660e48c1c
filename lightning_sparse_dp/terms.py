"""Terms: capture torch's mean-reduced losses inside a replica's step, and how its loss combines them.

While a replica's step (a rank's, in ``sparse_ddp``) runs, a :class:`TermCapture` is the thread's
``torch.overrides.TorchFunctionMode`` (modes are per thread, so each replica thread enters its own),
from the step's first loss call on (:meth:`TermCapture.run`: before it, the network's forward runs
without the mode's per-call cost).
Every call of a loss in :data:`~lightning_sparse_dp.losses.CAPTURED` with a mean reduction,
functional or through its ``nn.*Loss`` module (which calls the functional), becomes a *term*: its
value ``L`` and its denominator ``D`` as torch defines it (:func:`~lightning_sparse_dp.losses.denominator`).
The value handed back to the step is ``L`` times a factor of 1 whose value :attr:`Term.scale` sets
after the step, when every replica's ``D`` is known, so that it scales the gradient only; where
``D = 0`` (every label ignored, no voxel at a level) the value is 0, not NaN.

After a term, the mode follows the arithmetic the step does on terms: sums, differences, products and
quotients by numbers (or by tensors that need no gradient: a scheduled coefficient), negation,
copies and conversions. Each tensor so computed has a :class:`Form`: its coefficients ``c_k`` on the
step's terms; any other operation on a term (``sqrt``, a product of two terms, ``torch.stack``)
marks the result as not linear, with the reason. :meth:`TermCapture.combination` reads off how a
value (the loss, a logged value) is ``sum_k c_k L_k + r``; :mod:`~lightning_sparse_dp.weighting`
combines replicas' terms into whole-batch values.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import numbers
import os
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_sparse_dp._patch import SharedPatch
from lightning_sparse_dp.losses import CAPTURED, UNCAPTURED, Arguments, bind, denominator, is_mean, is_sum, loss_name

T = TypeVar("T")

_local = threading.local()  # .pending: the capture of this thread's step, until its first loss call enters it;
# .active: that capture once entered, until the step ends


def _trigger(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``original`` (a loss of ``torch.nn.functional``) that first enters the thread's pending capture, if any."""

    @functools.wraps(original)
    def trigger(*args: Any, **kwargs: Any) -> Tensor:
        capture = getattr(_local, "pending", None)
        if capture is not None:
            capture._activate()
        return original(*args, **kwargs)  # with the mode entered, torch hands the call to it

    return trigger


_TRIGGERS = {f.__name__: _trigger(f) for f in (*CAPTURED, *UNCAPTURED)}
_ORIGINALS: dict[Any, Any] = {_TRIGGERS[f.__name__]: f for f in (*CAPTURED, *UNCAPTURED)}


#: ``torch.nn.functional``'s losses are triggers while any step runs under a capture
_TRIGGERS_INSTALLED = SharedPatch({(F, name): trigger for name, trigger in _TRIGGERS.items()})

_CAPTURED_KIND, _UNCAPTURED_KIND = "captured", "uncaptured"
#: what ``__torch_function__`` does first with a loss it is handed (the originals and their triggers alike)
_KINDS: dict[Any, str] = {
    **{f: _CAPTURED_KIND for f in CAPTURED}, **{f: _UNCAPTURED_KIND for f in UNCAPTURED},
}
_KINDS.update({trigger: _KINDS[original] for trigger, original in _ORIGINALS.items()})
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


class Term:
    """One captured call: ``name`` (``"F.cross_entropy"``), denominator ``D`` and value ``L`` (0 where ``D = 0``).

    ``denominator`` is ``None`` for a ``reduction="sum"`` call (its value counts once per replica).
    ``site`` (:func:`call_site`'s key) names the place in the user's code that called it, the same in every
    process (``where``: ``file.py:line``), and ``in_loop`` whether that call ran inside a loop of the user's code; ``rows`` is the
    number of rows its input has (``input.shape[0]``; 1 for an unbatched or 0-dim input), which tells a
    loss over one sample's points from one over a decoder level's voxels; ``statistic`` whether its input
    is a reduction over rows (:func:`reduces_rows`: ``out.F.mean(0)``), not rows of the chunk.

    The value handed to the step is ``L * s`` with ``s`` a 0-dim tensor of 1: :attr:`scale` sets ``s``
    after the step, without a version bump, so the multiplication's backward (which reads ``s``
    then) scales the gradient that reaches the call. A plain multiplication costs less than a
    Python autograd function's backward (seen: about 10 against 30 microseconds).
    """

    __slots__ = ("name", "denominator", "value", "site", "where", "in_loop", "rows", "statistic", "_scale", "_factor")

    def __init__(
        self, name: str, denominator: float | Tensor | None, factor: Tensor, site: CallSite | None = None, rows: int = 1,
        statistic: bool = False,
    ) -> None:
        self.name, self.denominator, self._factor = name, denominator, factor
        site = site or CallSite(0, "?", False)
        self.site, self.where, self.in_loop, self.rows = site.key, site.where, site.in_loop, rows
        self.statistic = statistic
        self.value: Tensor | None = None
        self._scale = 1.0

    @property
    def is_sum(self) -> bool:
        """Whether the call reduced by ``"sum"``: each replica's value counts once, no denominator."""
        return self.denominator is None

    @property
    def scale(self) -> float:
        """What multiplies the gradient that reaches the call's value (1 until the strategy sets it)."""
        return self._scale

    @scale.setter
    def scale(self, scale: float) -> None:
        self._scale = scale
        self._factor.data.fill_(scale)  # .data: no version bump, or backward would refuse the saved factor

    def numbers(self) -> tuple[float, float]:
        """``(D, L)`` as Python floats (``D`` is 1 for a ``"sum"`` call)."""
        d = 1.0 if self.denominator is None else float(self.denominator)
        return d, float(self.value)  # type: ignore[arg-type]


def _scaled(value: Tensor, keep: Tensor | bool, factor: Tensor) -> Tensor:
    """``value * factor``; 0 where ``keep`` is false (a mean over nothing), still in the graph, with gradient 0."""
    if keep is True:
        return value * factor
    if keep is False:
        return value.nan_to_num(0.0, 0.0, 0.0) * 0.0
    return torch.where(keep, value, torch.zeros_like(value)) * factor


class Form:
    """How a tensor of the step was computed from its terms: ``coeffs`` ``{k: c_k}``, or ``None`` and ``why`` not.

    A 1-dim tensor stacked from losses (``torch.stack(losses)``) has ``elements``: the coefficients of each
    of its entries (``coeffs`` is then ``None`` and ``why`` says what a non-reducing use of it means).
    """

    __slots__ = ("tensor", "coeffs", "why", "elements")

    def __init__(
        self, tensor: Tensor, coeffs: dict[int, float] | None, why: str | None = None,
        elements: list[dict[int, float]] | None = None,
    ) -> None:
        self.tensor, self.coeffs, self.why, self.elements = tensor, coeffs, why, elements


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


@functools.cache
def library_dirs() -> tuple[str, ...]:
    """Folders whose frames are the library's, not a call site of the user's: torch (its losses and modules),
    Lightning (both names), torchmetrics and this package; the user's frames lie between a loss and the first of
    these above."""
    dirs = []
    for name in ("torch", "lightning", "pytorch_lightning", "torchmetrics", __name__.split(".")[0]):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(spec.origin) + os.sep)
    return tuple(dirs)


_SITES: dict[tuple[Any, int], CallSite] = {}  # (code, offset) -> that instruction's site
_JUMPS = frozenset({"JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"})
_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>"})


class CallSite(NamedTuple):
    """A place in the user's code that calls a loss: ``key`` (stable across processes), ``where`` (``file.py:line``),
    ``in_loop`` (inside a ``for`` / ``while`` body or a comprehension of the user's frames up to the step)."""

    key: int
    where: str
    in_loop: bool


def _frame_site(code: Any, offset: int, line: int | None) -> CallSite:
    """The site of one instruction: its key, and whether a backward jump of its code spans it (a loop body)."""
    found = _SITES.get((code, offset))
    if found is None:
        key = zlib.crc32(f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}:{offset}".encode())
        in_loop = code.co_name in _COMPREHENSIONS or any(
            ins.opname in _JUMPS and isinstance(ins.argval, int) and ins.argval <= offset < ins.offset
            for ins in dis.get_instructions(code)
        )
        found = _SITES[(code, offset)] = CallSite(key, f"{os.path.basename(code.co_filename)}:{line}", in_loop)
    return found


def call_site(depth: int = 1) -> CallSite:
    """Where the user's code called the loss being captured (``depth``: frames between the caller and this call).

    The site is the innermost frame outside torch, Lightning and this package (its code and
    instruction, so two loss calls on one line are two sites); ``in_loop`` is whether any of the user's
    frames up to the step (the first library frame above) is inside a loop: a loss called once per
    sample from a helper function is in a loop too. Costs a walk of the stack (a few microseconds).
    """
    library = library_dirs()
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code.co_filename.startswith(library):
        frame = frame.f_back
    if frame is None:
        return CallSite(0, "?", False)
    site = _frame_site(frame.f_code, frame.f_lasti, frame.f_lineno)
    outer, in_loop = frame.f_back, site.in_loop
    while not in_loop and outer is not None and not outer.f_code.co_filename.startswith(library):
        in_loop = _frame_site(outer.f_code, outer.f_lasti, outer.f_lineno).in_loop
        outer = outer.f_back
    return site if in_loop == site.in_loop else site._replace(in_loop=in_loop)


def _rows(func: Any, a: Arguments) -> int:
    """The rows of a loss call's input: ``input.shape[0]``, 1 for a 0-dim input or an unbatched class score."""
    x = a.get("input")
    if not isinstance(x, Tensor) or x.dim() == 0:
        return 1
    if x.dim() == 1 and func in (F.cross_entropy, F.nll_loss):
        return 1  # one sample's class scores [C]
    return int(x.shape[0])


_REDUCTIONS = (
    "MeanBackward", "SumBackward", "NanmeanBackward", "NansumBackward", "MaxBackward", "MinBackward", "AmaxBackward",
    "AminBackward", "StdBackward", "VarBackward", "LogsumexpBackward", "ProdBackward", "MedianBackward",
)
#: autograd nodes a statistic may pass through on its way to a loss (elementwise ops, views, conversions)
_THROUGH = (
    "View", "Unsqueeze", "Squeeze", "Expand", "Reshape", "Alias", "Permute", "Transpose", "TBackward", "ToCopy",
    "Clone", "Mul", "Div", "Add", "Sub", "Neg", "Pow", "Exp", "Log", "Sqrt", "Rsqrt", "Sigmoid", "Tanh", "Relu",
    "Abs", "Clamp",
)


def reduces_rows(x: Any, limit: int = 16) -> bool:
    """Whether ``x`` comes from a reduction over the rows (dim 0, or every dim) of a tensor, through elementwise
    ops only, as autograd recorded it: ``out.F.mean(0)``, ``feats.max(0).values``, ``x.mean()`` (a statistic of the
    chunk: no split of the batch computes it as one device does). A per-row reduction (``x.sum(1)``), ME's
    global pooling (one row per sample) and a stack of per-sample statistics are not. Looks at most ``limit``
    autograd nodes; ``False`` for a tensor that needs no gradient."""
    stack, seen = [getattr(x, "grad_fn", None)], 0
    while stack and seen < limit:
        node = stack.pop()
        seen += 1
        if node is None:
            continue
        name = node.name()
        if name.startswith(_REDUCTIONS):
            sizes = getattr(node, "_saved_self_sym_sizes", None)
            ndim = len(sizes) if sizes is not None else getattr(getattr(node, "_saved_self", None), "ndim", 0)
            dim = getattr(node, "_saved_dim", None)
            dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
            if ndim and (not dims or any(d % ndim == 0 for d in dims)):
                return True
            continue  # a reduction along the rows' other dims: per-row values
        if name.startswith(_THROUGH):
            stack.extend(n for n, _ in node.next_functions)
    return False


class TermCapture(TorchFunctionMode):
    """The terms and forms of one replica's step (enter it in the replica's thread: :meth:`run`).

    Attributes:
        terms: the captured calls, in call order.
        forms: ``id(tensor) -> Form`` of every tensor computed from terms (the tensors are kept alive).
    """

    def __init__(self) -> None:
        super().__init__()
        self.terms: list[Term] = []
        self.forms: dict[int, Form] = {}
        self._combinations: dict[int, tuple[Form, Any]] = {}  # id(value) -> (its form, combination(value))
        self.blocked: str | None = None  # why the mode could not be entered

    def tensor_of(self, value: Any) -> Tensor | None:
        """The combination of terms whose ``.item()`` / ``float()`` ``value`` is (the latest computed), else ``None``:
        a logged ``loss.item()`` is reduced as the loss. Only CPU tensors are looked at (a GPU one would sync)."""
        if not isinstance(value, float):
            return None
        for form in reversed(list(self.forms.values())):
            t = form.tensor
            if form.coeffs is not None and t.numel() == 1 and t.device.type == "cpu" and float(t.detach()) == value:
                return t
        return None

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` with this capture as the calling thread's torch function mode from its first loss call on.

        Until then the step runs without the mode, at no cost: the losses of ``torch.nn.functional``
        (which ``nn.*Loss`` modules call) are replaced, while any capture runs, by triggers that enter
        the pending capture of their thread. A loss imported by name before (``from
        torch.nn.functional import cross_entropy``) is captured once the mode is entered.
        """
        with _TRIGGERS_INSTALLED.held():
            _local.pending = self
            try:
                return fn()
            finally:
                _local.pending = None
                if getattr(_local, "active", None) is self:  # entered at a loss call of the step
                    _local.active = None
                    self.__exit__(None, None, None)

    def _activate(self) -> None:
        _local.pending = None
        if torch._C._len_torch_function_stack() > 0:  # the step's own mode (e.g. ``with torch.device(...)``)
            self.blocked = "the step had a torch function mode of its own active (e.g. `with torch.device(...)`) at its first loss"
            return
        self.__enter__()
        _local.active = self

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            kind = _KINDS.get(func)
        except TypeError:  # an unhashable callable: not a loss
            kind = None
        if kind is _CAPTURED_KIND:
            return self._capture(_ORIGINALS.get(func, func), args, kwargs)
        if kind is None and not self._touches_forms(args):
            return func(*args, **kwargs)  # most calls (a metric's update, the network after a loss): nothing to follow
        func = _ORIGINALS.get(func, func)
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):
            return out
        if kind is _UNCAPTURED_KIND and is_mean(bind(func, args, kwargs)):
            why = f"it calls {loss_name(func)}(reduction='mean'), which is not captured"
            self.forms[id(out)] = Form(out, None, why)
        elif self.forms:
            self._follow(func, args, kwargs, out)
        return out

    def _touches_forms(self, args: tuple) -> bool:
        """Whether an argument (or a tensor of a list / tuple first argument) is a tensor computed from terms."""
        forms = self.forms
        if not forms:
            return False
        for a in args:
            if isinstance(a, Tensor) and id(a) in forms:
                return True
        first = args[0] if args else None
        return isinstance(first, (list, tuple)) and any(isinstance(t, Tensor) and id(t) in forms for t in first)

    def _capture(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        out = func(*args, **kwargs)
        bound = bind(func, args, kwargs)
        if is_sum(bound):
            d: float | Tensor | None = None
            keep: Tensor | bool = True
        elif is_mean(bound):
            d = denominator(func, bound)
            if isinstance(d, Tensor) and d.device.type == "cpu":
                d = float(d)  # no device to wait for
            keep = d > 0 if isinstance(d, Tensor) else bool(d > 0)
        else:
            return out  # "none": what the step does with it is its own arithmetic
        term = Term(
            loss_name(func), d, torch.ones((), dtype=out.dtype, device=out.device), call_site(2), _rows(func, bound),
            reduces_rows(bound.get("input")),
        )
        value = _scaled(out, keep, term._factor)
        term.value = value.detach().clone()  # the step may change ``value`` in place
        self.forms[id(value)] = Form(value, {len(self.terms): 1.0})
        self.terms.append(term)
        return value

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Tensor) -> None:
        name = getattr(func, "__name__", "")
        forms = [self.forms.get(id(a)) if isinstance(a, Tensor) else None for a in args]
        if isinstance(args[0] if args else None, (list, tuple)):
            if any(isinstance(t, Tensor) and id(t) in self.forms for t in args[0]):
                self.forms[id(out)] = self._stacked(name, args, kwargs, out)
            return
        if not any(forms) or name in _IGNORED:
            return
        stacked = next((f for f in forms if f is not None and f.elements is not None), None)
        if stacked is not None:
            self.forms[id(out)] = self._reduced(name, args, kwargs, forms, stacked, out)
            return
        bad = next((f for f in forms if f is not None and f.coeffs is None), None)
        if bad is not None:
            self.forms[id(out)] = Form(out, None, bad.why)
            return
        coeffs = self._linear(name, args, kwargs, forms, out)
        self.forms[id(out)] = Form(out, coeffs, None) if isinstance(coeffs, dict) else Form(out, None, coeffs)

    def _stacked(self, name: str, args: tuple, kwargs: dict, out: Tensor) -> Form:
        """``torch.stack(losses)`` (dim 0) of one-element tensors computed from terms: a form per entry."""
        entries = [self.forms.get(id(t)) if isinstance(t, Tensor) else None for t in args[0]]
        why = f"it applies {name} to a list holding a loss"
        if name != "stack" or kwargs.get("dim", args[1] if len(args) > 1 else 0) not in (0, -out.dim()):
            return Form(out, None, why)
        if any(e is None or e.coeffs is None or e.tensor.numel() != 1 for e in entries) or out.dim() != 1:
            bad = next((e.why for e in entries if e is not None and e.coeffs is None and e.why), None)
            return Form(out, None, bad or why)
        return Form(out, None, "it uses a stack of losses other than by its mean or sum", [dict(e.coeffs) for e in entries])  # type: ignore[union-attr, arg-type]

    @staticmethod
    def _reduced(name: str, args: tuple, kwargs: dict, forms: list[Form | None], stacked: Form, out: Tensor) -> Form:
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

    @staticmethod
    def _linear(name: str, args: tuple, kwargs: dict, forms: list[Form | None], out: Tensor) -> dict[int, float] | str:
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

    def combination(self, value: Any) -> tuple[list[float], float, float] | str:
        """How ``value`` is ``sum_k c_k L_k + r`` in this replica: ``(coeffs, r, scale)``, or why it is not.

        ``coeffs[k]`` is 0 for a term ``value`` does not use; ``r`` is what the terms do not explain
        (a constant, a penalty on the parameters, or a part computed by other ops), set to 0 when it is
        within rounding of ``scale = |value| + sum_k |c_k L_k|``.
        """
        form = self.forms.get(id(value)) if isinstance(value, Tensor) else None
        cached = self._combinations.get(id(value))
        if form is not None and cached is not None and cached[0] is form:
            return cached[1]
        result = self._combination(value)
        if form is not None:  # keyed by the form, which an in-place change of the value replaces
            self._combinations[id(value)] = (form, result)
        return result

    def _combination(self, value: Any) -> tuple[list[float], float, float] | str:
        form = self.forms.get(id(value)) if isinstance(value, Tensor) else None
        if form is None and self.blocked:
            return self.blocked
        if form is None:
            return (
                "it is not computed from torch's mean-reduced losses (F.cross_entropy, F.mse_loss, ... with "
                "reduction='mean', or their nn.*Loss modules), e.g. a hand-written masked mean such as "
                "(loss * mask).sum() / mask.sum() or a loss torch does not define (Dice, Lovasz)"
            )
        if form.coeffs is None:
            return form.why or "it is not a linear combination of mean-reduced losses"
        if value.numel() != 1:
            return f"it has shape {tuple(value.shape)}"
        coeffs = [form.coeffs.get(k, 0.0) for k in range(len(self.terms))]
        parts = [c * t.numbers()[1] for c, t in zip(coeffs, self.terms) if c != 0.0]
        v = float(value.detach())
        r, scale = v - sum(parts), abs(v) + sum(abs(p) for p in parts)
        if abs(r) <= 64 * torch.finfo(value.dtype).eps * scale:
            r = 0.0
        return coeffs, r, scale


def outside_capture(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` that runs with its thread's :class:`TermCapture` out of the way (for a metric's ``update`` / ``forward``).

    What a torchmetrics metric computes in a step is its own state (merged across replicas by
    :mod:`~lightning_sparse_dp.metrics`), never a term of the loss, so the capture has nothing to follow in
    it, while every torch call made under the mode costs a Python ``__torch_function__`` call (an
    accuracy update of 48 samples: about 53 us bare, 130 under the mode). The wrapped call runs with the
    capture popped from the thread's torch function mode stack when it is the innermost mode (else, a
    mode the step entered after it is on top, the call runs under both as before), and with a pending
    capture not yet entered kept from entering: a mean-reduced loss a metric computes inside is not taken
    for one of the step's terms. Without a capture in the thread it calls ``fn`` directly.
    """

    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> T:
        pending, active = getattr(_local, "pending", None), getattr(_local, "active", None)
        if pending is None and active is None:
            return fn(*args, **kwargs)
        depth = torch._C._len_torch_function_stack()
        popped = active is not None and depth > 0 and torch._C._get_function_stack_at(depth - 1) is active
        _local.pending = None
        if popped:
            active.__exit__(None, None, None)
        try:
            return fn(*args, **kwargs)
        finally:
            if popped:
                active.__enter__()
            _local.pending = pending

    return outside


def _combine(a: dict[int, float], b: dict[int, float], beta: float) -> dict[int, float]:
    out = dict(a)
    for k, c in b.items():
        out[k] = out.get(k, 0.0) + beta * c
    return out


__all__ = ["CallSite", "Form", "Term", "TermCapture", "call_site", "library_dirs", "outside_capture", "reduces_rows"]
