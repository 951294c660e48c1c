"""Checks: the strategies' checks of the module for steps that run on chunks of the batch, and what they say.

A replica (a ``sparse_ddp`` rank) runs the user's step on a chunk of the batch, not on the whole batch as one device
does; these are the module's traits that matter then, looked at before the steps run:

- :func:`refuse_dataloader_iter`: a ``sparse_dp`` step written as ``step(self, dataloader_iter)`` fetches its batches
  itself, so it cannot be split before it runs: refused at setup;
- :func:`refuse_compiled_submodules`: a ``torch.compile``-d submodule cannot be replicated (its wrapper calls the
  module it wraps, the user's, and copying it writes into that module): refused at setup, naming the fix;
- :func:`warn_unsynchronized_batchnorm`: batch norm without ``sync_batchnorm`` normalizes each chunk with its own
  statistics: said once at setup (SyncBatchNorm layers left unsynchronized as a warning);
- :func:`refuse_old_gather`: a ``gather`` override written for ``gather(outputs, plan, weights)`` (before the stages
  took the step's context) would fail in the first step with Python's own ``TypeError``: refused at setup, naming the
  signature to write;
- :func:`min_points_per_chunk`: the fewest points the split gives a chunk, 2 where batch norm runs per replica (it
  needs more than one value per channel), for every step's split; what a chunk still raises is explained by
  :func:`~lightning_sparse_dp.step.errors.explain_replica_error`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.strategies.base import dataloader_iter_steps
from lightning_sparse_dp.syncbn.layer_sync import has_batch_norm


def min_points_per_chunk(module: nn.Module, synchronized: bool, batch_norm: bool | None = None) -> int:
    """The fewest points a replica's chunk should get: 2 when ``module`` has batch norm that each
    replica runs on its own chunk (``synchronized`` False), else 1. ``batch_norm``: whether it has, when known
    already (the strategy's replicas note it when they are built), else ``module``'s submodules are looked through.

    Batch norm in training mode needs more than one value per channel (torch raises otherwise), so a
    chunk of one point, e.g. the short last batch holding a one-point sample, is avoided when the
    batch allows (:func:`~lightning_sparse_dp.split.split_batch`'s ``min_points``). Strided layers
    can still leave a chunk one value; :func:`~lightning_sparse_dp.step.errors.explain_replica_error` names the fix then.
    """
    if synchronized:
        return 1
    return 2 if (has_batch_norm(module.modules()) if batch_norm is None else batch_norm) else 1


def refuse_old_gather(gather: Callable[..., Any]) -> None:
    """``sparse_dp`` at setup: the strategy's bound ``gather`` must take ``(outputs, step)``, as the hub calls it.

    Raises:
        MisconfigurationException: a ``gather`` that cannot be called so (an override written for the earlier
            ``gather(outputs, plan, weights)``), naming the signature to write and where plan and weights are now.
    """
    try:
        inspect.signature(gather).bind([], None)
    except TypeError:
        raise MisconfigurationException(
            f"sparse_dp: {gather.__qualname__}{inspect.signature(gather)} cannot be called as gather(outputs, step), "
            "how the strategy calls its stages. Write it as def gather(self, outputs, step) and read step.plan and "
            "step.weights (it was gather(outputs, plan, weights)); super().gather(outputs, step) does the default."
        ) from None


def refuse_dataloader_iter(module: nn.Module) -> None:
    """``sparse_dp`` at setup: a step written as ``step(self, dataloader_iter)`` cannot be split before it runs.

    Raises:
        MisconfigurationException: naming the steps, how to write them, and ``sparse_ddp``, which runs them.
    """
    iterating = dataloader_iter_steps(module)
    if iterating:
        raise MisconfigurationException(
            f"sparse_dp does not support {', '.join(iterating)}(self, dataloader_iter): it splits each batch before the "
            "step runs, and such a step fetches its batches itself. Write the step as step(self, batch, batch_idx), or "
            "use strategy='sparse_ddp', which runs such steps as DDP does."
        )


def refuse_compiled_submodules(module: nn.Module, replicas: int) -> None:
    """``sparse_dp`` at setup with several replicas: a submodule that ``torch.compile`` wrapped (``OptimizedModule``,
    e.g. ``self.head = torch.compile(nn.Linear(...))``) cannot be replicated. Its compiled ``forward`` is bound to
    the module it wraps, the user's, so a replica's call would run the user's parameters in every thread, and
    ``Module._replicate_for_data_parallel`` (torch's, as ``nn.DataParallel`` uses it) sets the copy's attributes
    through the wrapper's ``__setattr__``, which forwards them to the wrapped module: the user's module is changed.

    A TorchScript submodule (``torch.jit.script`` / ``trace``) cannot be replicated either: its parameters and
    submodules live in TorchScript's objects (``_parameters`` is a wrapper, not a dict).

    Raises:
        MisconfigurationException: naming the submodules and the fixes (keep the submodule uncompiled, compile a
            function the step calls, or ``sparse_ddp``; Lightning itself refuses a compiled LightningModule for any
            strategy but its single-device, DDP and FSDP ones; keep a scripted one a plain module while training).
    """
    if replicas < 2:
        return
    scripted = [name for name, m in module.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    scripted = [name for name in scripted if not any(name.startswith(f"{outer}.") for outer in scripted)]  # outermost
    if scripted:  # TorchScript keeps parameters and submodules in C++ (its _parameters a wrapper, not a dict)
        raise MisconfigurationException(
            f"sparse_dp: {', '.join(scripted)} is a TorchScript module (torch.jit.script / trace), which cannot be "
            "replicated into replica threads: its parameters and submodules live in TorchScript's own objects. Keep "
            "it a plain nn.Module while training (script it for deployment after), or use strategy='sparse_ddp', whose "
            "ranks each hold the whole module."
        )
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without torch.compile
        return
    compiled = [name for name, m in module.named_modules() if name and isinstance(m, OptimizedModule)]
    if compiled:
        raise MisconfigurationException(
            f"sparse_dp: {', '.join(compiled)} is a torch.compile-d submodule, which cannot be replicated: its compiled "
            "forward runs the module it wraps, not the replica's. Keep the submodule uncompiled (self.head = "
            "nn.Linear(...)), or compile inside a helper the step calls (torch.compile of a function), or use "
            "strategy='sparse_ddp', whose ranks each hold the whole module."
        )


def warn_eval_batchnorm(layers: list[nn.Module], replicas: int, strategy: str = "sparse_dp") -> None:
    """At setup of a validate / test / predict run without ``sync_batchnorm``, with two or more replicas (``sparse_dp``)
    or ranks (``sparse_ddp``): batch-norm ``layers`` without running statistics (``track_running_stats=False``, which
    normalize with the batch's statistics in eval mode too) said once to normalize each one's chunk."""
    if replicas >= 2 and layers:
        what = "replica" if strategy == "sparse_dp" else "rank"
        rank_zero_info(
            f"{strategy}: {len(layers)} batch-norm layer{'s' if len(layers) > 1 else ''} without running statistics "
            f"(track_running_stats=False) normalize each {what}'s chunk with its own statistics in validation, test "
            "and predict too (eval mode keeps the batch's statistics for them), not the whole batch's as on one "
            "device; pass Trainer(sync_batchnorm=True) to synchronize them."
        )


def warn_unsynchronized_batchnorm(module: nn.Module, replicas: int = 2, strategy: str = "sparse_dp") -> None:
    """At setup without ``sync_batchnorm``, with ``replicas`` replicas (``sparse_dp``) or ranks (``sparse_ddp``) of two
    or more: say once that batch norm runs per chunk. SyncBatchNorm layers (``ME.MinkowskiSyncBatchNorm``), which
    the user meant to synchronize, as a warning, from ``sparse_dp`` only (``sparse_ddp`` says its own); plain batch
    norm (torch's ``BatchNorm1d/2d/3d``, so ``ME.MinkowskiBatchNorm``'s inner ``bn``; the kinds both strategies
    synchronize) as one info line naming the layers' count and the fix, as its statistics are each chunk's, not the
    whole batch's one device computes."""
    if replicas < 2:
        return
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    if strategy == "sparse_dp" and any(isinstance(m, nn.SyncBatchNorm) for m in layers):
        rank_zero_warn(
            "sparse_dp: the model has SyncBatchNorm layers (e.g. ME.MinkowskiSyncBatchNorm) but sync_batchnorm is off: "
            "in one process they run as plain batch norm on each replica's chunk. Pass Trainer(sync_batchnorm=True) to "
            "synchronize them across sparse_dp replicas."
        )
        return
    plain = [m for m in layers if not isinstance(m, nn.SyncBatchNorm)]
    if plain:
        what = "replica" if strategy == "sparse_dp" else "rank"
        rank_zero_info(
            f"{strategy}: {len(plain)} batch-norm layer{'s' if len(plain) > 1 else ''} (e.g. ME.MinkowskiBatchNorm) "
            f"normalize each {what}'s chunk with its own statistics, not the whole batch's as on one device; pass "
            "Trainer(sync_batchnorm=True) to synchronize them."
        )


__all__ = ["min_points_per_chunk", "refuse_dataloader_iter", "warn_eval_batchnorm", "warn_unsynchronized_batchnorm"]
