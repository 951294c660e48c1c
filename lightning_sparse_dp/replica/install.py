"""Install: each replica's per-step state put in place before its step and taken back after it.

:func:`replica_state` (entered by the step's state stage, :func:`~lightning_sparse_dp.step.state.install_step`) gives a
:class:`ReplicaState` whose part for each replica (:meth:`ReplicaState.enter`, in the replica's own thread where it
can be) installs its buffer copies and refresh from the module where its thread makes them, its empty metric copies,
its ``self.log`` recorder and ``self.print``, its view of the loggers (whose calls run once:
:mod:`lightning_sparse_dp.replica.effects`), and the :class:`~lightning_sparse_dp.replica.changes.ModuleChanges` that notes
what its step sets on the module. With the strategy's deferred check of the replicas
(:class:`~lightning_sparse_dp.step.check.DeferredCheck`) the calling thread installs it once the check passed, and each
replica waits for it before its step (:func:`enter_checked`). At exit the recorders are removed
and the metric copies merged into the root's metrics; buffers the replicas' steps updated to different values are said
(:func:`say_diverged_buffers`). The step's types are imported for annotations only: this folder does not import the
step's stages (they import it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn
from torch import Tensor, nn

from lightning_sparse_dp.replica.changes import ModuleChanges
from lightning_sparse_dp.replica.effects import give_view
from lightning_sparse_dp.replica.metrics import ReplicaMetrics, StepMetrics
from lightning_sparse_dp.replica.recorder import install_recorder, remove_recorders
from lightning_sparse_dp.replica.watch import ReplicaWatch
from lightning_sparse_dp.split import SplitPlan
from lightning_sparse_dp.syncbn.collective import ThreadGroup

if TYPE_CHECKING:  # the step's types only: nothing here imports the step's stages
    from lightning_sparse_dp.step.check import DeferredCheck
    from lightning_sparse_dp.step.copies import BufferHandOff
    from lightning_sparse_dp.step.replicate import Replicas


class ReplicaState:
    """The replicas' per-step state (:func:`replica_state`): the log ``recorders`` (one per replica, ``None`` until
    its :meth:`enter`), the batch-norm ``group`` (``None`` without synchronized layers) and ``left``, the
    :class:`ModuleChanges` of what the step sets on the module; ``watch``: what the persistent replicas hold from step
    to step (:class:`~lightning_sparse_dp.replica.watch.ReplicaWatch`: their trainer views and recorders), ``None``
    for the module itself."""

    def __init__(
        self, replicas: list[nn.Module], metrics: StepMetrics, own: bool, refresh: Callable[[int], None] | None,
        group: ThreadGroup | None, left: ModuleChanges, buffers: BufferHandOff | None = None,
        watch: ReplicaWatch | None = None,
    ) -> None:
        self.replicas, self.metrics, self.own, self.refresh, self.group = replicas, metrics, own, refresh, group
        self.left, self.buffers, self.watch = left, buffers, watch
        self.recorders: list[Any] = [None] * len(replicas)

    def enter(self, i: int) -> Callable[[], None] | None:
        """Replica ``i``'s part, touching that replica only (so each replica's thread runs its own, before its
        step): its buffer copies (``buffers``: a :class:`~lightning_sparse_dp.step.copies.BufferHandOff`, replicas after
        the root one), its refresh from the module (``refresh(i)``:
        :meth:`~lightning_sparse_dp.step.replicate.Replicas.refresh_replica`), its empty metric copies where the module
        has metrics (:meth:`~lightning_sparse_dp.replica.metrics.StepMetrics.install`; first, so that logged metrics
        resolve to the replica's copy), its ``self.log`` recorder and ``self.print``
        (:func:`~lightning_sparse_dp.replica.recorder.install_recorder`; the one ``watch`` holds, emptied, where the
        module has no metric), its trainer view (:func:`~lightning_sparse_dp.replica.effects.give_view`), then
        :meth:`ModuleChanges.enter` (which notes the replica's attributes as its step finds them). Returns what must run
        last before the step: for replica 0, whose step writes the module's buffers, the wait for the others' buffer
        copies (``None`` for the others)."""
        if self.buffers is not None and i > 0:
            self.buffers.copy(i)
        if self.refresh is not None:
            self.refresh(i)
        metrics, watch = self.metrics, self.watch
        if watch is None or metrics.merged:
            metrics.install(i)
            # the persistent replicas' metrics are the copies just installed; the module itself (one chunk) is searched
            self.recorders[i] = install_recorder(self.replicas[i], i, metrics.copies(i) if self.own else None)
        else:  # no metric: the replica's recorder of the last step, emptied
            self.recorders[i] = watch.recorders[i] = install_recorder(self.replicas[i], i, {}, watch.recorders[i])
        if self.own and len(self.replicas) > 1:  # its loggers' calls run in replica 0's step only (effects.py)
            give_view(self.replicas[i], None if watch is None else watch.views, i)
        self.left.enter(i)
        return self.buffers.wait if self.buffers is not None and i == 0 else None


def enter_checked(check: DeferredCheck, i: int) -> Callable[[], None] | None:
    """Replica ``i``'s part (:meth:`ReplicaState.enter`) of the state the calling thread installs once its check of the
    replicas passed (:class:`~lightning_sparse_dp.step.check.DeferredCheck`, whose ``prepare`` enters
    :func:`replica_state`).

    Raises:
        StaleReplicas: the check failed (from :meth:`~lightning_sparse_dp.step.check.DeferredCheck.wait`).
    """
    return check.wait().enter(i)


def say_diverged_buffers(names: Sequence[str], warning_cache: WarningCache | None = None) -> None:
    """A warning for each of the module's buffers the replicas' steps updated to different values
    (:meth:`~lightning_sparse_dp.step.replicate.Replicas.diverged_buffers`, which names each once), through
    ``warning_cache`` (the strategy's) when given."""
    say = rank_zero_warn if warning_cache is None else warning_cache.warn
    for name in names:
        say(
            f"sparse_dp: the step updated the module's buffer {name!r} to a different value in each replica (from each "
            "one's chunk, e.g. a histogram of its labels): the module keeps the first replica's, as nn.DataParallel and "
            "DDP's buffer broadcast keep the first device's, not one device's update from the whole batch. Update it "
            "from the whole batch (the gathered step outputs in on_train_batch_end), or keep it in a torchmetrics "
            "metric, whose replicas' states are merged."
        )


def say_counted_buffers(counted: Sequence[tuple[str, float]], warning_cache: WarningCache | None = None) -> None:
    """A warning for each 0-dim buffer every replica's step changed by one number that is each chunk's count of samples
    or points (:meth:`~lightning_sparse_dp.step.replicate.Replicas.diverged_buffers`' ``counted``)."""
    say = rank_zero_warn if warning_cache is None else warning_cache.warn
    for name, d in counted:
        say(
            f"sparse_dp: the step changed the module's buffer {name!r} by {d:g} in every replica, which is also each "
            "chunk's number of samples or points: the replicas agree, so the module keeps that change, as DDP's buffer "
            "broadcast keeps rank 0's, where one device's step, if it counts the batch, changes it by the whole batch's "
            "count. Count from the whole batch (the gathered step outputs in on_train_batch_end), or keep the count in "
            "a torchmetrics SumMetric, whose replicas' states are merged."
        )


def say_written_frozen(names: Sequence[str], count: int, warning_cache: WarningCache | None = None) -> None:
    """A warning for each frozen parameter of the module that the replicas share and the step changed in place
    (:meth:`~lightning_sparse_dp.step.replicate.Replicas.written_frozen`): applied once per replica this step; the next
    step's replicas own copies of it."""
    say = rank_zero_warn if warning_cache is None else warning_cache.warn
    for name in names:
        say(
            f"sparse_dp: the step changed the frozen parameter {name!r} in place (e.g. an EMA teacher's "
            f"t.mul_(m).add_(s, alpha=1 - m)), which the {count} replicas share on this device: this step applied the "
            "change once per replica. From the next step each replica changes a copy of its own and the module keeps "
            "the root replica's change, as one device's (and DDP's rank 0). The exactness check (check_exactness, on by "
            "default) finds such parameters before the first step, so that no step applies it more than once."
        )


@contextmanager
def replica_state(
    module: nn.Module, replicas: list[nn.Module], devices: Sequence[torch.device], metrics: ReplicaMetrics,
    persistent: Replicas | None, group: ThreadGroup | None, deferred: bool = False, plan: SplitPlan | None = None,
    warning_cache: WarningCache | None = None, value_of: Callable[[list[Any]], Tensor | None] | None = None,
) -> Iterator[ReplicaState]:
    """The replicas' per-step state, installed for the apply stage and undone after it.

    Each replica's part (:meth:`ReplicaState.enter`) runs here for every replica, or, ``deferred``, in each
    replica's own thread before its step (then with the replica's refresh from the module first, which the caller
    leaves out: :meth:`~lightning_sparse_dp.step.replicate.Replicas.refresh_tensors` only, without the buffers where
    :attr:`~lightning_sparse_dp.step.replicate.Replicas.buffers_in_threads`). Undone at exit, in this order: the
    recorders removed before the calls are logged through the root module, which may itself be replica 0
    (:func:`~lightning_sparse_dp.replica.recorder.remove_recorders`), the metric copies merged into the root's metrics (when the
    body raised nothing) and the replicas' own metrics back
    (:meth:`~lightning_sparse_dp.replica.metrics.ReplicaMetrics.step_copies`).

    Args:
        plan: the step's split (the replicas' metrics' concatenated states are merged in the batch's order).
        persistent: the strategy's :class:`~lightning_sparse_dp.step.replicate.Replicas` (the step's ``replicas`` are
            theirs, unless the one replica is the module itself).
        group: the step's batch-norm group (:func:`~lightning_sparse_dp.syncbn.replicas.synchronized`, entered by the
            caller before the replicas start; ``None`` without synchronized layers).
        warning_cache: where the step's warnings go (the strategy's; :func:`say_diverged_buffers`).
        value_of: the whole batch's value of a number the replicas' steps each gave (the step's
            :meth:`~lightning_sparse_dp.loss.step.StepTerms.output_value`), for the metrics' merge.
    """
    with ExitStack() as stack:
        own = replicas[0] is not module  # the persistent replicas (not the module itself, for one chunk)
        if own and persistent is not None and metrics.empty_for is persistent:  # no metric in this module tree
            step_metrics = metrics.none
        else:
            step_metrics = stack.enter_context(
                metrics.step_copies(module, replicas, list(devices), persistent if own else None, plan, value_of)
            )
        stack.callback(remove_recorders, replicas)
        refresh = persistent.refresh_replica if deferred and own and persistent is not None else None
        buffers = persistent.buffer_hand_off(len(replicas)) if refresh is not None else None  # type: ignore[union-attr]
        attributes = persistent.attributes if own and persistent is not None else None
        left = ModuleChanges(module, replicas, deferred=True, attributes=attributes, plan=plan)
        watch = None if attributes is None else attributes.watch
        state = ReplicaState(replicas, step_metrics, own, refresh, group, left, buffers, watch)
        watch = own and persistent is not None and len(replicas) > 1
        marks = persistent.buffer_marks() if watch else []  # type: ignore[union-attr]
        frozen = persistent.frozen_marks() if watch else []  # type: ignore[union-attr]
        if not deferred:
            for i in range(len(replicas)):
                state.enter(i)
        yield state
        if marks:
            counted: list[tuple[str, float]] = []
            say_diverged_buffers(persistent.diverged_buffers(marks, len(replicas), plan, counted), warning_cache)  # type: ignore[union-attr]
            say_counted_buffers(counted, warning_cache)
        if frozen:
            say_written_frozen(persistent.written_frozen(frozen), len(replicas), warning_cache)  # type: ignore[union-attr]


__all__ = [
    "enter_checked", "replica_state", "say_counted_buffers", "say_diverged_buffers", "say_written_frozen",
    "ReplicaState",
]
