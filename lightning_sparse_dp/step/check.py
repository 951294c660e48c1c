"""Check: whether the replicas still fit the module, checked on the calling thread while the replicas make their chunks.

Whether the module's structure, parameters and buffers are as the replicas were built from
(:meth:`~lightning_sparse_dp.step.replicate.Replicas.unchanged`) walks the whole module every step.
:class:`DeferredCheck` takes that check, then the refresh of the replicas' tensors and the step's state for the
replicas, on the calling thread while the replicas' threads cut and place their chunks, instead of before they start;
each replica's thread waits for the outcome before it touches the module. Replicas that no longer fit raise
:class:`StaleReplicas` in their threads, before the user's step runs, so the strategy rebuilds them and runs the step
again with the chunks already made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lightning_sparse_dp.step.replicate import Replicas


class StaleReplicas(RuntimeError):
    """A :class:`DeferredCheck` found that the module changed since its replicas were built: raised in each replica's
    thread before it touches the module or runs the user's step, so the strategy rebuilds the replicas and runs the
    step again with the chunks already made."""


class DeferredCheck:
    """:meth:`Replicas.unchanged`, :meth:`Replicas.refresh_tensors` and then ``prepare()`` (the step's state for the
    replicas), taken on the calling thread (:meth:`run`) while the replicas' threads make their chunks, instead of
    before they start; each replica's thread waits for the outcome (:meth:`wait`) before it touches the module.

    Args:
        replicas: the persistent replicas, already known to serve the module and the step's devices
            (:meth:`Replicas.serve`).
        count: the step's replica count; ``buffers``: whether :meth:`run` refreshes the buffer copies too (else each
            replica's thread copies its own: :meth:`Replicas.buffer_hand_off`).
        prepare: called on the calling thread once the replicas fit; what it returns, :meth:`wait` hands to each
            replica (the strategy's: the step's :class:`~lightning_sparse_dp.replica.install.ReplicaState`).
    """

    def __init__(self, replicas: Replicas, count: int, buffers: bool, prepare: Callable[[], Any] | None = None) -> None:
        self.replicas, self.count, self.buffers, self.prepare = replicas, count, buffers, prepare
        self.prepared: Any = None
        self._done = threading.Event()
        self._fits = False

    def run(self) -> None:
        """The check, then (replicas that fit) the tensors' refresh and ``prepare()``; always releases the waiting
        replicas, also when one of them raises (they then raise :class:`StaleReplicas` and the caller's error is the
        step's)."""
        try:
            if self.replicas.unchanged():
                self.replicas.refresh_tensors(self.count, buffers=self.buffers)
                self.prepared = self.prepare() if self.prepare is not None else None
                self._fits = True
        finally:
            self._done.set()

    def wait(self) -> Any:
        """Block until :meth:`run` ended (a replica's thread, before it touches the module); returns what ``prepare()``
        returned.

        Raises:
            StaleReplicas: the replicas no longer fit the module (or their refresh or ``prepare()`` failed).
        """
        self._done.wait()
        if not self._fits:
            raise StaleReplicas("sparse_dp: the module changed since its replicas were built; they are rebuilt and the "
                                "step runs again.")
        return self.prepared


__all__ = ["DeferredCheck", "StaleReplicas"]
