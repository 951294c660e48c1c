"""The exactness check in ``sparse_dp``: its two runs of the first training step, given the strategy's own stages.

:class:`~lightning_sparse_dp.exactness.check.ExactnessCheck` compares; this file gives it the two runs on
``sparse_dp``: the module's own step on the root device over the whole batch
(:func:`~lightning_sparse_dp.exactness.check.one_device_step`), and the strategy's stages over the same batch on a
float64 copy, with the strategy's per-run state (its replicas, their batch-norm layers and metric copies, the loss
call sites it has read, its stage clock) swapped for fresh ones while the check runs (:func:`apart`), so that the
training that follows starts as it would have without the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_sparse_dp.exactness.check import backward, one_device_step
from lightning_sparse_dp.exactness.probe import float64_batch
from lightning_sparse_dp.loss.decide import SiteMemory
from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.replica.metrics import ReplicaMetrics
from lightning_sparse_dp.runtime.timing import StepTimer
from lightning_sparse_dp.split import SparseSpec
from lightning_sparse_dp.split.presplit import PreSplitBatch
from lightning_sparse_dp.step.context import StepContext
from lightning_sparse_dp.step.one_device import whole_batch_on
from lightning_sparse_dp.step.replicate import has_batch_norm
from lightning_sparse_dp.step.scatter import batch_transfer, build_sparse

if TYPE_CHECKING:
    from torch import nn

    from lightning_sparse_dp.strategies.sparse_dp import SparseDataParallelStrategy

#: the strategy's attributes that hold per-run state of its steps, swapped for fresh values while the check runs
_PER_RUN = ("_replicas", "_replica_sync_layers", "_replica_metrics", "_site_memory", "_said_idle", "_timer")


@contextmanager
def apart(strategy: SparseDataParallelStrategy) -> Iterator[None]:
    """The strategy's per-run state of its steps fresh inside the block (the check's copy gets replicas of its own, no
    stage times are recorded, no call site is remembered, loggers' calls run in no replica), its own back after it."""
    kept = {name: getattr(strategy, name) for name in _PER_RUN}
    fresh = {"_replicas": None, "_replica_sync_layers": [], "_replica_metrics": ReplicaMetrics(),
             "_site_memory": SiteMemory(), "_said_idle": True, "_timer": StepTimer(None, prefix="[sparse_dp check]")}
    for name, value in fresh.items():
        setattr(strategy, name, value)
    strategy._checking = True
    try:
        yield
    finally:
        strategy._checking = False
        for name, value in kept.items():
            setattr(strategy, name, value)


def check_training_step(strategy: SparseDataParallelStrategy, args: tuple, kwargs: dict) -> None:
    """Run the strategy's exactness check before this training step when it is due (several replicas, automatic
    optimization; :meth:`~lightning_sparse_dp.exactness.check.ExactnessCheck.due`); say once why a step is not
    checked otherwise."""
    module, check, devices = strategy.lightning_module, strategy._exactness, strategy.parallel_devices or []
    trainer = getattr(module, "_trainer", None)
    if check.mode is None or module is None or trainer is None or len(devices) < 2 or not args:
        return
    if not check.due(trainer.global_step):
        return
    if not module.automatic_optimization:
        strategy._warning_cache.info(
            "sparse_dp: exactness check: not run, because the module optimizes manually (its step calls the "
            "optimizers itself, which the check's copies must not reach). Training goes on unchecked."
        )
        return
    batch, root = args[0], strategy.root_device
    whole = batch.batch if isinstance(batch, PreSplitBatch) else batch
    if whole is None:
        strategy._warning_cache.info(
            "sparse_dp: exactness check: not run, because the batch was split without keeping the whole batch "
            "(a PreSplitBatch without .batch). Training goes on unchecked."
        )
        return
    dataloader_idx = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)

    def on_one_device(twin: nn.Module) -> tuple[Any, dict[str, Any], None]:
        probe = apply_to_collection(float64_batch(whole), SparseSpec, lambda s: build_sparse(s, root))
        probe = whole_batch_on(probe, root, batch_transfer(twin, dataloader_idx))
        return one_device_step(twin, probe, args[1:], kwargs)

    samples: list[int] = []

    def on_replicas(twin: nn.Module) -> tuple[Any, dict[str, Any], str | None]:
        with apart(strategy):
            step, _ = strategy._context("training_step", (float64_batch(batch), *args[1:]), kwargs, twin)
            assert step is not None  # several devices: the stages run
            output, calls = strategy._through_stages(step)
        samples.append(step.plan.num_samples if step.plan is not None else 0)
        loss = loss_of(output)
        backward(twin, loss)
        logged = {call.name: call.value for call in calls}
        return loss, logged, loss_reading(step, strategy.loss_weighting)

    synchronized = strategy._layer_sync is not None
    check.run(module, trainer, on_one_device, on_replicas, len(devices), lambda: samples[-1] if samples else "batch's",
              batch_norm_eval=not synchronized and has_batch_norm(module.modules()), warnings=strategy._warning_cache)


def loss_reading(step: StepContext, loss_weighting: Any) -> str:
    """How the strategy weighted the step's loss over its replicas, for a user."""
    weights = ", ".join(f"{w:.3g}" for w in step.weights or [])
    decision = step.terms.decision if step.terms is not None else None
    if decision is not None and decision.value is not None:
        terms = len(decision.scales[0]) if decision.scales else 0
        return (f"The strategy read the loss as {terms} mean-reduced loss call(s) per replica, each weighted by its own "
                f"share of the batch (loss_weighting='terms'; replica weights {weights})")
    if decision is not None:
        return (f"The strategy could not read the loss as a combination of mean-reduced loss calls ({decision.reason}) "
                f"and weighted each replica's loss by its share of the batch (weights {weights})")
    return f"The strategy weighted each replica's loss by loss_weighting={loss_weighting!r} (weights {weights})"


__all__ = ["apart", "check_training_step", "loss_reading"]
