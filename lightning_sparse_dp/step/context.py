"""The step's context: what one ``sparse_dp`` step carries from stage to stage, named.

The strategy makes one :class:`StepContext` per step (its ``_context``, for any of its four step hooks); each stage
reads what the stages before it filled in and fills in its own part, so the hub passes one object instead of a dozen
parameters and a stage's results have names, not tuple positions. The fields are listed about in the order the stages
fill them (``devices`` once the chunks are known; ``docs/architecture.md`` draws the path).
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


@dataclass(eq=False)
class StepContext:
    """One ``sparse_dp`` step, from the batch to the gathered output.

    The hub sets the fields up to ``warnings`` when the step starts; the stages fill in the rest, in this order.

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
        devices: the step's devices, device ``i`` for chunk ``i`` (set once the chunks are known).
        inputs: the chunks from ``scatter`` (placed, or a :class:`~lightning_sparse_dp.step.scatter.PendingChunk` each);
            ``plan``: its :class:`~lightning_sparse_dp.split.SplitPlan`.
        replicas: the modules from ``replicate``, replica ``i`` for ``inputs[i]``.
        check: the deferred check of replicas built in an earlier step
            (:class:`~lightning_sparse_dp.step.check.DeferredCheck`), set by ``replicate``; ``parallel_apply`` runs it
            on the calling thread once the replicas started.
        refresh_in_threads: set by ``replicate`` when it left each replica's refresh to the replica's thread.
        group: the step's batch-norm group (``None`` without synchronized layers and outside manual steps).
        replica_state: the replicas' per-step state (:class:`~lightning_sparse_dp.replica.install.ReplicaState`: recorders,
            what the step set on the module), from :func:`~lightning_sparse_dp.step.state.install_step`.
        terms: the capture of the replicas' mean-reduced losses (``loss_weighting="terms"``), else ``None``.
        before: each replica's preparation in its own thread, and ``after`` its wrap-up (``None``: done on the calling
            thread).
        outputs: the replicas' outputs from ``parallel_apply``, replica order.
        losses: each replica's loss, and ``weights`` its weight in the whole batch's
            (:func:`~lightning_sparse_dp.step.weigh.weigh`).
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
    after: list[Callable[[], Any]] | None = None
    outputs: list[Any] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    weights: list[float] | None = None


__all__ = ["StepContext"]
