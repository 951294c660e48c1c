"""Apply: every replica's step at once, one thread each, wrapped in what a step runs under (:func:`replica_steps`).

:func:`replica_steps` makes the callables, replica ``i``'s ``replicas[i].<step_name>(inputs[i], ...)``, that the
strategy runs on the replicas' threads (:class:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor`). Each is
wrapped, innermost first, in what the step does outside the module noted (the loggers' calls,
:mod:`lightning_sparse_dp.replica.effects`), its thread's own torch function mode (the capture of its mean-reduced
losses, or a :class:`~lightning_sparse_dp.loss.observer.StepObserver` counting its means), its preparation, its rank of
the batch-norm group and its clock (stage ``replica<i>``).

The preparation runs in the replica's thread before its step: its chunk cut and placed first where it is still a
:class:`~lightning_sparse_dp.step.scatter.PendingChunk` (it reads the batch only), then the replica's part of the step's
state (:meth:`~lightning_sparse_dp.replica.install.ReplicaState.enter`, which may wait for the caller's check of the
replicas first), and, once the step returned, the replica's part after it
(:meth:`~lightning_sparse_dp.replica.install.ReplicaState.leave`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

from lightning_sparse_dp.loss.observer import StepObserver
from lightning_sparse_dp.step.scatter import PendingChunk

T = TypeVar("T")


def _step_on(step: Callable[..., T], inputs: Sequence[Any], i: int, args: tuple, kwargs: Mapping[str, Any]) -> T:
    return step(inputs[i], *args, **kwargs)


def _prepared(before: Callable[[], Any] | None, inputs: Any, i: int, step: Callable[[], T]) -> T:
    """A pending ``inputs[i]`` made (and stored), then ``before()``, then what ``before()`` returned when it is a
    callable (the last thing before the step: replica 0 waits there for the others' buffer copies), then ``step()``.
    The chunk comes first: it reads the batch only, while ``before()`` may wait for the caller's check of the replicas
    (:class:`~lightning_sparse_dp.step.check.DeferredCheck`) before it touches the module. When making the chunk raises,
    ``before()`` still runs (its own errors dropped) before the error is raised: other replicas may wait for what it
    does (replica 0 for this one's buffer copies, :class:`~lightning_sparse_dp.step.copies.BufferHandOff`)."""
    if isinstance(inputs[i], PendingChunk):
        try:
            inputs[i] = inputs[i]()
        except BaseException:
            if before is not None:
                with suppress(Exception):
                    before()
            raise
    last = before() if before is not None else None
    if last is not None:
        last()
    return step()


def replica_steps(
    replicas: Sequence[Any], inputs: Sequence[Any], step_name: str, args: tuple = (),
    kwargs: Mapping[str, Any] | None = None, terms: Any = None, group: Any = None, timer: Any = None,
    before: Sequence[Callable[[], Any]] | None = None, effects: Any = None,
) -> list[Callable[[], Any]]:
    """One call per replica, ``replicas[i].<step_name>(inputs[i], *args, **kwargs)``, wrapped in what the step runs
    under, innermost first: what it does outside the module noted (``effects``: a
    :class:`~lightning_sparse_dp.replica.effects.StepEffects`), the thread's torch function mode that observes it (the
    capture of its losses, ``terms``: a :class:`~lightning_sparse_dp.loss.step.StepTerms`; else a
    :class:`~lightning_sparse_dp.loss.observer.StepObserver` counting its means), its preparation (below), its rank of
    the batch-norm group (``group``), its clock (``timer``: a :class:`~lightning_sparse_dp.runtime.timing.StepTimer`,
    ``replica<i>``).

    The preparation runs in replica ``i``'s thread before the step: where ``inputs[i]`` is a
    :class:`~lightning_sparse_dp.step.scatter.PendingChunk`, the chunk made and left in ``inputs[i]`` (a list) for the
    caller, then ``before[i]()`` (the replica's part of the step's state,
    :meth:`~lightning_sparse_dp.replica.install.ReplicaState.enter`), then the callable ``before[i]()`` returned, if any.
    Inside the group's rank, so an error there aborts the batch-norm group as the step's would."""
    steps = [partial(_step_on, getattr(r, step_name), inputs, i, args, kwargs or {}) for i, r in enumerate(replicas)]
    if effects is not None:
        steps = [partial(effects.watch, i, step) for i, step in enumerate(steps)]
    if terms is not None:  # each step under its thread's own torch function mode: its capture, or a plain observer
        steps = terms.wrap(steps)
    else:
        steps = [partial(StepObserver().run, step) for step in steps]
    steps = [
        partial(_prepared, before[i] if before else None, inputs, i, step) for i, step in enumerate(steps)
    ]
    if group is not None:
        steps = [partial(group.run, rank, step) for rank, step in enumerate(steps)]
    if timer is not None:
        steps = [timer.timed(f"replica{i}", step) for i, step in enumerate(steps)]
    return steps


__all__ = ["replica_steps"]
