"""Timing: wall-clock seconds of each stage of each step, for benchmarks, tuning and Lightning's profilers.

Stages: ``split`` (planning the split), ``place`` (only where a subclass's ``scatter`` places chunks on the main
thread), ``replicate``, ``state`` (installing and undoing the replicas' per-step state: metric copies and their
merge into the root's, log recorders, the batch-norm group; each replica's own part runs in its thread, inside
``replica<i>``), ``apply`` (all replicas' steps, wall clock),
``replica<i>`` (replica ``i``'s step, inside its thread, its preparation included), ``scatter<i>`` (chunk ``i`` cut
and placed in replica ``i``'s thread, part of ``replica<i>``), ``weigh`` (the loss weights and the terms' decision),
``gather``, ``log`` (the replicas' ``self.log`` calls reduced and logged), ``backward`` (the whole backward pass:
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
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

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

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Record the duration of the ``with`` body as stage ``name`` of the current step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._current is not None:
                self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start

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


class StepTimer:
    """Times the stages of one strategy's steps into :class:`StageTimes` and a Lightning profiler.

    Args:
        times: where stage durations are recorded, or ``None`` to record none.
        prefix: the profiler action prefix, e.g. ``"[sparse_dp]"``.

    Attributes:
        profiler: a ``lightning.pytorch.profilers.Profiler`` (``trainer.profiler``), set by the
            strategy at setup; ``None``: no profiler actions.
    """

    def __init__(self, times: StageTimes | None, prefix: str) -> None:
        self.times = times
        self.prefix = prefix
        self.profiler: Any = None

    def new_step(self) -> None:
        """Start recording a step (:meth:`StageTimes.new_step`)."""
        if self.times is not None:
            self.times.new_step()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as stage ``name``: a profiler action ``prefix + name``, and in :attr:`times`."""
        action = self.profiler.profile(f"{self.prefix}{name}") if self.profiler is not None else nullcontext()
        recorded = self.times.stage(name) if self.times is not None else nullcontext()
        with action, recorded:
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
