"""Sites: where the user's code called a captured loss, and what the loss's input is.

:func:`call_site` names the place (the innermost user frame's file, function and source position, stable across
processes and across compiled frames) and whether a loop of the user's frames encloses it; :func:`input_rows` counts
the input's rows; :func:`reduces_rows` tells a statistic of the chunk (``out.F.mean(0)``) from rows of it, on autograd's
graph. :func:`in_checkpoint` and :func:`in_transform` tell a call that ``torch.utils.checkpoint`` or a ``torch.func``
transform runs, and :func:`unweighable` why a loss's gradient cannot reach the factors of terms called there.
:mod:`~lightning_sparse_dp.loss.decide` reads per-sample losses and matched terms from these.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import itertools
import os
import sys
import weakref
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse_dp.loss.denominators import Arguments
from lightning_sparse_dp.runtime.process import LOSS_SITES as _SITES

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lightning_sparse_dp.loss.term import Term


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


def from_step_code(depth: int = 1) -> bool:
    """Whether the torch call being observed (``depth``: frames between the caller and this call) was made by the
    user's code (past torch's wrappers of its ops: ``Tensor`` methods, ``torch.functional``, ``torch.nn.functional``),
    not inside a layer or utility of torch's, MinkowskiEngine's, Lightning's, torchmetrics' or this package's: an op
    inside ME's ``autograd.Function`` forward or ``spectral_norm``'s power iteration runs without autograd too, but what
    it computes is the layer's, which autograd records."""
    frame = sys._getframe(depth + 1)
    wrappers, library = _step_code_dirs()
    while frame is not None and frame.f_code.co_filename in wrappers:
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(library)


@functools.cache
def _step_code_dirs() -> tuple[frozenset[str], tuple[str, ...]]:
    """torch's files that wrap its ops, and the folders of the libraries (:func:`library_dirs`, MinkowskiEngine)."""
    torch_dir = os.path.dirname(torch.__file__)
    wrappers = frozenset(os.path.join(torch_dir, *name) for name in (
        ("_tensor.py",), ("functional.py",), ("nn", "functional.py"), ("overrides.py",), ("_jit_internal.py",)))
    engine = importlib.util.find_spec("MinkowskiEngine")
    extra = (os.path.dirname(engine.origin) + os.sep,) if engine is not None and engine.origin else ()
    return wrappers, (*library_dirs(), *extra)


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
        # keyed by the call's place in the source (line and columns, Python 3.11's co_positions), not its bytecode
        # offset: torch.compile runs a function's frames with other bytecode, where offsets move, positions do not
        position = next(itertools.islice(code.co_positions(), offset // 2, None), None)
        place = ":".join(map(str, position)) if position is not None and position[0] is not None else f"@{offset}"
        key = zlib.crc32(f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}:{place}".encode())
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
    sample from a helper function is in a loop too. Costs a walk of the stack (:func:`locate`).
    """
    return locate(depth + 1)[0]


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def locate(depth: int = 1) -> tuple[CallSite, bool]:
    """:func:`call_site` and :func:`in_checkpoint` of the loss call being captured, in one walk of the stack
    (``depth``: frames between the caller and this call). Each frame's reading (:func:`_frame_site`) is made once
    per code object and instruction and looked up after; what depends on the frames above the site (whether a loop
    of the user's encloses it, whether ``torch.utils.checkpoint`` runs it) is walked at every call, since one site
    may be reached from several places."""
    library = library_dirs()
    frame = sys._getframe(depth + 1)
    checkpointed = False
    while frame is not None and frame.f_code.co_filename.startswith(library):
        checkpointed = checkpointed or frame.f_code.co_filename.endswith(_CHECKPOINT_FILE)
        frame = frame.f_back
    if frame is None:
        return CallSite(0, "?", False), checkpointed
    code = frame.f_code
    site = _SITES.get((code, frame.f_lasti)) or _frame_site(code, frame.f_lasti, frame.f_lineno)
    outer, in_loop = frame.f_back, site.in_loop
    while not in_loop and outer is not None and not outer.f_code.co_filename.startswith(library):
        code = outer.f_code
        in_loop = (_SITES.get((code, outer.f_lasti)) or _frame_site(code, outer.f_lasti, outer.f_lineno)).in_loop
        outer = outer.f_back
    while not checkpointed and outer is not None:
        checkpointed = outer.f_code.co_filename.endswith(_CHECKPOINT_FILE)
        outer = outer.f_back
    return (site if in_loop == site.in_loop else site._replace(in_loop=in_loop)), checkpointed


def in_checkpoint() -> bool:
    """Whether the calling code runs inside ``torch.utils.checkpoint`` (a frame of ``torch/utils/checkpoint.py`` on the
    stack): a loss computed there is computed again in backward, outside the step (:mod:`~.capture`)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


#: the top of torch.func's interpreter stack, ``None`` outside any transform (:func:`in_transform`)
peek_transform: Any = getattr(torch._C._functorch, "peek_interpreter_stack", None) or (lambda: None)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is running: a loss called inside one is
    the transform's function (per-sample gradients, a Hessian-vector product), evaluated on batched or wrapped tensors
    whose values cannot be read (``.item()`` raises under ``vmap``); the capture leaves it alone, and reads what the
    step does with the transform's results outside it (a mean of per-sample norms is a term). No public torch test:
    ``torch._C._functorch.peek_interpreter_stack`` (torch >= 2.0; ``False`` where it is missing), which the capture
    calls itself (:data:`peek_transform`)."""
    return peek_transform() is not None


def unweighable(terms: Sequence[Term]) -> str | None:
    """Why a loss using ``terms`` cannot be weighted term by term: a term its backward does not reach through the
    term's factor (computed again inside ``torch.utils.checkpoint``, or where autograd recorded nothing); else ``None``."""
    for t in terms:
        if t.checkpointed:
            return (
                f"{t.name} at {t.where} runs inside torch.utils.checkpoint, which computes it again in backward, "
                "outside the step, where its gradient cannot be weighted. Checkpoint the layers and call the loss "
                "outside: h = checkpoint(self.head, h, use_reentrant=False); loss = F.cross_entropy(h, y)"
            )
        if t.unrecorded:
            return (
                f"{t.name} at {t.where} runs where autograd records nothing (inside a torch.autograd.Function's "
                "forward, whose backward is written by hand, or under torch.no_grad), so the gradient that reaches the "
                "loss does not pass through it and cannot be weighted. Call the loss outside the Function (let it "
                "return the logits), or pass loss_weighting= a count of what the loss is a mean over"
            )
    return None


def input_rows(func: Any, a: Arguments) -> int:
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
    # selections by value over the rows (OHEM's loss.topk(k), a sorted top fraction): which rows depends on the others
    "TopkBackward", "SortBackward", "KthvalueBackward",
)


#: autograd nodes a statistic may pass through on its way to a loss (elementwise ops, views, conversions)
_THROUGH = (
    "View", "Unsqueeze", "Squeeze", "Expand", "Reshape", "Alias", "Permute", "Transpose", "TBackward", "ToCopy",
    "Clone", "Mul", "Div", "Add", "Sub", "Rsub", "Neg", "Reciprocal", "Pow", "Exp", "Log", "Sqrt", "Rsqrt", "Sigmoid",
    "Tanh", "Relu", "Abs", "Clamp", "Slice",
)


def _of_parameters(node: Any, limit: int = 16) -> bool:
    """Whether what the reduction ``node`` reduces is an elementwise function of leaves that need a gradient (the
    module's parameters: ``head.bias.pow(2).mean()``) and of nothing else: every input path runs through
    :data:`_THROUGH` nodes to an ``AccumulateGrad``. An input without a gradient on the way (a batch tensor: autograd
    records it as no node) or any other node (a layer, which reads the batch) makes it not (a statistic of the chunk).
    Looks at most ``limit`` nodes; not proven within them is not."""
    stack, seen = [n for n, _ in node.next_functions], 0
    while stack:
        n = stack.pop()
        seen += 1
        if n is None or seen > limit:
            return False
        name = n.name()
        if name == "torch::autograd::AccumulateGrad":
            continue
        if not name.startswith(_THROUGH):
            return False
        stack.extend(m for m, _ in n.next_functions)
    return True


def reduces_rows(x: Any, limit: int = 16) -> bool:
    """Whether ``x`` comes from a reduction over the rows (dim 0, or every dim) of a tensor, through elementwise
    ops and slices only, as autograd recorded it: ``out.F.mean(0)``, ``feats.max(0).values``, ``x.mean()``, or a
    selection of rows by their values (``loss.topk(k)``, ``loss.sort().values[:n]``: OHEM) (a statistic of the
    chunk: no split of the batch computes it as one device does). A per-row reduction (``x.sum(1)``), ME's
    global pooling (one row per sample), a stack of per-sample statistics and a statistic of the parameters alone
    (:func:`_of_parameters`: ``head.bias.pow(2).mean()``, one value in every replica) are not. Looks at most ``limit``
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
            dims = tuple(d - 2**64 if d >= 2**63 else d for d in dims)  # autograd saves a negative dim as uint64
            if ndim and (not dims or any(d % ndim == 0 for d in dims)) and not _of_parameters(node):
                return True
            continue  # a reduction along the rows' other dims (per-row values), or of the parameters alone
        if name.startswith(_THROUGH):
            stack.extend(n for n, _ in node.next_functions)
    return False


#: torch reductions (by name, as functions and as Tensor methods) that give a statistic when they reduce dim 0 or every
#: dim, and where their ``dim`` is given positionally (``norm(input, p, dim)``, ``topk(input, k, dim)``)
_ROW_REDUCTIONS = {
    **dict.fromkeys(("sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "std", "var", "prod",
                     "logsumexp", "median", "nanmedian", "sort", "msort", "argsort"), 1),
    **dict.fromkeys(("norm", "topk", "kthvalue"), 2),
    "bincount": 99,  # no dim: counts over every row (class frequencies of the chunk)
}
#: their names: where autograd records nothing in a step that records (a ``torch.no_grad`` block), one of them starts
#: the following (:class:`RowStatistics`); ops inside an ``autograd.Function``'s forward (ME's layers) are not followed
ROW_REDUCTION_NAMES = frozenset(_ROW_REDUCTIONS)
#: what a statistic passes through on its way to a loss without autograd (``_THROUGH``'s ops by their torch names)
_PASSING = frozenset({
    "add", "__add__", "__radd__", "sub", "__sub__", "rsub", "__rsub__", "mul", "__mul__", "__rmul__", "div",
    "__truediv__", "__rtruediv__", "__div__", "neg", "__neg__", "pow", "__pow__", "__rpow__", "exp", "log", "sqrt",
    "rsqrt", "sigmoid", "tanh", "relu", "abs", "clamp", "clamp_min", "clamp_max", "reciprocal", "view", "reshape",
    "unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose", "t", "clone", "to", "double", "float",
    "contiguous", "detach",
    # and, where autograd records nothing, what selects or weighs rows by a statistic (an OHEM threshold:
    # ``w[prob < thr] = 1``, ``y[prob >= thr] = ignore_index``, ``loss[idx]`` of a sort's indices)
    "lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__getitem__",
    "where", "masked_fill", "maximum", "minimum", "fmax", "fmin", "logical_and", "logical_or", "logical_not",
    "__and__", "__or__", "__invert__", "__xor__", "bool", "long", "int", "half", "type_as", "softmax", "log_softmax",
    "index_select", "gather", "masked_select",
})
#: in-place ops by which a statistic reaches a tensor the step made itself (``w[mask] = 1.0``, ``w.masked_fill_(...)``)
_WRITING = frozenset({"__setitem__", "index_put_", "masked_fill_", "copy_", "mul_", "add_", "div_", "sub_", "clamp_"})


class RowStatistics:
    """The statistics of the chunk a step computes where autograd records nothing (a validation or test step, a
    ``torch.no_grad`` / ``torch.inference_mode`` block of a training step), for :func:`reduces_rows`' question without
    a graph: the results of a reduction over the rows (dim 0, or every dim) of a tensor of several rows (``p.sum(0)``,
    ``err.sort()``, ``torch.bincount(y)``), and what the step computes from them (:data:`_PASSING`:
    ``1 - 2 * inter / union``; a mask ``prob < thr`` of an OHEM threshold, a weight or target written through it,
    ``w[mask] = 1``: :data:`_WRITING`), also where autograd records again (``ce * w``). Fed the torch calls of the
    step's thread by its capture (:meth:`follow`: every call without autograd, and those given a statistic); held by
    weak reference. A statistic read into a Python number (``.item()``) is followed no further."""

    def __init__(self) -> None:
        #: the statistics and what was computed from them, by id (empty: nothing to follow)
        self.held: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def holds(self, x: Any) -> bool:
        """Whether ``x`` is such a statistic, or computed from one as above."""
        return isinstance(x, Tensor) and self.held.get(id(x)) is x

    def touches(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call's arguments include such a statistic (then its result is one: :meth:`follow`)."""
        held = self.held
        if not held:
            return False
        return any(isinstance(a, Tensor) and held.get(id(a)) is a for a in (*args, *kwargs.values()))

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note ``out`` (a tensor, or the values of a ``(values, indices)`` result) when ``func(*args, **kwargs)``
        reduced the rows of a tensor, or passed a statistic on."""
        name = getattr(func, "__name__", None)
        x = args[0] if args else kwargs.get("input")
        if name in _WRITING:  # the statistic written into the tensor changed in place
            if self.touches(args[1:], kwargs) and isinstance(x, Tensor):
                self.held[id(x)] = x
            return
        if name in _PASSING:
            found = self.touches(args, kwargs)
        elif name in _ROW_REDUCTIONS and isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] > 1:
            at = _ROW_REDUCTIONS[name]
            dim = kwargs.get("dim", args[at] if len(args) > at else None)
            if isinstance(dim, Tensor):  # torch.max(a, b): elementwise
                return
            if dim is None and name in ("sort", "argsort", "topk", "kthvalue"):
                dim = -1  # their default: the last dim
            dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
            found = not dims or any(d % x.dim() == 0 for d in dims)
        else:
            return
        if found:  # the result, or a (values, indices) result's both: rows selected by a sort are a statistic too
            for t in (out if isinstance(out, tuple) else (out,)):
                if isinstance(t, Tensor):
                    self.held[id(t)] = t


__all__ = [
    "ROW_REDUCTION_NAMES", "CallSite", "RowStatistics", "call_site", "from_step_code", "in_checkpoint", "in_transform",
    "input_rows", "library_dirs", "locate", "peek_transform", "reduces_rows", "unweighable",
]
