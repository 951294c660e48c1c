"""Capture torch's mean-reduced losses inside a replica's step, and how its loss combines them.

Every replica's step (a rank's, in ``sparse_ddp``) runs under a
:class:`~lightning_sparse_dp.loss.observer.StepObserver`, the thread's
``torch.overrides.TorchFunctionMode`` (modes are per thread, so each replica thread enters its own and no other
thread sees anything): it counts the step's one-value means (:mod:`~lightning_sparse_dp.loss.means`) and notes the
collectives its own code calls (:mod:`~lightning_sparse_dp.loss.collectives`). Nothing of torch is replaced:
``torch.mean``, ``F.cross_entropy`` and ``torch.distributed.all_reduce`` stay torch's own objects everywhere.
With ``loss_weighting="terms"`` the observer is a :class:`TermCapture`.
Every call of a loss in :data:`~lightning_sparse_dp.loss.denominators.CAPTURED` with a mean reduction,
functional or through its ``nn.*Loss`` module (which calls the functional), becomes a *term*: its
value ``L`` and its denominator ``D`` as torch defines it (:func:`~lightning_sparse_dp.loss.denominators.denominator`).
The value handed back to the step is ``L`` times a factor of 1 whose value
:attr:`~lightning_sparse_dp.loss.term.Term.scale` sets
after the step, when every replica's ``D`` is known, so that it scales the gradient only; where
``D = 0`` (every label ignored, no voxel at a level) the value is 0, not NaN.

A full reduction of a floating tensor by ``torch.sum`` / ``torch.mean`` (``y_hat.sum()``, ``per_point.mean()``: one
value, no ``dim``; in a step with gradients, of a tensor that needs them) is a term too, of reduction ``"sum"`` or
``"mean"`` over its elements (``D = x.numel()``): a loss written by hand over the chunk's rows (samples, points,
voxels: a chunk holds whole samples, so the batch's rows are the chunks' rows together) is then exact as torch's are.
A sum with one value in every replica (a penalty on the parameters, ``w.pow(2).sum()``) is read as the remainder
(:mod:`~lightning_sparse_dp.loss.decide`).

After a term, the mode follows the arithmetic the step does on terms: sums, differences, products and
quotients by numbers (or by tensors that need no gradient: a scheduled coefficient), negation,
copies and conversions. Each tensor so computed has a :class:`Form`: its coefficients ``c_k`` on the
step's terms; any other operation on a term (``sqrt``, a product of two terms, ``torch.stack``)
marks the result as not linear, with the reason. :meth:`TermCapture.combination` reads off how a
value (the loss, a logged value) is ``sum_k c_k L_k + r``; :mod:`~lightning_sparse_dp.loss.decide`
combines replicas' terms into whole-batch values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sparse_dp.loss.classes import one_class
from lightning_sparse_dp.loss.denominators import (
    CAPTURED_NAMES,
    bind,
    class_bounds,
    full_reduction,
    is_mean,
    loss_name,
    reduction_of,
    shared_arguments,
)
from lightning_sparse_dp.loss.forms import Form, follow
from lightning_sparse_dp.loss.means import (
    MEAN_FUNCTIONS,
    last_holding,
    note_mean,
    scalar_values,
)
from lightning_sparse_dp.loss.observer import (
    CAPTURED_KIND,
    COLLECTIVE_KIND,
    KINDS,
    MEAN_KIND,
    PASS_KIND,
    SUM_KIND,
    TENSOR_MAX,
    UNCAPTURED_KIND,
    StepObserver,
    say_if_chunk_grid,
    say_own_generator,
)
from lightning_sparse_dp.loss.sites import (
    ROW_REDUCTION_NAMES,
    RowStatistics,
    from_step_code,
    input_rows,
    locate,
    peek_transform,
    reduces_rows,
)
from lightning_sparse_dp.loss.term import Term, scaled_value
from lightning_sparse_dp.replica.derived import note_derived
from lightning_sparse_dp.runtime.process import REPLICA_CALL as _replica_call
from lightning_sparse_dp.runtime.process import SAID_ONCE as _said


def _say_input_gradients() -> None:
    """Once per process: a step without a graph of its own (validation, test, predict) took ``torch.autograd.grad`` of
    a loss over its chunk: each replica's gradients are of its chunk's mean, not the batch's."""
    _said.warn(
        "sparse_dp: an evaluation step (validation, test or predict) calls torch.autograd.grad of a loss over its chunk "
        "(input gradients, a saliency map): each replica differentiates its own chunk's mean, so the gradients are "
        "scaled by 1 / (its chunk's samples or points), where one device's are scaled by 1 / (the whole batch's): "
        "about replicas times one device's. Differentiate the loss's sum (reduction='sum') and divide the gradients by "
        "the whole batch's count, put in the batch in on_before_batch_transfer."
    )


class TermCapture(StepObserver):
    """The terms and forms of one replica's step (enter it in the replica's thread: :meth:`run`).

    Attributes:
        terms: the captured calls, in call order.
        forms: ``id(tensor) -> Form`` of every tensor computed from terms (the tensors are kept alive).
        weighable: no term so far is checkpointed or unrecorded (:func:`~lightning_sparse_dp.loss.sites.unweighable`).
    """

    def __init__(self, collectives: list[str] | None = None) -> None:
        super().__init__(collectives)
        self.terms: list[Term] = []
        self.forms: dict[int, Form] = {}
        self.recording = True  # whether the step records gradients (set by run)
        self.weighable = True  # every term so far reached by its gradient through its factor (not checkpointed...)
        self._combinations: dict[int, tuple[Form, Any]] = {}  # id(value) -> (its form, combination(value))
        #: the chunk's statistics, followed where autograd records nothing (made by :meth:`_followed`; ``None`` until)
        self.statistics: RowStatistics | None = None
        #: counts of the chunk: one-element tensors without gradient from a full sum of the step's (``mask.sum()``,
        #: not a term) and what the step computed from them (``.clamp(min=1)``), by id; and the Python numbers read off
        #: them (``int(mask.sum())``); a loss divided by one is noted in its form (:attr:`Form.counted`)
        self.counts: dict[int, Tensor] = {}
        self.count_values: set[float] = set()

    def read_numbers(self) -> None:
        """Every term's ``(D, L)`` (:meth:`~lightning_sparse_dp.loss.term.Term.numbers`) read at once: one copy to the
        host per device (:func:`~lightning_sparse_dp.loss.means.scalar_values`) instead of two waits on the GPU per term
        and reader."""
        todo = [t for t in self.terms if t._numbers is None and t.value is not None]
        if not todo:
            return
        tensors = [t.value for t in todo] + [t.denominator for t in todo if isinstance(t.denominator, Tensor)]
        tensors += [b for t in todo if t.bounds is not None for b in t.bounds]
        read = iter(scalar_values(tensors))  # type: ignore[arg-type]
        values = [next(read) for _ in todo]
        for term, v in zip(todo, values):
            d = term.denominator
            term._numbers = (next(read) if isinstance(d, Tensor) else 1.0 if d is None else float(d), v)
        for term in todo:
            if term.bounds is not None:
                term._class = one_class(next(read), next(read))

    def tensor_of(self, value: Any) -> Tensor | None:
        """The combination of terms whose ``.item()`` / ``float()`` ``value`` is (the latest computed), else ``None``:
        a logged ``loss.item()`` is reduced as the loss (on a GPU: one copy to the host per device and lookup)."""
        if not isinstance(value, float):
            return None
        candidates = [form.tensor for form in self.forms.values() if form.coeffs is not None and form.tensor.numel() == 1]
        i = last_holding(candidates, value)
        return None if i is None else candidates[i]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if kwargs and isinstance(kwargs.get("generator"), torch.Generator) and getattr(_replica_call, "replicas", 1) > 1:
            say_own_generator()
        if func is TENSOR_MAX:
            say_if_chunk_grid()
        try:
            kind = KINDS.get(func)
        except TypeError:  # an unhashable callable: not a loss
            kind = None
        if (kind is CAPTURED_KIND or kind is SUM_KIND or kind is MEAN_KIND) and peek_transform() is not None:
            return func(*args, **kwargs)  # inside torch.func's vmap / grad: its own function of the inputs, not a term
        if kind is CAPTURED_KIND:
            return self._capture(func, args, kwargs)
        if (kind is SUM_KIND or kind is MEAN_KIND) and full_reduction(args, kwargs) and not (
            self.forms and self._touches_forms(args)
        ):
            out = self._reduction(func, args, kwargs)
            if self.derived:  # (StepObserver's note: a reduction of a metric's value)
                note_derived(self.derived, func, args, kwargs, out)
            return out
        plain = kind is None and (not self.forms or not self._touches_forms(args))
        # no graph to read the chunk's statistics off (a step or block without autograd: an OHEM threshold under
        # torch.no_grad), or an op on what such a block computed (``ce * weight``): followed
        stats = self.statistics
        following = not self.recording or (
            not torch.is_grad_enabled() and getattr(func, "__name__", None) in ROW_REDUCTION_NAMES and from_step_code(1)
        ) or (stats is not None and bool(stats.held) and stats.touches(args, kwargs))
        if plain and not following and not self.counts and not self.derived:
            return func(*args, **kwargs)  # most calls (the network, a metric's update): nothing to follow
        out = func(*args, **kwargs)
        if self.derived:  # (StepObserver's note: what the step computes from a metric's value)
            note_derived(self.derived, func, args, kwargs, out)
        if plain and not following and not self.counts:
            return out
        if kind is SUM_KIND or self.counts:
            self._note_count(kind, args, out)
        if following:
            self._followed().follow(func, args, kwargs, out)
            if func is torch.autograd.grad and self.forms and self._touches_forms(args[:1]):
                _say_input_gradients()
        if plain:
            return out
        if kind is MEAN_KIND or kind is COLLECTIVE_KIND or kind is PASS_KIND:
            self._observe(kind, func, args, kwargs, out)
        if not isinstance(out, Tensor):
            return out
        if kind is UNCAPTURED_KIND and is_mean(bind(func, args, kwargs)):
            why = f"it calls {loss_name(func)}(reduction='mean'), which is not captured"
            self.forms[id(out)] = Form(out, None, why)
        elif self.forms:
            follow(self.forms, func, args, kwargs, out, self._is_count if self.counts else None)
        return out

    def _note_count(self, kind: Any, args: tuple, out: Any) -> None:
        """``out`` noted as a count of the chunk (:attr:`counts`) when it is a full sum that is no term, or a number
        or one-element tensor computed from a count."""
        if isinstance(out, Tensor):
            if out.numel() == 1 and not out.requires_grad and (
                kind is SUM_KIND or any(isinstance(a, Tensor) and self._is_count(a) for a in args)
            ):
                self.counts[id(out)] = out
        elif type(out) in (int, float) and args and isinstance(args[0], Tensor) and self._is_count(args[0]):
            self.count_values.add(out)  # int(mask.sum()), mask.sum().item()

    def _is_count(self, x: Any) -> bool:
        """Whether the divisor ``x`` is a count of the chunk (:attr:`counts`, :attr:`count_values`)."""
        if isinstance(x, Tensor):
            return self.counts.get(id(x)) is x
        return type(x) in (int, float) and x in self.count_values

    def _of_statistics(self, arguments: Any) -> bool:
        """Whether one of a loss call's ``arguments`` (its input, a target, a weight) is a statistic of the chunk
        the step computed where autograd records nothing, or was computed from one (:attr:`statistics`)."""
        return self.statistics is not None and any(self.statistics.holds(a) for a in arguments)

    def _followed(self) -> RowStatistics:
        """:attr:`statistics`, made at the first torch call the step makes where autograd records nothing."""
        if self.statistics is None:
            self.statistics = RowStatistics()
        return self.statistics

    def _touches_forms(self, args: tuple) -> bool:
        """Whether an argument (or a tensor of a list / tuple first argument) is a tensor computed from terms. Asked
        only once there are forms (the callers test ``self.forms`` first: every torch call of the step comes here)."""
        forms = self.forms
        for a in args:
            if isinstance(a, Tensor) and id(a) in forms:
                return True
        first = args[0] if args else None
        return isinstance(first, (list, tuple)) and any(isinstance(t, Tensor) and id(t) in forms for t in first)

    def _capture(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        out = func(*args, **kwargs)
        bound = bind(func, args, kwargs)
        reduced = reduction_of(func, bound)
        if reduced is None:
            return out  # "none": what the step does with it is its own arithmetic
        d, keep = reduced
        site, checkpointed = locate(2)
        # in a loop, a mean's target classes: a loop over each chunk's classes pairs its calls by them (loss/classes.py)
        bounds = class_bounds(func, bound) if site.in_loop and d is not None else None
        term = Term(
            CAPTURED_NAMES[func],
            d,
            torch.ones((), dtype=out.dtype, device=out.device),
            site,
            input_rows(func, bound),
            reduces_rows(bound.get("input")) or self._of_statistics(bound.values()),
            shared_arguments(func, bound),
            bounds,
        )
        return self._add(term, out, keep, checkpointed)

    def _add(self, term: Term, out: Tensor, keep: Tensor | bool, checkpointed: bool) -> Tensor:
        """``out`` as the step's next term: scaled by the term's factor, its value kept, its form a term of its own.

        Inside ``torch.utils.checkpoint`` (:func:`~lightning_sparse_dp.loss.sites.in_checkpoint`) ``out`` is handed back
        as torch made it: backward computes it again where no capture runs (torch function modes do not reach the
        recomputation), so a factor there would be missing (``use_reentrant=True``: the gradient unscaled) or would
        save tensors the recomputation does not (``use_reentrant=False``: torch's ``CheckpointError``). Such a term is
        read but cannot be weighted (:func:`~lightning_sparse_dp.loss.decide.summarize` says why)."""
        term.checkpointed = checkpointed
        term.unrecorded = self.recording and not torch.is_grad_enabled() and not checkpointed
        self.weighable = self.weighable and not (checkpointed or term.unrecorded)  # else summarize says which, why
        value = out if checkpointed else out * term._factor if keep is True else scaled_value(out, keep, term._factor)
        term.value = value.detach().clone()  # the step may change ``value`` in place
        self.forms[id(value)] = Form(value, {len(self.terms): 1.0})
        self.terms.append(term)
        return value

    def _reduction(self, func: Any, args: tuple, kwargs: dict) -> Tensor:
        """A full ``torch.sum`` / ``torch.mean`` of a floating tensor
        (:func:`~lightning_sparse_dp.loss.denominators.full_reduction`) as a term: reduction ``"sum"`` (no denominator)
        or ``"mean"`` over its ``numel()`` elements; a mean also counted for the logged values
        (:func:`~lightning_sparse_dp.loss.means.note_mean`)."""
        out = func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        mean = func in MEAN_FUNCTIONS
        if mean:
            note_mean(args, kwargs, out)
        site, checkpointed = locate(2)
        term = Term(
            f"torch.{func.__name__}", float(x.numel()) if mean else None,
            torch.ones((), dtype=out.dtype, device=out.device), site, int(x.shape[0]),
            reduces_rows(x) or self._of_statistics((x,)),  # read off the graph, else followed
        )
        return self._add(term, out, x.numel() > 0 or not mean, checkpointed)

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
        self.read_numbers()
        parts = [c * t._numbers[1] for c, t in zip(coeffs, self.terms) if c != 0.0]  # type: ignore[index]
        v = float(value.detach())
        r, scale = v - sum(parts), abs(v) + sum(abs(p) for p in parts)
        if abs(r) <= 64 * torch.finfo(value.dtype).eps * scale:
            r = 0.0
        return coeffs, r, scale


__all__ = ["TermCapture"]
