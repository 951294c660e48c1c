"""Layer sync: batch-norm conversion through Lightning's ``LayerSync`` plugin point, for both strategies.

``Trainer(sync_batchnorm=True)`` hands every parallel strategy a ``LayerSync`` plugin (Lightning's
``TorchSyncBatchNorm``, in ``strategy._layer_sync``), which ``DDPStrategy.setup`` applies to the model
when fitting and ``DDPStrategy.teardown`` reverts. ``torch.nn.SyncBatchNorm`` does not fit either
strategy: in one process it runs plain batch norm on each replica's chunk, and it refuses CPU input
("SyncBatchNorm expected input tensor to be on GPU", torch/nn/modules/batchnorm.py). So
:class:`SyncBatchNormSwap` swaps torch's BatchNorm1d/2d/3d and SyncBatchNorm (and so the ``.bn`` of
``ME.MinkowskiBatchNorm`` / ``ME.MinkowskiSyncBatchNorm``) for
:class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm`, in place (each layer object given the synchronized
class, so every reference to it still reaches it; state-dict keys unchanged), and both strategies take it (or a
subclass) in place of ``TorchSyncBatchNorm`` (:class:`~lightning_sparse_dp.strategies.base.SparseStrategyMixin`); a ``LayerSync``
plugin of the user's own (``Trainer(plugins=[...])``) is kept. ``sparse_dp`` applies and reverts it
with :func:`apply_layer_sync` / :func:`revert_layer_sync`, the steps of ``DDPStrategy.setup`` /
``teardown``, which ``sparse_ddp`` inherits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.syncbn.batchnorm import Swap, convert_sync_batchnorm, revert_sync_batchnorm


class SyncBatchNormSwap(LayerSync):
    """Lightning ``LayerSync`` plugin: batch norm swapped for :class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm`.

    The swapped layers synchronize through whatever collective they are given:
    ``sparse_dp`` joins the replicas' layers into each step's thread group
    (:func:`~lightning_sparse_dp.syncbn.replicas.synchronized`);
    :class:`~lightning_sparse_dp.syncbn.process_group.ProcessGroupSyncBatchNorm`
    gives them a process group.
    """

    def __init__(self) -> None:
        self._swaps: list[Swap] = []

    def apply(self, model: Module) -> Module:
        """Swap ``model``'s batch-norm layers, in place (see
        :func:`~lightning_sparse_dp.syncbn.batchnorm.convert_sync_batchnorm`); returns ``model``."""
        self._swaps += convert_sync_batchnorm(model)
        return model

    def revert(self, model: Module) -> Module:
        """Give the user's layers their classes back (the same objects: they hold the trained values); returns ``model``."""
        revert_sync_batchnorm(self._swaps)
        self._swaps = []
        return model


def apply_layer_sync(strategy: Any) -> None:
    """``DDPStrategy.setup``'s step: apply ``strategy._layer_sync`` to ``strategy.model`` when fitting, and in the other
    stages when the module has batch norm without running statistics (:func:`eval_batch_statistics`), which normalizes
    with the batch's statistics in eval mode too (one device's: the whole batch's)."""
    if strategy._layer_sync is not None and _needed(strategy):
        strategy.model = strategy._layer_sync.apply(strategy.model)


def revert_layer_sync(strategy: Any) -> None:
    """``DDPStrategy.teardown``'s step: revert ``strategy._layer_sync`` on ``strategy.model`` where it was applied."""
    if strategy._layer_sync is not None and strategy.model is not None and _needed(strategy):
        strategy.model = strategy._layer_sync.revert(strategy.model)


def eval_batch_statistics(module: Module | None) -> list[Module]:
    """``module``'s batch-norm layers that normalize with the batch's statistics in eval mode too
    (``track_running_stats=False``: no running statistics; torch's ``_BatchNorm.forward``)."""
    return [] if module is None else [m for m in module.modules() if isinstance(m, _BatchNorm) and m.running_mean is None]


def _needed(strategy: Any) -> bool:
    module = strategy.lightning_module
    trainer = trainer_of(module)
    return trainer is not None and (trainer.state.fn == TrainerFn.FITTING or bool(eval_batch_statistics(module)))


def has_batch_norm(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` is a batch-norm layer (``torch.nn.modules.batchnorm._BatchNorm``: torch's and ME's,
    whose ``MinkowskiBatchNorm`` holds one)."""
    return any(isinstance(m, _BatchNorm) for m in modules)


__all__ = ["SyncBatchNormSwap", "apply_layer_sync", "eval_batch_statistics", "has_batch_norm", "revert_layer_sync"]
