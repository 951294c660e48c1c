"""State: the stage that installs the replicas' per-step state around the apply stage and merges what the step left.

Two calls from the hub (the strategy's ``_through_stages``), both timed as stage ``state``: :func:`install_step`
around ``parallel_apply`` (the step's batch-norm group, the capture of the replicas' losses,
:func:`~lightning_sparse_dp.replica.install.replica_state` installed by the deferred check or here, manual
optimization's calls met once), and after the weigh stage :func:`merge_into_module`: what the replicas' steps set on
the module, merged as one device's step leaves it, a value that is a combination of captured losses by its
whole-batch value, any other as step outputs are gathered (:func:`combine_values`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lightning_sparse_dp.loss.step import StepTerms
from lightning_sparse_dp.loss.weights import step_weights
from lightning_sparse_dp.replica.install import ReplicaState, enter_checked, replica_state
from lightning_sparse_dp.replica.metrics import ReplicaMetrics
from lightning_sparse_dp.split import SplitPlan
from lightning_sparse_dp.step.context import StepContext
from lightning_sparse_dp.step.gather import gather_outputs
from lightning_sparse_dp.step.manual import manual_step
from lightning_sparse_dp.step.output_roles import rows_of_chunks
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.syncbn.collective import ThreadGroup
from lightning_sparse_dp.syncbn.replicas import synchronized


def combine_values(
    plan: SplitPlan, weights: Sequence[float], terms: StepTerms | None, root: torch.device,
    output_layout: Mapping[str, str] | None, warning_cache: WarningCache, values: list[Any],
) -> tuple[Any, bool]:
    """The replicas' values of one attribute or list entry the step left on ``self``, merged as one device's:
    a combination of captured losses (or its ``.item()``), or a mean each replica computed with ``torch.mean`` /
    ``.mean()``, by its whole-batch value (:meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`; ``True``:
    exact), else as step outputs are (``False``; :func:`~lightning_sparse_dp.step.gather.gather_outputs`, the leaves of
    a dict or list the same way, its ``"loss"`` key included: not the step's own loss).

    Raises:
        ValueError: tensors that are not rows of their chunks (:func:`~lightning_sparse_dp.step.output_roles.rows_of_chunks`:
            a confusion matrix, a histogram the step sets on ``self``), which the output merge would concatenate into a
            value of another size than any step's; the caller keeps the root replica's then.
    """
    if terms is not None and all(isinstance(v, (Tensor, float)) for v in values):
        value = terms.output_value(values)
        if value is not None:
            return (value.to(values[0].device) if isinstance(values[0], Tensor) else float(value)), True
    if all(isinstance(v, Tensor) and v.dim() > 0 for v in values) and not rows_of_chunks(values, plan):
        raise ValueError("tensors of a fixed size, not rows of the chunks: no merge of them is one device's value")
    structures = isinstance(values[0], (Mapping, list, tuple))  # their leaves' merge is said here, a leaf's by the caller
    value_of = terms.output_value if structures and terms is not None else None  # a 0-dim leaf's whole value, or said
    return gather_outputs(values, plan, weights, root, output_layout, warning_cache, say_lists=structures,
                          value_of=value_of, exact_loss=False), False


@dataclass(eq=False)
class InstalledStep:
    """What :func:`install_step` installed for one step, for the hub to put in the step's context.

    Attributes:
        group: the step's batch-norm group (``None`` without synchronized layers, outside manual steps).
        terms: the capture of the replicas' mean-reduced losses (``loss_weighting="terms"``), else ``None``.
        before: each replica's preparation in its own thread (``None``: on the calling thread).
        replica_state: the replicas' per-step state (:class:`~lightning_sparse_dp.replica.install.ReplicaState`); where the
            deferred check installs it, set once the body ended.
        weights: the replicas' weights, known before a manual step (``None`` otherwise).
    """

    group: ThreadGroup | None = None
    terms: StepTerms | None = None
    before: list[Callable[[], Any]] | None = None
    replica_state: ReplicaState | None = None
    weights: list[float] | None = None


@contextmanager
def install_step(
    step: StepContext, persistent: Replicas | None, sync_layers: Sequence[Sequence[Any]], metrics: ReplicaMetrics,
    loss_weighting: Any, site_memory: Any,
) -> Iterator[InstalledStep]:
    """The replicas' per-step state around the apply stage (stage ``state``), undone at exit; yields what it installed
    (:class:`InstalledStep`): the step's batch-norm group (:func:`~lightning_sparse_dp.syncbn.replicas.synchronized` of
    ``sync_layers``), the capture of the replicas' mean-reduced losses
    (:meth:`~lightning_sparse_dp.loss.step.StepTerms.for_step`) and :func:`replica_state`, which ``step.check`` installs
    once it passed (each replica waits for it in its ``before``: :func:`enter_checked`), else installed here, each
    replica's part in its own thread when ``step.refresh_in_threads``; under manual optimization the replicas'
    optimizer calls, met once, with the weights known before the step
    (:func:`~lightning_sparse_dp.step.manual.manual_step`). Reads the step's context, writes none of it.

    Args:
        persistent: the strategy's :class:`~lightning_sparse_dp.step.replicate.Replicas` (``None`` before any).
        metrics: the strategy's :class:`~lightning_sparse_dp.replica.metrics.ReplicaMetrics`; ``loss_weighting`` and
            ``site_memory``: its options for :class:`~lightning_sparse_dp.loss.step.StepTerms`.
    """
    n, out = len(step.replicas), InstalledStep()
    with ExitStack() as stack:
        with step.call.timer.stage("state"):
            if n > 1 and sync_layers and sync_layers[0]:  # else no group: one replica, or no synchronized layer
                out.group = stack.enter_context(synchronized(sync_layers[:n]))
            out.terms = StepTerms.for_step(loss_weighting, step.call.name, n, step.call.warnings, site_memory, step.plan)
            install = partial(stack.enter_context, replica_state(
                step.call.module, step.replicas, step.devices, metrics, persistent, out.group, step.refresh_in_threads,
                step.plan, step.call.warnings, None if out.terms is None else out.terms.output_value,
            ))
            if step.check is not None:  # installed by the check, on the calling thread, once it passed
                step.check.prepare = install
                out.before = [partial(enter_checked, step.check, i) for i in range(n)]
            else:
                out.replica_state = install()
                out.before = [partial(out.replica_state.enter, i) for i in range(n)] if step.refresh_in_threads else None
        if step.call.manual and n > 1:  # the replicas' manual_backward and optimizer calls met once, weights needed inside
            assert persistent is not None and step.plan is not None
            out.weights = step_weights(step.plan, step.inputs, loss_weighting, step.call.warnings)
            out.group = stack.enter_context(manual_step(
                step.call.module, persistent, step.replicas, out.group, out.weights, out.terms, partial(_on_module, out, step)
            ))
        yield out
        if step.check is not None:
            out.replica_state = step.check.prepared
        with step.call.timer.stage("state"):  # ... and undone (metrics merged into the root's)
            stack.close()


def _on_module(out: InstalledStep, step: StepContext, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on the module itself once in the step, through the step's replica state when it has one
    (:meth:`~lightning_sparse_dp.replica.changes.ModuleChanges.once_on_module`: what it changes is one device's)."""
    state = out.replica_state if out.replica_state is not None else (step.check.prepared if step.check else None)
    return state.left.once_on_module(fn) if state is not None else fn()


def merge_into_module(step: StepContext, root: torch.device, output_layout: Mapping[str, str] | None) -> None:
    """What the replicas' steps set on the module (``step.replica_state.left``), merged into it as one device's step would have
    left it (stage ``state``; :meth:`~lightning_sparse_dp.replica.changes.ModuleChanges.merge` by :func:`combine_values`)."""
    assert step.replica_state is not None and step.plan is not None and step.weights is not None
    with step.call.timer.stage("state"):
        combine = partial(combine_values, step.plan, step.weights, step.terms, root, output_layout, step.call.warnings)
        step.replica_state.left.merge(combine, step.call.warnings)


__all__ = ["InstalledStep", "combine_values", "install_step", "merge_into_module"]
