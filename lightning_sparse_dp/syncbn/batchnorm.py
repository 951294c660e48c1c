"""The synchronized batch-norm layer and the conversion that swaps it in and out (the math: :mod:`._functions`).

:class:`SyncBatchNorm` is ``torch.nn`` batch norm whose training-mode statistics and gradient sums are
those of every rank's input together, exchanged through whatever
:class:`~lightning_sparse_dp.syncbn.collective.Collective` it is given: the replica threads of a
``sparse_dp`` step (:mod:`.replicas`) or a process group (:mod:`.process_group`).
:func:`convert_sync_batchnorm` / :func:`revert_sync_batchnorm` swap a model's batch-norm layers for it and back.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.syncbn._functions import SyncBatchNormFunction
from lightning_sparse_dp.syncbn.collective import Collective


class SyncBatchNorm(_BatchNorm):
    """Batch norm synchronized through :attr:`collective` (the math: :mod:`lightning_sparse_dp.syncbn._functions`).

    Input ``[N, C]`` or ``[N, C, *]`` (ME's batch norm passes the features ``[N, C]``). When
    :attr:`collective` is ``None`` or has one rank, it is ``torch.nn.BatchNorm`` exactly. Made by
    :func:`convert_sync_batchnorm` from an existing layer, sharing its parameters and buffers.

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
    """The class a swapped layer gets: a subclass of its own torch class where it is ``BatchNorm1d/2d/3d`` (or of
    theirs), so that ``isinstance(m, nn.BatchNorm1d)`` holds for the swapped layer; :class:`SyncBatchNorm` for torch's
    ``SyncBatchNorm``, whose own forward needs a process group."""
    for torch_class, ours in ((nn.BatchNorm1d, SyncBatchNorm1d), (nn.BatchNorm2d, SyncBatchNorm2d),
                              (nn.BatchNorm3d, SyncBatchNorm3d)):
        if isinstance(layer, torch_class):
            return ours
    return SyncBatchNorm


#: what a layer the user changed during the fit carries besides its tensors, given back at the revert
_SETTINGS = ("momentum", "eps")

Swap = tuple[nn.Module, str, nn.Module]


def _hand_over(source: nn.Module, target: nn.Module) -> None:
    """``target``'s own parameters and buffers become ``source``'s: the same tensors, as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` hands them to the layer it builds, in the same dicts; and its
    hooks ``source``'s (:data:`SHARED`), so that what a callback registered on the layer in its ``setup``, which
    Lightning calls before the strategy's (a hook, ``ModelPruning``'s mask), reaches the layer that trains, as on one
    device, and a hook's handle removes it there (torch's conversion drops hooks)."""
    for name in SHARED:
        if name in source.__dict__:
            target.__dict__[name] = source.__dict__[name]


#: what a swap hands over of the layer, the same objects: its parameters and buffers (their dicts, so that what changes
#: them on either layer, ``torch.nn.utils.prune`` registering ``weight_orig`` and ``weight_mask`` on the layer a
#: ``ModelPruning`` callback found in its ``setup``, reaches both) and its hook dicts (``register_forward_hook``, ...,
#: the state-dict hooks)
SHARED = (
    "_parameters", "_buffers", "_non_persistent_buffers_set", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks", "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def convert_sync_batchnorm(module: nn.Module) -> list[Swap]:
    """Swap every batch-norm layer inside ``module`` for a :class:`SyncBatchNorm`, in place.

    Converts torch's ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` wherever they are children, which
    covers the ``.bn`` of ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``. Built as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` builds its layers (the constructor, the old
    layer's tensors handed over, ``add_module``): the new layer holds the old one's ``weight``,
    ``bias`` and buffers (the same tensors), so the state dict keeps its keys and values and the
    optimizer its parameters. ``module`` itself is not swapped (it has no parent to hold the new layer).

    Returns:
        ``(parent, name, original)`` for every swap, for :func:`revert_sync_batchnorm`.
    """
    swaps: list[Swap] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SWAPPED_TYPES) and not isinstance(child, SyncBatchNorm):
                new = _sync_class(child)(
                    child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats,
                    device=child.running_mean.device if child.running_mean is not None else None,
                )
                _hand_over(child, new)
                new.train(child.training)
                for setting in _SETTINGS:  # as swapped: a change the fit makes through the new layer is given back
                    new.__dict__[f"_lsdp_swapped_{setting}"] = getattr(child, setting)
                parent.add_module(name, new)
                swaps.append((parent, name, child))
    return swaps


def revert_sync_batchnorm(swaps: list[Swap]) -> None:
    """Put the original layers back, holding the tensors the swapped layers end with: the trained values,
    and the buffers a conversion after the swap replaced (``.to(dtype / device)`` makes new buffer tensors,
    e.g. a precision plugin's or ``model_to_device`` at setup)."""
    for parent, name, original in reversed(swaps):
        current = getattr(parent, name)
        _hand_over(current, original)
        original.train(current.training)
        for setting in _SETTINGS:  # a momentum schedule through the swapped layer: what the fit set on it (a change
            value = getattr(current, setting)  # made through the user's own layer, held elsewhere, stays)
            if value != current.__dict__.get(f"_lsdp_swapped_{setting}", value):
                setattr(original, setting, value)
        parent.add_module(name, original)


__all__ = [
    "SWAPPED_TYPES", "Swap", "SyncBatchNorm", "SyncBatchNorm1d", "SyncBatchNorm2d", "SyncBatchNorm3d",
    "convert_sync_batchnorm", "revert_sync_batchnorm",
]
