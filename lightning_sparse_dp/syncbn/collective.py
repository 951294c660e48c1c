"""Collective: the all-gather that synchronized layers use, over replica threads or (elsewhere) processes.

One batch-norm implementation (:mod:`lightning_sparse_dp.syncbn.batchnorm`) runs over any :class:`Collective`:

- :class:`ThreadGroup` (here): the replicas of one ``sparse_dp`` step, threads of one process. Replica
  ``r`` calls ``group.member(r).all_gather(t)``; the call returns when every replica has made its
  matching call (the ``k``-th call of each replica is matched with the ``k``-th call of the others,
  as the calls of a ``torch.distributed`` process group are).
- a ``torch.distributed`` process group (``sparse_ddp``), same protocol.

Reductions are left to the caller, who sums the gathered list in rank order, so results are the
same on every rank and repeat bit for bit (``torch.distributed.all_reduce`` makes no such promise).
:func:`gather_reduce` gathers and reduces in one call: over a :class:`ThreadGroup` the rank that
completes the rendezvous computes the reduction once and hands every rank the result
(:meth:`ThreadGroup.all_gather_reduce`); over any other collective each rank reduces the gathered list.
A waiting rank is woken once, when its call completes (or the group stops), not at every arrival.

Timing (threads). The group's :class:`LayerTimes` add up, per rank, the seconds spent waiting at rendezvous for
the other ranks, and the seconds each synchronized layer reports (:meth:`LayerTimes.record`);
:meth:`LayerTimes.timings` gives their means over ranks, which ``sparse_dp`` records as stage times. What a
collective can do beyond :class:`Collective` is :class:`FusedCollective`, asked with :func:`is_fused`.

Failure (threads). A replica that raises aborts the group (:meth:`ThreadGroup.abort`, done by
:meth:`ThreadGroup.run`): every replica waiting in ``all_gather``, and every later call, raises
:class:`ReplicaAborted` at once. A replica that finishes its part of a phase (its step's forward, or
its backward) with fewer calls than another replica has made in that phase would leave that replica
waiting forever; the group detects it and aborts with an error naming the call counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_sparse_dp.runtime.executor import ReplicaAborted
from lightning_sparse_dp.runtime.process import FUSED_BATCH_NORM as _FUSED

T = TypeVar("T")


R = TypeVar("R")


def gather_reduce(collective: Collective, tensor: Tensor, fn: Callable[[list[Tensor]], R]) -> R:
    """``fn(collective.all_gather(tensor))``: every rank's ``tensor`` reduced by ``fn``, the same on every rank.

    A :class:`ThreadMember` computes ``fn`` once for all ranks (:meth:`ThreadGroup.all_gather_reduce`); any other
    collective gathers and each rank computes it. ``fn`` must not depend on which rank calls it.
    """
    if is_fused(collective):
        return collective.all_gather_reduce(tensor, fn)  # type: ignore[attr-defined]
    return fn(collective.all_gather(tensor))


@runtime_checkable
class Collective(Protocol):
    """One rank's handle on a group of ``world_size`` ranks that gather tensors together.

    Attributes:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: the number of ranks in the group.
    """

    rank: int
    world_size: int

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order, on the caller's device.

        Every rank must call it the same number of times, in the same order; the returned tensors
        must not be modified in place (on one device they may be the other ranks' own tensors).

        Raises:
            ReplicaAborted: the group was aborted (another rank failed), or ranks gave tensors of
                different shapes or dtypes.
        """
        ...


@runtime_checkable
class FusedCollective(Collective, Protocol):
    """A :class:`Collective` that can also compute on the gathered items once for every rank (a :class:`ThreadMember`;
    a process group cannot: each rank computes its part), and keeps each synchronized layer's time.

    Callers ask :func:`is_fused` (``isinstance``, remembered per type) for the fused path; every other collective gets the
    plain one (:func:`gather_reduce`, per-rank statistics).
    """

    def all_gather_reduce(self, tensor: Tensor, fn: Callable[[list[Tensor]], R]) -> R:
        """``fn`` of every rank's ``tensor``, computed once and handed to every rank (:meth:`ThreadGroup.all_gather_reduce`)."""
        ...

    def all_gather_apply(self, item: Any, kind: Hashable, fn: Callable[[list[Any]], R]) -> R:
        """``fn`` of every rank's ``item`` of any shape, computed once (:meth:`ThreadGroup.all_gather_apply`)."""
        ...

    def record(self, seconds: float, layer: int | None = None) -> int:
        """Add ``seconds`` to this rank's time in a synchronized layer (:meth:`LayerTimes.record`); its index."""
        ...


def is_fused(collective: Collective) -> bool:
    """``isinstance(collective, FusedCollective)``, remembered per type: a runtime-checkable protocol's
    ``isinstance`` looks up every member (a dict lookup here), and synchronized layers ask it in every forward and
    backward of every replica."""
    kind = type(collective)
    fused = _FUSED.get(kind)
    if fused is None:
        fused = _FUSED[kind] = isinstance(collective, FusedCollective)
    return fused


class LayerTimes:
    """Per rank, the seconds spent in each synchronized layer and waiting for the other ranks at rendezvous; each rank
    writes only its own entries, from its own thread. ``sparse_dp`` records :meth:`timings` as stage times."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.waited = [0.0] * world_size  # seconds each rank spent waiting for the others in a call
        self.layers: list[list[float]] = [[] for _ in range(world_size)]  # per rank, per recorded layer

    def record(self, rank: int, seconds: float, layer: int | None = None) -> int:
        """Add ``seconds`` to ``rank``'s time in layer ``layer`` (``None``: the rank's next layer); its index.

        Called by each rank from its own thread, forward and backward."""
        times = self.layers[rank]
        if layer is None:
            times.append(seconds)
            return len(times) - 1
        times[layer] += seconds
        return layer

    def timings(self) -> dict[str, float]:
        """Mean over ranks of the seconds spent in the synchronized layers so far: ``syncbn<j>`` per layer (its
        work and its wait, forward and backward), ``syncbn`` all layers, ``syncbn_wait`` waiting for the other
        ranks at the rendezvous (the floor a slower replica sets); empty when no layer was recorded."""
        layers = min(len(t) for t in self.layers)
        if layers == 0:
            return {}
        out = {f"syncbn{j}": sum(t[j] for t in self.layers) / self.world_size for j in range(layers)}
        out["syncbn"] = sum(out.values())
        out["syncbn_wait"] = sum(self.waited) / self.world_size
        return out


class ThreadGroup:
    """A :class:`Collective` group for the replica threads of one process (ranks ``0..world_size-1``).

    Each rank's calls are numbered; call ``k`` completes when every rank has made its call ``k``.
    Phases (:meth:`run`) let the same group serve a step's forward and, later, its backward.

    Args:
        world_size: the number of ranks (>= 1).

    Raises:
        ValueError: ``world_size < 1``.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        self.world_size = world_size
        self._cond = threading.Condition()
        self._calls = [0] * world_size  # calls made by each rank so far
        self._slots: dict[int, list[tuple[int, Any, Hashable] | None]] = {}  # call -> [(phase, item, kind) per rank]
        self._reads: dict[int, int] = {}  # call -> ranks that have taken the result
        self._phase = [0] * world_size  # phases each rank has entered through run()
        self._finished: dict[int, int] = {}  # rank -> calls made when it finished its current phase
        self._error: str | None = None
        self._mismatched: set[int] = set()  # calls whose ranks gave tensors of different shapes / dtypes
        self.times = LayerTimes(world_size)  # each rank's time in the synchronized layers and at rendezvous

    def member(self, rank: int) -> ThreadMember:
        """The :class:`Collective` of ``rank``.

        Raises:
            ValueError: ``rank`` outside ``0..world_size-1``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a group of {self.world_size}.")
        return ThreadMember(self, rank)

    @property
    def aborted(self) -> bool:
        """Whether the group was aborted."""
        return self._error is not None

    def all_gather(self, rank: int, tensor: Tensor) -> list[Tensor]:
        """``rank``'s next call: see :meth:`Collective.all_gather`."""
        slot = self._rendezvous(rank, tensor, None)
        device = tensor.device
        return [t if t.device == device else t.to(device) for _, t, _ in slot]  # type: ignore[misc]

    def all_gather_apply(self, rank: int, item: Any, kind: Hashable, fn: Callable[[list[Any]], R]) -> R:
        """``rank``'s next call: ``fn`` of every rank's ``item`` (any object; rank order), computed once, by the rank
        that completes the call, and handed to every rank (the same object: do not modify it in place).

        Unlike :meth:`all_gather_reduce` nothing is moved between devices and the items may differ in shape (e.g.
        each replica's input); ``kind`` (hashable, e.g. the layer's channels and dtype) must be the same on every
        rank, as a tensor's shape and dtype must in :meth:`Collective.all_gather`: ranks that give different kinds
        ran different layers, and the group aborts.

        Raises:
            ReplicaAborted: as :meth:`Collective.all_gather`.
            Exception: what ``fn`` raised (in every rank).
        """
        result = self._rendezvous(rank, item, fn, kind)[-1]
        if isinstance(result, BaseException):
            raise result
        return result

    def all_gather_reduce(self, rank: int, tensor: Tensor, fn: Callable[[list[Tensor]], R]) -> R:
        """``rank``'s next call: ``fn`` of every rank's ``tensor`` (rank order), computed once, by the rank that
        completes the call, and handed to every rank (the same object on one device: do not modify it in
        place; its tensors moved to the caller's device where they are elsewhere).

        Raises:
            ReplicaAborted: as :meth:`Collective.all_gather`.
            Exception: what ``fn`` raised (in every rank).
        """
        slot = self._rendezvous(rank, tensor, fn)
        result = slot[-1]
        if isinstance(result, BaseException):
            raise result
        device = tensor.device  # replicas on other CUDA devices get the result's tensors on their own
        return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) and t.device != device else t, result)

    def _rendezvous(self, rank: int, tensor: Any, fn: Callable[[list[Any]], Any] | None, kind: Hashable = None) -> list:
        """Add ``rank``'s ``tensor`` to its next call and wait for the others: the call's slot,
        ``[(phase, tensor, kind)] * world_size`` and, with ``fn``, ``fn``'s result (or its exception) at the end.
        ``kind`` (``None``: the tensor's shape and dtype) must be the same on every rank (:meth:`_check_same_kind`);
        over tensors ``fn`` gets them moved to the completing rank's device, over other items the items."""
        with self._cond:
            self._raise_if_aborted()
            call = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(call, [None] * self.world_size)
            slot[rank] = (self._phase[rank], tensor, (tuple(tensor.shape), tensor.dtype) if kind is None else kind)
            if all(s is not None for s in slot[: self.world_size]):
                self._check_same_kind(call, slot)
                if fn is not None and self._error is None:
                    items = [entry[1] for entry in slot]
                    if kind is None:
                        device = tensor.device
                        items = [t if t.device == device else t.to(device) for t in items]
                    try:
                        slot.append(fn(items))
                    except Exception as err:  # every rank raises it
                        slot.append(err)
                self._cond.notify_all()
            else:
                self._check_stranded()
                if self._error is not None:
                    self._cond.notify_all()
                start = time.perf_counter()
                while self._error is None and any(s is None for s in slot[: self.world_size]):
                    self._cond.wait()
                self.times.waited[rank] += time.perf_counter() - start
            if any(s is None for s in slot[: self.world_size]) or call in self._mismatched:
                self._raise_if_aborted()  # a complete call is handed out even if the group stopped since
            self._reads[call] = self._reads.get(call, 0) + 1
            if self._reads[call] == self.world_size:  # everyone has its result: forget the call
                del self._slots[call], self._reads[call]
        return slot

    def abort(self, rank: int, error: BaseException | str) -> None:
        """Stop every waiting and future call with :class:`ReplicaAborted`: rank ``rank`` failed with ``error``."""
        with self._cond:
            if self._error is None:
                what = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
                self._error = f"replica {rank} raised {what}"
            self._cond.notify_all()

    def finish(self, rank: int) -> None:
        """Mark ``rank``'s part of the current phase as done; wakes ranks that would wait for it in vain."""
        with self._cond:
            self._finished[rank] = self._calls[rank]
            self._check_stranded()
            self._cond.notify_all()

    def run(self, rank: int, fn: Callable[[], T]) -> T:
        """Run ``fn()`` as ``rank``'s part of a new phase: abort the group if it raises, finish the phase either way.

        Raises:
            whatever ``fn`` raises (after aborting the group, unless it is :class:`ReplicaAborted`).
        """
        with self._cond:
            self._phase[rank] += 1
            self._finished.pop(rank, None)
        try:
            return fn()
        except BaseException as err:
            if not isinstance(err, ReplicaAborted):
                self.abort(rank, err)
            raise
        finally:
            self.finish(rank)

    # --- under the lock ----------------------------------------------------------------------------
    def _raise_if_aborted(self) -> None:
        if self._error is not None:
            raise ReplicaAborted(f"the replica group stopped: {self._error}.")

    def _check_same_kind(self, call: int, slot: list) -> None:
        kinds = [kind for _, _, kind in slot[: self.world_size]]
        if len(set(kinds)) > 1:
            self._mismatched.add(call)
        if len(set(kinds)) > 1 and self._error is None:
            self._error = (
                f"collective call #{call} got tensors of different shapes / dtypes (or layers of different kinds) from the "
                f"replicas ({kinds}); the "
                "replicas ran different layers (data-dependent control flow?). Every replica must run the same "
                "synchronized layers in the same order"
            )

    def _check_stranded(self) -> None:
        """Abort when a rank finished its phase while another rank of that phase waits in a call it will never make."""
        if self._error is not None:
            return
        for done_rank, done_calls in self._finished.items():
            phase = self._phase[done_rank]
            for call, slot in self._slots.items():
                slot = slot[: self.world_size]
                if call < done_calls or all(s is not None for s in slot):
                    continue
                if any(s is not None and s[0] == phase for s in slot):
                    self._error = (
                        f"replica {done_rank} finished after {done_calls} collective call(s) while other replicas "
                        f"wait in call #{call}: the replicas reach different numbers of batch-norm calls, or of a "
                        "manual step's manual_backward / optimizer calls (data-dependent control flow: a branch on "
                        "the chunk's values), which the replicas cannot pair up. Make every replica run the same "
                        "batch-norm layers and the same manual_backward and optimizer calls (decide from the whole "
                        "batch, e.g. in on_train_batch_start), or train without sync_batchnorm"
                    )
                    return


class ThreadMember:
    """Rank ``rank``'s :class:`Collective` in a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """See :meth:`Collective.all_gather`."""
        return self.group.all_gather(self.rank, tensor)

    def all_gather_reduce(self, tensor: Tensor, fn: Callable[[list[Tensor]], R]) -> R:
        """See :meth:`ThreadGroup.all_gather_reduce`."""
        return self.group.all_gather_reduce(self.rank, tensor, fn)

    def all_gather_apply(self, item: Any, kind: Hashable, fn: Callable[[list[Any]], R]) -> R:
        """See :meth:`ThreadGroup.all_gather_apply`."""
        return self.group.all_gather_apply(self.rank, item, kind, fn)

    def record(self, seconds: float, layer: int | None = None) -> int:
        """See :meth:`LayerTimes.record`."""
        return self.group.times.record(self.rank, seconds, layer)

    def __repr__(self) -> str:
        return f"ThreadMember(rank={self.rank}, world_size={self.world_size})"


__all__ = [
    "Collective", "FusedCollective", "LayerTimes", "ReplicaAborted", "ThreadGroup", "ThreadMember", "gather_reduce",
    "is_fused",
]
