"""Threads: the CPU cores split between CPU replicas, as Lightning's DDP launcher splits them between processes.

Lightning's DDP launcher gives each of ``p`` local processes ``cores // p`` intra-op threads
(``torch.set_num_threads`` and ``OMP_NUM_THREADS``) unless ``OMP_NUM_THREADS`` is set
(``lightning.fabric.strategies.launchers.subprocess_script._set_num_threads_if_needed``). CPU replicas
are threads of one process, so the same share has to be set in three places:

- torch's intra-op threads: a per-thread OpenMP setting; the replica threads set it
  (:class:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor` ``threads_per_replica``);
- ME's OpenMP threads: every ``ME.CoordinateManager`` (one per SparseTensor / TensorField) calls
  ``omp_set_num_threads(min(CPU_COUNT, 20))`` in the calling thread, with ``CPU_COUNT`` read from
  ``OMP_NUM_THREADS`` when ME is imported, else all cores (MinkowskiCoordinateManager.py), which
  overrides the thread's torch setting too (torch and ME share one OpenMP runtime). The module-level
  ``CPU_COUNT`` is read at each construction, so it is set to the share for the run;
- OpenBLAS (ME's CPU convolutions call ``cblas_sgemm`` / ``cblas_dgemm``): one process-wide thread
  count, set to the share when the library is loaded and ``OPENBLAS_NUM_THREADS`` is not set.

Nothing is changed when the user set ``OMP_NUM_THREADS`` before the imports (ME, OpenBLAS and torch read it
then). When the user called ``torch.set_num_threads(k)`` after this package was imported (its count differs from
the one seen at import), or set ``OMP_NUM_THREADS=k`` after the imports, each replica runs ``k`` threads, and ME
and OpenBLAS get ``k`` too, since ME would undo it.

``sparse_ddp``'s processes get their share from Lightning's launcher, which sets ``OMP_NUM_THREADS``
after ME and OpenBLAS read it: :func:`follow_omp_num_threads` gives them the launcher's count.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_sparse_dp.runtime.me import ME

#: torch's intra-op thread count when this package was imported (what it is unless the user changes it).
DEFAULT_TORCH_THREADS = torch.get_num_threads()


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def chosen_torch_threads() -> int | None:
    """The intra-op thread count the user chose with ``torch.set_num_threads`` after importing this package.

    ``None`` when the calling thread's count is the one seen at import, or the one ME sets in a thread that
    builds a SparseTensor (``min(CPU_COUNT, 20)``, MinkowskiCoordinateManager.py; e.g. after a forward pass
    before the fit, on a machine whose logical CPUs outnumber torch's default, its physical cores).
    """
    count = torch.get_num_threads()
    me_count = min(int(me_coordinate_manager_module().CPU_COUNT), 20)
    return None if count in (DEFAULT_TORCH_THREADS, me_count) else count


def threads_per_replica(num_replicas: int, cores: int | None = None) -> int:
    """``cores // num_replicas``, at least 1 (Lightning's DDP share per process).

    Raises:
        ValueError: ``num_replicas < 1``.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    return max(1, (available_cores() if cores is None else cores) // num_replicas)


@dataclass(frozen=True)
class CorePlan:
    """Where each CPU replica's thread runs.

    Attributes:
        cores: ``cores[i]``, the CPU ids replica ``i``'s thread is pinned to (``os.sched_setaffinity``).
        groups: ``groups[i]``, the index of replica ``i``'s core set: replicas with one group id share it, and
            :func:`~lightning_sparse_dp.split.balanced_assignment` (``groups=``) evens the points per group.
    """

    cores: tuple[frozenset[int], ...]
    groups: tuple[int, ...]


def check_pin(pin: object) -> bool | None:
    """``pin`` itself when it is ``None``, ``True`` or ``False`` (the strategy's ``pin_replicas``).

    Raises:
        ValueError: anything else.
    """
    if pin is not None and not isinstance(pin, bool):
        raise ValueError(f"pin_replicas must be None (pin with sync_batchnorm and more replicas than cores), True or "
                         f"False, got {pin!r}.")
    return pin


def check_prepare_in_threads(prepare: object) -> bool | None:
    """``prepare`` itself when it is ``None``, ``True`` or ``False`` (the strategy's ``prepare_in_threads``).

    Raises:
        ValueError: anything else.
    """
    if prepare is not None and not isinstance(prepare, bool):
        raise ValueError(f"prepare_in_threads={prepare!r}; use None (the default: in the replicas' threads), True "
                         "(the same) or False (on the main thread).")
    return prepare


def plan_cores(
    num_replicas: int, pin: bool | None = None, cores: Sequence[int] | None = None, synchronized: bool = True
) -> CorePlan | None:
    """The cores of each replica thread, when more replicas than cores run in lockstep (or ``pin=True``).

    Why: with ``R`` replica threads on ``C < R`` cores the operating system runs ``C`` of them at a time,
    and wherever the replicas wait for each other (every synchronized batch norm, forward and backward,
    and the end of the step) the last ones run while cores idle (docs/benchmarks.md, "Costs of the step's
    parts"). Pinned instead, core ``c`` runs its own replicas only, and the points are
    evened per core, not per replica: the ``R`` replicas are spread over the ``C`` cores in order (the
    first ``C - R % C`` cores get ``R // C`` replicas, the others one more), and a batch's samples are
    balanced over the cores first and over each core's replicas second. A core stays busy while any of
    its replicas has work, so every core finishes each stretch between two synchronizations at about the
    same time.

    With ``R <= C`` and ``pin=True``, replica ``i`` gets cores ``[i k, (i + 1) k)`` with ``k = C // R`` (its
    intra-op threads, which inherit the mask, stay on them), one group each.

    Args:
        num_replicas: ``R``.
        pin: ``None`` (pin when ``synchronized`` and ``R > C``), ``True`` (always, for ``R >= 2``) or
            ``False`` (never).
        cores: the CPU ids to use (default: this process's affinity mask, ``os.sched_getaffinity(0)``).
        synchronized: whether the replicas wait for each other inside the step (synchronized batch norm).
            Without it they meet only at the step's end, the operating system's scheduling loses little, and
            ``pin=None`` leaves the threads and the split alone: the per-core split changes how many samples
            each replica gets, which per-replica batch norm (after global pooling, say) can notice.

    Returns:
        the plan, or ``None``: one replica, ``pin=False``, ``pin=None`` without ``synchronized`` or with
        ``R <= C``, or no ``os.sched_setaffinity`` on this platform.
    """
    if num_replicas < 2 or pin is False or not hasattr(os, "sched_setaffinity") or (pin is None and not synchronized):
        return None
    ids = sorted(cores) if cores is not None else sorted(os.sched_getaffinity(0))
    count = len(ids)
    if count == 0 or (pin is None and num_replicas <= count):
        return None
    if num_replicas <= count:
        k = count // num_replicas
        return CorePlan(tuple(frozenset(ids[i * k : (i + 1) * k]) for i in range(num_replicas)), tuple(range(num_replicas)))
    per_core, extra = divmod(num_replicas, count)
    placement = [c for c in range(count) for _ in range(per_core + (c >= count - extra))]
    return CorePlan(tuple(frozenset([ids[c]]) for c in placement), tuple(placement))


def configure_replica_threads(
    executor: Any, num_replicas: int, pin: bool | None, synchronized: bool, device_type: str = "cpu"
) -> tuple[ThreadSplit | None, tuple[int, ...] | None]:
    """CPU replicas: the cores' threads split between them (:func:`split_threads`) and their threads pinned
    (:func:`plan_cores`), both set on ``executor`` (a :class:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor`).

    Other devices (``device_type``, e.g. ``"cuda"``): nothing is changed; ``pin=True`` is answered with a
    warning that it applies to CPU replicas only (a GPU replica's thread mostly waits on its device).

    Returns:
        ``(split, groups)``: the thread split to restore at teardown (``None``: nothing changed), and the
        replicas' core groups for the split (``None``: not pinned).
    """
    if device_type != "cpu":
        if pin:
            rank_zero_warn(
                f"sparse_dp: pin_replicas=True applies to CPU replicas only; the replicas run on {device_type} devices, so no "
                "thread is pinned and the split stays per replica. Leave pin_replicas unset (None) for GPUs."
            )
        return None, None
    split = split_threads(num_replicas)
    if split is not None:
        executor.threads_per_replica = split.per_replica
    plan = plan_cores(num_replicas, pin, synchronized=synchronized)
    executor.affinity = plan.cores if plan else None
    return split, (plan.groups if plan else None)


def me_coordinate_manager_module() -> ModuleType:
    """The module whose ``CPU_COUNT`` ``ME.CoordinateManager`` reads.

    ME's ``__init__`` imports its files as top-level modules (``MinkowskiCoordinateManager``), so
    ``import MinkowskiEngine.MinkowskiCoordinateManager`` would load a second, unused copy.
    """
    return sys.modules[ME.CoordinateManager.__module__]


def _openblas() -> ctypes.CDLL | None:
    """OpenBLAS as already loaded in this process (by ME), or ``None``; never loads it."""
    for name in ("libopenblas.so.0", "libopenblas.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):
            continue
        if hasattr(lib, "openblas_set_num_threads") and hasattr(lib, "openblas_get_num_threads"):
            return lib
    return None


@dataclass
class ThreadSplit:
    """The process-wide settings changed for a run, to undo with :meth:`restore`.

    Attributes:
        per_replica: the intra-op threads of each replica.
    """

    per_replica: int
    me_cpu_count: int | None = None
    openblas_threads: int | None = None
    main_thread_threads: int | None = None

    def restore(self) -> None:
        """Put ME's ``CPU_COUNT``, OpenBLAS's thread count and the calling thread's torch threads back.

        The calling thread's count is restored because ME sets it whenever a SparseTensor is built there.
        """
        if self.main_thread_threads is not None and torch.get_num_threads() != self.main_thread_threads:
            torch.set_num_threads(self.main_thread_threads)
        if self.me_cpu_count is not None:
            me_coordinate_manager_module().CPU_COUNT = self.me_cpu_count
            self.me_cpu_count = None
        if self.openblas_threads is not None:
            lib = _openblas()
            if lib is not None:
                lib.openblas_set_num_threads(self.openblas_threads)
            self.openblas_threads = None


def _omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer, or ``None`` (unset or not one)."""
    try:
        count = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return count if count >= 1 else None


def _give_me_and_openblas(count: int, split: ThreadSplit) -> ThreadSplit:
    """ME's ``CPU_COUNT`` and, unless ``OPENBLAS_NUM_THREADS`` / ``GOTO_NUM_THREADS`` is set, OpenBLAS's thread
    count set to ``count``; what they were is kept in ``split`` for :meth:`ThreadSplit.restore`."""
    coordinate_manager = me_coordinate_manager_module()
    if coordinate_manager.CPU_COUNT != count:
        split.me_cpu_count = coordinate_manager.CPU_COUNT
        coordinate_manager.CPU_COUNT = count
    lib = _openblas()
    blas_set = "OPENBLAS_NUM_THREADS" in os.environ or "GOTO_NUM_THREADS" in os.environ
    if lib is not None and not blas_set and int(lib.openblas_get_num_threads()) != count:
        split.openblas_threads = int(lib.openblas_get_num_threads())
        lib.openblas_set_num_threads(count)
    return split


def split_threads(num_replicas: int) -> ThreadSplit | None:
    """Give each replica's ME OpenMP and OpenBLAS its share of the cores for the run, and say so (info).

    The share is ``threads_per_replica(num_replicas)``, or ``k`` when the user called ``torch.set_num_threads(k)``
    after importing this package: each replica thread runs with the calling thread's ``k`` intra-op threads, and
    ME would set it back to its import-time count (every core) at every SparseTensor, so ME and OpenBLAS get
    ``k`` too (left at every core, each replica's ME and OpenBLAS threads compete for the cores the replicas share:
    docs/benchmarks.md, "Costs of the step's parts"): :func:`chosen_torch_threads`.

    ``OMP_NUM_THREADS`` set before the imports is the user's count, which ME, OpenBLAS and torch read then; set
    after them (a notebook cell), only this run reads it: it is taken as ``k`` the same way.

    Returns:
        the split (torch's per-thread count is for the replica threads to set), or ``None``: one replica, or
        ``OMP_NUM_THREADS`` is set and ME read it at import (the user's count, kept).
    """
    if num_replicas < 2:
        return None
    if "OMP_NUM_THREADS" in os.environ:
        late = _omp_num_threads()
        if late is None or late == me_coordinate_manager_module().CPU_COUNT:
            return None  # read by ME, OpenBLAS and torch at import: the user's count, kept
        chosen, how = late, "OMP_NUM_THREADS (set after the imports)"
    else:
        chosen, how = chosen_torch_threads(), "torch.set_num_threads"
    count = chosen if chosen is not None else threads_per_replica(num_replicas)
    split = _give_me_and_openblas(count, ThreadSplit(count, main_thread_threads=torch.get_num_threads()))
    if chosen is not None:
        rank_zero_info(
            f"sparse_dp: {num_replicas} CPU replicas each run the {count} intra-op thread(s) {how} chose, for "
            "ME's OpenMP and OpenBLAS too (ME would set every replica thread back to its import-time count at each "
            "SparseTensor). Export OMP_NUM_THREADS before starting Python to leave ME and OpenBLAS alone."
        )
    else:
        rank_zero_info(
            f"sparse_dp: {num_replicas} CPU replicas on {available_cores()} cores get {count} intra-op "
            "thread(s) each (torch, ME's OpenMP, OpenBLAS), as Lightning's DDP splits cores between processes. Set "
            "OMP_NUM_THREADS (or call torch.set_num_threads) to choose."
        )
    return split


def follow_omp_num_threads() -> ThreadSplit | None:
    """Give ME's OpenMP and OpenBLAS the ``OMP_NUM_THREADS`` set after they read it (``sparse_ddp``'s processes).

    ME reads ``OMP_NUM_THREADS`` once, when it is imported (its ``CPU_COUNT``, which every coordinate manager
    passes to ``omp_set_num_threads`` in the calling thread), and OpenBLAS when it is loaded (with ME), falling
    back to ``OMP_NUM_THREADS`` when ``OPENBLAS_NUM_THREADS`` / ``GOTO_NUM_THREADS`` are not set. Lightning's DDP
    launcher sets ``OMP_NUM_THREADS=cores // processes`` and ``torch.set_num_threads`` in every rank after the
    script imported ME (it starts the other ranks before it sets the variable), so without this every rank
    would run ME's OpenMP (overriding torch's count in every thread that builds a SparseTensor) and OpenBLAS
    on every core. This applies ME's and OpenBLAS's own rule again, with the variable as it is now.

    Returns:
        what was changed, to undo at teardown (:meth:`ThreadSplit.restore`), or ``None``: the variable is not a
        positive integer, or ME and OpenBLAS already follow it.
    """
    count = _omp_num_threads()
    if count is None:
        return None
    split = _give_me_and_openblas(count, ThreadSplit(count))
    return split if split.me_cpu_count is not None or split.openblas_threads is not None else None


__all__ = [
    "DEFAULT_TORCH_THREADS",
    "CorePlan",
    "ThreadSplit",
    "available_cores",
    "check_pin",
    "check_prepare_in_threads",
    "chosen_torch_threads",
    "configure_replica_threads",
    "follow_omp_num_threads",
    "me_coordinate_manager_module",
    "plan_cores",
    "split_threads",
    "threads_per_replica",
]
