"""The ``sparse_dp`` strategy: one process, one replica per device; the hub of the step's stages (``lightning_sparse_dp/step/``).

Lightning's four step hooks run the hub, ``_step``, which calls each stage once, in the order ``docs/architecture.md``
draws; Lightning's plumbing for one process (world size 1, the replica threads from setup to teardown) is the base
class, :class:`~lightning_sparse_dp.strategies.single_process.SingleProcessParallelStrategy`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from operator import attrgetter
from typing import Any

import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_sparse_dp.exactness.check import eval_key
from lightning_sparse_dp.loss.weights import HeldWeighting
from lightning_sparse_dp.replica.metrics import ReplicaMetrics
from lightning_sparse_dp.replica.recorder import LogCall
from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.runtime.threads import check_pin, check_prepare_in_threads
from lightning_sparse_dp.runtime.timing import StageTimes, StepTimer
from lightning_sparse_dp.split import HeldLayouts, SplitPlan
from lightning_sparse_dp.split.presplit import presplit_loader
from lightning_sparse_dp.step.backward import backward_in_replicas, clear_replica_gradients
from lightning_sparse_dp.step.check import DeferredCheck, StaleReplicas
from lightning_sparse_dp.step.context import StepCall, StepContext, dataloader_index
from lightning_sparse_dp.step.log import emit, log_step
from lightning_sparse_dp.step.log_memory import LogMemory
from lightning_sparse_dp.step.prepare import PlacedChunks, PreparedBatch, prepare_batch, say_changed_after_cut
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.step.scatter import step_cutters
from lightning_sparse_dp.step.skipped import skipped_outputs
from lightning_sparse_dp.step.state import install_step, merge_into_module
from lightning_sparse_dp.step.weigh import exact_outputs, weigh
from lightning_sparse_dp.strategies.base import SparseStrategyMixin
from lightning_sparse_dp.strategies.checks import (
    refuse_compiled_submodules,
    refuse_dataloader_iter,
    refuse_old_gather,
    warn_eval_batchnorm,
    warn_unsynchronized_batchnorm,
)
from lightning_sparse_dp.strategies.exactness import check_eval_step, check_training_step
from lightning_sparse_dp.strategies.single_process import SingleProcessParallelStrategy
from lightning_sparse_dp.strategies.stages import ReplicaStages
from lightning_sparse_dp.syncbn.layer_sync import apply_layer_sync, eval_batch_statistics, revert_layer_sync

#: a parameter's ``requires_grad`` (read in C over a list of parameters)
_GRAD_FLAG = attrgetter("requires_grad")


class SparseDataParallelStrategy(SparseStrategyMixin, ReplicaStages, SingleProcessParallelStrategy):
    """Data parallelism in one process for MinkowskiEngine sparse batches, registered as ``"sparse_dp"``.

    Every step: the batch is split into chunks of whole samples (batch indices renumbered), each chunk
    is placed on its device (SparseTensor / TensorField built there), the LightningModule is
    replicated onto the devices in use, the step runs on every replica at once, and the outputs are
    gathered on the root device: the loss is ``sum_i w_i * loss_i``, exactly the whole-batch mean for
    the chosen weighting. ``self.log`` calls in replicas are reduced and logged once.

    The stages are methods to override, as ``torch.nn.DataParallel``'s are: :meth:`scatter` (split and place),
    :meth:`replicate`, :meth:`parallel_apply` and :meth:`gather`
    (:class:`~lightning_sparse_dp.strategies.stages.ReplicaStages`), each given the step's
    :class:`~lightning_sparse_dp.step.context.StepContext` and timed as Lightning profiler action ``[sparse_dp]<stage>``.

    Args:
        loss_weighting: what each replica's loss is weighted by: ``"terms"`` (default; every call of
            torch's mean-reduced losses by its own share ``D_ik / sum_j D_jk``, exact for any linear
            combination of them, :mod:`~lightning_sparse_dp.loss.decide`), ``"auto"``, ``"samples"``,
            ``"points"``, ``"equal"`` or a callable ``fn(chunk) -> number`` (e.g. ``lambda c: (c["labels"]
            != 255).sum()`` for ``ignore_index=255``): :func:`~lightning_sparse_dp.loss.weights.chunk_counts`.
        layout: roles for batch entries that cannot be told apart, passed to
            :func:`~lightning_sparse_dp.split.split_batch`, e.g. ``{"labels": "points"}``; a key that
            matches nothing in a batch is an error.
        output_layout: how step outputs are combined, by key: ``{"hist": "sum"}``, roles
            ``"samples"``, ``"points"``, ``"sum"``, ``"mean"``, ``"cat"``, ``"list"``
            (:func:`~lightning_sparse_dp.step.gather.gather_outputs`).
        split_fn: replaces :func:`~lightning_sparse_dp.split.split_batch` in :meth:`scatter`:
            ``split_fn(batch, num_chunks) -> (chunks, SplitPlan)``.
        split: how whole samples are assigned to replicas: ``"balanced"`` (default; even point
            counts, :func:`~lightning_sparse_dp.split.balanced_assignment`) or ``"contiguous"``
            (consecutive samples, sizes differing by at most one). Outputs come back in the original
            order either way.
        presplit: split batches in DataLoader worker processes
            (:class:`~lightning_sparse_dp.split.presplit.PreSplitCollate`) for loaders with ``num_workers > 0``,
            unless ``split_fn`` is given or the module overrides ``on_before_batch_transfer`` (which
            must see the whole batch).
        record_stage_times: record each step's stage durations in :attr:`stage_times`
            (:class:`~lightning_sparse_dp.runtime.timing.StageTimes`).
        pin_replicas: CPU replicas only: pin each replica's thread to cores and even the ``"balanced"``
            split's points per core (:func:`~lightning_sparse_dp.runtime.threads.plan_cores`). ``None`` (default):
            with ``sync_batchnorm`` and more replicas than cores; ``True``: always; ``False``: never;
            anything else raises ``ValueError``.
        sync_batchnorm: swap batch norm (torch's BatchNorm1d/2d/3d and SyncBatchNorm, so ME's batch-norm layers too)
            for :class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm`, synchronized across the replicas of each
            step, while fitting; reverted at teardown. Through Lightning's ``LayerSync`` plugin point
            (:class:`~lightning_sparse_dp.syncbn.layer_sync.SyncBatchNormSwap`), so ``Trainer(sync_batchnorm=True)`` too.
        replicas_per_device: replicas on each device (default 1): ``devices=1, replicas_per_device=3`` runs three
            replicas on one GPU, so that the multi-replica paths (replica threads and streams, the gather, the
            gradient reduction) run on a one-GPU machine; exact, no faster; with synchronized batch norm too (the
            replicas meet from their own threads, as CPU replicas do). ``parallel_devices`` may also repeat a device.
        prepare_in_threads: where each replica's share of the step's own work runs (cutting and placing its chunk,
            refreshing the replica, installing its metric copies and log recorder): ``None`` (default) or ``True``: in
            the replica's thread, beside the others (on GPUs the copies and SparseTensor builds overlap); ``False``: on
            the main thread before the replicas start; anything else raises ``ValueError``.
        allow_unpatched_me: go on with CPU replicas on a MinkowskiEngine that this project's recipe did not build
            (``scripts/build_minkowski.sh``), whose CPU defects make replicas differ from one device (refused at
            setup otherwise; :func:`~lightning_sparse_dp.runtime.me.missing_patches`).
        check_exactness: at the first training step of each fit, run the step on one device and on the replicas
            (float64 copies, the same batch) and compare (:mod:`lightning_sparse_dp.exactness`): ``True`` / ``"warn"``
            (default) says the outcome once (an info line when equal, a warning naming the worst tensors and the
            fixes when not), ``"error"`` raises :class:`~lightning_sparse_dp.exactness.check.ExactnessError` instead
            of the warning, ``False`` turns it off; anything else raises ``ValueError``.
        check_exactness_every_n_steps: also check every this many optimizer steps (default 0: the first step only).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``, ``checkpoint_io``,
            ``precision_plugin``), which the Trainer fills from ``accelerator=`` and ``devices=``.

    Raises:
        ValueError: an unknown ``loss_weighting`` or ``split``, a bad ``check_exactness`` or its every-n-steps.
        MisconfigurationException: at setup, for ``step(self, dataloader_iter)``, unusable devices, or CPU replicas
            on an unpatched MinkowskiEngine; at construction of the Trainer, for ``num_nodes > 1``.
    """

    strategy_name = "sparse_dp"
    description = "Single-process data parallelism for MinkowskiEngine sparse batches (lightning-sparse-dp)"

    def __init__(
        self,
        *,
        loss_weighting: str | Callable[[Any], Any] = "terms",
        layout: Mapping[Any, str] | None = None,
        output_layout: Mapping[Any, str] | None = None,
        split_fn: Callable[[Any, int], tuple[list[Any], SplitPlan]] | None = None,
        sync_batchnorm: bool = False,
        split: str = "balanced",
        presplit: bool = True,
        record_stage_times: bool = False,
        pin_replicas: bool | None = None,
        allow_unpatched_me: bool = False,
        replicas_per_device: int = 1,
        prepare_in_threads: bool | None = None,
        check_exactness: bool | str = True,
        check_exactness_every_n_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        self._set_options(loss_weighting, split, layout, allow_unpatched_me, check_exactness, check_exactness_every_n_steps)
        if not isinstance(replicas_per_device, int) or replicas_per_device < 1:
            raise ValueError(f"replicas_per_device={replicas_per_device!r}; give an int >= 1.")
        self.replicas_per_device = replicas_per_device  # before the base class sets parallel_devices
        super().__init__(**kwargs)
        self.sync_batchnorm = sync_batchnorm  # the LayerSync plugin is resolved at setup (base._resolve_layer_sync)
        self.output_layout = dict(output_layout) if output_layout else None
        self.split_fn = split_fn
        self.presplit = presplit
        self.pin_replicas = check_pin(pin_replicas)
        self.prepare_in_threads = check_prepare_in_threads(prepare_in_threads)
        self.stage_times = StageTimes() if record_stage_times else None
        self._timer = StepTimer(self.stage_times, prefix="[sparse_dp]")
        self._warning_cache = WarningCache()  # one-time warnings and infos of this strategy
        self._replicas: Replicas | None = None
        self._step_sites: frozenset | None = None  # the last step's loss call sites (loss/decide.py Decision.sites)
        self._replica_sync_layers, self._replica_metrics = [], ReplicaMetrics()  # their sync BN layers, metric copies
        self._loader_batch_sizes: set[int] = set()  # the batch_size of every DataLoader Lightning handed over
        self._said_idle = False  # replicas left idle by a batch of fewer chunks, said once (step.scatter.say_idle)
        self._checking = False  # the exactness check's run of the stages (strategies/exactness.py)
        self._frozen_written: set[str] = set()  # frozen parameters steps change in place (step.replicate.Replicas)
        self._log_memory = LogMemory()  # what the steps showed of the logged names (step/log.py), for the run
        self._batch_norm_seen: set[int] = set()  # ids of the batch-norm layers setup (or a rebuild) synchronized or said
        self._prepared: PreparedBatch | None = None  # the last batch batch_to_device prepared, for its step
        self._backward_scope = ExitStack()  # Lightning's backward, from pre_backward to post_backward
        self._refresh: tuple[DeferredCheck | None, bool] = (None, False)  # how replicate left the replicas' refresh
        self._weighting = HeldWeighting()  # loss_weighting checked and resolved once per batch structure (step.weigh)
        self._held_layouts = HeldLayouts()  # the split's decisions about a batch's structure (split/held.py)

    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None and self.parallel_devices is not None
        self._check_minkowski_build(self.root_device.type, len(self.parallel_devices))
        refuse_dataloader_iter(module)
        refuse_old_gather(self.gather)
        refuse_compiled_submodules(module, len(self.parallel_devices))
        self._resolve_layer_sync()
        if self._layer_sync is None and trainer.state.fn == TrainerFn.FITTING:  # said once: batch norm per replica
            warn_unsynchronized_batchnorm(module, len(self.parallel_devices))
        elif self._layer_sync is None:  # validate / test / predict: batch norm that keeps the batch's statistics in eval
            warn_eval_batchnorm(eval_batch_statistics(module), len(self.parallel_devices))
        apply_layer_sync(self)  # as DDPStrategy.setup: swap batch norm when fitting (or used in eval), before precision
        self._batch_norm_seen = {id(m) for m in module.modules() if isinstance(m, _BatchNorm)}  # layers added later:
        # ReplicaStages._new_batch_norm
        super().setup(trainer)
        self._timer.profiler = trainer.profiler
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._exactness.reset(len(self.parallel_devices) if fitting else 1, self._warning_cache)  # checked, or said off
        self._start_replica_threads(self.pin_replicas, synchronized=self._layer_sync is not None)

    @override
    def teardown(self) -> None:
        revert_layer_sync(self)  # as DDPStrategy.teardown: the user's layer types come back, holding the trained values
        if self._replicas is not None:  # frozen parameters the steps changed in place: owned by the next fit's replicas
            self._frozen_written |= self._replicas.frozen_written
        self._replicas, self._replica_sync_layers, self._prepared = None, [], None
        super().teardown()  # the replica threads stopped, the CPU threads given back (single_process.py)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Note the loader's ``batch_size`` (the split's evidence of what a per-sample tensor is) and move the split into
        the loader's worker processes (``presplit``), when it has workers."""
        size = getattr(dataloader, "batch_size", None)
        if isinstance(size, int):
            self._loader_batch_sizes.add(size)
        self.advise_workers(dataloader)
        if not self.presplit or self.split_fn is not None or self.parallel_devices is None or len(self.parallel_devices) < 2:
            return dataloader  # one device: nothing to split
        options = self._split_options()
        del options["batch_sizes"]  # the worker's split takes its own loader's
        return presplit_loader(dataloader, len(self.parallel_devices), **options, module=self.lightning_module)

    # --- the step: Lightning's four step hooks, each through the stages below --------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        check = self._exactness
        trainer = trainer_of(self.lightning_module)
        stopping = trainer is None or trainer.should_stop
        checked = not check.done and check_training_step(self, args, kwargs)  # when due: one device's and ours compared
        with self.precision_plugin.train_step_context():
            output = self._step("training_step", args, kwargs)
        if not stopping and trainer.should_stop and self.lightning_module.automatic_optimization:  # by a replica's step
            # (under manual optimization the hooks of manual_backward and opt.step run in the step, once: not said)
            self._warning_cache.info(
                "sparse_dp: the training step set self.trainer.should_stop from a replica's chunk: as with Lightning's "
                "DDP ranks, any replica's stop ends the fit, where one device decides on the whole batch. Decide it in "
                "on_train_batch_end(outputs, batch, batch_idx), which gets the gathered outputs and the whole batch."
            )
        sites, self._step_sites = self._step_sites, None
        # the set lookup before new_sites (which repeats it to note the sites): a steady step calls nothing in check.py
        if sites is not None and check.mode is not None and sites not in check.site_sets and check.new_sites(sites):
            if not checked:  # a term after a warm-up, alternating objectives: this step checked too, after its forward
                check_training_step(self, args, kwargs, again=True)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_first_eval_step("validation_step", args, kwargs)
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_first_eval_step("test_step", args, kwargs)
        with self.precision_plugin.test_step_context():
            return self._step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_first_eval_step("predict_step", args, kwargs)
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", args, kwargs)

    def _check_first_eval_step(self, hook: str, args: tuple, kwargs: dict) -> None:
        """The exactness check of the first step of each evaluation hook and dataloader in a run (the set lookup first:
        every later step passes it)."""
        index = dataloader_index(args, kwargs)
        if self._exactness.mode is not None and eval_key(hook, index) not in self._exactness.evaluated:
            check_eval_step(self, hook, args, kwargs)

    def _step(self, name: str, args: tuple, kwargs: dict) -> Any:
        """One step through the stages (:meth:`_through_stages`), the replicas' ``self.log`` calls then logged once
        through the module."""
        step, whole_batch = self._context(name, args, kwargs, self.lightning_module)
        if step is None:  # one device: plain Lightning's step on the module itself (step/prepare.py)
            return getattr(self.lightning_module, name)(whole_batch, *args[1:], **kwargs)
        output, calls = self._through_stages(step)
        with step.call.timer.stage("emit"):
            emit(step.call.module, calls)
        return output

    def _through_stages(self, step: StepContext) -> tuple[Any, list[LogCall]]:
        """The step's stages, one call each, their results written into ``step`` here (a stage writes none of it): the
        gathered output, and the replicas' ``self.log`` calls reduced (not yet logged)."""
        step.inputs, step.plan = self.scatter(step.call.source, step)
        step.outputs = self._run_replicas(step)  # replicate -> the replicas' step state -> parallel_apply
        step.losses, step.weights = weigh(step, self.loss_weighting, self._weighting)
        decision = step.terms.decision if step.terms is not None else None
        self._step_sites = decision.sites if decision is not None else None  # for the exactness check (training_step)
        root = step.call.parallel_devices[0]  # the root device, as the step started (_context)
        merge_into_module(step, root, self.output_layout)  # what the replicas set on it, as one device's
        replicas = self._replicas
        if (replicas is not None and not step.call.manual  # manual: toggles are given to the replicas as they happen
                and list(map(_GRAD_FLAG, replicas.parameters[0])) != list(map(_GRAD_FLAG, replicas.trainable))):
            for source, own in zip(replicas.trainable, replicas.parameters[0]):  # requires_grad_() in the step: the
                source.requires_grad_(own.requires_grad)  # root replica's, as rank 0's
            replicas.stale = True  # the next step's replicas built from the module's flags
        groups = self._replicas.rank_optimizers[0] if self._replicas is not None else None
        if groups is not None and groups.copies:  # the optimizers' groups the root replica changed, as rank 0's
            groups.write_back()
        if step.call.name == "training_step":  # each replica's backward in its thread, when Lightning's backward reaches it
            clear_replica_gradients(step, self._replicas)  # what a backward inside the step left, as zero_grad clears
            step.outputs = backward_in_replicas(step, self._replicas, self._replica_threads())
        output = self.gather(exact_outputs(step), step)
        return output, log_step(step, root)  # the replicas' self.log calls, reduced

    def _context(self, name: str, args: tuple, kwargs: dict, module: Any) -> tuple[StepContext | None, Any]:
        """The step's context for ``module``, or ``None`` and the whole batch on the one device (one device, nothing
        to split: the module's own step). The batch is the one :meth:`batch_to_device` prepared, else (a step driven
        by hand, the exactness check's copy) prepared here the same way."""
        if module is None or not args:
            raise TypeError(f"sparse_dp expects a module set up and the batch as the first argument of {name}.")
        devices = tuple(self.parallel_devices or ())  # read once: the step's stages take them from its StepCall
        prepared = self._prepared
        if prepared is not None and prepared.batch is args[0] and module is self.lightning_module:
            self._prepared = None
            if isinstance(prepared.source, PlacedChunks) and prepared.source.changed_since(args[0]):
                say_changed_after_cut(name)
        else:
            prepared = self._prepare(args[0], module, dataloader_index(args, kwargs),
                                     devices)
        if prepared.whole is not None:
            return None, prepared.whole
        self._timer.new_step()
        manual = name == "training_step" and not module.automatic_optimization  # chunks and weights known before it
        in_threads = self._in_threads() and not manual
        call = StepCall(name=name, batch=args[0], source=prepared.split_source(args[0]), module=module, args=args[1:],
                        kwargs=kwargs, manual=manual, in_threads=in_threads, timer=self._timer,
                        warnings=self._warning_cache, parallel_devices=devices, logged=self._log_memory)
        return StepContext(call), None

    def _run_replicas(self, step: StepContext) -> list[Any]:
        """:meth:`replicate`, the replicas' step state around :meth:`parallel_apply`, and the outputs as one device's
        (``None`` from some chunks: :func:`~lightning_sparse_dp.step.skipped.skipped_outputs`). When the replicas'
        deferred check finds the module changed (:class:`~lightning_sparse_dp.step.check.StaleReplicas`: no replica
        touched it, no step ran), the replicas are rebuilt and the step runs again on the chunks already made."""
        step.devices = list(step.call.parallel_devices[: len(step.inputs)])
        for attempt in (1, 2):
            step.replicas = self.replicate(step.call.module, step.devices, step)
            (step.check, step.refresh_in_threads), self._refresh = self._refresh, (None, False)  # the strategy keeps none
            try:
                with install_step(step, self._replicas, self._replica_sync_layers, self._replica_metrics,
                                  self.loss_weighting, self._memory_for(step.call.name)) as installed:
                    step.group, step.terms = installed.group, installed.terms
                    step.before, step.weights = installed.before, installed.weights
                    step.outputs = self.parallel_apply(step.replicas, step.inputs, step)
                step.replica_state = installed.replica_state  # where the check installed it: known once the body ended
                break
            except StaleReplicas:
                if attempt == 2:
                    raise
                self._replicas, step.check, step.refresh_in_threads = None, None, False
        if any(output is None for output in step.outputs):  # None from some chunks: the skipped stage decides
            return skipped_outputs(step)  # one device's result where it is known, else refused
        return step.outputs

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The batch Lightning's hooks and callbacks receive, prepared for the step (:mod:`~.step.prepare`): the
        collated batch (with one device, moved by the transfer hooks as plain Lightning moves it); where the module or
        its datamodule has its own batch-transfer hooks, the batch is split here and they run on each chunk with its
        device, before the ``on_*_batch_start`` hooks, as Lightning runs them."""
        batch = super().batch_to_device(batch, device, dataloader_idx)  # on_before_batch_transfer, on older Lightning
        module, devices = self.lightning_module, self.parallel_devices
        if module is None or not devices:
            return batch
        self._prepared = self._prepare(batch, module, dataloader_idx, devices)
        return self._prepared.batch

    def _prepare(self, batch: Any, module: Any, dataloader_idx: int, devices: Sequence[torch.device]) -> PreparedBatch:
        """``batch`` prepared for the hooks and the step (:func:`~lightning_sparse_dp.step.prepare.prepare_batch`) on
        ``devices`` (the strategy's, as the caller read them)."""
        devices = list(devices)
        return prepare_batch(batch, module, devices, dataloader_idx,
                             lambda b: step_cutters(b, len(devices), self.split_fn, **self._split_options()),
                             one_device=len(devices) == 1 and self.split_fn is None)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Lightning's backward (``Strategy.backward``, not overridden) from here to :meth:`post_backward`: timed, with
        autograd's device threads off in this thread (a no-op on CPU), so that the node that runs the replicas' passes
        (:mod:`~lightning_sparse_dp.step.backward`) runs in this thread on every device type."""
        self._backward_scope.close()  # a backward that raised left its scope open: closed before the next one
        self._backward_scope.enter_context(self._timer.stage("backward"))
        self._backward_scope.enter_context(torch.autograd.set_multithreading_enabled(False))
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        self._backward_scope.close()


SparseDataParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["SparseDataParallelStrategy"]
