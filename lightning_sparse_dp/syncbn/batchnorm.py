"""The synchronized batch-norm layer and the conversion that swaps it in and out (the math: :mod:`._functions`).

:class:`SyncBatchNorm` is ``torch.nn`` batch norm whose training-mode statistics and gradient sums are
those of every rank's input together, exchanged through whatever
:class:`~lightning_sparse_dp.syncbn.collective.Collective` it is given: the replica threads of a
``sparse_dp`` step (:mod:`.replicas`) or a process group (:mod:`.process_group`).
:func:`convert_sync_batchnorm` / :func:`revert_sync_batchnorm` swap a model's batch-norm layers for it and back.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.syncbn._functions import SyncBatchNormFunction
from lightning_sparse_dp.syncbn.collective import Collective


class SyncBatchNorm(_BatchNorm):
    """Batch norm synchronized through :attr:`collective` (the math: :mod:`lightning_sparse_dp.syncbn._functions`).

    Input ``[N, C]`` or ``[N, C, *]`` (ME's batch norm passes the features ``[N, C]``). When
    :attr:`collective` is ``None`` or has one rank, it is ``torch.nn.BatchNorm`` exactly. An existing layer becomes
    one in place (:func:`convert_sync_batchnorm`).

    Attributes:
        collective: the :class:`~lightning_sparse_dp.syncbn.collective.Collective` of this rank, set by the
            strategy for each step (``sparse_dp``) or once (``sparse_ddp``); ``None``: no synchronization.
        update_running_stats: whether this rank's layer updates the running statistics (with the
            global ones) in a synchronized step. ``sparse_dp`` sets it on the root replica only, whose
            layer shares the module's buffers (once per step); ``sparse_ddp`` leaves it on for every
            rank, each updating its own copy identically.
    """

    collective: Collective | None = None
    update_running_stats: bool = True

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input [N, C] or [N, C, *], got shape {tuple(input.shape)}")

    def forward(self, input: Tensor) -> Tensor:
        collective = self.collective
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        if collective is None or collective.world_size == 1 or not batch_statistics:
            return super().forward(input)
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got input of shape {tuple(input.shape)}")
        running = None
        if self.training and self.track_running_stats and self.update_running_stats:
            running = (self.running_mean, self.running_var, self._update_factor())
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, collective, self.eps, running)

    def _update_factor(self) -> float:
        """Count this batch in ``num_batches_tracked`` and give the running statistics' update factor, as
        ``torch.nn.modules.batchnorm._BatchNorm.forward`` does (``momentum``, or ``1 / num_batches_tracked``
        for the cumulative average when ``momentum`` is ``None``)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor


#: The layers :func:`convert_sync_batchnorm` swaps: torch's BatchNorm1d/2d/3d and SyncBatchNorm, which
#: includes the ``bn`` inside ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``.
SWAPPED_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    """:class:`SyncBatchNorm` in place of a ``BatchNorm1d``: still one for ``isinstance`` (the user's code that looks for
    batch norm, e.g. to leave it out of weight decay or to freeze it, finds it as on one device)."""


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    """:class:`SyncBatchNorm` in place of a ``BatchNorm2d`` (see :class:`SyncBatchNorm1d`)."""


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    """:class:`SyncBatchNorm` in place of a ``BatchNorm3d`` (see :class:`SyncBatchNorm1d`)."""


def _sync_class(layer: nn.Module) -> type[SyncBatchNorm]:
    """The class a swapped layer gets: a subclass of its own torch class where it is ``BatchNorm1d/2d/3d``, so that
    ``isinstance(m, nn.BatchNorm1d)`` holds for the swapped layer; for a class of the user's derived from one of them,
    a subclass of both (:func:`_user_sync_class`: its own ``forward``, which calls ``super().forward``, runs the
    synchronized one); :class:`SyncBatchNorm` for torch's ``SyncBatchNorm``, whose own forward needs a process group."""
    for torch_class, ours in ((nn.BatchNorm1d, SyncBatchNorm1d), (nn.BatchNorm2d, SyncBatchNorm2d),
                              (nn.BatchNorm3d, SyncBatchNorm3d)):
        if isinstance(layer, torch_class):
            return ours if type(layer) is torch_class else _user_sync_class(type(layer), ours)
    return SyncBatchNorm


@functools.cache
def _user_sync_class(cls: type, ours: type[SyncBatchNorm]) -> type[SyncBatchNorm]:
    """``cls`` (the user's subclass of a torch batch norm) before ``ours`` in the method order: what ``cls`` defines
    (a ``forward`` of its own around ``super().forward``) runs, its torch base's forward is the synchronized one. A
    layer of it pickles as a layer of ``cls`` (``torch.save`` of the module during the fit: the class is found by its
    name), and deep-copies as itself."""
    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # pickled as the user's class (found by its name)
        return _as_class, (cls, self.__dict__)

    def __deepcopy__(self: Any, memo: dict[int, Any]) -> Any:  # a copy keeps the synchronized class (the check's)
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__,
                 "__deepcopy__": __deepcopy__}
    return type(cls.__name__, (cls, ours), namespace)


def _as_class(cls: type, state: dict[str, Any]) -> Any:
    """A layer of class ``cls`` with ``state`` as its ``__dict__`` (unpickling a swapped layer of a user's class)."""
    layer = object.__new__(cls)
    layer.__dict__.update(state)
    return layer


#: a swap: the layer, swapped in place, and the class it had
Swap = tuple[nn.Module, type]

#: what a swap sets on a layer, taken off at the revert
_SET = ("collective", "update_running_stats")


def convert_sync_batchnorm(module: nn.Module) -> list[Swap]:
    """Swap every batch-norm layer inside ``module`` for a :class:`SyncBatchNorm`, in place: the layer itself.

    Converts torch's ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` wherever they are in ``module.modules()``, which
    covers the ``.bn`` of ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``. Where
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` builds a new layer and hands it the old one's tensors, this
    gives the layer object itself its synchronized class (``layer.__class__``, :func:`_sync_class`: a subclass of
    its own torch class): every reference to it (a parent's, a list the module keeps in ``__init__``, a callback's,
    a hook's, an optimizer's parameters) reaches the layer that trains, as on one device, and what is done to it
    through any of them (``.eval()``, a momentum schedule, ``torch.nn.utils.prune``) is done to it. The state dict
    keeps its keys and values.

    Returns:
        ``(layer, its class)`` for every swap, for :func:`revert_sync_batchnorm`.
    """
    swaps: list[Swap] = []
    for layer in module.modules():
        if isinstance(layer, SWAPPED_TYPES) and not isinstance(layer, SyncBatchNorm):
            swaps.append((layer, type(layer)))
            layer.__class__ = _sync_class(layer)
    return swaps


def revert_sync_batchnorm(swaps: list[Swap]) -> None:
    """Give the layers their classes back, with what the swap set on them (its collective) taken off: they hold
    what the fit left them (the trained tensors, a momentum the fit set)."""
    for layer, cls in reversed(swaps):
        layer.__class__ = cls
        for name in _SET:
            layer.__dict__.pop(name, None)


__all__ = [
    "SWAPPED_TYPES", "Swap", "SyncBatchNorm", "SyncBatchNorm1d", "SyncBatchNorm2d", "SyncBatchNorm3d",
    "convert_sync_batchnorm", "revert_sync_batchnorm",
]
