"""The ``sparse_ddp`` strategy: Lightning's DDP with exact losses, point-balanced batches and sync batch norm.

``sparse_dp`` runs replicas in one process; ``sparse_ddp`` is the same training across processes and
machines on ``torch.distributed``, as a thin subclass of Lightning's ``DDPStrategy`` (its launchers,
cluster environments, process groups and gradient all-reduce are used as they are). What it adds:

- **exact loss**: DDP averages gradients equally over ranks: the global batch's gradient only for equal
  shares. By default (``loss_weighting="terms"``) each of torch's mean-reduced losses the step calls is
  captured with its denominator ``D_rk`` (:mod:`~lightning_sparse_dp.loss.capture`) and its gradient scaled
  by ``world_size * D_rk / D_k``, ``D_k = sum_r D_rk``, from every rank's summary of its terms, gathered
  in one fixed-size all-gather after the step (:func:`~lightning_sparse_dp.ddp.exchange.gather_objects`; at each
  ``manual_backward``
  under manual optimization) and read alike by every rank (:mod:`~lightning_sparse_dp.loss.decide`):
  exact for any linear combination of such losses, per-sample losses included.
  Otherwise (said once) rank ``r`` with ``n_r`` of the global batch's ``N = sum_r n_r`` (the same
  gather) has its loss scaled by ``world_size * n_r / N``: the gradient of the mean over what
  ``n_r`` counts;
- **logged values** reduced with the same weights: a mean logged with ``self.log(..., sync_dist=True)`` reaches
  Lightning's results after the step as the global batch's value (combinations of captured losses exactly, other
  means weighted by their element counts, else ``sum_r n_r v_r / N``) with one device's batch size, the same on
  every rank, so on-step values and epoch means are one device's
  (:mod:`~lightning_sparse_dp.ddp.logged_means`);
- **point-balanced batches**: the ``DistributedSampler`` Lightning injects is replaced by
  :class:`~lightning_sparse_dp.ddp.sampler.PointBalancedBatchSampler` (whole samples, even point
  counts, no padding, the same number of steps on every rank);
- **sync batch norm over the process group** on CPU (gloo) and CUDA, through Lightning's
  ``LayerSync`` plugin (``Trainer(sync_batchnorm=True)``), reverted at teardown;
- **predictions in dataset order on every rank**: a predict DataLoader in dataset order gets the same
  point-balanced shares, and each step's outputs are all-gathered and merged as ``sparse_dp`` merges
  its replicas' (:mod:`~lightning_sparse_dp.step.gather`: per-sample lists and rows in the global batch's
  order), so ``trainer.predict`` returns one device's predictions on every rank.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_sparse_dp.ddp.exchange import (
    count_and_plan,
    destroy_process_group_at_exit,
    gather_objects,
    gather_step_outputs,
)
from lightning_sparse_dp.ddp.logged_means import HeldMeans
from lightning_sparse_dp.ddp.rank_loaders import dataset_point_counts, point_balanced_loader
from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler
from lightning_sparse_dp.loss.capture import TermCapture
from lightning_sparse_dp.loss.decide import ChunkShape, Summary, summarize
from lightning_sparse_dp.loss.memory import SiteMemory
from lightning_sparse_dp.loss.observer import StepObserver
from lightning_sparse_dp.loss.reweight import PartWeight, scaled
from lightning_sparse_dp.loss.step import rank_scale
from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.runtime.compat import results_of, trainer_of, uses_distributed_sampler
from lightning_sparse_dp.runtime.threads import ThreadSplit, follow_omp_num_threads
from lightning_sparse_dp.split import BatchLayoutError, SplitPlan, split_batch
from lightning_sparse_dp.step.context import dataloader_index
from lightning_sparse_dp.step.scatter import check_me_devices, place_batch
from lightning_sparse_dp.strategies.base import SparseStrategyMixin, dataloader_iter_steps
from lightning_sparse_dp.strategies.checks import warn_eval_batchnorm, warn_unsynchronized_batchnorm
from lightning_sparse_dp.strategies.exactness import check_rank_step
from lightning_sparse_dp.strategies.rank_logging import RankLogging
from lightning_sparse_dp.syncbn.layer_sync import eval_batch_statistics
from lightning_sparse_dp.syncbn.process_group import ProcessGroupSyncBatchNorm


class SparseDDPStrategy(RankLogging, SparseStrategyMixin, DDPStrategy):
    """Lightning's DDP for MinkowskiEngine sparse batches, registered as ``"sparse_ddp"``.

    ``Trainer(strategy="sparse_ddp", devices=M, num_nodes=N)`` launches and connects processes as
    ``"ddp"`` does (popen launcher, torchrun / SLURM / ``MASTER_ADDR`` + ``NODE_RANK`` environments,
    gloo on CPU, NCCL on CUDA); the module docstring lists what it adds.

    Args:
        loss_weighting: ``"terms"`` (default: each of torch's mean-reduced losses weighted by its own
            share, :mod:`~lightning_sparse_dp.loss.decide`; ``"auto"`` where the loss is not a linear
            combination of them, said once), ``"auto"`` (samples when the batch has a per-sample tensor, else
            points when it has a per-point target; :func:`~lightning_sparse_dp.loss.weights.resolve_auto`), ``"samples"
            (exact for losses averaged over samples), ``"points"`` (exact for losses averaged over points),
            ``"equal"`` (plain DDP: every rank weighs the same) or a callable ``fn(batch) -> number`` (e.g.
            the points whose label is not ``ignore_index``), as in ``sparse_dp``.
        split: how the samples of a global batch are dealt to ranks: ``"balanced"`` (default; even
            point counts) or ``"contiguous"`` (consecutive samples, a plain index split).
        count_points: ``count_points(dataset[i]) -> int``, points of one sample, used when the
            dataset has no ``point_counts`` attribute; default: rows of the sample's first tensor.
            Counts are measured once per dataset, each rank measuring ``1/world_size`` of it.
        layout: roles for batch entries that cannot be told apart, as for ``split_batch`` (used to
            count ``n_r``).
        output_layout: how ``trainer.predict``'s outputs of the ranks are merged, by key, as ``sparse_dp``'s
            (:func:`~lightning_sparse_dp.step.gather.gather_outputs`): ``{"pair": "fixed"}``...
        allow_unpatched_me: go on with CPU ranks on a MinkowskiEngine this project's recipe did not build (refused
            at setup otherwise: its CPU defects make a rank's result depend on its share of the batch).
        check_exactness, check_exactness_every_n_steps: the exactness check, as in ``sparse_dp``: rank 0's batch is the
            probe, every rank runs one device's step over it and its share through this strategy's weighting, and the
            averaged gradients and the module's state after the step are compared
            (:func:`~lightning_sparse_dp.strategies.exactness.check_rank_step`).
        **kwargs: passed to ``DDPStrategy``: what the Trainer fills (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``) and its options
            (``start_method``, ``timeout``, ``process_group_backend``, ``find_unused_parameters``,
            ``static_graph``...).

    Raises:
        ValueError: an unknown ``loss_weighting`` or ``split``.
    """

    strategy_name = "sparse_ddp"
    description = "DDP with exact losses, point-balanced batches and sync batch norm for MinkowskiEngine (lightning-sparse-dp)"
    own_layer_sync = ProcessGroupSyncBatchNorm  # Trainer(sync_batchnorm=True): batch norm over the process group

    def __init__(
        self,
        *,
        loss_weighting: Any = "terms",
        split: str = "balanced",
        count_points: Callable[[Any], int] | None = None,
        layout: Mapping[Any, str] | None = None,
        output_layout: Mapping[Any, str] | None = None,
        allow_unpatched_me: bool = False,
        check_exactness: bool | str = True,
        check_exactness_every_n_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        self._set_options(loss_weighting, split, layout, allow_unpatched_me, check_exactness, check_exactness_every_n_steps)
        super().__init__(**kwargs)
        self.output_layout = dict(output_layout) if output_layout else None
        self.count_points = count_points
        self._count: float | None = None  # n_r during a training / validation / test step
        self._capture: TermCapture | None = None  # the step's mean-reduced losses (loss_weighting="terms")
        self._batch: Any = None  # this rank's batch during a step
        self._plan: SplitPlan | None = None  # its split as one chunk, made when the terms need it
        self._memory: SiteMemory | None = None  # the site memory its logged values are read with (_memory_for)
        self._collectives: list[str] = []  # torch.distributed calls of the user's code in this step
        self._iterating: list[str] = []  # steps written as step(self, dataloader_iter), found at setup
        self._loss_scale = 1.0
        self._settling = False  # the step's held means are being logged as the global batch's (reduce leaves them)
        self._point_counts: dict[int, tuple[Any, list[int]]] = {}  # id(dataset) -> (dataset, counts)
        self._predict_samplers: list[PointBalancedBatchSampler] = []  # per predict DataLoader, in order
        self._warning_cache = WarningCache()
        self._threads: ThreadSplit | None = None  # ME's and OpenBLAS's thread counts changed for the run
        self._eval_sync = False  # the layer sync applied for a validate / test / predict run (batch norm without running stats)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        atexit.unregister(destroy_process_group_at_exit)  # registered once per process, however many runs
        atexit.register(destroy_process_group_at_exit)
        self._threads = follow_omp_num_threads()  # the launcher's OMP_NUM_THREADS, set after ME read it

    @override
    def teardown(self) -> None:
        if self._eval_sync and self.model is not None and self._layer_sync is not None:  # applied for validate / test
            self.model = self._layer_sync.revert(self.model)
        self._eval_sync = False
        if self._threads is not None:
            self._threads.restore()
            self._threads = None
        super().teardown()

    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        self._check_minkowski_build(self.root_device.type, self.world_size)
        self._iterating = dataloader_iter_steps(module)
        self._resolve_layer_sync()
        if (
            self._layer_sync is None
            and self.root_device.type == "cpu"
            and self.world_size > 1
            and module is not None
            and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())
        ):
            rank_zero_warn(
                "sparse_ddp: the model has SyncBatchNorm layers (e.g. ME.MinkowskiSyncBatchNorm), which torch runs on "
                "GPUs only; on CPU they raise. Pass Trainer(sync_batchnorm=True): sparse_ddp then synchronizes them over "
                "the process group (gloo), on CPU too."
            )
        fitting = trainer.state.fn == TrainerFn.FITTING
        eval_norms = [] if fitting else eval_batch_statistics(module)  # batch norm keeping the batch's statistics in eval
        if self._layer_sync is None and module is not None and fitting:  # said once
            warn_unsynchronized_batchnorm(module, self.world_size, "sparse_ddp")
        elif self._layer_sync is None:
            warn_eval_batchnorm(eval_norms, self.world_size, "sparse_ddp")
        self._eval_sync = self._layer_sync is not None and bool(eval_norms) and self.model is not None
        if self._eval_sync:  # DDPStrategy.setup applies the layer sync when fitting only
            self.model = self._layer_sync.apply(self.model)
        super().setup(trainer)  # applies self._layer_sync (ProcessGroupSyncBatchNorm) when fitting
        self._exactness.reset(self.world_size if fitting else 1, self._warning_cache)  # checked, or said off

    # --- exact loss and logs ---------------------------------------------------------------------
    def global_count(self, n: float) -> float:
        """``N = sum_r n_r`` over the ranks (one all-reduce; every rank must call it, in the same order)."""
        if self.loss_weighting == "equal" or not dist.is_available() or not dist.is_initialized():
            return n * self.world_size
        total = torch.tensor([n], dtype=torch.float64, device=self.root_device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item())

    def _weighted(self, step_name: str, args: tuple, kwargs: dict, run: Callable[[], Any] | None = None) -> Any:
        """The step (``run``, else Lightning's DDP step on the module) on this rank's batch ``args[0]``, its loss scale
        (``self._loss_scale``) and logged means weighted by what it counts (``run`` given: the exactness check's copy,
        the trainer's results left alone)."""
        if step_name in self._iterating:  # step(self, dataloader_iter): its batches are fetched inside it
            self._warning_cache.info(
                f"sparse_ddp: {step_name}(self, dataloader_iter) fetches its batches itself, so they cannot be weighted: "
                "its ranks are averaged as DDP does (the point-balanced sampler still deals the batches)."
            )
            return getattr(super(), step_name)(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        n, plan = count_and_plan(batch, self.loss_weighting, self.layout, self._warning_cache)
        terms = self.loss_weighting == "terms"
        if step_name == "training_step" and not terms:  # the gradient scale needs N now; evaluation steps need no collective
            total = self.global_count(n)
            # a global batch with nothing to count (every label ignored) contributes no gradient, never NaN
            self._loss_scale = PartWeight.rank(self.world_size, n / total if total > 0 else 0.0).loss_factor
        self._count = n
        results = results_of(trainer_of(self.lightning_module)) if run is None else None
        means = (HeldMeans(results, self._log_row, self._on_all_ranks)
                 if results is not None and self.loss_weighting != "equal" else None)
        self._batch, self._plan, self._collectives = batch, plan, []
        self._memory = self._memory_for(step_name)  # an evaluation step's logs: never the training steps' readings
        self._capture = TermCapture(self._collectives) if terms else None
        observer = self._capture or StepObserver(self._collectives)  # this rank's thread only: means, collectives
        step = run or partial(getattr(super(), step_name), *args, **kwargs)
        try:
            with means or nullcontext():
                output = observer.run(step)
            module = self.lightning_module
            if step_name == "training_step" and terms and (module is None or module.automatic_optimization):
                self._loss_scale = self._term_scale(output)
            if means is not None and means.calls:  # every rank logs its sync_dist means alike, as DDP requires
                self._settle(means)
            return output
        finally:
            self._count = None
            self._capture = None
            self._batch = self._plan = self._memory = None
            self._collectives = []

    def _step_plan(self) -> SplitPlan:
        """This rank's batch split as one chunk (what the terms are read against), once per step."""
        if self._plan is None:
            self._plan = split_batch(self._batch, 1, layout=self.layout)[1]
        return self._plan

    def _summary(self, value: Any) -> Summary:
        """This rank's :class:`Summary` of ``value`` (its loss, or a logged value) on its share of the batch."""
        assert self._capture is not None
        return summarize(self._capture, value, ChunkShape.of(self._step_plan(), 0), self._count or 0.0, self._collectives)

    def _on_all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce of a flag; ``flag`` without a process group of several)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        found = torch.tensor([int(flag)], device=self.root_device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        return bool(found.item())

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (:func:`~lightning_sparse_dp.ddp.exchange.gather_objects`); ``[obj]``
        without a process group of several."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [obj]
        return gather_objects(obj, self.root_device)

    def _term_scale(self, output: Any) -> float:
        """After the step (or at a ``manual_backward`` in it): the loss scale, and each term's gradient scale, from
        every rank's summary of the loss (:func:`rank_scale`)."""
        assert self._capture is not None
        summaries = self._gather(self._summary(loss_of(output)))
        return rank_scale(
            summaries, self.global_rank, self._capture, self.world_size, self._site_memory, self._warning_cache,
            self._step_plan,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        check, iterating = self._exactness, "training_step" in self._iterating
        checked = not iterating and not check.done and check_rank_step(self, args, kwargs)  # when due: compared
        output = self._weighted("training_step", args, kwargs)
        memory = self._site_memory
        sites, memory.last_sites = memory.last_sites, None  # every rank's: decided from every rank's summaries
        if (sites is not None and check.mode is not None and not iterating and sites not in check.site_sets
                and check.new_sites(sites)):
            if not checked:  # a loss call site no checked step called: this step checked too, after its forward
                check_rank_step(self, args, kwargs, again=True)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._weighted("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._weighted("test_step", args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward of ``closure_loss * world_size * n_r / N`` (the step output itself is left unscaled).

        Under manual optimization (``self.manual_backward(loss)`` inside the step) with ``loss_weighting="terms"``,
        the ranks decide on ``loss`` here, before its backward runs: every rank calls ``manual_backward`` alike.
        """
        module = self.lightning_module
        if self._capture is not None and module is not None and not module.automatic_optimization:
            self._loss_scale = self._term_scale(closure_loss)
        closure_loss = scaled(closure_loss, self._loss_scale)  # 0: nothing to count here (a NaN mean adds 0)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``predict_step`` on this rank's share, then every rank's output merged in the global
        batch's order (:func:`~lightning_sparse_dp.ddp.exchange.gather_step_outputs`), so each rank returns one device's
        predictions."""
        output = super().predict_step(*args, **kwargs)
        index = dataloader_index(args, kwargs)
        if self.world_size == 1 or not dist.is_initialized() or index >= len(self._predict_samplers):
            return output
        batch_idx = int(args[1] if len(args) > 1 else kwargs["batch_idx"])
        return gather_step_outputs(output, self._predict_samplers[index], batch_idx, self.root_device,
                                   args[0] if args else kwargs.get("batch"), self.layout, self.output_layout)

    @override
    def on_predict_end(self) -> None:
        self._predict_samplers = []
        super().on_predict_end()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's transfer, then, on a GPU, the batch's ``ME.SparseTensor`` / ``ME.TensorField`` rebuilt on
        this rank's device (:func:`~lightning_sparse_dp.step.scatter.place_batch`): they have no ``.to()``, so DDP leaves
        them on the CPU, where ME's CUDA layers crash the process on them.

        Raises:
            RuntimeError: an ME tensor elsewhere in a batch the split cannot read
                (:func:`~lightning_sparse_dp.step.scatter.check_me_devices`).
        """
        batch = super().batch_to_device(batch, device, dataloader_idx)
        device = torch.device(device or self.root_device)
        if device.type != "cuda":
            return batch
        try:
            check_me_devices(batch, device)
        except RuntimeError as misplaced:
            try:
                return place_batch(batch, device, layout=self.layout)
            except BatchLayoutError:
                raise misplaced from None
        return batch

    # --- point-balanced batches (rank_loaders.py) ---------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's, then its ``DistributedSampler`` replaced by a :class:`PointBalancedBatchSampler` where it
        is Lightning's own injection (:func:`~lightning_sparse_dp.ddp.rank_loaders.point_balanced_loader`)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = trainer_of(self.lightning_module)
        return point_balanced_loader(
            dataloader, world_size=self.world_size, rank=self.global_rank, split=self.split,
            counts_of=self.dataset_point_counts, say=self._warning_cache.info, predict_samplers=self._predict_samplers,
            use_distributed_sampler=uses_distributed_sampler(trainer),
        )

    def dataset_point_counts(self, dataset: Any) -> list[int]:
        """Points per sample of ``dataset``: its ``point_counts`` attribute, else measured once (shared by ranks;
        :func:`~lightning_sparse_dp.ddp.rank_loaders.dataset_point_counts`)."""
        return dataset_point_counts(dataset, self._point_counts, self.world_size, self.global_rank, self.count_points)


SparseDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["SparseDDPStrategy"]
