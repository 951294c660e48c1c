"""lightning-sparse-dp: train MinkowskiEngine sparse networks on several devices with Lightning.

``import lightning_sparse_dp`` registers the strategies ``"sparse_dp"`` (one process) and
``"sparse_ddp"`` (:mod:`~lightning_sparse_dp.strategies.sparse_ddp`: processes and machines on torch.distributed)::

    import lightning as L
    import lightning_sparse_dp  # noqa: F401

    trainer = L.Trainer(strategy="sparse_dp", accelerator="cpu", devices=3)

The data path of one ``sparse_dp`` step, one module per stage (``docs/architecture.md`` draws it,
for ``sparse_ddp`` too):

- :mod:`~lightning_sparse_dp.split`: batch -> chunks of whole samples, batch indices renumbered;
- :mod:`~lightning_sparse_dp.step.scatter`: chunk -> its device, SparseTensor / TensorField built there;
- :mod:`~lightning_sparse_dp.step.replicate`: module -> one replica per device, ME ``__slots__`` carried;
- :mod:`~lightning_sparse_dp.runtime.executor`: every replica's step at once, one thread per replica;
- :mod:`~lightning_sparse_dp.step.backward`: every replica's backward in its own thread, gradients reduced;
- :mod:`~lightning_sparse_dp.loss.capture` / :mod:`~lightning_sparse_dp.loss.decide`: torch's mean-reduced
  losses captured in each replica's step (:mod:`~lightning_sparse_dp.loss.denominators`: their denominators),
  each weighted by its share of the batch;
- :mod:`~lightning_sparse_dp.loss.weights`: the weights that make the replicas' losses the whole-batch mean;
- :mod:`~lightning_sparse_dp.step.gather`: the gather: outputs -> root device, in batch order (per-sample lists too);
- :mod:`~lightning_sparse_dp.step.log`: replicas' ``self.log`` calls -> reduced, logged once;
- :mod:`~lightning_sparse_dp.replica.metrics`: torchmetrics state per replica -> merged into the root's.

Beside it: :mod:`~lightning_sparse_dp.syncbn` (synchronized batch norm for both strategies: the layer,
its math, the all-gather between replica threads or over a process group, the ``LayerSync`` plugin),
:mod:`~lightning_sparse_dp.split.presplit` (the split in DataLoader workers), :mod:`~lightning_sparse_dp.runtime.threads`
(CPU cores per replica), :mod:`~lightning_sparse_dp.runtime.timing` (stage times and profiler actions),
:mod:`~lightning_sparse_dp.step.errors` (errors raised in replicas, re-raised with the fix), and for
``sparse_ddp`` :mod:`~lightning_sparse_dp.ddp.sampler` (each rank's point-balanced share of every global batch).

:class:`~lightning_sparse_dp.strategies.sparse_dp.SparseDataParallelStrategy` orchestrates them (on
:class:`~lightning_sparse_dp.strategies.single_process.SingleProcessParallelStrategy`, Lightning's plumbing for one process);
:class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy` is Lightning's DDP with the same split, loss
weights and batch norm; :mod:`~lightning_sparse_dp.strategies.base` holds what the two share.
"""

import lightning_utilities.core.rank_zero as _rank_zero

_RANK_ZERO_LOG = _rank_zero.log  # where Lightning's rank-zero lines went before this import (see the end)

from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler
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
        registered there), imported on first use (:mod:`._namespaces`); ``None`` without ``pytorch_lightning``."""
        if name == "pl":
            return _namespaces.import_mirror()
        raise AttributeError(f"module 'lightning_sparse_dp' has no attribute {name!r}")
