"""The process-group transport of synchronized batch norm (``sparse_ddp``), and its Lightning plugin.

:class:`ProcessGroupCollective` is the :class:`~lightning_sparse_dp.syncbn.collective.Collective` of one
``torch.distributed`` rank: ``all_gather`` over a process group (gloo on CPU, NCCL on CUDA). The
batch-norm math is :mod:`lightning_sparse_dp.syncbn.batchnorm`, the same as ``sparse_dp``'s over threads.

:class:`ProcessGroupSyncBatchNorm` is a Lightning ``LayerSync`` plugin: ``Trainer(strategy="sparse_ddp",
sync_batchnorm=True)`` uses it in place of Lightning's ``TorchSyncBatchNorm`` (whose
``torch.nn.SyncBatchNorm`` refuses CPU input: "SyncBatchNorm expected input tensor to be on GPU",
torch/nn/modules/batchnorm.py). ``apply`` swaps torch's BatchNorm1d/2d/3d and SyncBatchNorm (so the
``.bn`` of ``ME.MinkowskiBatchNorm`` / ``ME.MinkowskiSyncBatchNorm``) for
:class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm` layers holding a :class:`ProcessGroupCollective`,
in place (:class:`~lightning_sparse_dp.syncbn.layer_sync.SyncBatchNormSwap`); ``revert`` gives the layers their
classes back.
Every rank updates its own running statistics with the identical global ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm
from lightning_sparse_dp.syncbn.layer_sync import SyncBatchNormSwap


class ProcessGroupCollective:
    """This rank's :class:`~lightning_sparse_dp.syncbn.collective.Collective` over a ``torch.distributed`` process group.

    Args:
        group: the process group; None for the default (world) group. It must be initialized when
            :attr:`rank`, :attr:`world_size` or :meth:`all_gather` are used.

    Every rank of the group must make the same calls in the same order (as with any collective): a rank
    that runs fewer synchronized layers leaves the others waiting until the process group's timeout
    (``SparseDDPStrategy(timeout=...)``), which then raises in every rank.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order (``torch.distributed.all_gather``)."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def __repr__(self) -> str:
        return f"ProcessGroupCollective(group={self.group!r})"


class ProcessGroupSyncBatchNorm(SyncBatchNormSwap):
    """Lightning ``LayerSync`` plugin: batch norm synchronized over a process group (see the module docstring).

    Args:
        group: the process group to synchronize over; None for the world.
    """

    def __init__(self, group: Any = None) -> None:
        super().__init__()
        self.group = group

    def apply(self, model: Module) -> Module:
        """Swap ``model``'s batch-norm layers for ones synchronized over :attr:`group`, in place; returns ``model``."""
        super().apply(model)
        collective = ProcessGroupCollective(self.group)
        for layer, _ in self._swaps:
            assert isinstance(layer, SyncBatchNorm)
            layer.collective = collective
            layer.update_running_stats = True  # every rank keeps its own, identical, running statistics
        return model


__all__ = ["ProcessGroupCollective", "ProcessGroupSyncBatchNorm"]
