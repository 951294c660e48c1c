"""Compare: what two runs of one training step left, tensor by tensor, as relative differences.

A run of the step (one device's, or the strategy's on its replicas) is summed up as a :class:`StepRecord`: the loss,
every parameter's gradient, the module's state after the step (``state_dict``: parameters and buffers, frozen ones and
teacher / EMA copies included), the states of its ``torchmetrics`` metrics (those kept in plain lists and dicts too),
the values the step logged and the numbers and tensors the module keeps in its own attributes.
:func:`differences` lines two records up, name by name.

The measure is the max-norm relative difference of a tensor, ``max|a - b| / max|b|`` (``b`` the one-device run's;
0 when both are all zeros; NaN where both are NaN counts as equal), the per-tensor measure the project's exactness tests
use: unlike an element-wise ratio it does not blow up on an element that is 0 in one run and rounding noise in the
other (a batch-norm bias gradient's cancellation). A gradient is measured against at least :data:`GRADIENT_FLOOR` times
the step's largest gradient (the one-device run's largest ``max|grad|`` over the parameters): a gradient that is zero
in exact math (the bias of a layer right before batch norm, which the normalization's mean removes) is rounding noise
in both runs, two noises whose ratio means nothing; a real difference in it shows still (a difference of ``d`` in a
gradient smaller than the floor reads ``d / floor``, above the check's tolerance for any ``d`` above rounding). A
tensor held below float64 in either run counts as equal within its own precision's rounding (:data:`LOW_PRECISION_ULPS`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

#: a gradient's relative difference is taken over at least this fraction of the step's largest gradient. Rounding
#: noise of a gradient that is zero in exact math is float64's epsilon times what it is summed from, which batch norm's
#: ``1 / sigma`` can make thousands of times the largest gradient (4.5e-13 of it, a Linear bias before
#: ``BatchNorm1d``): that reads 5e-10 here, under the check's tolerance (1e-8), while a difference of 1e-3 relative
#: in a gradient a millionth of the largest still reads 1e-6
GRADIENT_FLOOR = 1e-3
#: a tensor held in a lower precision than float64 in either run (a torchmetrics state, which ``.double()`` leaves
#: float32 under ``precision="64-true"``; a logged Python float made a float32 tensor) differs only beyond this many
#: units of rounding of its precision: its sums over the batch, in another order on the replicas, round apart there
#: (a float32 ``MeanMetric`` state 9.9e-8 relative off), which is not a difference of the step
LOW_PRECISION_ULPS = 256


@dataclass
class StepRecord:
    """What one run of a training step left.

    Attributes:
        loss: the step's loss (0-dim), or ``None`` when the step returned none.
        grads: ``parameter name -> .grad`` after the backward pass (``None``: no gradient).
        state: ``state_dict()`` of the module after the step (parameters and buffers).
        metrics: ``"<metric path>.<state>" -> tensor`` of every ``torchmetrics.Metric`` of the module (list states
            concatenated along dim 0).
        logged: ``name -> value`` of the step's ``self.log`` calls (numbers and one-element tensors; a logged
            ``Metric`` is compared through :attr:`metrics`).
        outputs: ``path -> tensor`` of what the step returned (:func:`output_tensors`; compared for evaluation steps).
        attributes: ``"name"`` / ``"name[k]"`` -> tensor of the module's own public attributes (and ``hparams``) that
            are tensors or numbers, or hold them in lists, tuples and dicts (what the step, or a hook in its backward,
            kept on the module: ``self.preds``, ``self.grad_norms.append(...)``, ``self.counts["pos"] += n``).
    """

    loss: Tensor | None
    grads: dict[str, Tensor | None] = field(default_factory=dict)
    state: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)
    logged: dict[str, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] = field(default_factory=dict)
    attributes: dict[str, Tensor] = field(default_factory=dict)


def record_step(module: nn.Module, loss: Tensor | None, logged: Mapping[str, Any], metrics: bool = True,
                output: Any = None) -> StepRecord:
    """A :class:`StepRecord` of ``module`` after a step's backward pass (tensors detached and cloned to the CPU);
    ``metrics=False``: without the metrics' states; ``output``: the step's output, whose tensors are recorded
    (:func:`output_tensors`)."""
    def keep(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().to("cpu", copy=True)

    states = {}
    leaves = list(_attribute_leaves(module))
    # the module's metrics, and those it keeps in plain lists and dicts (no submodule: ``{"loss": MeanMetric()}``)
    found = [*module.named_modules(), *((n, v) for n, v in leaves if isinstance(v, Metric))] if metrics else []
    for path, m in found:
        if isinstance(m, Metric):
            for name, value in m.metric_state.items():
                tensor = _state_tensor(value)
                if tensor is not None:
                    states[f"{path}.{name}"] = keep(tensor)
    values = {}
    for name, value in logged.items():
        if isinstance(value, Tensor):
            values[name] = keep(value.reshape(()))
        elif isinstance(value, numbers.Number):
            values[name] = torch.tensor(float(value), dtype=torch.float64)  # type: ignore[arg-type]
    return StepRecord(
        loss=keep(loss.reshape(()) if loss is not None else None),
        grads={n: keep(p.grad) for n, p in module.named_parameters()},
        state={n: keep(t) for n, t in module.state_dict().items() if isinstance(t, Tensor)},  # type: ignore[misc]
        metrics=states,
        logged=values,
        outputs={name: keep(t) for name, t in output_tensors(output).items()},  # type: ignore[misc]
        attributes={name: keep(t) for name, t in _attribute_tensors(leaves).items()},  # type: ignore[misc]
    )


#: nesting levels of lists, tuples and dicts read in the module's attributes (:func:`_attribute_leaves`)
ATTRIBUTE_DEPTH = 4


def _attribute_leaves(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of what the module's own public attributes (its ``__dict__``, not parameters, buffers or
    submodules) and Lightning's ``hparams`` hold, the lists, tuples and dicts among them read through (to
    :data:`ATTRIBUTE_DEPTH` levels) by path (``"preds[2]"``, ``"counts['pos']"``, ``"hparams['n_steps']"``)."""
    def read(name: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        if depth < ATTRIBUTE_DEPTH and isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                yield from read(f"{name}[{k}]", v, depth + 1)
        elif depth < ATTRIBUTE_DEPTH and isinstance(value, Mapping):
            for k, v in value.items():
                yield from read(f"{name}[{k!r}]", v, depth + 1)
        else:
            yield name, value

    for name, value in vars(module).items():
        if not name.startswith("_"):
            yield from read(name, value, 0)
    hparams = vars(module).get("_hparams")
    if isinstance(hparams, Mapping):
        yield from read("hparams", dict(hparams), 0)


def _attribute_tensors(leaves: list[tuple[str, Any]]) -> dict[str, Tensor]:
    """Of the module's attribute ``leaves`` (:func:`_attribute_leaves`), the tensors and numbers (a count kept on the
    module, ``self.num_pos += int((y == 1).sum())``; as float64 0-dim tensors), by path."""
    return {name: v if isinstance(v, Tensor) else torch.tensor(float(v), dtype=torch.float64)
            for name, v in leaves if isinstance(v, (Tensor, numbers.Real))}


def output_tensors(output: Any, path: str = "output") -> dict[str, Tensor]:
    """``path -> tensor`` of a step's output: tensors and numbers in dicts, lists and tuples (``output['logits']``,
    ``output[0]``), an ME ``SparseTensor`` / ``TensorField`` as its features and coordinates (``.F`` / ``.C``), its
    rows sorted (:func:`_row_order`: ME's row order differs between a chunk's tensor and the batch's), and so are the
    rows of coordinates returned with their features in one dict, list or tuple (:func:`_rows_aligned`)."""
    if isinstance(output, Tensor):
        return {path: output}
    if isinstance(output, numbers.Number) and not isinstance(output, bool):
        return {path: torch.tensor(float(output), dtype=torch.float64)}  # type: ignore[arg-type]
    if isinstance(output, Mapping):
        keys, values = list(output), _rows_aligned(list(output.values()))
        return {k: v for key, value in zip(keys, values) for k, v in output_tensors(value, f"{path}[{key!r}]").items()}
    if isinstance(output, (list, tuple)):
        values = _rows_aligned(list(output))
        return {k: v for i, value in enumerate(values) for k, v in output_tensors(value, f"{path}[{i}]").items()}
    features, coordinates = getattr(output, "F", None), getattr(output, "C", None)
    if isinstance(features, Tensor) and isinstance(coordinates, Tensor):
        order = _row_order(coordinates, features)  # ME orders a tensor's rows by its coordinate map: compared as sets
        return {f"{path}.F": features[order], f"{path}.C": coordinates[order]}
    return {}


def _is_coordinates(value: Any) -> bool:
    """Whether ``value`` reads as coordinates: an integer tensor ``[n, d]`` (``x.C``, ``x.C[:, 1:]``)."""
    return (isinstance(value, Tensor) and value.dim() == 2 and not value.is_floating_point()
            and not value.is_complex() and value.dtype != torch.bool)


def _rows_aligned(values: list[Any]) -> list[Any]:
    """``values`` (one dict's, list's or tuple's entries) with the rows of coordinates and what comes with them sorted:
    each integer tensor ``[n, d]`` (:func:`_is_coordinates`) and every tensor beside it with ``n`` rows (its features,
    ``(out.C[i, 1:], out.F[i])`` of a sample; ``{"coords": out.C, "logits": out.F}``) are put in one order, the
    lexicographic order of their rows (:func:`_row_order`: the coordinates first). ME gives a generated or strided
    tensor's rows in its coordinate map's order, which differs between one device's batch and a replica's chunk: the
    rows are compared by their coordinates, not by position; other coordinates, another value or a missing row still
    differ. A new list; the other entries as they were."""
    values = list(values)
    for n in {len(v) for v in values if _is_coordinates(v)}:
        rows = [i for i, v in enumerate(values) if isinstance(v, Tensor) and v.dim() >= 1 and len(v) == n]
        keys = sorted(rows, key=lambda i: not _is_coordinates(values[i]))  # the coordinates first, then the rest
        order = _row_order(*(values[i] for i in keys))
        for i in rows:
            values[i] = values[i][order.to(values[i].device)]
    return values


def _row_order(*columns: Tensor) -> Tensor:
    """The order of the rows of ``columns`` (tensors of ``n`` rows each, ``[coordinates, features]``) put side by
    side (each flattened to ``[n, k]``; ``n`` may be 0), lexicographic (stable sorts from the last column to the first): an ME
    tensor's rows as a set, whatever order its coordinate map gave them. ``[n]`` int64, on the first column's
    device."""
    n = len(columns[0])
    rows = torch.cat([c.detach().cpu().double().reshape(n, 1) if c.dim() == 1 else c.detach().cpu().double().flatten(1)
                      for c in columns], 1)
    order = torch.arange(n)
    for c in reversed(range(rows.shape[1])):
        order = order[torch.argsort(rows[order, c], stable=True)]
    return order.to(columns[0].device)


def _state_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, list) and value and all(isinstance(v, Tensor) for v in value):
        return torch.cat([v.reshape(-1) for v in value])
    return None


def relative_difference(actual: Tensor | None, expected: Tensor | None, floor: float = 0.0) -> float:
    """``max|actual - expected| / max(max|expected|, floor)`` over the elements (``inf`` for different shapes, or a
    tensor against none unless the tensor is all zeros: a parameter without a gradient and one with a zero gradient
    train alike).

    NaN in both at the same place counts as equal; NaN in one only is ``inf``. Integer and bool tensors compare as
    float64.
    """
    if actual is None or expected is None:
        other = expected if actual is None else actual
        return 0.0 if other is None or not bool(other.ne(0).any()) else math.inf
    if actual.shape != expected.shape:
        return math.inf
    a, b = actual.double(), expected.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    a, b = torch.where(both_nan, 0.0, a), torch.where(both_nan, 0.0, b)
    if bool(torch.isnan(a).any() | torch.isnan(b).any()):
        return math.inf
    if a.numel() == 0:
        return 0.0
    diff = float((a - b).abs().max())
    if diff == 0.0:
        return 0.0
    scale = max(float(b.abs().max()), floor)
    return math.inf if scale == 0.0 or math.isinf(diff) else diff / scale


def differences(actual: StepRecord, expected: StepRecord) -> Iterator[tuple[str, float]]:
    """``(what, relative difference)`` for every tensor of the two records, named for a user: ``"loss"``,
    ``"grad of 'head.weight'"``, ``"state 'bn.running_mean'"``, ``"metric state 'acc.tp'"``, ``"logged 'train_loss'"``.
    A name in one record only has difference ``inf``. Gradients are measured over at least :data:`GRADIENT_FLOOR`
    times ``expected``'s largest gradient."""
    yield "loss", relative_difference(actual.loss, expected.loss)
    sizes = [float(g.abs().max()) for g in expected.grads.values() if g is not None and g.numel()]
    largest = max((s for s in sizes if math.isfinite(s)), default=0.0)
    parts = (("grad of", actual.grads, expected.grads, GRADIENT_FLOOR * largest),
             ("state", actual.state, expected.state, 0.0), ("metric state", actual.metrics, expected.metrics, 0.0),
             ("logged", actual.logged, expected.logged, 0.0), ("returned", actual.outputs, expected.outputs, 0.0),
             ("attribute", actual.attributes, expected.attributes, 0.0))
    for label, mine, theirs, floor in parts:
        for name in list(theirs) + [n for n in mine if n not in theirs]:
            if name not in mine or name not in theirs:
                yield f"{label} {name!r}", math.inf
            else:
                d = relative_difference(mine[name], theirs[name], floor)
                yield f"{label} {name!r}", 0.0 if d <= _rounding(mine[name], theirs[name]) else d


def _rounding(a: Tensor | None, b: Tensor | None) -> float:
    """The relative difference two runs' rounding explains in a tensor held below float64 in either
    (:data:`LOW_PRECISION_ULPS` of its coarser precision); 0 for float64 and non-float tensors."""
    eps = max((torch.finfo(t.dtype).eps for t in (a, b) if t is not None and t.is_floating_point()), default=0.0)
    return LOW_PRECISION_ULPS * eps if eps > torch.finfo(torch.float64).eps else 0.0


__all__ = [
    "GRADIENT_FLOOR", "LOW_PRECISION_ULPS", "StepRecord", "differences", "output_tensors", "record_step",
    "relative_difference",
]
