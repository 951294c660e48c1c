"""Synchronized batch norm: the one place to read it, for both strategies.

Batch norm over the whole batch, although each replica (``sparse_dp``) or rank (``sparse_ddp``)
sees only its share, as ``torch.nn.SyncBatchNorm`` computes it. As torch keeps the module in
``batchnorm.py`` and its autograd function in ``_functions.py``:

- :mod:`~lightning_sparse_dp.syncbn.batchnorm`: the layer, :class:`SyncBatchNorm`, and the swap of a
  model's batch-norm layers for it and back (:func:`convert_sync_batchnorm`, :func:`revert_sync_batchnorm`);
- :mod:`~lightning_sparse_dp.syncbn._functions`: the math (statistics combined with Chan et al.'s
  formula, gradient sums exchanged) over any collective;
- :mod:`~lightning_sparse_dp.syncbn._gathered`: small layers of CPU replica threads, computed once for all
  replicas on their input together (torch's own kernels: the one-device computation);
- :mod:`~lightning_sparse_dp.syncbn.collective`: the collective protocol and :class:`ThreadGroup`,
  the abortable all-gather between replica threads;
- :mod:`~lightning_sparse_dp.syncbn.replicas`: ``sparse_dp``'s side, each step's replica layers made
  one group (:func:`synchronized`);
- :mod:`~lightning_sparse_dp.syncbn.process_group`: ``sparse_ddp``'s side, the collective over a
  ``torch.distributed`` process group and its ``LayerSync`` plugin;
- :mod:`~lightning_sparse_dp.syncbn.layer_sync`: the ``LayerSync`` plugin that swaps batch norm,
  applied and reverted as Lightning's ``DDPStrategy`` does (``Trainer(sync_batchnorm=True)``).
"""

from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from lightning_sparse_dp.syncbn.collective import Collective, ReplicaAborted, ThreadGroup
from lightning_sparse_dp.syncbn.layer_sync import SyncBatchNormSwap
from lightning_sparse_dp.syncbn.process_group import ProcessGroupCollective, ProcessGroupSyncBatchNorm
from lightning_sparse_dp.syncbn.replicas import sync_layers, synchronized

__all__ = [
    "Collective",
    "ProcessGroupCollective",
    "ProcessGroupSyncBatchNorm",
    "ReplicaAborted",
    "SyncBatchNorm",
    "SyncBatchNormSwap",
    "ThreadGroup",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "sync_layers",
    "synchronized",
]
