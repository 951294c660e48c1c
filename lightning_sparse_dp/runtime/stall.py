"""Stall: a replica that has not finished after a long wait is reported, with where each waiting replica is.

:meth:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor.run` waits for every replica's callable. A step that never ends
(a deadlock) would leave the process
silent; a :class:`StallWatch` instead warns once per call after ``LSDP_STALL_WARNING_S`` seconds (default 300;
``0`` turns it off), naming each unfinished replica with the innermost frames of its thread's Python stack
(``sys._current_frames``), and the call goes on: a step that is merely slow still ends as it would have.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

#: seconds a step's replicas may take before a :class:`StallWatch` says where they are (``LSDP_STALL_WARNING_S``)
DEFAULT_STALL_WARNING_S = 300.0


def stall_seconds() -> float:
    """``LSDP_STALL_WARNING_S`` as seconds (default :data:`DEFAULT_STALL_WARNING_S`; ``0`` or less: never warn).

    Raises:
        ValueError: the variable is not a number.
    """
    value = os.environ.get("LSDP_STALL_WARNING_S", "")
    try:
        return float(value) if value.strip() else DEFAULT_STALL_WARNING_S
    except ValueError:
        raise ValueError(f"LSDP_STALL_WARNING_S={value!r}: give seconds (a number; 0 turns the warning off).") from None


class StallWatch:
    """A daemon thread that watches the replicas' calls of one :class:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor`:
    a call still running ``seconds`` after it began is reported once (:func:`stall_message`), from the watch's own
    thread, while the call goes on. The executor's hot path only marks a call's start and end (:meth:`begin`,
    :meth:`end`: an attribute each); the thread starts with the first call and polls every ``min(seconds / 2, 5)``
    seconds.

    Args:
        seconds: the wait before the warning (a watch is made only where there is one: the executor makes none for
            ``LSDP_STALL_WARNING_S=0``).

    Raises:
        ValueError: ``seconds <= 0`` (no watch to keep).
    """

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"seconds={seconds!r}; give a positive wait (make no StallWatch to turn the warning off).")
        self.seconds = seconds
        self._call: tuple[float, Sequence[Future], Sequence[torch.device], list[bool]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, futures: Sequence[Future], devices: Sequence[torch.device]) -> None:
        """A call began: ``futures[i]`` is replica ``i``'s callable on ``devices[i]``, run in the thread named
        ``sparse_dp-replica<i>_...``."""
        self._call = (time.monotonic(), futures, devices, [False])
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="sparse_dp-stall-watch", daemon=True)
            self._thread.start()

    def end(self) -> None:
        """The call began last has ended."""
        self._call = None

    def close(self) -> None:
        """Stop the watch's thread and wait for it to end (at the executor's shutdown: nothing is left running)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds / 2, 5.0)):
            call = self._call
            if call is None or call[3][0] or time.monotonic() - call[0] < self.seconds:
                continue
            started, futures, devices, warned = call
            warned[0] = True
            pending = [i for i, f in enumerate(futures) if not f.done()]
            if pending:
                rank_zero_warn(stall_message(pending, devices, time.monotonic() - started))


def stall_message(pending: Sequence[int], devices: Sequence[torch.device], seconds: float) -> str:
    """What :class:`StallWatch` says: each unfinished replica, its device and the innermost frames of its thread."""
    frames = sys._current_frames()
    threads = {t.name: t.ident for t in threading.enumerate()}
    lines = [
        f"sparse_dp: replica(s) {list(pending)} of this step have not finished after {seconds:.1f} s; still waiting. "
        "If the step is stuck (a deadlock), this is where each one is (innermost frames last); please report it. "
        "(LSDP_STALL_WARNING_S sets the wait before this warning; 0 turns it off.)"
    ]
    for i in pending:
        ident = next((t for name, t in threads.items() if name.startswith(f"sparse_dp-replica{i}_")), None)
        frame = frames.get(ident) if ident is not None else None
        where = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "  (its thread is not running)\n"
        lines.append(f"replica {i} on {devices[i]}:\n{where.rstrip()}")
    return "\n".join(lines)


__all__ = ["DEFAULT_STALL_WARNING_S", "StallWatch", "stall_message", "stall_seconds"]
