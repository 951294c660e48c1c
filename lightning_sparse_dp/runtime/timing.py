"""Timing: wall-clock seconds of each stage of each step, for benchmarks, tuning and Lightning's profilers.

Stages: ``split`` (planning the split), ``place`` (only where chunks are placed on the main thread:
``prepare_in_threads=False``, or a subclass's ``scatter``), ``replicate``, ``state`` (installing and undoing the
replicas' per-step state: metric copies and their merge into the root's, log recorders, the batch-norm group; each
replica's own part runs in its thread, inside ``replica<i>``), ``apply`` (all replicas' steps, wall clock),
``replica<i>`` (replica ``i``'s step, inside its thread, its preparation included), ``scatter<i>`` (chunk ``i`` cut
and placed in replica ``i``'s thread, part of ``replica<i>``), ``weigh`` (the loss weights and the terms' decision),
``gather``, ``log`` (the replicas' ``self.log`` calls reduced), ``emit`` (the reduced values logged once through the
module's ``self.log``), ``backward`` (the whole backward pass:
every replica's at once, then the reduction),
``backward<i>`` (replica ``i``'s backward pass, inside its thread), ``reduce`` (the replicas'
gradients added into the module's) and, with synchronized batch norm, ``syncbn<j>`` (layer ``j``'s
forward and backward, its work and its wait at the rendezvous, mean over replicas), ``syncbn`` (all
layers) and ``syncbn_wait`` (waiting for the slowest replica at the rendezvous). Timed with
``time.perf_counter``; on CUDA the times are host-side (kernels may still run; synchronize in the
step for device times).

:class:`StepTimer` is what the strategy times stages with: each main-thread stage is also a
Lightning profiler action ``[sparse_dp]<stage>`` (``trainer.profiler.profile(...)``, so
``Trainer(profiler="simple")`` and ``"advanced"`` list the stages beside Lightning's own hooks), and
is recorded in :class:`StageTimes` when ``record_stage_times=True``. Per-replica stages
(``replica<i>``, ``backward<i>``) run in replica threads and go to :class:`StageTimes` only:
Lightning's profilers are not made for concurrent actions (the advanced one runs one cProfile per
action).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from lightning.pytorch.profilers import PassThroughProfiler

T = TypeVar("T")


class StageTimes:
    """Per-step stage durations in seconds, the last ``max_steps`` steps.

    Args:
        max_steps: how many steps are kept.
    """

    def __init__(self, max_steps: int = 100_000) -> None:
        self.steps: deque[dict[str, float]] = deque(maxlen=max_steps)
        self._current: dict[str, float] | None = None

    def new_step(self) -> None:
        """Start recording a step."""
        self._current = {}
        self.steps.append(self._current)

    def stage(self, name: str) -> _Stage:
        """Record the duration of the ``with`` body as stage ``name`` of the current step (added to what the step
        recorded under ``name`` before)."""
        return _Stage(self, name)

    def record(self, name: str, seconds: float) -> None:
        """Record ``seconds`` as stage ``name`` of the current step (replacing an earlier value)."""
        if self._current is not None:
            self._current[name] = seconds

    def timed(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` wrapped to record its duration as stage ``name`` (callable from any thread)."""
        current = self._current

        def run() -> T:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                if current is not None:
                    current[name] = time.perf_counter() - start

        return run

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median seconds of each stage over the recorded steps after the first ``skip``."""
        steps = list(self.steps)[skip:]
        names = sorted({n for s in steps for n in s})
        return {n: statistics.median(s[n] for s in steps if n in s) for n in names}


class _Stage:
    """:meth:`StageTimes.stage`'s context manager (a class: a generator-based one costs several times as much)."""

    __slots__ = ("times", "name", "start")

    def __init__(self, times: StageTimes, name: str) -> None:
        self.times, self.name = times, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        current = self.times._current
        if current is not None:
            current[self.name] = current.get(self.name, 0.0) + time.perf_counter() - self.start


_NOTHING = nullcontext()  # reentrant and reusable: the stage of a timer that records nothing


class StepTimer:
    """Times the stages of one strategy's steps into :class:`StageTimes` and a Lightning profiler.

    Args:
        times: where stage durations are recorded, or ``None`` to record none.
        prefix: the profiler action prefix, e.g. ``"[sparse_dp]"``.

    Attributes:
        profiler: a ``lightning.pytorch.profilers.Profiler`` (``trainer.profiler``), set by the
            strategy at setup; ``None``: no profiler actions (Lightning's ``PassThroughProfiler``, the
            Trainer's default, is taken as ``None``: its actions do nothing).
    """

    def __init__(self, times: StageTimes | None, prefix: str) -> None:
        self.times = times
        self.prefix = prefix
        self._profiler: Any = None

    @property
    def profiler(self) -> Any:
        return self._profiler

    @profiler.setter
    def profiler(self, profiler: Any) -> None:
        self._profiler = None if isinstance(profiler, PassThroughProfiler) else profiler

    def new_step(self) -> None:
        """Start recording a step (:meth:`StageTimes.new_step`)."""
        if self.times is not None:
            self.times.new_step()

    def stage(self, name: str) -> AbstractContextManager[None]:
        """Time the ``with`` body as stage ``name``: a profiler action ``prefix + name``, and in :attr:`times`."""
        if self._profiler is None:  # the common case: one small object, or none (this runs ~20 times a step)
            return self.times.stage(name) if self.times is not None else _NOTHING
        return self._profiled(name)

    @contextmanager
    def _profiled(self, name: str) -> Iterator[None]:
        with self._profiler.profile(f"{self.prefix}{name}"), (self.times.stage(name) if self.times is not None else _NOTHING):
            yield

    def record(self, stages: dict[str, float]) -> None:
        """Record measured ``{stage: seconds}`` in :attr:`times` (no profiler action: they were measured elsewhere)."""
        if self.times is not None:
            for name, seconds in stages.items():
                self.times.record(name, seconds)

    def timed(self, name: str, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` recording its duration as stage ``name`` of :attr:`times` (from any thread), or ``fn`` itself."""
        return fn if self.times is None else self.times.timed(name, fn)


__all__ = ["StageTimes", "StepTimer"]
