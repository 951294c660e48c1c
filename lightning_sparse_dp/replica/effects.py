"""What a replica's step does outside the module: its loggers' calls, the schedulers it steps.

On one device a step runs once per batch, so what it does outside the module happens once, with the whole batch:
``self.logger.experiment.add_image(...)`` logs one image, ``np.save(f"{out}/{batch_idx}_{i}.npy", pred[i])`` writes
one file per sample of the batch. Every replica runs the step on its chunk of the batch (and every replica of one
process is global rank 0, so ``rank_zero_only`` guards let them all through): each would log its own image. Here,
replicas behave as Lightning's DDP ranks do, the root replica as rank 0:

- **Loggers.** During a step of several replicas each replica's ``self.trainer`` (and so ``self.logger``,
  ``self.loggers``, ``self.trainer.logger``) is a view of the trainer (:func:`trainer_view`): the same object state
  (its ``__dict__`` shared, ``isinstance`` checks hold), but its loggers are views too, whose public methods and whose
  ``experiment``'s public methods run in replica 0's step only, as ``self.print`` does
  (:func:`~lightning_sparse_dp.replica.recorder.install_recorder`); in the other replicas they return ``None`` (methods named
  ``get*`` run everywhere: they read). Attributes that are not methods (``log_dir``, ``save_dir``, ``version``) read as
  they are. A call made is said once per step name and call (:meth:`StepEffects.say`), with the fix: return what to log
  from the step and log it in ``on_*_batch_end``, which gets the gathered outputs and the whole batch.
- **Files.** Nothing is intercepted (``open`` stays Python's own in every thread): a file a step writes is written
  by every replica, as every DDP rank writes it, each with its own chunk; a file named by a position in the batch (or
  by ``batch_idx``) is then written once per replica and the last write wins. Write per-sample files from
  ``on_*_batch_end`` (which gets the gathered outputs and the whole batch) or a ``BasePredictionWriter``, and name
  them by what the sample carries (an id or a path in the batch); README and docs/troubleshooting.md say this rule.

- **Optimizers.** The view's ``optimizers`` are the replica's views of the trainer's optimizers, as
  ``self.optimizers()``'s (:mod:`~lightning_sparse_dp.replica.optimizers`): a change of their param groups is the
  replica's own, the root replica's written back. So are the view's ``strategy``'s ``optimizers``.
- **Schedulers.** The view's ``lr_scheduler_configs`` (and so ``self.lr_schedulers()``) show the schedulers so that a
  scheduler stepped by hand in the step is stepped once for the replicas' ``k``-th calls, as each DDP rank steps its
  own (:mod:`~lightning_sparse_dp.replica.schedulers`).

Nothing here changes a step of one replica (one device, or a one-chunk batch): the step is the module's, as on one
device.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.replica.optimizers import rank_view
from lightning_sparse_dp.replica.schedulers import configs_view
from lightning_sparse_dp.runtime.compat import set_trainer, trainer_of
from lightning_sparse_dp.runtime.process import STEP_EFFECTS as _current

T = TypeVar("T")


class StepEffects:
    """What the replicas' steps of one step did outside the module.

    Args:
        step_name: ``"training_step"``, ...; named in what is said.
        count: the number of replicas (``>= 2``; 1 for a step run apart, as the exactness check runs one).
        run_none: the loggers' calls run in no replica, replica 0's neither (the exactness check's runs, which must
            leave no trace).
    """

    def __init__(self, step_name: str, count: int, run_none: bool = False) -> None:
        self.step_name = step_name
        self.count = count
        self.run_none = run_none
        self.calls: list[set[str]] = [set() for _ in range(count)]  # per replica: "self.logger.experiment.add_image"
        # per replica, its views of the optimizers (replica/optimizers.py), which self.trainer.optimizers shows too
        self.rank_optimizers: list[Any] | None = None
        # the calls the replicas make once together (replica/schedulers.py call_once): (key, replica) -> calls made,
        # (key, k) -> the k-th call's outcome
        self.once_lock = threading.Lock()
        self.once_counts: dict[tuple[int, int], int] = {}
        self.once_results: dict[tuple[int, int], Future[Any]] = {}

    def watch(self, index: int, step: Callable[[], T]) -> T:
        """``step()`` as replica ``index``'s step: its loggers' calls noted (in the replica's thread)."""
        _current.effects, _current.index = self, index
        try:
            return step()
        finally:
            _current.effects = None

    def say(self, warning_cache: WarningCache) -> None:
        """After the step, on the calling thread: each logger call the replicas made, said once (per step name and
        call)."""
        if not any(self.calls):
            return
        for what in sorted(set().union(*self.calls)):
            if _said(warning_cache, f"{self.step_name} {what}"):
                continue
            callers = [i for i, calls in enumerate(self.calls) if what in calls]
            ran = "ran in replica 0's step only, with replica 0's chunk" if callers[0] == 0 else "ran in none of them"
            warning_cache.warn(
                f"sparse_dp: {self.step_name} called {what} in replicas {callers} (of {self.count}, each running the "
                f"step on its chunk of the batch), where one device calls it once a step, with the whole batch. It "
                f"{ran}: a logger's calls run in replica 0's step only (as self.print does), the other replicas' are "
                f"skipped. To log from the whole batch, return what you need from {self.step_name} and call the logger "
                f"in {_batch_end(self.step_name)}(outputs, batch, batch_idx), which gets the gathered outputs and the "
                "whole batch."
            )


def _said(warning_cache: WarningCache, key: str) -> bool:
    """Whether ``key`` was said already; noted as said (in the strategy's warning cache, a set of what was said)."""
    key = f"sparse_dp effects: {key}"
    if key in warning_cache:
        return True
    warning_cache.add(key)
    return False


def _batch_end(step_name: str) -> str:
    return f"on_{step_name.removesuffix('_step').replace('training', 'train')}_batch_end"


def _context() -> tuple[int, StepEffects] | None:
    effects = getattr(_current, "effects", None)
    return None if effects is None else (_current.index, effects)


# --- loggers --------------------------------------------------------------------------------------------------------
def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


def _call_once(method: Callable[..., T]) -> Callable[..., T]:
    """Replica 0's ``method``: run, with what it calls of the loggers in turn not noted again."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> T:
        if getattr(_current, "inside", False):
            return method(*args, **kwargs)
        _current.inside = True
        try:
            return method(*args, **kwargs)
        finally:
            _current.inside = False

    return call


def _is_view(obj: Any) -> bool:
    return type(obj).__dict__.get("_lsdp_view", False) is True


def _sharing(obj: Any, view_class: Callable[[], type]) -> Any:
    """An instance of ``view_class()`` (a subclass of ``obj``'s class) whose ``__dict__`` is ``obj``'s: what is set on
    either is set on both, ``isinstance`` checks hold; ``obj`` itself where that cannot be made (slots, a C type, a
    ``__new__`` of its own)."""
    try:
        shown = object.__new__(view_class())
        shown.__dict__ = obj.__dict__
    except (TypeError, AttributeError):
        return obj
    return shown


@functools.cache
def _view_class(cls: type, path: str) -> type:
    """A subclass of ``cls`` whose public methods (and ``experiment``, for a logger) behave as this module says,
    for views that share an instance's ``__dict__``."""
    base_get = cls.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        value = base_get(self, name)
        if name.startswith("_"):
            return value
        context = _context()
        if context is None or getattr(_current, "inside", False):
            return value
        index, effects = context
        if name == "experiment" and not path.endswith(".experiment"):  # a logger's: its calls are followed too
            return view(value, f"{path}.experiment")
        if not callable(value) or isinstance(value, type) or name.startswith("get"):
            return value
        effects.calls[index].add(f"{path}.{name}")
        return _call_once(value) if index == 0 and not effects.run_none else _skipped

    namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__, "_lsdp_view": True}
    return type(cls.__name__, (cls,), namespace)


def view(obj: Any, path: str) -> Any:
    """A view of the logger or experiment ``obj`` (``path``: how the step reaches it, e.g. ``"self.logger"``) that
    shares its state; ``obj`` itself when it cannot have one (no ``__dict__``, ``None``)."""
    if obj is None or not hasattr(obj, "__dict__") or type(obj).__module__ == "builtins" or _is_view(obj):
        return obj
    return _sharing(obj, lambda: _view_class(type(obj), path))


@functools.cache
def _trainer_class(cls: type) -> type:
    def logger(self: Any) -> Any:
        return view(cls.logger.fget(self), "self.logger")

    def loggers(self: Any) -> list[Any]:
        return [view(lg, "self.logger") for lg in cls.loggers.fget(self)]

    def lr_scheduler_configs(self: Any) -> list[Any]:
        configs = cls.lr_scheduler_configs.fget(self)
        return configs_view(configs) if _context() is not None and configs else configs

    def optimizers(self: Any) -> list[Any]:
        return [rank_view(o) for o in cls.optimizers.fget(self)]

    def strategy(self: Any) -> Any:
        found = cls.strategy.fget(self)
        return found if _context() is None else _strategy_view(found)

    namespace = {"logger": property(logger, cls.logger.fset), "loggers": property(loggers, cls.loggers.fset),
                 "__module__": cls.__module__, "_lsdp_view": True}
    if isinstance(getattr(cls, "strategy", None), property):
        namespace["strategy"] = property(strategy)
    if isinstance(getattr(cls, "lr_scheduler_configs", None), property):
        namespace["lr_scheduler_configs"] = property(lr_scheduler_configs)
    if isinstance(getattr(cls, "optimizers", None), property):
        namespace["optimizers"] = property(optimizers, cls.optimizers.fset)
    return type(cls.__name__, (cls,), namespace)


@functools.cache
def _strategy_class(cls: type) -> type:
    """A subclass of the strategy class ``cls`` whose ``optimizers`` are the calling replica's views
    (:func:`~lightning_sparse_dp.replica.optimizers.rank_view`), for views that share a strategy's ``__dict__``."""

    def optimizers(self: Any) -> list[Any]:
        return [rank_view(o) for o in cls.optimizers.fget(self)]

    return type(cls.__name__, (cls,), {"optimizers": property(optimizers, cls.optimizers.fset),
                                       "__module__": cls.__module__, "_lsdp_view": True})


def _strategy_view(strategy: Any) -> Any:
    """``self.trainer.strategy`` in a replica's step: ``strategy``'s state, its ``optimizers`` the replica's views
    (``self.trainer.strategy.optimizers[0].param_groups``, as ``self.optimizers()``'s); ``strategy`` itself when it
    cannot have such a view."""
    if (not isinstance(getattr(type(strategy), "optimizers", None), property) or _is_view(strategy)
            or not hasattr(strategy, "__dict__")):
        return strategy
    return _sharing(strategy, lambda: _strategy_class(type(strategy)))


def trainer_view(trainer: Any) -> Any:
    """What a replica's step sees as its trainer: ``trainer``'s state (its ``__dict__`` shared: what the step sets on
    it, e.g. ``should_stop``, is set on the trainer), with :func:`view`\\ s of its loggers. ``trainer`` itself when it
    is ``None``, already a view, or has no ``logger`` / ``loggers`` properties."""
    if trainer is None or _is_view(trainer):
        return trainer
    cls = type(trainer)
    if not isinstance(getattr(cls, "logger", None), property) or not isinstance(getattr(cls, "loggers", None), property):
        return trainer
    return _sharing(trainer, lambda: _trainer_class(cls))


def give_view(replica: Any, views: list[tuple[Any, type, Any] | None] | None = None, index: int = 0) -> None:
    """The replica's ``_trainer`` (Lightning's ``self.trainer``) a :func:`trainer_view`, for its step; the replica's
    next refresh from the module gives it the trainer back. Touches that replica only (its own thread may run it).

    ``views``: per replica, ``(trainer, its class, its view)`` last given (the persistent replicas'
    :class:`~lightning_sparse_dp.replica.watch.ReplicaWatch`): replica ``index`` gets that view again while its trainer
    is the same object of the same class, else a new one, kept there."""
    trainer = trainer_of(replica)
    if views is None:
        set_trainer(replica, trainer_view(trainer))
        return
    held = views[index]
    if held is None or held[0] is not trainer or held[1] is not type(trainer):
        held = views[index] = (trainer, type(trainer), trainer_view(trainer))
    set_trainer(replica, held[2])


__all__ = ["StepEffects", "give_view", "trainer_view", "view"]
