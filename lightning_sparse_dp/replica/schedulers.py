"""Schedulers: a learning-rate scheduler stepped by hand inside a step is stepped once, as on one device.

The replicas run the step in threads of one process and share the trainer's schedulers. A step that steps one by
hand (a per-batch warm-up written in ``training_step``: ``self.lr_schedulers().step()``, or
``self.trainer.lr_scheduler_configs[0].scheduler.step()``) would step it once per replica, where one device steps it
once and each of Lightning's DDP ranks steps its own as often. During a step of several replicas each replica's
trainer view (:func:`~lightning_sparse_dp.replica.effects.trainer_view`) shows, as its ``lr_scheduler_configs`` (which
``self.lr_schedulers()`` reads), copies of the configs whose ``scheduler`` is a :func:`once_view` of the trainer's:
the same object state (its ``__dict__`` shared, ``isinstance`` checks hold) whose ``step`` makes the replicas'
``k``-th calls one call (:func:`call_once`): the first replica to make its ``k``-th call of a scheduler's ``step``
steps it, the others wait for that call and get what it returned. So every replica, after its ``k``-th call, sees the
scheduler stepped ``k`` times, as every DDP rank sees its own. The view's ``optimizer`` is the replica's view of it
(:func:`~lightning_sparse_dp.replica.optimizers.rank_view`): a change of its param groups in the step
(``self.lr_schedulers().optimizer.param_groups[0]["lr"] = ...``) is the replica's own, as a DDP rank's, the root
replica's written back; the scheduler's own ``step`` changes the trainer's groups, once.

A scheduler that steps on a value (``ReduceLROnPlateau.step(metrics)``) is stepped with the value of the replica that
called first (its chunk's, where one device's is the whole batch's): pass a value of the whole batch, or let Lightning
step it (``"monitor"`` in ``configure_optimizers``). Outside a step of several replicas (one device, Lightning's own
stepping after the step) the trainer's configs and schedulers are its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from lightning_sparse_dp.replica.optimizers import rank_view
from lightning_sparse_dp.runtime.process import STEP_EFFECTS as _current

T = TypeVar("T")


def call_once(effects: Any, index: int, key: int, fn: Callable[[], T]) -> T:
    """Replica ``index``'s ``k``-th call of ``key`` in the step of ``effects`` (a
    :class:`~lightning_sparse_dp.replica.effects.StepEffects`; calls counted per replica): the first replica to make a
    ``k``-th call of ``key`` runs ``fn()``, every replica's ``k``-th call returns its result or raises its exception."""
    with effects.once_lock:
        k = effects.once_counts[(key, index)] = effects.once_counts.get((key, index), 0) + 1
        outcome = effects.once_results.get((key, k))
        first = outcome is None
        if outcome is None:
            outcome = effects.once_results[(key, k)] = Future()
    if first:
        try:
            outcome.set_result(fn())
        except BaseException as err:
            outcome.set_exception(err)
            raise
    return outcome.result()


@functools.cache
def _once_class(cls: type) -> type:
    """A subclass of the scheduler class ``cls`` whose ``step``, in a replica's step of several, is one call of the
    replicas' (:func:`call_once`, keyed by the shared state), and ``cls.step`` elsewhere."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        effects = getattr(_current, "effects", None)
        own = object.__new__(cls)  # the scheduler itself (its optimizer the trainer's, not the replica's view)
        own.__dict__ = self.__dict__
        if effects is None:
            return cls.step(own, *args, **kwargs)
        return call_once(effects, _current.index, id(self.__dict__), lambda: cls.step(own, *args, **kwargs))

    def optimizer(self: Any) -> Any:  # what the step changes through it is the replica's, as a DDP rank's own
        try:
            return rank_view(self.__dict__["optimizer"])
        except KeyError:
            raise AttributeError("optimizer") from None

    def set_optimizer(self: Any, value: Any) -> None:
        self.__dict__["optimizer"] = value

    namespace = {"step": step, "__module__": cls.__module__, "_lsdp_view": True}
    if "optimizer" not in dir(cls):
        namespace["optimizer"] = property(optimizer, set_optimizer)
    return type(cls.__name__, (cls,), namespace)


def once_view(scheduler: Any) -> Any:
    """``scheduler`` as a replica's step sees it: its state shared, its ``step`` one call of the replicas'
    (:func:`call_once`); ``scheduler`` itself when it cannot have one (no ``__dict__``, no ``step``, a view already)."""
    if (not hasattr(scheduler, "__dict__") or not callable(getattr(type(scheduler), "step", None))
            or type(scheduler).__dict__.get("_lsdp_view", False)):
        return scheduler
    try:
        shown = object.__new__(_once_class(type(scheduler)))
        shown.__dict__ = scheduler.__dict__
    except (TypeError, AttributeError):  # slots, a C type, a __new__ of its own: left as it is
        return scheduler
    return shown


def configs_view(configs: list[Any]) -> list[Any]:
    """The trainer's ``lr_scheduler_configs`` as a replica's step sees them: copies whose ``scheduler`` is a
    :func:`once_view` (a config that is not a dataclass with a ``scheduler`` is left as it is)."""
    return [dataclasses.replace(c, scheduler=once_view(c.scheduler))
            if dataclasses.is_dataclass(c) and hasattr(c, "scheduler") else c for c in configs]


__all__ = ["call_once", "configs_view", "once_view"]
