"""The step's context: what one ``sparse_dp`` step is given (:class:`StepCall`) and what its stages make
(:class:`StepContext`), named.

The strategy makes one :class:`StepContext` per step (its ``_context``, for any of its four step hooks), holding the
step's :class:`StepCall`: the hook, the batch, its arguments and how the step runs, set once and never changed (a
frozen dataclass). Each stage returns its results; the hub (the strategy's ``_through_stages``) alone writes them into
the context, so the next stage reads them by name, not by tuple position. ``docs/architecture.md`` draws the path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import nn

from lightning_sparse_dp.loss.step import StepTerms
from lightning_sparse_dp.runtime.timing import StepTimer
from lightning_sparse_dp.split import SplitPlan
from lightning_sparse_dp.step.check import DeferredCheck
from lightning_sparse_dp.syncbn.collective import ThreadGroup

if TYPE_CHECKING:
    from lightning_sparse_dp.replica.install import ReplicaState


@dataclass(frozen=True, eq=False)
class StepCall:
    """What one ``sparse_dp`` step is given, set when it starts (read-only: ``FrozenInstanceError`` on assignment).

    Attributes:
        name: the step hook, ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
        batch: the batch the hook was given, what Lightning's loop and hooks saw (the collated batch, or a
            :class:`~lightning_sparse_dp.split.presplit.PreSplitBatch` that kept none).
        source: what ``scatter`` splits (:class:`~lightning_sparse_dp.step.prepare.PreparedBatch`'s ``source``: the
            batch, a PreSplitBatch, or chunks placed where Lightning moves a batch).
        module: the LightningModule (the root device's, which replica 0 is unless one chunk runs the module itself).
        args: the hook's arguments after the batch (``batch_idx``, ``dataloader_idx``); ``kwargs``: its keywords.
        manual: a training step under manual optimization (its chunks are made and its weights known before it).
        in_threads: each replica prepares in its own thread (``prepare_in_threads``, not for manual steps): it cuts and
            places its chunk (``scatter``) and refreshes itself (``replicate``).
        timer: the strategy's clock of the stages (:class:`~lightning_sparse_dp.runtime.timing.StepTimer`).
        warnings: the strategy's one-time warnings and infos (Lightning's ``WarningCache``).
        parallel_devices: the strategy's devices, one per replica, root device first, read once when the step starts
            (the hub's stages read them here, not from the strategy's property); empty for a context made outside the
            hub (``parallel_apply`` without a step).
        logged: the strategy's reading of logged names across steps (:class:`~lightning_sparse_dp.step.log.LogMemory`),
            ``None`` outside the hub.
    """

    name: str
    batch: Any
    source: Any
    module: nn.Module
    args: tuple
    kwargs: dict
    manual: bool
    in_threads: bool
    timer: StepTimer
    warnings: WarningCache
    parallel_devices: tuple[torch.device, ...] = ()
    logged: Any = None


def dataloader_index(args: tuple, kwargs: dict) -> int:
    """The ``dataloader_idx`` of a step hook's call (``validation_step(batch, batch_idx, dataloader_idx)``, positional
    or by keyword), 0 when it has none (one dataloader)."""
    return int(args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0))


@dataclass(eq=False)
class StepContext:
    """One ``sparse_dp`` step: its :class:`StepCall` and, in the order the hub writes them, its stages' results.

    Attributes:
        call: what the step was given (:class:`StepCall`).
        devices: the step's devices, device ``i`` for chunk ``i`` (set once the chunks are known).
        inputs: the chunks from ``scatter`` (placed, or a :class:`~lightning_sparse_dp.step.scatter.PendingChunk` each);
            ``plan``: its :class:`~lightning_sparse_dp.split.SplitPlan`.
        replicas: the modules from ``replicate``, replica ``i`` for ``inputs[i]``.
        check: the deferred check of replicas built in an earlier step
            (:class:`~lightning_sparse_dp.step.check.DeferredCheck`), left by ``replicate``; ``parallel_apply`` runs it
            on the calling thread once the replicas started.
        refresh_in_threads: whether ``replicate`` left each replica's refresh to the replica's thread.
        group: the step's batch-norm group (``None`` without synchronized layers and outside manual steps).
        replica_state: the replicas' per-step state (:class:`~lightning_sparse_dp.replica.install.ReplicaState`: recorders,
            what the step set on the module), from :func:`~lightning_sparse_dp.step.state.install_step`.
        terms: the capture of the replicas' mean-reduced losses (``loss_weighting="terms"``), else ``None``.
        before: each replica's preparation in its own thread (``None``: done on the calling thread).
        outputs: the replicas' outputs from ``parallel_apply``, replica order.
        losses: each replica's loss, and ``weights`` its weight in the whole batch's
            (:func:`~lightning_sparse_dp.step.weigh.weigh`).
    """

    call: StepCall
    devices: list[torch.device] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)
    plan: SplitPlan | None = None
    replicas: list[nn.Module] = field(default_factory=list)
    check: DeferredCheck | None = None
    refresh_in_threads: bool = False
    group: ThreadGroup | None = None
    replica_state: ReplicaState | None = None
    terms: StepTerms | None = None
    before: list[Callable[[], Any]] | None = None
    outputs: list[Any] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    weights: list[float] | None = None


__all__ = ["StepCall", "StepContext", "dataloader_index"]
