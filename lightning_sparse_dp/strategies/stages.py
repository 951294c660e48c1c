"""The ``sparse_dp`` strategy's four public stages, methods to override as ``torch.nn.DataParallel``'s are.

:meth:`ReplicaStages.scatter` (split and place), :meth:`ReplicaStages.replicate`, :meth:`ReplicaStages.parallel_apply`
and :meth:`ReplicaStages.gather`, each timed as Lightning profiler action ``[sparse_dp]<stage>``; the hub
(:class:`~lightning_sparse_dp.strategies.sparse_dp.SparseDataParallelStrategy`) calls them in the order
``docs/architecture.md`` draws. A mixin of the strategy: it reads the strategy's options and state (devices, timer,
replicas, warnings, the split's held layouts) and keeps nothing of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.replica.effects import StepEffects
from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.split import SplitPlan, balanced_assignment
from lightning_sparse_dp.step.apply import replica_steps
from lightning_sparse_dp.step.check import DeferredCheck
from lightning_sparse_dp.step.context import StepCall, StepContext
from lightning_sparse_dp.step.errors import explain_replica_error
from lightning_sparse_dp.step.gather import gather_outputs
from lightning_sparse_dp.step.prepare import PlacedChunks
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.step.scatter import pending_chunks, place_chunks, say_idle, step_cutters
from lightning_sparse_dp.strategies.checks import min_points_per_chunk, warn_unsynchronized_batchnorm
from lightning_sparse_dp.syncbn.layer_sync import apply_layer_sync
from lightning_sparse_dp.syncbn.replicas import sync_layers


class ReplicaStages:
    """``scatter`` -> ``replicate`` -> ``parallel_apply`` -> ``gather`` of the ``sparse_dp`` strategy, and the split's
    options they share (a mixin: ``self`` is the strategy).

    One signature: each stage takes its data first (the batch; the module and devices; the replicas and their chunks;
    the replicas' outputs) and the step's :class:`~lightning_sparse_dp.step.context.StepContext` last, as ``step``, and
    returns its results without writing any of ``step`` (the hub does). ``scatter``, ``replicate`` and
    ``parallel_apply`` also run without a step (``step=None``: on the calling thread; ``parallel_apply`` then names the
    hook); ``gather`` reads the step's plan and weights, so it needs one.
    """

    def scatter(self, batch: Any, step: StepContext | None = None) -> tuple[list[Any], SplitPlan]:
        """Split ``batch`` into chunks of whole samples, chunk ``i`` for ``parallel_devices[i]``.

        The split is ``split_fn``, the DataLoader workers' (:class:`~lightning_sparse_dp.split.presplit.PreSplitBatch`)
        or :func:`~lightning_sparse_dp.split.split_batch`; at most one chunk per device (fewer when the batch has fewer
        samples, said once). Placing builds each chunk's SparseTensor / TensorField on its device and moves the rest
        there (:func:`~lightning_sparse_dp.step.scatter.place_chunks`); chunks placed already, where the module's own
        batch-transfer hooks ran on them (:class:`~lightning_sparse_dp.step.prepare.PlacedChunks`), are taken as they
        are. Given a
        ``step`` that prepares in threads (``step.call.in_threads``), chunk ``i`` is cut and placed in replica ``i``'s thread
        instead: it is a :class:`~lightning_sparse_dp.step.scatter.PendingChunk` until then.

        Returns:
            ``(inputs, plan)``: the chunks, chunk ``i`` for device ``i``, and the split's plan.

        Raises:
            ValueError: a PreSplitBatch with more chunks than devices.
            BatchLayoutError: a batch the split cannot read (see :func:`~lightning_sparse_dp.split.split_batch`).
        """
        devices = self.parallel_devices or ()
        if isinstance(batch, PlacedChunks):  # split and placed where Lightning moves a batch (the transfer hooks ran)
            inputs, plan = batch.chunks, batch.plan
        else:
            with self._timer.stage("split"):
                cutters, plan = step_cutters(batch, len(devices), self.split_fn, **self._split_options())
            if step is not None and step.call.in_threads:
                inputs = pending_chunks(cutters, devices, self._timer)
            else:
                with self._timer.stage("place"):
                    inputs = place_chunks([cut_chunk() for cut_chunk in cutters], devices)
        if not self._said_idle and plan.num_chunks < len(devices):  # replicas idle in this step: said once
            say_idle(plan, len(devices), self._warning_cache)
            self._said_idle = True
        return inputs, plan

    def replicate(self, module: nn.Module, devices: Sequence[torch.device], step: StepContext | None = None) -> list[nn.Module]:
        """The replicas of ``module`` for ``devices`` (replica ``i`` on ``devices[i]``), refreshed for this step.

        One chunk on the root device runs ``module`` itself. Otherwise the persistent
        :class:`~lightning_sparse_dp.step.replicate.Replicas` are refreshed, or rebuilt when the module's structure,
        parameters or devices changed. Given a ``step`` that prepares in threads (``step.call.in_threads``), each replica's
        refresh is left to its own thread (here only the tensors, on CPU not the buffers), and replicas built in an
        earlier step are checked by a :class:`~lightning_sparse_dp.step.check.DeferredCheck` (run by
        :meth:`parallel_apply`) while the threads cut: both noted in ``self._refresh`` (``(check, refresh_in_threads)``),
        which the hub puts in the step's context. Writes nothing of ``step``.
        """
        self._refresh = (None, False)
        with self._timer.stage("replicate"):
            if list(devices) == [self.root_device]:
                return [module]
            built, in_threads = self._replicas, step is not None and step.call.in_threads
            if in_threads and built is not None and len(devices) > 1 and built.serve(module, devices):
                self._refresh = (DeferredCheck(built, len(devices), buffers=not built.buffers_in_threads), True)
            else:
                if built is None or not built.matches(module, devices):
                    assert self.parallel_devices is not None
                    if built is not None:  # frozen parameters a step changed in place: the new replicas own copies
                        self._frozen_written |= built.frozen_written | built.own_frozen
                    self._new_batch_norm(module)
                    built = self._replicas = Replicas(module, self.parallel_devices, own_frozen=self._frozen_written)
                    self._replica_sync_layers = [sync_layers(r) for r in built.modules]
                if not in_threads:
                    return built.refresh(len(devices))
                built.refresh_tensors(len(devices), buffers=not built.buffers_in_threads)
                self._refresh = (None, True)
            return built.modules[: len(devices)]

    def _new_batch_norm(self, module: nn.Module) -> None:
        """Before the replicas are built (again: the module changed since they were, a layer added in a hook of the
        fit): while fitting, batch norm the module got since setup is synchronized as setup's was (``sync_batchnorm``:
        :func:`~lightning_sparse_dp.syncbn.layer_sync.apply_layer_sync`, which swaps only the new layers), or said to
        normalize each chunk with its own statistics (without it), as setup says of the layers it finds."""
        trainer = trainer_of(module)
        if self._checking or trainer is None or trainer.state.fn != TrainerFn.FITTING:  # not the check's copies
            return
        seen = self._batch_norm_seen
        new = [m for m in module.modules() if isinstance(m, _BatchNorm) and id(m) not in seen]
        if not new:
            return
        seen.update(id(m) for m in new)
        if self._layer_sync is not None:
            apply_layer_sync(self)
        else:
            warn_unsynchronized_batchnorm(nn.ModuleList(new), len(self.parallel_devices or ()))

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], step: StepContext | None = None, *,
        hook: str | None = None, args: tuple = (), kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``replicas[i].<step hook>(inputs[i], ...)`` for every ``i`` at once, one thread each.

        Args:
            replicas: from :meth:`replicate`.
            inputs: from :meth:`scatter`, one chunk per replica (a
                :class:`~lightning_sparse_dp.step.scatter.PendingChunk` is made in its replica's thread first).
            step: the hub's :class:`~lightning_sparse_dp.step.context.StepContext`: its hook and arguments, what each
                replica's step runs under (``group``, ``terms``, each replica's ``before`` in its thread;
                :func:`~lightning_sparse_dp.step.apply.replica_steps`) and ``step.check``, run on this thread once the
                replicas started (a subclass's own ``parallel_apply`` that does not call this one runs it so). ``None``
                for a call outside a step: the replicas' ``hook`` with nothing installed.
            hook, args, kwargs: without ``step``, the step hook's name (``"training_step"``...) and its other arguments
                (``batch_idx``, ``dataloader_idx``).

        Returns:
            the replicas' outputs, replica order.

        Raises:
            RuntimeError: a strategy that has no devices yet (not given to a Trainer).
            TypeError: neither a ``step`` nor a ``hook``.
            Exception: the first failing replica's error, with a note naming the replica and device.
        """
        if self.parallel_devices is None:
            raise RuntimeError(
                "sparse_dp: a step ran on a strategy with no devices yet; run it through a Trainer (fit / validate / "
                "test / predict), which gives the strategy its devices."
            )
        if step is None:
            if not isinstance(hook, str):
                raise TypeError(
                    "sparse_dp: parallel_apply(replicas, inputs, step) runs the step's StepContext; outside a step, "
                    "name the step hook: parallel_apply(replicas, inputs, hook='training_step', args=(batch_idx,))."
                )
            step = StepContext(StepCall(name=hook, batch=None, source=None, module=replicas[0], args=tuple(args),
                                        kwargs=dict(kwargs or {}), manual=False, in_threads=False, timer=self._timer,
                                        warnings=self._warning_cache))
        executor = self._replica_threads()
        devices = self.parallel_devices[: len(replicas)]
        call = step.call
        effects = StepEffects(call.name, len(replicas), run_none=self._checking) if len(replicas) > 1 else None
        if effects is not None and self._replicas is not None:  # self.trainer.optimizers: the replicas' views
            effects.rank_optimizers = self._replicas.rank_optimizers
        steps = replica_steps(replicas, inputs, call.name, call.args, call.kwargs, step.terms, step.group, self._timer,
                              step.before, effects)
        meanwhile = None if step.check is None else self._timer.timed("check", step.check.run)  # stage check
        with self._timer.stage("apply"):
            try:
                outputs = executor.run(steps, devices, meanwhile=meanwhile)
            except Exception as err:
                raise err if step.plan is None else explain_replica_error(err, step.plan)
        if effects is not None and not self._checking:  # loggers' calls (the check's copies make none)
            effects.say(self._warning_cache)
        return outputs

    def gather(self, outputs: Sequence[Any], step: StepContext) -> Any:
        """The replicas' outputs as one output on the root device (:func:`~lightning_sparse_dp.step.gather.gather_outputs`).

        The loss is ``sum_i step.weights[i] * loss_i`` (:func:`~lightning_sparse_dp.loss.weights.step_weights`: the whole
        batch's mean for the loss weighting); other outputs are merged back in batch order (``step.plan``) by
        ``output_layout`` or their lengths.

        Raises:
            ValueError: a ``step`` without its plan or weights (a context no hub filled in).
        """
        if step.plan is None or step.weights is None:
            raise ValueError(
                "sparse_dp: gather(outputs, step) merges by the step's split plan and weights; give it the step's "
                "context after scatter and weigh filled them in."
            )
        with self._timer.stage("gather"):
            value_of = None if step.terms is None else step.terms.output_value
            with_loss = step.terms is None or step.terms.with_loss  # a predict step's 0-dim output is no loss
            return gather_outputs(outputs, step.plan, step.weights, self.root_device, self.output_layout,
                                  self._warning_cache, value_of=value_of, exact_loss=with_loss, inputs=step.inputs,
                                  layout=self.layout)

    def _in_threads(self) -> bool:  # prepare_in_threads: None is True
        return self.prepare_in_threads is not False

    def _split_options(self) -> dict[str, Any]:
        """The split's ``layout``, ``assignment`` (``split``; per core first when pinned), ``min_points_per_chunk``, the
        loaders' ``batch_sizes`` and the strategy's held layouts (``layouts``: the decisions about a batch's structure,
        made once and reused while they hold, :mod:`~lightning_sparse_dp.split.held`; a held layout is checked against
        every batch)."""
        pinned = self._core_groups is not None and self.split == "balanced"
        assignment = partial(balanced_assignment, groups=self._core_groups) if pinned else self.split
        module, synchronized, built = self.lightning_module, self._layer_sync is not None, self._replicas
        if module is None or synchronized:
            min_points = 1
        elif built is not None and built.root is module:  # no walk per step: the replicas noted it when built
            min_points = 2 if built.batch_norm else 1
        else:
            min_points = min_points_per_chunk(module, synchronized)
        return {"layout": self.layout, "assignment": assignment, "min_points": min_points,
                "batch_sizes": self._loader_batch_sizes, "layouts": self._held_layouts}


__all__ = ["ReplicaStages"]
