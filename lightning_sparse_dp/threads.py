"""Threads: the CPU cores split between CPU replicas, as Lightning's DDP launcher splits them between processes.

Lightning's DDP launcher gives each of ``p`` local processes ``cores // p`` intra-op threads
(``torch.set_num_threads`` and ``OMP_NUM_THREADS``) unless ``OMP_NUM_THREADS`` is set
(``lightning.fabric.strategies.launchers.subprocess_script._set_num_threads_if_needed``). CPU replicas
are threads of one process, so the same share has to be set in three places:

- torch's intra-op threads: a per-thread OpenMP setting; the replica threads set it
  (:class:`~lightning_sparse_dp.apply.ReplicaExecutor` ``threads_per_replica``);
- ME's OpenMP threads: every ``ME.CoordinateManager`` (one per SparseTensor / TensorField) calls
  ``omp_set_num_threads(min(CPU_COUNT, 20))`` in the calling thread, with ``CPU_COUNT`` read from
  ``OMP_NUM_THREADS`` when ME is imported, else all cores (MinkowskiCoordinateManager.py), which
  overrides the thread's torch setting too (torch and ME share one OpenMP runtime). The module-level
  ``CPU_COUNT`` is read at each construction, so it is set to the share for the run;
- OpenBLAS (ME's CPU convolutions call ``cblas_sgemm`` / ``cblas_dgemm``): one process-wide thread
  count, set to the share when the library is loaded and ``OPENBLAS_NUM_THREADS`` is not set.

Nothing is changed when the user chose: ``OMP_NUM_THREADS`` is set, or ``torch.set_num_threads`` was
called after this package was imported (its count differs from the one seen at import).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_sparse_dp._me import ME

#: torch's intra-op thread count when this package was imported (what it is unless the user changes it).
DEFAULT_TORCH_THREADS = torch.get_num_threads()


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def user_chose_threads() -> bool:
    """Whether the user set ``OMP_NUM_THREADS`` or called ``torch.set_num_threads`` after importing this package."""
    return "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() != DEFAULT_TORCH_THREADS


def threads_per_replica(num_replicas: int, cores: int | None = None) -> int:
    """``cores // num_replicas``, at least 1 (Lightning's DDP share per process).

    Raises:
        ValueError: ``num_replicas < 1``.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    return max(1, (available_cores() if cores is None else cores) // num_replicas)


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


def split_threads(num_replicas: int) -> ThreadSplit | None:
    """Give ME's OpenMP and OpenBLAS ``threads_per_replica(num_replicas)`` threads for the run, and say so (info).

    Returns:
        the split (torch's per-thread count is for the replica threads to set), or ``None`` when the user
        chose the thread counts (:func:`user_chose_threads`) or there is one replica.
    """
    if num_replicas < 2 or user_chose_threads():
        return None
    split = ThreadSplit(threads_per_replica(num_replicas), main_thread_threads=torch.get_num_threads())
    coordinate_manager = me_coordinate_manager_module()
    split.me_cpu_count = coordinate_manager.CPU_COUNT
    coordinate_manager.CPU_COUNT = split.per_replica
    lib = _openblas()
    if lib is not None and "OPENBLAS_NUM_THREADS" not in os.environ:
        split.openblas_threads = int(lib.openblas_get_num_threads())
        lib.openblas_set_num_threads(split.per_replica)
    rank_zero_info(
        f"sparse_dp: {num_replicas} CPU replicas on {available_cores()} cores get {split.per_replica} intra-op "
        "thread(s) each (torch, ME's OpenMP, OpenBLAS), as Lightning's DDP splits cores between processes. Set "
        "OMP_NUM_THREADS (or call torch.set_num_threads) to choose."
    )
    return split


__all__ = [
    "DEFAULT_TORCH_THREADS",
    "ThreadSplit",
    "available_cores",
    "me_coordinate_manager_module",
    "split_threads",
    "threads_per_replica",
    "user_chose_threads",
]
