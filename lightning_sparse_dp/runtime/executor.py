"""Executor: one callable per replica run at once, each in a persistent thread bound to its replica's device.

:class:`ReplicaExecutor` (:func:`run_on_replicas`: a temporary one where none is given) does what
``torch.nn.parallel.parallel_apply`` does, with three differences: the threads are kept for the whole run (one per
replica index) instead of being started on every call; it runs on CPU devices too (``parallel_apply`` asks for the
current CUDA stream); and it carries the caller's thread-local state into each thread (:class:`ThreadState`), with
autograd's device threads turned off there (``torch.autograd.set_multithreading_enabled(False)``, thread-local: "the
backward pass runs on the calling thread"), so that a replica's backward pass runs in its own thread on a GPU exactly as
on CPU, where autograd always runs it in the calling thread (on an accelerator torch would otherwise run it in the
device's one worker thread). The caller's state: grad mode, inference mode, autocast (enabled flag and dtype, per device
type) and the intra-op thread count (``torch.set_num_threads``, which with OpenMP is a per-thread setting), plus
``torch.cuda.device(d)`` and the caller's current stream of ``d`` on CUDA (as ``parallel_apply`` does). An exception in
a replica is raised in the calling thread, unchanged in type, with a note naming the replica and device; the other
replicas are waited for first so nothing is left running. While a replica's call runs, :func:`replicas_running` tells
code in its thread how many replicas the call has.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sparse_dp.runtime.defaults import float64_defaults, float64_defaults_on
from lightning_sparse_dp.runtime.devices import device_context, replica_contexts
from lightning_sparse_dp.runtime.process import FLOAT64_DEFAULTS as _float64
from lightning_sparse_dp.runtime.process import REPLICA_CALL as _this_thread
from lightning_sparse_dp.runtime.randomness import SharedDraws
from lightning_sparse_dp.runtime.stall import StallWatch, stall_seconds

T = TypeVar("T")


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


class ReplicaAborted(RuntimeError):
    """A replica stopped because another one failed (a secondary error: the other one's is raised); raised by the
    replicas' batch-norm group (:class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup`) once a rank failed."""


@dataclass(frozen=True)
class ThreadState:
    """Thread-local torch state of the caller, to re-enter in a worker thread."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    intra_op_threads: int  # torch.get_num_threads() (OpenMP's per-thread setting, which ME's CPU kernels use too)
    float64_defaults: bool = False  # the exactness check's float64 runs (runtime/defaults.py)

    @classmethod
    def capture(cls) -> ThreadState:
        autocast = []
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if device_type == "cuda" and not torch.cuda.is_available():
                continue
            autocast.append(
                (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast), torch.get_num_threads(),
                   getattr(_float64, "on", False))  # float64_defaults_on(), read here: a thread-local every call reads

    def enter(self, stack: ExitStack) -> None:
        """Enter this state in the current thread; ``stack`` undoes it (the thread count stays set).

        Only what differs from the thread's own state is entered (a replica thread usually has the caller's
        state already: grad mode on, no inference mode, autocast off): entering ``torch.autocast`` and the
        grad-mode contexts costs Python at every call, which replica threads take in turn under the GIL.
        """
        if torch.get_num_threads() != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        if torch.is_inference_mode_enabled() != self.inference_mode:
            stack.enter_context(torch.inference_mode(self.inference_mode))
        if torch.is_grad_enabled() != self.grad_enabled:  # after inference mode, which turns grad mode off
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, enabled, dtype in self.autocast:
            # the dtype counts while disabled too: a step's own torch.autocast(device_type) without a dtype takes it
            if torch.is_autocast_enabled(device_type) != enabled or torch.get_autocast_dtype(device_type) != dtype:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        if self.float64_defaults and not float64_defaults_on():
            stack.enter_context(float64_defaults())


class ReplicaExecutor:
    """Persistent threads, one per replica index, that run one callable per replica.

    Replica ``i`` always runs on thread ``i``, so each replica's autograd nodes are numbered by the
    same thread every step, which keeps the order of the backward pass, and so its floating-point
    sums, the same from run to run (``Trainer(deterministic=True)``).

    Args:
        num_replicas: the most replicas run at once (the number of devices): one thread each.
        threads_per_replica: torch intra-op threads of each replica thread when several replicas run
            (:mod:`lightning_sparse_dp.runtime.threads`); ``None``: the caller's count.
        affinity: ``affinity[i]``, the CPU ids replica thread ``i`` pins itself to (``os.sched_setaffinity``)
            before it runs anything when several replicas run (:func:`~lightning_sparse_dp.runtime.threads.plan_cores`);
            ``None``: not pinned.
        transient: the threads end after each :meth:`run` (started again by the next): for a step run outside a
            Trainer's setup and teardown, which leaves no thread behind.

    A call whose replicas have not finished after ``LSDP_STALL_WARNING_S`` seconds (default 300) is reported once,
    naming where each unfinished replica's thread is, and goes on (:class:`~lightning_sparse_dp.runtime.stall.StallWatch`).
    Replicas that draw random numbers from a generator they share while torch's deterministic algorithms are on are
    said once (:class:`~lightning_sparse_dp.runtime.randomness.SharedDraws`).

    Raises:
        ValueError: ``num_replicas < 1``, or ``LSDP_STALL_WARNING_S`` is not a number.
    """

    def __init__(
        self,
        num_replicas: int,
        threads_per_replica: int | None = None,
        affinity: Sequence[frozenset[int]] | None = None,
        transient: bool = False,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        self.num_replicas = num_replicas
        self.threads_per_replica = threads_per_replica
        self.affinity = affinity
        self.transient = transient
        self._seconds = stall_seconds()  # LSDP_STALL_WARNING_S (lightning_sparse_dp.runtime.stall)
        self._threads, self._watch = self._start()
        self._lock = threading.Lock()
        self._draws = SharedDraws()  # says once when replicas sharing a generator draw under deterministic=True

    def _start(self) -> tuple[list[ThreadPoolExecutor], StallWatch | None]:
        """One single-thread pool per replica (its thread starts with its first call) and the stall watch (``None``:
        turned off, ``LSDP_STALL_WARNING_S=0``, decided here for every call)."""
        pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sparse_dp-replica{i}") for i in range(self.num_replicas)]
        return pools, StallWatch(self._seconds) if self._seconds > 0 else None

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaExecutor:
        """The threads are the process's: a deep copy (of a Trainer, e.g. by a callback) shares this executor."""
        return self

    def run(
        self, fns: Sequence[Callable[[], T]], devices: Sequence[torch.device], meanwhile: Callable[[], None] | None = None,
    ) -> list[T]:
        """Call ``fns[i]()`` on ``devices[i]`` for every ``i`` at once and return the results in order.

        A single callable runs in the calling thread (no thread hop); several run in their replicas' threads, on every
        device type alike, each with autograd's device threads off for its backward passes (:func:`_call`).
        ``meanwhile()`` runs in the calling thread once the others have started (first, for a single callable), always:
        replicas may wait for it (:class:`~lightning_sparse_dp.step.check.DeferredCheck`); its error is raised once
        every replica has finished.

        Raises:
            ValueError: more callables than threads, or lengths that differ.
            Exception: the first failing replica's exception (lowest index, preferring errors that are
                not :class:`ReplicaAborted`), with a note ``"raised in replica i on device d"``; raised
                after every replica has finished.
        """
        if len(fns) != len(devices):
            raise ValueError(f"{len(fns)} callables for {len(devices)} devices.")
        if len(fns) > self.num_replicas:
            raise ValueError(f"{len(fns)} callables for an executor of {self.num_replicas} replica threads.")
        state = ThreadState.capture()
        if len(fns) == 1:
            if meanwhile is not None:
                meanwhile()
            return [_call(fns[0], devices[0], 0, state)]
        if self.threads_per_replica is not None:
            state = dataclasses.replace(state, intra_op_threads=self.threads_per_replica)
        contexts = replica_contexts(devices)  # the caller's CUDA streams, as torch's parallel_apply hands them on
        affinity = self.affinity
        generators = self._draws.before(devices) if self._draws.looking else None
        with self._lock:  # one step at a time: replicas of two steps never interleave
            try:
                mine, errors, futures = self._submit(fns, devices, state, contexts, affinity, meanwhile)
            finally:
                if self.transient:  # no thread outlives the call
                    self.shutdown()
                    self._threads, self._watch = self._start()
        if mine is not None:
            raise mine
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, ReplicaAborted)), failed[0])
        if generators is not None:  # a call SharedDraws looks at (before said which)
            self._draws.after(generators)
        return [f.result() for f in futures]

    def _submit(
        self, fns: Sequence[Callable[[], T]], devices: Sequence[torch.device], state: ThreadState,
        contexts: list[Callable[[], AbstractContextManager[Any]]], affinity: Sequence[frozenset[int]] | None,
        meanwhile: Callable[[], None] | None,
    ) -> tuple[BaseException | None, list[BaseException | None], list[Future]]:
        """Every callable submitted to its replica's thread, ``meanwhile()`` run here, every replica waited for:
        ``meanwhile``'s error, each replica's (``None`` where none) and the futures."""
        try:
            futures: list[Future] = [
                self._threads[i].submit(_call, fn, device, i, state, context, affinity[i] if affinity else None, len(fns))
                for i, (fn, device, context) in enumerate(zip(fns, devices, contexts))
            ]
        except BaseException:  # a thread refused the call (shut down): those started may wait for meanwhile
            if meanwhile is not None:
                with suppress(Exception):
                    meanwhile()
            raise
        watch = self._watch
        if watch is not None:  # a warning if stuck
            watch.begin(futures, devices)
        mine: BaseException | None = None
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as err:  # noqa: BLE001 -- raised below, after every replica has finished
                mine = err
        errors = [f.exception() for f in futures]  # waits for every replica
        if watch is not None:
            watch.end()
        return mine, errors, futures

    def shutdown(self) -> None:
        """Stop the threads (waits for running callables)."""
        for thread in self._threads:
            thread.shutdown(wait=True)
        if self._watch is not None:
            self._watch.close()


def replicas_running() -> int:
    """How many replicas run the step whose replica the calling thread is running (1 outside a replica's call)."""
    return getattr(_this_thread, "replicas", 1)


def _call(
    fn: Callable[[], T], device: torch.device, index: int, state: ThreadState,
    context: Callable[[], AbstractContextManager[Any]] | None = None, cores: frozenset[int] | None = None,
    replicas: int = 1,
) -> T:
    """``fn()`` in this thread as replica ``index``'s call on ``device``: the caller's ``state`` entered, autograd's
    device threads off, and ``context()`` (from :func:`~lightning_sparse_dp.runtime.devices.replica_contexts`; ``None``:
    ``device``'s own :func:`~lightning_sparse_dp.runtime.devices.device_context`) entered; pinned to ``cores`` first.

    Raises:
        BaseException: what ``fn`` raised, with a note naming the replica and its device.
    """
    _this_thread.replicas = replicas
    try:
        if cores is not None and getattr(_this_thread, "cores", None) != cores:
            _this_thread.cores = cores
            try:
                os.sched_setaffinity(0, cores)  # 0: the calling thread (Linux); its OpenMP threads inherit the mask
            except OSError as err:  # e.g. a container that refuses the mask: run unpinned, say so once
                rank_zero_warn(f"sparse_dp: could not pin replica {index}'s thread to CPUs {sorted(cores)} ({err}); it "
                               "runs unpinned. Pass pin_replicas=False to skip pinning.")
        with ExitStack() as stack:
            state.enter(stack)
            if torch._C._is_multithreading_enabled():  # one threading model: backward passes run in this thread
                stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            stack.enter_context(device_context(device) if context is None else context())
            return fn()
    except BaseException as err:
        note = f"raised in replica {index} on device {device} (lightning_sparse_dp)"
        if hasattr(err, "add_note") and note not in getattr(err, "__notes__", ()):
            err.add_note(note)
        raise
    finally:
        _this_thread.replicas = 1


def run_on_replicas(
    fns: Sequence[Callable[[], Any]], devices: Sequence[torch.device], executor: ReplicaExecutor | None = None
) -> list[Any]:
    """Run ``fns[i]()`` on ``devices[i]`` concurrently; see :meth:`ReplicaExecutor.run`.

    Not ``torch.nn.parallel.parallel_apply``'s contract (modules and inputs): it takes callables, e.g.
    ``functools.partial(replica.training_step, chunk, batch_idx)``. Without ``executor`` a temporary one
    is made and shut down (as ``parallel_apply`` does with its threads); the strategy keeps one for the run.
    """
    if executor is not None:
        return executor.run(fns, devices)
    temporary = ReplicaExecutor(max(1, len(fns)))
    try:
        return temporary.run(fns, devices)
    finally:
        temporary.shutdown()


__all__ = ["ReplicaAborted", "ReplicaExecutor", "ThreadState", "replicas_running", "run_on_replicas"]
