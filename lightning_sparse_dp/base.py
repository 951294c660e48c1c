"""Base: what both strategies share, ``sparse_dp`` (one process) and ``sparse_ddp`` (processes).

Their options that mean the same in both (``loss_weighting``, ``split``, ``layout``), checked at
construction; their registration under their own name; and batch norm through Lightning's
``LayerSync`` plugin point: ``strategy._layer_sync`` holds :attr:`SparseStrategyMixin.own_layer_sync`
where Lightning would put its ``TorchSyncBatchNorm`` (see :mod:`lightning_sparse_dp.layer_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from typing_extensions import override

from lightning_sparse_dp.weighting import check_loss_weighting
from lightning_sparse_dp.layer_sync import SyncBatchNormSwap
from lightning_sparse_dp.split import resolve_assignment


class SparseStrategyMixin:
    """Mixin of :class:`~lightning_sparse_dp.strategy.SparseDataParallelStrategy` and
    :class:`~lightning_sparse_dp.ddp.SparseDDPStrategy` (before the Lightning base class)."""

    strategy_name: ClassVar[str]
    description: ClassVar[str]
    #: The ``LayerSync`` plugin that replaces Lightning's ``TorchSyncBatchNorm`` (``Trainer(sync_batchnorm=True)``).
    own_layer_sync: ClassVar[type[LayerSync]] = SyncBatchNormSwap

    def _set_options(
        self, loss_weighting: str | Callable[[Any], Any], split: str, layout: Mapping[Any, str] | None
    ) -> None:
        """Check and keep the shared options.

        Raises:
            ValueError: an unknown ``loss_weighting`` or ``split``.
        """
        check_loss_weighting(loss_weighting)
        resolve_assignment(split, "split", callables=False)
        self.loss_weighting = loss_weighting
        self.split = split
        self.layout = dict(layout) if layout else None

    @property
    def _layer_sync(self) -> LayerSync | None:
        return self.__dict__.get("_layer_sync_plugin")

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        # The Trainer assigns strategy._layer_sync after building the strategy (its accelerator connector): None
        # without Trainer(sync_batchnorm=True), which must not undo the strategy's own sync_batchnorm=True. A
        # LayerSync plugin of the user's own (Trainer(plugins=[...])) is kept.
        if type(plugin) is TorchSyncBatchNorm or (plugin is None and self.__dict__.get("sync_batchnorm")):
            plugin = self.own_layer_sync()
        self.__dict__["_layer_sync_plugin"] = plugin

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # not the Lightning base class's: DDPStrategy's would register the "ddp" names again, for this class
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description)


__all__ = ["SparseStrategyMixin"]
