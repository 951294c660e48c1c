"""The exactness check in both strategies: its two runs of the first training step, given each strategy's own step.

:class:`~lightning_sparse_dp.exactness.check.ExactnessCheck` compares; this file gives it the two runs.

- ``sparse_dp`` (:func:`check_training_step`): the module's own step on the root device over the whole batch
  (:func:`~lightning_sparse_dp.exactness.check.one_device_step`), and the strategy's stages over the same batch on a
  float64 copy, with the strategy's per-run state (its replicas, their batch-norm layers and metric copies, the loss
  call sites it has read, its stage clock) swapped for fresh ones while the check runs (:func:`apart`), so that the
  training that follows starts as it would have without the check.
- ``sparse_ddp`` (:func:`check_rank_step`): the probe is rank 0's batch, sent to every rank; every rank runs one
  device's step over all of it, and its own share of it (the probe split as ``sparse_dp`` splits a batch) through the
  strategy's loss weighting, the gradients then averaged over the ranks as DDP averages them
  (``torch.distributed.all_reduce``). Every rank reaches the same outcome; rank 0 says it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.exactness.check import OUTPUT_KEY, backward, one_device_step, quiet_step
from lightning_sparse_dp.exactness.probe import float64_batch
from lightning_sparse_dp.loss.memory import SiteMemory
from lightning_sparse_dp.loss.reweight import scaled
from lightning_sparse_dp.loss.step import FALLBACK_START
from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.replica.metrics import ReplicaMetrics
from lightning_sparse_dp.replica.recorder import no_print
from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.runtime.timing import StepTimer
from lightning_sparse_dp.split import SparseSpec, split_batch
from lightning_sparse_dp.split.presplit import PreSplitBatch, as_specs
from lightning_sparse_dp.step.context import StepContext, dataloader_index
from lightning_sparse_dp.step.prepare import lightning_transfer
from lightning_sparse_dp.step.scatter import build_sparse
from lightning_sparse_dp.syncbn.layer_sync import has_batch_norm

if TYPE_CHECKING:
    from torch import nn

    from lightning_sparse_dp.strategies.sparse_ddp import SparseDDPStrategy
    from lightning_sparse_dp.strategies.sparse_dp import SparseDataParallelStrategy

#: the strategy's attributes that hold per-run state of its steps, swapped for fresh values while the check runs
_PER_RUN = ("_replicas", "_replica_sync_layers", "_replica_metrics", "_site_memory", "_eval_site_memory", "_said_idle",
            "_timer", "_warning_cache")


class _Unsaid(WarningCache):
    """What the check's run of the stages would say, kept unsaid: the step that follows says it, once."""

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        self.add(message)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        self.add(message)


@contextmanager
def apart(strategy: SparseDataParallelStrategy) -> Iterator[None]:
    """The strategy's per-run state of its steps fresh inside the block (the check's copy gets replicas of its own, no
    stage times are recorded, no call site is remembered, loggers' calls run in no replica, what the stages would say
    is left for the step itself to say), its own back after it."""
    kept = {name: getattr(strategy, name) for name in _PER_RUN}
    fresh = {"_replicas": None, "_replica_sync_layers": [], "_replica_metrics": ReplicaMetrics(),
             "_site_memory": SiteMemory(), "_eval_site_memory": SiteMemory(), "_said_idle": True,
             "_timer": StepTimer(None, prefix="[sparse_dp check]"),
             "_warning_cache": _Unsaid()}
    for name, value in fresh.items():
        setattr(strategy, name, value)
    strategy._checking = True
    try:
        yield
    finally:
        strategy._checking = False
        for name, value in kept.items():
            setattr(strategy, name, value)


def _due(owner: Any, count: int, args: tuple, again: bool = False) -> Any:
    """The trainer when the strategy's exactness check runs before this training step (``count`` replicas or ranks,
    two or more; automatic optimization; :meth:`~lightning_sparse_dp.exactness.check.ExactnessCheck.due`; ``again``:
    after it, for a step that called a loss call site no checked step called), else ``None``; a manual step is said
    once not to be checked."""
    module, check = owner.lightning_module, owner._exactness
    trainer = trainer_of(module)
    if check.mode is None or module is None or trainer is None or count < 2 or not args:
        return None
    if again:
        check.again(trainer.global_step)
    elif not check.due(trainer.global_step):
        return None
    if not module.automatic_optimization:
        strategy = owner.strategy_name
        owner._warning_cache.info(
            f"{strategy}: exactness check: not run, because the module optimizes manually (its step calls the "
            "optimizers itself, which the check's copies must not reach). Training goes on unchecked."
        )
        return None
    return trainer


def check_training_step(strategy: SparseDataParallelStrategy, args: tuple, kwargs: dict, again: bool = False) -> bool:
    """Run the strategy's exactness check before this training step when it is due (several replicas, automatic
    optimization; :meth:`~lightning_sparse_dp.exactness.check.ExactnessCheck.due`); say once why a step is not
    checked otherwise. ``again``: run it now, after the step's forward (the module's parameters as the step found
    them; what its forward updated, running statistics or a metric's state, the start of both runs), for a step that
    called a loss call site no checked step called. Returns whether it ran."""
    module, check, devices = strategy.lightning_module, strategy._exactness, strategy.parallel_devices or []
    trainer = _due(strategy, len(devices), args, again)
    if trainer is None:
        return False
    batch, root = args[0], strategy.root_device
    whole = batch.batch if isinstance(batch, PreSplitBatch) else batch
    if whole is None:
        strategy._warning_cache.info(
            "sparse_dp: exactness check: not run, because the batch was split without keeping the whole batch "
            "(a PreSplitBatch without .batch). Training goes on unchecked."
        )
        return False

    def on_one_device(twin: nn.Module) -> tuple[Any, dict[str, Any], None]:
        return one_device_step(twin, _whole_probe(twin, whole, root, args, kwargs), args[1:], kwargs)

    samples: list[int] = []

    def on_replicas(twin: nn.Module) -> tuple[Any, dict[str, Any], str | None]:
        strategy._frozen_written |= check.frozen_written  # changed in place by the step: each replica owns a copy
        step, output, logged = _stages_on(strategy, twin, "training_step", args, kwargs, samples)
        loss = loss_of(output)
        backward(twin, loss)
        return loss, logged, loss_reading(step, strategy.loss_weighting)

    synchronized = strategy._layer_sync is not None
    check.run(module, trainer, on_one_device, on_replicas, len(devices), lambda: samples[-1] if samples else "batch's",
              batch_norm_eval=not synchronized and has_batch_norm(module.modules()), warnings=strategy._warning_cache)
    return True


def _whole_probe(twin: nn.Module, whole: Any, root: torch.device, args: tuple, kwargs: dict) -> Any:
    """The whole batch as one device's step on ``twin`` gets it: float64, its ME tensors built on ``root``, then the
    module's own transfer hooks (which move the rest)."""
    probe = apply_to_collection(float64_batch(whole), SparseSpec, lambda s: build_sparse(s, root))
    return lightning_transfer(twin, dataloader_index(args, kwargs))(probe, root)


def _stages_on(
    strategy: SparseDataParallelStrategy, twin: nn.Module, name: str, args: tuple, kwargs: dict, samples: list[int],
) -> tuple[StepContext, Any, dict[str, Any]]:
    """The strategy's stages for hook ``name`` on the check's copy ``twin`` over the step's batch in float64, apart
    from the run's own state (:func:`apart`; every replica's copy prints nothing): the step's context, its gathered
    output and ``name -> value`` of what it logged; the batch's samples appended to ``samples``."""
    twin.print = no_print
    with apart(strategy):
        step, _ = strategy._context(name, (float64_batch(args[0]), *args[1:]), kwargs, twin)
        assert step is not None  # several devices: the stages run
        output, calls = strategy._through_stages(step)
    samples.append(step.plan.num_samples if step.plan is not None else 0)
    return step, output, {call.name: call.value for call in calls}


def check_eval_step(strategy: SparseDataParallelStrategy, name: str, args: tuple, kwargs: dict) -> None:
    """Run the strategy's exactness check on the first step of the evaluation hook ``name`` (``"validation_step"``,
    ``"test_step"``, ``"predict_step"``) in a run, with several replicas: the module's own step on one device over the
    whole batch and the strategy's stages over the same batch, each on a float64 copy, no backward; what they logged,
    their metrics' states and the tensors they returned compared
    (:meth:`~lightning_sparse_dp.exactness.check.ExactnessCheck.run`). A value that couples the batch's samples (a
    similarity between samples, a nearest neighbour in the batch) is each chunk's on the replicas, which only such a
    measurement sees."""
    module, check, devices = strategy.lightning_module, strategy._exactness, strategy.parallel_devices or []
    trainer = trainer_of(module)
    dataloader_idx = dataloader_index(args, kwargs)
    if module is None or trainer is None or len(devices) < 2 or not args or not check.eval_due(name, dataloader_idx):
        return
    batch, root = args[0], strategy.root_device
    whole = batch.batch if isinstance(batch, PreSplitBatch) else batch
    if whole is None:
        return  # said at the training step's check; an evaluation without a whole batch has nothing to compare
    samples: list[int] = []

    def on_one_device(twin: nn.Module) -> tuple[Any, dict[str, Any], None]:
        probe = _whole_probe(twin, whole, root, args, kwargs)
        output, logged = quiet_step(twin, lambda: getattr(twin, name)(probe, *args[1:], **kwargs))
        return None, {**logged, OUTPUT_KEY: output}, None

    def on_replicas(twin: nn.Module) -> tuple[Any, dict[str, Any], None]:
        _, output, logged = _stages_on(strategy, twin, name, args, kwargs, samples)
        return None, {**logged, OUTPUT_KEY: output}, None

    # the copies made outside Lightning's inference mode (the replicas' parameters are built from them), without grad
    with torch.inference_mode(False), torch.no_grad():
        check.run(module, trainer, on_one_device, on_replicas, len(devices),
                  lambda: samples[-1] if samples else "batch's", batch_norm_eval=False, warnings=strategy._warning_cache,
                  evaluation=(name, args[1] if len(args) > 1 else 0, dataloader_idx))


def check_rank_step(strategy: SparseDDPStrategy, args: tuple, kwargs: dict, again: bool = False) -> bool:
    """Run ``sparse_ddp``'s exactness check before this training step when it is due (every rank at once: the
    decision reads ``global_step`` only); say once, on rank 0, why a step is not checked otherwise. ``again``: run it
    now, after the step's forward, for a step that called a loss call site no checked step called (every rank at once:
    the sites are decided from every rank's summaries). Returns whether it ran."""
    module, check, world = strategy.lightning_module, strategy._exactness, strategy.world_size
    trainer = _due(strategy, world if dist.is_initialized() else 1, args, again)
    if trainer is None:
        return False
    root = strategy.root_device
    sent = [move_data_to_device(as_specs(args[0]), "cpu") if strategy.global_rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)  # rank 0's batch: the probe, the same on every rank
    probe = sent[0]
    chunks, plan = split_batch(probe, world, layout=strategy.layout)
    if len(chunks) < world:
        strategy._warning_cache.info(
            f"sparse_ddp: exactness check of training step {trainer.global_step}: not run, because rank 0's batch has "
            f"fewer samples ({plan.num_samples}) than there are ranks ({world}). Training goes on unchecked."
        )
        return False

    def on_device(batch: Any) -> Any:
        built = apply_to_collection(float64_batch(batch), SparseSpec, lambda s: build_sparse(s, root))
        return move_data_to_device(built, root)

    def on_one_device(twin: nn.Module) -> tuple[Any, dict[str, Any], None]:
        return one_device_step(twin, on_device(probe), args[1:], kwargs)

    def on_ranks(twin: nn.Module) -> tuple[Any, dict[str, Any], str | None]:
        mine = on_device(chunks[strategy.global_rank])
        kept = strategy._loss_scale, strategy._site_memory, strategy._warning_cache
        unsaid = _Unsaid()
        strategy._site_memory, strategy._warning_cache = SiteMemory(), unsaid
        try:  # the rank's step under the strategy's weighting, on the copy: its logs recorded (not compared here)
            run = partial(agreed, partial(twin.training_step, mine, *args[1:], **kwargs), world)
            output, _ = quiet_step(twin, partial(strategy._weighted, "training_step", (mine, *args[1:]), kwargs, run=run))
            scale = strategy._loss_scale
        finally:
            strategy._loss_scale, strategy._site_memory, strategy._warning_cache = kept
        loss = loss_of(output)
        backward(twin, None if loss is None else scaled(loss, scale))
        for p in twin.parameters():  # DDP's average of the ranks' gradients (a rank without one adds zeros)
            if p.requires_grad:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / world
        total = None
        if loss is not None:
            total = (loss.detach() * scale).reshape(1)
            dist.all_reduce(total)
            total = total[0] / world
        # why the weighting fell back on the probe's shares (a share with no labeled point), which the check's line
        # names: training's own shares may not fall back, and where one does, training says it
        fell_back = sorted(m.removeprefix("sparse_ddp: ").rstrip(".") for m in unsaid if FALLBACK_START in str(m))
        return total, {}, (f"The strategy weighted each rank's loss by its share of the global batch "
                           f"(loss_weighting={strategy.loss_weighting!r}; rank {strategy.global_rank}'s loss scale "
                           f"{scale:.4g}, on top of its loss terms' own shares)"
                           + (f"; on the probe's shares: {fell_back[0]}" if fell_back else ""))

    said = strategy._warning_cache if strategy.global_rank == 0 else WarningCache()  # rank 0 says it
    sync = strategy._layer_sync is not None
    check.run(module, trainer, on_one_device, on_ranks, world, lambda: plan.num_samples,
              batch_norm_eval=not sync and has_batch_norm(module.modules()), warnings=said)
    return True


def agreed(step: Callable[[], Any], world: int) -> Any:
    """``step()`` on this rank, its failure known to every rank before any goes on (one ``all_gather_object``): a step
    that raises on some ranks' shares of the probe only (a loss over no labeled point) must not leave the others
    waiting in the collectives that follow it (the weighting's gather, synchronized batch norm's backward) while the
    failed rank moves on. Every rank raises then, naming the first rank that failed and its error. A step that raises
    between two synchronized layers of its forward still leaves the others waiting there.

    Raises:
        RuntimeError: the step raised on some rank.
    """
    failure, output = None, None
    try:
        output = step()
    except Exception as err:  # noqa: BLE001  (agreed below, raised on every rank)
        failure = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    failures: list[str | None] = [None] * world
    dist.all_gather_object(failures, failure)
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]}'s step on its share of the probe raised {failed[0][1]}")
    return output


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


__all__ = ["agreed", "apart", "check_eval_step", "check_rank_step", "check_training_step", "loss_reading"]
