"""lightning-sparse-dp: train MinkowskiEngine sparse networks on several devices with Lightning.

``import lightning_sparse_dp`` registers the strategies ``"sparse_dp"`` (one process) and
``"sparse_ddp"`` (:mod:`~lightning_sparse_dp.strategies.sparse_ddp`: processes and machines on torch.distributed)::

    import lightning as L
    import lightning_sparse_dp  # noqa: F401

    trainer = L.Trainer(strategy="sparse_dp", accelerator="cpu", devices=3)

This file holds the public names only; the folders are the plan (``docs/architecture.md`` draws it), each
``__init__`` listing its files in data-path order:

- :mod:`~lightning_sparse_dp.strategies`: the two strategies; ``sparse_dp``'s step hooks run the hub that calls the
  stages of one step in order;
- :mod:`~lightning_sparse_dp.exactness`: the first training step run on one device and on the replicas, compared;
- :mod:`~lightning_sparse_dp.step`: those stages, one file each (``docs/architecture.md`` draws the data path);
- :mod:`~lightning_sparse_dp.replica`: what makes a replica's step one device's (its state on the module, metrics,
  ``self.log``, loggers);
- :mod:`~lightning_sparse_dp.split`: a batch into chunks of whole samples, and back;
- :mod:`~lightning_sparse_dp.loss`: the exact loss, each replica's (rank's) loss weighted by what it is a mean over;
- :mod:`~lightning_sparse_dp.syncbn`: synchronized batch norm for both strategies;
- :mod:`~lightning_sparse_dp.ddp`: ``sparse_ddp``'s pieces across processes (the point-balanced sampler, the
  ranks' exchange);
- :mod:`~lightning_sparse_dp.runtime`: replica threads, devices, clocks, the installed ME, the ``pytorch_lightning``
  mirror, and (:mod:`~lightning_sparse_dp.runtime.process`) every piece of process-wide state the package keeps.
"""

import lightning_utilities.core.rank_zero as _rank_zero

_RANK_ZERO_LOG = _rank_zero.log  # where Lightning's rank-zero lines went before this import (see the end)

from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler
from lightning_sparse_dp.exactness import ExactnessError
from lightning_sparse_dp.loss.weights import chunk_counts
from lightning_sparse_dp.runtime.executor import ReplicaExecutor
from lightning_sparse_dp.runtime.timing import StageTimes
from lightning_sparse_dp.split import BatchLayoutError, SparseSpec, SplitPlan, split_batch
from lightning_sparse_dp.split.presplit import PreSplitBatch, PreSplitCollate
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.strategies.sparse_ddp import SparseDDPStrategy
from lightning_sparse_dp.strategies.sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm
from lightning_sparse_dp.syncbn.collective import Collective, ThreadGroup

__version__ = "0.2.0"

__all__ = [
    "BatchLayoutError",
    "Collective",
    "ExactnessError",
    "PointBalancedBatchSampler",
    "PreSplitBatch",
    "PreSplitCollate",
    "ReplicaExecutor",
    "Replicas",
    "SparseDDPStrategy",
    "SparseDataParallelStrategy",
    "SparseSpec",
    "SplitPlan",
    "StageTimes",
    "SyncBatchNorm",
    "ThreadGroup",
    "chunk_counts",
    "split_batch",
]

if __name__ == "lightning_sparse_dp":  # not in the mirror itself (lightning_sparse_dp.pl runs this file too)
    from lightning_sparse_dp.runtime import namespaces as _namespaces

    _namespaces.import_when_imported()  # pytorch_lightning's registry too, once the process imports it
    if _RANK_ZERO_LOG.name.endswith(".utilities.rank_zero"):  # the user imported pytorch_lightning (or lightning) first
        _rank_zero.log = _RANK_ZERO_LOG  # importing the other namespace must not move Lightning's messages

    def __getattr__(name: str) -> object:
        """``lightning_sparse_dp.pl``: this package for modules written against ``pytorch_lightning`` (its strategies
        registered there), imported on first use (:mod:`.runtime.namespaces`); ``None`` without ``pytorch_lightning``."""
        if name == "pl":
            return _namespaces.import_mirror()
        raise AttributeError(f"module 'lightning_sparse_dp' has no attribute {name!r}")
