"""The ``sparse_dp`` strategy: the step pipeline of single-process data parallelism for ME networks.

A thin orchestrator over the stages of one step (``docs/architecture.md`` draws them), each an
overridable method as ``torch.nn.DataParallel``'s are: ``scatter`` (:mod:`.split`, :mod:`.place`)
-> ``replicate`` (:mod:`.replicate`) -> per-step replica state (:mod:`.state`: :mod:`.metrics`, :mod:`.log`,
:mod:`.syncbn.replicas`) -> ``parallel_apply`` (:mod:`.apply`) -> loss weights (:mod:`.loss`) and per-replica
backward (:mod:`.backward`) -> ``gather`` (:mod:`.outputs`) -> log (:mod:`.log`). One device skips them all
(:mod:`.one_device`). Lightning's plumbing for one process is the base class,
:class:`~lightning_sparse_dp.single_process.SingleProcessParallelStrategy`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor, nn
from typing_extensions import override

from lightning_sparse_dp.apply import ReplicaExecutor, replica_steps
from lightning_sparse_dp.backward import parallel_backward
from lightning_sparse_dp.base import SparseStrategyMixin
from lightning_sparse_dp.effects import StepEffects
from lightning_sparse_dp.hints import (
    explain_replica_error,
    min_points_per_chunk,
    refuse_dataloader_iter,
    warn_unsynchronized_batchnorm,
)
from lightning_sparse_dp.log import emit, reduce_log_calls
from lightning_sparse_dp.loss.step import StepTerms
from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.loss.weights import step_weights
from lightning_sparse_dp.manual import manual_step
from lightning_sparse_dp.metrics import ReplicaMetrics
from lightning_sparse_dp.one_device import one_device_batch
from lightning_sparse_dp.outputs import gather_outputs
from lightning_sparse_dp.place import Transfer, batch_transfer, pending_chunks, place_chunks
from lightning_sparse_dp.presplit import PreSplitBatch, presplit_loader, step_cutters
from lightning_sparse_dp.replicate import DeferredCheck, Replicas, StaleReplicas
from lightning_sparse_dp.single_process import SingleProcessParallelStrategy
from lightning_sparse_dp.skipped import check_skipped
from lightning_sparse_dp.split import SplitPlan, balanced_assignment
from lightning_sparse_dp.state import combine_values, enter_checked, leave_checked, replica_state
from lightning_sparse_dp.syncbn.collective import ThreadGroup
from lightning_sparse_dp.syncbn.layer_sync import apply_layer_sync, revert_layer_sync
from lightning_sparse_dp.syncbn.replicas import sync_layers, synchronized
from lightning_sparse_dp.threads import ThreadSplit, check_pin, check_prepare_in_threads, configure_replica_threads
from lightning_sparse_dp.timing import StageTimes, StepTimer


class SparseDataParallelStrategy(SparseStrategyMixin, SingleProcessParallelStrategy):
    """Data parallelism in one process for MinkowskiEngine sparse batches, registered as ``"sparse_dp"``.

    Every step: the batch is split into chunks of whole samples (batch indices renumbered), each chunk
    is placed on its device (SparseTensor / TensorField built there), the LightningModule is
    replicated onto the devices in use, the step runs on every replica at once, and the outputs are
    gathered on the root device: the loss is ``sum_i w_i * loss_i``, exactly the whole-batch mean for
    the chosen weighting. ``self.log`` calls in replicas are reduced and logged once.

    The stages are methods to override, as ``torch.nn.DataParallel``'s are: :meth:`scatter` (split
    and place), :meth:`replicate`, :meth:`parallel_apply` and :meth:`gather`; each is a Lightning
    profiler action ``[sparse_dp]<stage>``.

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
            (:func:`~lightning_sparse_dp.outputs.gather_outputs`).
        split_fn: replaces :func:`~lightning_sparse_dp.split.split_batch` in :meth:`scatter`:
            ``split_fn(batch, num_chunks) -> (chunks, SplitPlan)``.
        split: how whole samples are assigned to replicas: ``"balanced"`` (default; even point
            counts, :func:`~lightning_sparse_dp.split.balanced_assignment`) or ``"contiguous"``
            (consecutive samples, sizes differing by at most one). Outputs come back in the original
            order either way.
        presplit: split batches in DataLoader worker processes
            (:class:`~lightning_sparse_dp.presplit.PreSplitCollate`) for loaders with ``num_workers > 0``,
            unless ``split_fn`` is given or the module overrides ``on_before_batch_transfer`` (which
            must see the whole batch).
        record_stage_times: record each step's stage durations in :attr:`stage_times`
            (:class:`~lightning_sparse_dp.timing.StageTimes`).
        pin_replicas: CPU replicas only: pin each replica's thread to cores and even the ``"balanced"``
            split's points per core (:func:`~lightning_sparse_dp.threads.plan_cores`). ``None`` (default):
            with ``sync_batchnorm`` and more replicas than cores; ``True``: always; ``False``: never;
            anything else raises ``ValueError``.
        sync_batchnorm: swap batch norm (torch's BatchNorm1d/2d/3d and SyncBatchNorm, so ME's batch-norm
            layers too) for :class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm`, synchronized across the
            replicas of each step, while fitting; reverted at teardown. It goes through Lightning's
            ``LayerSync`` plugin point (:class:`~lightning_sparse_dp.syncbn.layer_sync.SyncBatchNormSwap`, applied
            at setup as ``DDPStrategy.setup`` does), so ``Trainer(sync_batchnorm=True)`` turns it on too.
        replicas_per_device: replicas on each device (default 1): ``devices=1, replicas_per_device=3`` runs three
            replicas on one GPU, so that the multi-replica paths (replica threads and streams, the gather, the
            gradient reduction) run on a one-GPU machine; exact, no faster; with synchronized batch norm too (the
            replicas meet from their own threads, as CPU replicas do). ``parallel_devices`` may also repeat a device.
        prepare_in_threads: where each replica's share of the step's own work runs (cutting its chunk out of the
            batch and placing it, refreshing the replica, installing its metric copies and log recorder):
            ``None`` (default) or ``True``: in the replica's thread, beside the other replicas, off the main thread's
            serial part (on GPUs the copies to the device and SparseTensor builds release the GIL and overlap; on
            CPU it measured the same wall time as ``False`` within this project's 2-core machine's spread,
            docs/benchmarks.md); ``False``: on the main thread before the replicas start; anything else raises
            ``ValueError``.
        allow_unpatched_me: go on with CPU replicas on a MinkowskiEngine that this project's recipe did not build
            (``scripts/build_minkowski.sh``), whose CPU defects make replicas differ from one device (refused at
            setup otherwise; :func:`~lightning_sparse_dp._me.missing_patches`).
        **kwargs: Lightning's strategy arguments (``accelerator``, ``parallel_devices``,
            ``checkpoint_io``, ``precision_plugin``), which the Trainer fills from ``accelerator=`` and
            ``devices=``.

    Raises:
        ValueError: an unknown ``loss_weighting`` or ``split``.
        MisconfigurationException: at setup, for ``step(self, dataloader_iter)``, unusable devices, or CPU replicas
            on an unpatched MinkowskiEngine; at construction
            of the Trainer, for ``num_nodes > 1``.
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
        **kwargs: Any,
    ) -> None:
        self._set_options(loss_weighting, split, layout, allow_unpatched_me)
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
        self._core_groups: tuple[int, ...] | None = None  # replicas pinned to one core share a group (plan_cores)
        self.stage_times = StageTimes() if record_stage_times else None
        self._timer = StepTimer(self.stage_times, prefix="[sparse_dp]")
        self._warning_cache = WarningCache()  # one-time warnings and infos of this strategy
        self._executor: ReplicaExecutor | None = None  # the replica threads, from setup to teardown
        self._replicas: Replicas | None = None
        self._replica_sync_layers: list[list] = []
        self._replica_metrics = ReplicaMetrics()
        self._thread_split: ThreadSplit | None = None
        self._loader_batch_sizes: set[int] = set()  # the batch_size of every DataLoader Lightning handed over
        self._transfer: Transfer | None = None  # this step's batch-transfer hooks (place.batch_transfer)
        self._said_idle = False  # replicas left idle by a batch of fewer chunks, said once (_say_idle)

    # --- set-up and teardown (the rest of Lightning's plumbing: single_process.py) -------------------
    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None and self.parallel_devices is not None
        self._check_minkowski_build(self.root_device.type, len(self.parallel_devices))
        refuse_dataloader_iter(module)
        self._resolve_layer_sync()
        if self._layer_sync is None:  # said once: batch norm per replica
            warn_unsynchronized_batchnorm(module, len(self.parallel_devices))
        apply_layer_sync(self)  # as DDPStrategy.setup: swap batch norm when fitting, before the precision conversion
        super().setup(trainer)
        self._timer.profiler = trainer.profiler
        if self._executor is None:
            self._executor = ReplicaExecutor(len(self.parallel_devices))
        if self._thread_split is None:  # CPU cores split between replicas, pinned (a warning for pin_replicas on GPUs)
            self._thread_split, self._core_groups = configure_replica_threads(
                self._executor, len(self.parallel_devices), self.pin_replicas, self._layer_sync is not None,
                self.root_device.type,
            )

    @override
    def teardown(self) -> None:
        revert_layer_sync(self)  # as DDPStrategy.teardown: the user's layer types come back, holding the trained values
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._replicas, self._replica_sync_layers = None, []
        if self._thread_split is not None:
            self._thread_split.restore()
            self._thread_split = None
        super().teardown()

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

    # --- the step ------------------------------------------------------------------------------
    def _parallel_step(self, step_name: str, args: tuple, kwargs: dict, backward: bool = False) -> Any:
        """One step: scatter -> replicate -> parallel_apply -> gather -> log.

        ``backward`` (the training step): each replica's backward runs in its own thread when Lightning
        calls backward on the gathered loss (:func:`~lightning_sparse_dp.backward.parallel_backward`).
        """
        module = self.lightning_module
        if module is None or not args:
            raise TypeError(f"sparse_dp expects a module set up and the batch as the first argument of {step_name}.")
        # the batch-transfer hooks, run on each chunk as each DDP rank runs them on its batch (None: not overridden)
        self._transfer = batch_transfer(module, args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0))
        batch = one_device_batch(args[0], self.parallel_devices, self.split_fn, self._transfer)
        if batch is not None:  # one device: plain Lightning's step on the module itself (one_device.py)
            return getattr(module, step_name)(batch, *args[1:], **kwargs)
        self._timer.new_step()
        manual = step_name == "training_step" and not module.automatic_optimization  # needs chunks, hooks on replicas first
        threads = self._in_threads() and not manual  # each replica prepares in its thread, before its step
        inputs, plan = self._scatter_pending(args[0]) if threads else self.scatter(args[0])
        self._say_idle(plan)
        in_threads = threads and type(self).replicate is SparseDataParallelStrategy.replicate  # not an overridden one
        apply = partial(self._apply, module, step_name, args, kwargs, inputs, plan, in_threads, manual)
        try:
            outputs, replicas, installed, group, terms, weights = apply()
        except StaleReplicas:  # the module changed since the replicas were built (DeferredCheck): rebuilt, run again
            outputs, replicas, installed, group, terms, weights = apply(rebuild=True)
        recorders, left = installed.recorders, installed.left  # left: merged back below
        if any(o is None for o in outputs):  # None from some chunks: one device's result where it is known, else refused
            outputs = check_skipped(
                outputs, step_name, module, plan.chunk_samples, [r.calls if r is not None else {} for r in recorders]
            )
        with self._timer.stage("weigh"):
            losses = [loss_of(o) for o in outputs]  # the replicas' own: a logged value that is one is reduced as the loss
            if weights is None:
                weights = step_weights(plan, inputs, self.loss_weighting, self._warning_cache)
            if terms is not None:  # each term weighted by its own share (gradient scales set), or "auto" said once
                terms.weigh(losses, plan, weights)
        with self._timer.stage("state"):
            combine = partial(combine_values, plan, weights, terms, self.root_device, self.output_layout, self._warning_cache)
            left.merge(combine, self._warning_cache)
        if backward and len(replicas) > 1 and torch.is_grad_enabled():
            # each replica will run its own backward, in its own thread, when Lightning calls backward on the loss
            assert self._replicas is not None
            outputs = parallel_backward(
                outputs, self._replicas, executor=self._replica_threads(), group=group, times=self._timer
            )
        with self._timer.stage("weigh"):
            if terms is not None:  # the losses shifted so that the gather's weighted sum is the whole batch's loss
                outputs = terms.exact_outputs(outputs, weights)
        output = self.gather(outputs, plan, weights)
        with self._timer.stage("log"):
            exact = terms.log_value if terms is not None else None
            calls = reduce_log_calls(  # no batch_size given: Lightning infers it from the batch, unless split in workers
                recorders, weights, plan.num_samples, self.root_device, module, losses, self._warning_cache, exact,
                infer_batch_size=not isinstance(args[0], PreSplitBatch),
            )
        with self._timer.stage("emit"):  # Lightning's own self.log, which a one-device step runs inside the step
            emit(module, calls)
        return output

    def _apply(
        self, module: nn.Module, step_name: str, args: tuple, kwargs: dict, inputs: list[Any], plan: SplitPlan,
        in_threads: bool, manual: bool, rebuild: bool = False,
    ) -> tuple[list[Any], list[nn.Module], Any, ThreadGroup | None, StepTerms | None, list[float] | None]:
        """Replicate, install the replicas' step state, run the step on every replica (:meth:`parallel_apply`) and undo
        the state (metrics merged): ``(outputs, replicas, installed state, batch-norm group, terms, weights)``, the
        weights ``None`` unless a manual step needed them inside it.

        Raises:
            StaleReplicas: the replicas' deferred check found the module changed (no replica touched it, no step ran):
                call again with ``rebuild``, the chunks already made.
        """
        assert self.parallel_devices is not None
        devices = self.parallel_devices[: len(inputs)]
        replicas, check = self._step_replicas(module, devices, rebuild) if in_threads else (self.replicate(module, devices), None)
        with ExitStack() as state:
            with self._timer.stage("state"):  # the replicas' per-step state, installed (by a deferred check: below) ...
                group = state.enter_context(synchronized(self._replica_sync_layers[: len(replicas)]))  # None for one
                install = partial(state.enter_context, replica_state(
                    module, replicas, devices, self._replica_metrics, self._replicas, group, in_threads, plan
                ))
                terms = StepTerms.for_step(self.loss_weighting, step_name, len(replicas), self._warning_cache, self._site_memory)
                if terms is not None:
                    terms.set_plan(plan)  # the chunks' shapes: each replica summarizes its loss in its thread
                if check is not None:  # installed by the check, on this thread, once it passed; each replica waits
                    check.prepare = install
                    before = [partial(enter_checked, check, i) for i in range(len(replicas))]
                    after = [partial(leave_checked, check, i) for i in range(len(replicas))]
                else:
                    installed = install()
                    before = [partial(installed.enter, i) for i in range(len(replicas))] if in_threads else None
                    after = [partial(installed.leave, i) for i in range(len(replicas))] if in_threads else None
            weights: list[float] | None = None
            if manual and len(replicas) > 1:
                # the replicas' manual_backward and optimizer calls met once per step, weights needed inside it
                weights = step_weights(plan, inputs, self.loss_weighting, self._warning_cache)
                assert self._replicas is not None
                group = state.enter_context(manual_step(module, self._replicas, replicas, group, weights, terms, plan))
            outputs = self.parallel_apply(
                replicas, inputs, step_name, args[1:], kwargs, group=group, plan=plan, terms=terms, before=before,
                after=after, meanwhile=None if check is None else self._timer.timed("check", check.run),  # stage check
            )
            if check is not None:
                installed = check.prepared
            with self._timer.stage("state"):  # ... and undone (metrics merged into the root's)
                state.close()
        return outputs, replicas, installed, group, terms, weights

    def scatter(self, batch: Any) -> tuple[list[Any], SplitPlan]:
        """Split ``batch`` into chunks of whole samples and place chunk ``i`` on ``parallel_devices[i]``.

        The split is ``split_fn``, the DataLoader workers' (:class:`~lightning_sparse_dp.presplit.PreSplitBatch`)
        or :func:`~lightning_sparse_dp.split.split_batch`; at most one chunk per device (fewer when the
        batch has fewer samples). Placing builds each chunk's SparseTensor / TensorField on its device
        (:func:`~lightning_sparse_dp.place.place_chunks`).

        Returns:
            ``(inputs, plan)``: the placed chunks, chunk ``i`` on device ``i``, and the split's plan.

        Raises:
            ValueError: a PreSplitBatch with more chunks than devices.
            BatchLayoutError: a batch the split cannot read (see :func:`~lightning_sparse_dp.split.split_batch`).
        """
        with self._timer.stage("split"):
            cutters, plan = step_cutters(batch, len(self.parallel_devices or ()), self.split_fn, **self._split_options())
            chunks = [cut_chunk() for cut_chunk in cutters]
        with self._timer.stage("place"):
            return place_chunks(chunks, self.parallel_devices or (), self._transfer), plan

    def _scatter_pending(self, batch: Any) -> tuple[list[Any], SplitPlan]:
        """:meth:`scatter` with chunk ``i`` cut and placed in replica ``i``'s thread (``prepare_in_threads``;
        :func:`~lightning_sparse_dp.place.pending_chunks`): the main thread only plans the split (stage ``split``,
        :func:`~lightning_sparse_dp.presplit.step_cutters`). A subclass's own :meth:`scatter` runs as it is."""
        if type(self).scatter is not SparseDataParallelStrategy.scatter:
            return self.scatter(batch)
        with self._timer.stage("split"):
            cutters, plan = step_cutters(batch, len(self.parallel_devices or ()), self.split_fn, **self._split_options())
        return pending_chunks(cutters, self.parallel_devices or (), self._timer, self._transfer), plan

    def _step_replicas(
        self, module: nn.Module, devices: Sequence[torch.device], rebuild: bool
    ) -> tuple[list[nn.Module], DeferredCheck | None]:
        """The replicas for replica threads that prepare themselves, and the check of them the main thread takes while
        their threads make their chunks (:class:`~lightning_sparse_dp.replicate.DeferredCheck`, run by
        :meth:`parallel_apply`, so not under a subclass's own), or ``None`` where they were (re)built or refreshed here
        (:meth:`replicate` without ``refresh_modules``)."""
        persistent = None if rebuild else self._replicas
        ours = type(self).parallel_apply is SparseDataParallelStrategy.parallel_apply  # which runs the check (meanwhile)
        if ours and persistent is not None and len(devices) > 1 and persistent.serve(module, devices):
            with self._timer.stage("replicate"):  # the check itself runs during parallel_apply, beside the replicas
                check = DeferredCheck(persistent, len(devices), buffers=not persistent.buffers_in_threads)
            return persistent.modules[: len(devices)], check
        if rebuild:
            self._replicas = None
        return self.replicate(module, devices, refresh_modules=False), None

    def replicate(self, module: nn.Module, devices: Sequence[torch.device], refresh_modules: bool = True) -> list[nn.Module]:
        """The replicas of ``module`` for ``devices`` (replica ``i`` on ``devices[i]``), refreshed for this step.

        One chunk on the root device runs ``module`` itself. Otherwise the persistent
        :class:`~lightning_sparse_dp.replicate.Replicas` are refreshed, or rebuilt when the module's
        structure, parameters or devices changed. Without ``refresh_modules`` only their tensors are (CPU: not buffers;
        :meth:`~lightning_sparse_dp.replicate.Replicas.refresh_tensors`): each replica's thread refreshes the rest.
        """
        with self._timer.stage("replicate"):
            if list(devices) == [self.root_device]:
                return [module]
            if self._replicas is None or not self._replicas.matches(module, devices):
                assert self.parallel_devices is not None
                self._replicas = Replicas(module, self.parallel_devices)
                self._replica_sync_layers = [sync_layers(r) for r in self._replicas.modules]
            if refresh_modules:
                return self._replicas.refresh(len(devices))
            self._replicas.refresh_tensors(len(devices), buffers=not self._replicas.buffers_in_threads)
            return self._replicas.modules[: len(devices)]

    def parallel_apply(
        self,
        replicas: Sequence[nn.Module],
        inputs: Sequence[Any],
        step_name: str,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        group: ThreadGroup | None = None,
        plan: SplitPlan | None = None,
        terms: StepTerms | None = None,
        before: Sequence[Callable[[], Any]] | None = None,
        meanwhile: Callable[[], None] | None = None,
        after: Sequence[Callable[[], Any]] | None = None,
    ) -> list[Any]:
        """Run ``replicas[i].<step_name>(inputs[i], *args, **kwargs)`` for every ``i`` at once, one thread each.

        Args:
            replicas: from :meth:`replicate`.
            inputs: from :meth:`scatter`, one chunk per replica.
            step_name: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
            args, kwargs: the step's other arguments (``batch_idx``, ``dataloader_idx``).
            group: the step's batch-norm group: each replica's step is its rank's part of it.
            plan: the split, to explain errors a small chunk causes (:func:`~lightning_sparse_dp.hints.explain_replica_error`).
            terms: each replica's step runs under its capture of mean-reduced losses (:mod:`~lightning_sparse_dp.loss.capture`).
            before: ``before[i]()`` runs in replica ``i``'s thread before its step, ``after[i]()`` after it
                (:func:`~lightning_sparse_dp.apply.replica_steps`); ``meanwhile()`` in this thread once they started.

        Returns:
            the replicas' outputs, replica order.

        Raises:
            RuntimeError: a strategy that has no devices yet (not given to a Trainer).
            Exception: the first failing replica's error, with a note naming the replica and device.
        """
        if self.parallel_devices is None:
            raise RuntimeError(
                "sparse_dp: a step ran on a strategy with no devices yet; run it through a Trainer (fit / validate / "
                "test / predict), which gives the strategy its devices."
            )
        executor = self._replica_threads()
        devices = self.parallel_devices[: len(replicas)]
        effects = StepEffects(step_name, len(replicas)) if len(replicas) > 1 else None  # loggers' calls, files written
        steps = replica_steps(replicas, inputs, step_name, args, kwargs, terms, group, self._timer, before, after, effects)
        with self._timer.stage("apply"):
            try:
                outputs = executor.run(steps, devices, meanwhile=meanwhile)
            except Exception as err:
                raise err if plan is None else explain_replica_error(err, plan)
        if effects is not None:
            effects.say(self._warning_cache)
        return outputs

    def _replica_threads(self) -> ReplicaExecutor:
        """The replica threads: made at setup and shut down at teardown; a step run after teardown (Lightning's loop
        driven by hand after ``fit``, as plain Lightning allows) makes them again, shut down with the strategy."""
        if self._executor is None:
            assert self.parallel_devices is not None
            self._executor = ReplicaExecutor(len(self.parallel_devices))
            weakref.finalize(self, self._executor.shutdown)
        return self._executor

    def gather(self, outputs: Sequence[Any], plan: SplitPlan, weights: Sequence[float]) -> Any:
        """The replicas' outputs as one output on the root device (:func:`~lightning_sparse_dp.outputs.gather_outputs`).

        The loss is ``sum_i weights[i] * loss_i`` (:func:`~lightning_sparse_dp.loss.weights.step_weights`:
        the whole batch's mean for the loss weighting); other outputs are merged back into the batch's
        order by ``output_layout`` or their lengths.
        """
        with self._timer.stage("gather"):
            return gather_outputs(outputs, plan, weights, self.root_device, self.output_layout, self._warning_cache)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward of the step's loss, timed, with autograd's device threads off in the calling thread (a
        no-op on CPU): the node that runs the replicas' passes (:mod:`~lightning_sparse_dp.backward`) runs in this
        thread on every device type, as on CPU, and each replica's pass in its own thread."""
        with self._timer.stage("backward"), torch.autograd.set_multithreading_enabled(False):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _say_idle(self, plan: SplitPlan) -> None:
        """Once per strategy: a batch split into fewer chunks than replicas (fewer samples than devices, or chunks kept
        to two points for batch norm) leaves replicas idle in its step."""
        devices = len(self.parallel_devices or ())
        if plan.num_chunks < devices and not self._said_idle:
            self._said_idle = True
            self._warning_cache.info(
                f"sparse_dp: a batch of {plan.num_samples} sample(s) ran on {plan.num_chunks} of the {devices} replicas "
                f"(a chunk holds whole samples): {devices - plan.num_chunks} replica(s) idle in such steps (said once). "
                f"A batch_size of at least {devices} (and drop_last=True for a short last batch) keeps every replica busy."
            )

    def _in_threads(self) -> bool:
        return self.prepare_in_threads is not False

    def _split_options(self) -> dict[str, Any]:
        """The split's ``layout``, ``assignment`` (``split``; per core first when pinned), ``min_points_per_chunk`` and the
        loaders' ``batch_sizes``."""
        pinned = self._core_groups is not None and self.split == "balanced"
        assignment = partial(balanced_assignment, groups=self._core_groups) if pinned else self.split
        module, synchronized, built = self.lightning_module, self._layer_sync is not None, self._replicas
        batch_norm = built.batch_norm if built is not None and built.root is module else None  # no walk per step
        return {"layout": self.layout, "assignment": assignment,
                "min_points": 1 if module is None else min_points_per_chunk(module, synchronized, batch_norm),
                "batch_sizes": self._loader_batch_sizes}

SparseDataParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["SparseDataParallelStrategy"]
