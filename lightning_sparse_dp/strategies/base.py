"""Base: :class:`SparseStrategyMixin`, what ``sparse_dp`` (one process) and ``sparse_ddp`` (processes) share.

Three things: the options that mean the same in both (``loss_weighting``, ``split``, ``layout``),
checked at construction; registration under the strategy's own name; and which ``LayerSync`` plugin
batch norm goes through: at setup, ``strategy._layer_sync`` (a plain attribute, as Lightning's
``ParallelStrategy`` keeps it) becomes :attr:`SparseStrategyMixin.own_layer_sync` where Lightning put
its ``TorchSyncBatchNorm`` (see :mod:`lightning_sparse_dp.syncbn.layer_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from lightning_sparse_dp.exactness.check import ExactnessCheck, resolve_mode
from lightning_sparse_dp.loss.memory import SiteMemory
from lightning_sparse_dp.loss.weights import check_loss_weighting
from lightning_sparse_dp.runtime.me import CPU_PATCHES, GPU_PATCHES, missing_patches, unpatched_message
from lightning_sparse_dp.split import resolve_assignment
from lightning_sparse_dp.syncbn.layer_sync import SyncBatchNormSwap

STEP_NAMES = ("training_step", "validation_step", "test_step", "predict_step")


def dataloader_iter_steps(module: Any) -> list[str]:
    """The module's steps written as ``step(self, dataloader_iter)`` (Lightning hands them the iterator, and the step
    fetches its batches itself), found as Lightning finds them (``is_param_in_hook_signature``, explicit)."""
    if module is None:
        return []
    return [
        name
        for name in STEP_NAMES
        if callable(getattr(module, name, None))
        and is_param_in_hook_signature(getattr(module, name), "dataloader_iter", explicit=True)
    ]


class SparseStrategyMixin:
    """Mixin of :class:`~lightning_sparse_dp.strategies.sparse_dp.SparseDataParallelStrategy` and
    :class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy` (before the Lightning base class)."""

    strategy_name: ClassVar[str]
    description: ClassVar[str]
    #: The ``LayerSync`` plugin that replaces Lightning's ``TorchSyncBatchNorm`` (``Trainer(sync_batchnorm=True)``).
    own_layer_sync: ClassVar[type[LayerSync]] = SyncBatchNormSwap
    #: The strategy's own ``sync_batchnorm`` option (``sparse_dp``'s), honoured without ``Trainer(sync_batchnorm=True)``.
    sync_batchnorm: bool = False

    def _set_options(
        self,
        loss_weighting: str | Callable[[Any], Any],
        split: str,
        layout: Mapping[Any, str] | None,
        allow_unpatched_me: bool = False,
        check_exactness: bool | str = True,
        check_exactness_every_n_steps: int = 0,
    ) -> None:
        """Check and keep the shared options.

        Raises:
            ValueError: an unknown ``loss_weighting`` or ``split``, a ``check_exactness`` other than ``True``, ``False``,
                ``"warn"`` or ``"error"``, a ``check_exactness_every_n_steps`` other than an int >= 0.
        """
        check_loss_weighting(loss_weighting)
        resolve_assignment(split, "split", callables=False)
        self.loss_weighting = loss_weighting
        self.split = split
        self.layout = dict(layout) if layout else None
        self._site_memory = SiteMemory()  # how the step's loss call sites were read (term_weights), for the run
        # the evaluation steps' own (validation inside a fit reads its losses as a validate() run does, not by what the
        # training steps showed of the same call sites: a loop whose count changed between training steps)
        self._eval_site_memory = SiteMemory()
        self._constant_sizes: dict[str, bool] = {}  # logged names' batch_size= read as a constant (ddp/logged_means.py)
        self.allow_unpatched_me = allow_unpatched_me
        #: the exactness check of training steps (:mod:`~lightning_sparse_dp.exactness.check`)
        self._exactness = ExactnessCheck(resolve_mode(check_exactness), check_exactness_every_n_steps, self.strategy_name)

    def _memory_for(self, hook: str) -> SiteMemory:
        """The site memory of a step of ``hook`` (``"training_step"``, ``"validation_step"``...): the training steps'
        for the run, the evaluation steps' apart (each reads what its own steps showed of a call site, never the
        other's: a loop whose count differs between them), except what the training steps settled of a loop's kind
        (a loop over the classes each chunk holds, not one over its samples; a mean or a sum of them): one call site of
        one code is such a loop in validation too, and a validation batch may not tell it."""
        if hook == "training_step":
            return self._site_memory
        trained, memory = self._site_memory, self._eval_site_memory
        for key, reading in trained.items():
            if reading[0] == "classes" and key not in memory:
                memory[key] = reading
        for key, kind in trained.classes.items():
            memory.classes.setdefault(key, kind)
        return memory

    def _check_minkowski_build(self, device_type: str, count: int) -> None:
        """Before the first step: refuse CPU replicas / ranks (``count > 1``) on an ME without the CPU patches
        (unless ``allow_unpatched_me``, then warn); on GPUs warn once what the missing patches cost.

        Raises:
            MisconfigurationException: CPU replicas on an unpatched ME, ``allow_unpatched_me`` not set.
        """
        if count < 2:
            return
        missing = missing_patches(CPU_PATCHES if device_type == "cpu" else GPU_PATCHES)
        if not missing:
            return
        message = unpatched_message(self.strategy_name, device_type, missing)
        if device_type == "cpu" and not self.allow_unpatched_me:
            raise MisconfigurationException(message)
        rank_zero_warn(message)

    def _resolve_layer_sync(self) -> None:
        """At setup, before the plugin is applied: ``self._layer_sync`` becomes :attr:`own_layer_sync` in place of
        Lightning's ``TorchSyncBatchNorm``, or in place of ``None`` when the strategy was built with
        ``sync_batchnorm=True``; a ``LayerSync`` plugin of the user's own (``Trainer(plugins=[...])``) is kept.

        Not earlier: the Trainer's accelerator connector assigns ``strategy._layer_sync`` after the strategy
        is built (``None`` without ``Trainer(sync_batchnorm=True)``), so only at setup is its choice final.
        """
        plugin = self._layer_sync  # type: ignore[has-type]  # ParallelStrategy's plain attribute
        if type(plugin) is TorchSyncBatchNorm or (plugin is None and self.sync_batchnorm):
            self._layer_sync = self.own_layer_sync()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # not the Lightning base class's: DDPStrategy's would register the "ddp" names again, for this class
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.description)


__all__ = ["STEP_NAMES", "SparseStrategyMixin", "dataloader_iter_steps"]
