"""Losses: what each of torch's mean-reduced losses divides by, for one call.

A call of ``F.cross_entropy(..., reduction="mean")`` (or of ``nn.CrossEntropyLoss``, which calls it)
returns ``S / D``: the ``reduction="sum"`` result ``S`` over the call's denominator ``D``. The
whole batch's value of such a term, computed in parts ``i``, is ``sum_i D_i L_i / sum_i D_i``
(docs/exactness.md). :func:`denominator` gives ``D`` for a call as torch
defines it (``tests/loss/test_terms.py`` checks every case against torch's own ``reduction="sum"``):

- ``cross_entropy`` / ``nll_loss`` with class-index targets: the targets that are not
  ``ignore_index``; with a class ``weight``, the sum of ``weight[target]`` over those targets
  (``label_smoothing`` divides by the same sum: aten/src/ATen/native/LossNLL.cpp). With probability
  targets (floating-point ``target``): the number of samples, ``input.numel() / C``; ``ignore_index``
  does not apply;
- ``binary_cross_entropy``, ``binary_cross_entropy_with_logits``, ``mse_loss``, ``l1_loss``,
  ``smooth_l1_loss``, ``huber_loss``: the elements of the (broadcast) input; an element ``weight``
  of BCE or ``huber_loss`` is not in the denominator, while ``mse_loss`` / ``l1_loss`` with an
  element ``weight`` divide by its sum (torch 2.13's ``torch/nn/functional.py``);
- ``kl_div``: ``"batchmean"`` divides by ``input.size(0)``, ``"mean"`` by the elements.

Other losses torch reduces by a mean (``poisson_nll_loss``, ``ctc_loss``, margin losses...) are not
captured: :data:`UNCAPTURED` names them, so a loss built from them is said to fall back.

:func:`reduction_of` gives a captured call's ``D`` (none for ``reduction="sum"``) and where its value is kept;
:func:`full_reduction` tells a ``torch.sum`` / ``torch.mean`` of a whole tensor of rows (``y_hat.sum()``), which is a
term too: a sum, or a mean over ``x.numel()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import _reduction

from lightning_sparse_dp.runtime.process import LOSS_PARAMETERS as _PARAMETERS

Arguments = dict[str, Any]  # a call's arguments by name, defaults filled in (:func:`bind`)
Denominator = Callable[[Arguments], "float | Tensor"]


def _class_targets(a: Arguments) -> float | Tensor:
    """``cross_entropy`` / ``nll_loss``: weight sum of the non-ignored class-index targets, or the samples."""
    x, target, weight = a["input"], a["target"], a.get("weight")
    if target.is_floating_point():  # probability targets (cross_entropy only): a mean over samples
        return float(x.numel() // x.shape[1]) if x.dim() >= 2 else 1.0
    keep = target != a["ignore_index"]
    if weight is None:
        return keep.sum(dtype=torch.float64)
    safe = torch.where(keep, target, torch.zeros_like(target))  # an ignored index may lie outside weight
    return (weight.to(torch.float64)[safe] * keep).sum()


def class_bounds(func: Callable[..., Any], a: Arguments) -> Tensor | None:
    """The smallest and largest class of a ``cross_entropy`` / ``nll_loss`` call's class-index targets that are not
    ``ignore_index``: an int64 tensor ``[2]`` on the target's device (no device sync), ``lo > hi`` where every target
    is ignored; equal where the call is over one class (a per-class loss, ``F.cross_entropy(logits[y == c], y[y ==
    c])``: :mod:`~lightning_sparse_dp.loss.classes` pairs such calls across replicas by their class). ``None`` for
    another loss, probability targets, or a target that is not a tensor of indices."""
    if func is not F.cross_entropy and func is not F.nll_loss:
        return None
    target = a.get("target")
    if not isinstance(target, Tensor) or target.is_floating_point() or target.is_complex():
        return None
    t = target.reshape(-1).long()
    keep = t != a["ignore_index"]
    info = torch.iinfo(torch.int64)
    return torch.stack([torch.where(keep, t, info.max).min(), torch.where(keep, t, info.min).max()]) if t.numel() else (
        torch.tensor([info.max, info.min], device=t.device)
    )


def _elements(a: Arguments) -> float:
    return float(torch.broadcast_shapes(a["input"].shape, a["target"].shape).numel())


def _weighted_elements(a: Arguments) -> float | Tensor:
    """``mse_loss`` / ``l1_loss``: with an element ``weight``, the weights' sum."""
    weight = a.get("weight")
    return _elements(a) if weight is None else weight.sum(dtype=torch.float64)


def _kl_div(a: Arguments) -> float:
    x = a["input"]
    if _reduction_of(a) == "batchmean":
        return float(x.shape[0]) if x.dim() > 0 else 1.0
    return _elements(a)


#: torch's losses whose mean is captured, and their denominators.
CAPTURED: dict[Callable[..., Tensor], Denominator] = {
    F.cross_entropy: _class_targets,
    F.nll_loss: _class_targets,
    F.binary_cross_entropy: _elements,
    F.binary_cross_entropy_with_logits: _elements,
    F.mse_loss: _weighted_elements,
    F.l1_loss: _weighted_elements,
    F.smooth_l1_loss: _elements,
    F.huber_loss: _elements,
    F.kl_div: _kl_div,
}

#: torch's losses with a mean reduction that are not captured (a loss built from them falls back).
UNCAPTURED: tuple[Callable[..., Tensor], ...] = tuple(
    getattr(F, name)
    for name in (
        "poisson_nll_loss", "gaussian_nll_loss", "margin_ranking_loss", "hinge_embedding_loss",
        "multilabel_margin_loss", "soft_margin_loss", "multilabel_soft_margin_loss", "cosine_embedding_loss",
        "multi_margin_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss", "ctc_loss",
    )
    if hasattr(F, name)
)


def bind(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Arguments:
    """``func``'s arguments by name, defaults filled in (its signature read once; cheaper than
    ``inspect.Signature.bind``, which the call itself has already checked)."""
    params = _PARAMETERS.get(func)
    if params is None:
        sig = inspect.signature(func).parameters.values()
        params = _PARAMETERS[func] = ([p.name for p in sig], {p.name: p.default for p in sig if p.default is not p.empty})
    names, defaults = params
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    return out


def _reduction_of(a: Arguments) -> str:
    if a.get("size_average") is not None or a.get("reduce") is not None:  # torch's legacy arguments
        return _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    return a.get("reduction", "mean")


_MEANS = ("mean", "batchmean", "elementwise_mean")


def is_mean(a: Arguments) -> bool:
    """Whether the call reduces by a mean (``"mean"``, or ``kl_div``'s ``"batchmean"``)."""
    return _reduction_of(a) in _MEANS


def is_sum(a: Arguments) -> bool:
    """Whether the call reduces by a sum (``reduction="sum"``)."""
    return _reduction_of(a) == "sum"


def denominator(func: Callable[..., Tensor], a: Arguments) -> float | Tensor:
    """``D`` of one mean-reduced call of a :data:`CAPTURED` loss: its value times ``D`` is its ``"sum"`` value.

    Returns a Python float, or a float64 0-dim tensor on the target's device (no device sync).

    Raises:
        KeyError: ``func`` is not in :data:`CAPTURED`.
    """
    return CAPTURED[func](a)


def shared_arguments(func: Callable[..., Tensor], a: Arguments) -> tuple[Tensor, ...]:
    """The tensor arguments of one call of a :data:`CAPTURED` loss that apply to all of its rows alike: a class
    ``weight`` of ``cross_entropy`` / ``nll_loss``, ``pos_weight`` of ``binary_cross_entropy_with_logits``, and an
    element ``weight`` that broadcasts over the input's rows (a per-class ``[C]`` weight of BCE) rather than giving
    each row its own. The whole batch's criterion takes each of them once for every row, so a split computes it exactly
    only where every part was given the same (not one computed from its chunk's labels)."""
    out = []
    x, weight = a.get("input"), a.get("weight")
    if isinstance(weight, Tensor):
        per_class = func in (F.cross_entropy, F.nll_loss)
        per_row = isinstance(x, Tensor) and x.dim() > 0 and weight.dim() == x.dim() and weight.shape[0] == x.shape[0]
        if per_class or not per_row:
            out.append(weight)
    pos_weight = a.get("pos_weight")
    if isinstance(pos_weight, Tensor):
        out.append(pos_weight)
    return tuple(out)


def loss_name(func: Callable[..., Any]) -> str:
    """``"F.cross_entropy"``: how messages name a loss function."""
    return f"F.{getattr(func, '__name__', func)}"


#: :func:`loss_name` of every :data:`CAPTURED` loss, made once
CAPTURED_NAMES: dict[Callable[..., Tensor], str] = {func: loss_name(func) for func in CAPTURED}


def reduction_of(func: Any, bound: Any) -> tuple[float | Tensor | None, Tensor | bool] | None:
    """A captured loss call's denominator (``None`` for ``reduction="sum"``) and where its value is kept (``False`` /
    a tensor: 0 where the mean is over nothing); ``None`` for ``reduction="none"``."""
    reduction = _reduction_of(bound)  # read once: is_sum / is_mean each read it again
    if reduction == "sum":
        return None, True
    if reduction not in _MEANS:
        return None
    d = CAPTURED[func](bound)  # denominator(func, bound)
    if isinstance(d, Tensor) and d.device.type == "cpu":
        d = float(d)  # no device to wait for
    return d, (d > 0 if isinstance(d, Tensor) else bool(d > 0))


def full_reduction(args: tuple, kwargs: dict) -> bool:
    """Whether a ``torch.sum`` / ``torch.mean`` call reduces a whole floating tensor of rows to one value: no ``dim``
    (nor ``axis``), the input at least 1-dim and, where gradients are recorded, needing one (a count such as
    ``mask.float().sum()`` stays a number the step divides by)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor) or len(args) > 1 or "dim" in kwargs or "axis" in kwargs:
        return False
    return x.dim() >= 1 and x.is_floating_point() and (x.requires_grad or not torch.is_grad_enabled())


__all__ = [
    "CAPTURED", "CAPTURED_NAMES", "UNCAPTURED", "Arguments", "bind", "class_bounds", "denominator", "full_reduction",
    "is_mean", "is_sum", "loss_name", "reduction_of", "shared_arguments",
]
