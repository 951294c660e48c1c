"""Apply: run one callable per replica concurrently, each in a thread bound to its device.

The same idea as ``torch.nn.parallel.parallel_apply``, with three differences: the threads are
kept for the whole run instead of being started on every call; it runs on CPU devices too
(``parallel_apply`` asks for the current CUDA stream); and it carries the caller's thread-local
state into each thread: grad mode, inference mode and autocast (enabled flag and dtype, per
device type), plus ``torch.cuda.device(d)`` on CUDA. An exception in a replica is raised in the
calling thread, unchanged in type, with a note naming the replica and device; the other replicas
are waited for first so nothing is left running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lightning_sparse_dp.place import device_context

T = TypeVar("T")

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """Thread-local torch state of the caller, to re-enter in a worker thread."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls) -> ThreadState:
        autocast = []
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if device_type == "cuda" and not torch.cuda.is_available():
                continue
            autocast.append(
                (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            )
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast))

    def enter(self, stack: ExitStack) -> None:
        """Enter this state in the current thread; ``stack`` undoes it."""
        stack.enter_context(torch.inference_mode(self.inference_mode))
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))


class ReplicaExecutor:
    """A pool of persistent threads that runs one callable per replica.

    Args:
        num_threads: the most replicas run at once (the number of devices).
    """

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}.")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="sparse_dp-replica")
        self._lock = threading.Lock()

    def run(self, fns: Sequence[Callable[[], T]], devices: Sequence[torch.device]) -> list[T]:
        """Call ``fns[i]()`` on ``devices[i]`` for every ``i`` at once and return the results in order.

        A single callable runs in the calling thread (no thread hop).

        Raises:
            ValueError: more callables than threads, or lengths that differ.
            Exception: the first failing replica's exception (lowest index), with a note
                ``"raised in replica i on device d"``; raised after every replica has finished.
        """
        if len(fns) != len(devices):
            raise ValueError(f"{len(fns)} callables for {len(devices)} devices.")
        if len(fns) > self.num_threads:
            raise ValueError(f"{len(fns)} callables for an executor of {self.num_threads} threads.")
        state = ThreadState.capture()
        if len(fns) == 1:
            return [_call(fns[0], devices[0], 0, state)]
        with self._lock:  # one step at a time: replicas of two steps never interleave
            futures: list[Future] = [
                self._pool.submit(_call, fn, device, i, state) for i, (fn, device) in enumerate(zip(fns, devices))
            ]
            errors = [f.exception() for f in futures]  # waits for every replica
        for err in errors:
            if err is not None:
                raise err
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        """Stop the threads (waits for running callables)."""
        self._pool.shutdown(wait=True)


def _call(fn: Callable[[], T], device: torch.device, index: int, state: ThreadState) -> T:
    try:
        with ExitStack() as stack:
            state.enter(stack)
            stack.enter_context(device_context(device))
            return fn()
    except BaseException as err:
        note = f"raised in replica {index} on device {device} (lightning_sparse_dp)"
        if hasattr(err, "add_note") and note not in getattr(err, "__notes__", ()):
            err.add_note(note)
        raise


def parallel_apply(
    fns: Sequence[Callable[[], Any]], devices: Sequence[torch.device], executor: ReplicaExecutor | None = None
) -> list[Any]:
    """Run ``fns[i]()`` on ``devices[i]`` concurrently; see :meth:`ReplicaExecutor.run`.

    Without ``executor`` a temporary one is made and shut down (as ``torch.nn.parallel.parallel_apply``
    does with its threads); the strategy keeps one for the whole run.
    """
    if executor is not None:
        return executor.run(fns, devices)
    temporary = ReplicaExecutor(max(1, len(fns)))
    try:
        return temporary.run(fns, devices)
    finally:
        temporary.shutdown()


__all__ = ["ReplicaExecutor", "ThreadState", "parallel_apply"]
