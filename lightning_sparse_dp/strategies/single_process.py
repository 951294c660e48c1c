"""Single process: what Lightning asks of a parallel strategy that runs every device in one process.

Cut after Lightning Fabric's ``strategies/dp.py``: one process, world size 1, the root device is the
first device, and the LightningModule itself is never wrapped, so checkpoints hold its plain state
dict. Collectives across processes are no-ops (there is one), the batch stays where the DataLoader
left it (the step places each chunk on its own device), and teardown skips
``ParallelStrategy.teardown``, which expects a cluster environment. The step pipeline is
:class:`~lightning_sparse_dp.strategies.sparse_dp.SparseDataParallelStrategy`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.fabric.utilities.data import suggested_max_num_workers
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_sparse_dp.runtime.compat import LOOPS_CALL_BEFORE_TRANSFER, call_batch_hook, trainer_of
from lightning_sparse_dp.runtime.devices import check_default_streams, check_devices
from lightning_sparse_dp.runtime.executor import ReplicaExecutor, replicas_running
from lightning_sparse_dp.runtime.me import check_coordinate_manager_mode
from lightning_sparse_dp.runtime.threads import ThreadSplit, configure_replica_threads


class SingleProcessParallelStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` whose devices all belong to this one process (base of ``sparse_dp``).

    The step hooks are the subclass's (``sparse_dp``'s hub); this class answers what Lightning asks of a parallel
    strategy in one process and keeps the replica threads from setup to teardown (:meth:`_start_replica_threads`).

    Raises:
        MisconfigurationException: at ``setup_environment``, for unusable devices
            (:func:`~lightning_sparse_dp.runtime.devices.check_devices`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._collective_warnings = WarningCache()  # a collective called in a replica's step, said once
        self._executor: ReplicaExecutor | None = None  # the replica threads (_start_replica_threads)
        self._outside_fit: ReplicaExecutor | None = None  # for a step outside setup..teardown: threads per call
        self._thread_split: ThreadSplit | None = None  # the CPU threads split between them, given back at teardown
        self._core_groups: tuple[int, ...] | None = None  # replicas pinned to one core share a group (plan_cores)

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The replicas' devices, one entry per replica: each device Lightning gives, ``replicas_per_device`` times
        (the subclass's attribute; 1 without it)."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        k = getattr(self, "replicas_per_device", 1)
        self._parallel_devices = None if devices is None else [d for d in devices for _ in range(k)]

    @property
    def num_nodes(self) -> int:
        """1: every device of this strategy belongs to this one process."""
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # the Trainer's connector sets this from Trainer(num_nodes=...) on strategies that have the attribute
        if num_nodes != 1:
            raise MisconfigurationException(
                f"Trainer(num_nodes={num_nodes}) with {getattr(self, 'strategy_name', type(self).__name__)}: its replicas "
                "are threads of one process, on one machine. For several machines use strategy='sparse_ddp' (the same "
                "exact training over processes and nodes), e.g. Trainer(strategy='sparse_ddp', num_nodes="
                f"{num_nodes}, devices=<GPUs per node>)."
            )

    @property
    @override
    def world_size(self) -> int:
        """1: one process, whatever cluster it runs in (a SLURM, torchelastic, LSF or MPI environment Lightning detected
        describes the job's processes, not this strategy's; its requeue and signal handling still apply)."""
        return 1

    @property
    @override
    def global_rank(self) -> int:
        """0: the only process (see :attr:`world_size`)."""
        return 0

    @property
    @override
    def local_rank(self) -> int:
        """0: the only process on this machine (see :attr:`world_size`)."""
        return 0

    @property
    @override
    def node_rank(self) -> int:
        """0: one machine (see :attr:`world_size`)."""
        return 0

    def advise_workers(self, dataloader: object) -> None:
        """Lightning's advice for a loader with fewer than 2 workers, where Lightning's own check stays silent because
        it assumes a process per device (``suggested_max_num_workers(num_devices)``): this strategy is one process, so
        the bound is one process's, as plain Lightning's on one device (``data_connector._worker_check``)."""
        trainer = trainer_of(self.lightning_module)
        if not isinstance(dataloader, DataLoader) or trainer is None or dataloader.num_workers >= 2:
            return
        ours, lightnings = suggested_max_num_workers(1), suggested_max_num_workers(max(1, trainer.num_devices))
        if lightnings > 1 or ours <= 1 or dataloader.num_workers > 0:  # Lightning says it, or has nothing to say
            return
        stage = trainer.state.stage
        name = f"{stage.dataloader_prefix}_dataloader" if stage is not None else "dataloader"
        advice = (  # Lightning's own words (lightning/pytorch/trainer/connectors/data_connector.py, _worker_check)
            f"The '{name}' does not have many workers which may be a bottleneck. Consider increasing the value of the"
            f" `num_workers` argument` to `num_workers={ours}` in the `DataLoader` to improve performance."
        )
        rank_zero_warn(advice, category=PossibleUserWarning)

    @property
    @override
    def root_device(self) -> torch.device:
        """The first of :attr:`parallel_devices` (a subclass's own property included).

        Raises:
            AssertionError: no devices yet (the strategy was given no Trainer).
        """
        devices = self.parallel_devices
        assert devices is not None
        return devices[0]

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None  # one process reads the whole batch; no DistributedSampler

    @property
    @override
    def is_distributed(self) -> bool:
        return False

    @override
    def setup_environment(self) -> None:
        check_devices(list(self.parallel_devices or []))
        check_default_streams(self.parallel_devices or [])
        check_coordinate_manager_mode(len(self.parallel_devices or []))  # again at every step (step/scatter.py)
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The batch as ``on_before_batch_transfer`` leaves it; the batch stays where it is.

        The hook runs once per batch, as under plain Lightning: Lightning 2.6's loops call it before this
        method (:data:`LOOPS_CALL_BEFORE_TRANSFER`), earlier versions' ``batch_to_device`` called it, and then
        this method does. The subclass's ``batch_to_device`` then prepares the batch for the step: where the module has
        its own ``transfer_batch_to_device`` / ``on_after_batch_transfer``, they run there, on the main thread, on
        each chunk with its device (:mod:`~lightning_sparse_dp.step.prepare`); otherwise each chunk is moved in its
        replica's thread.
        """
        module = self.lightning_module
        if module is None:
            return batch
        if LOOPS_CALL_BEFORE_TRANSFER:
            return batch
        return call_batch_hook(module, "on_before_batch_transfer", batch, dataloader_idx)

    # --- the replica threads: one per replica, from setup to teardown ------------------------------------
    def _start_replica_threads(self, pin: bool | None, synchronized: bool) -> None:
        """At setup: the replica threads (:class:`~lightning_sparse_dp.runtime.executor.ReplicaExecutor`), and the CPU
        cores split between them, pinned per ``pin`` (:func:`~lightning_sparse_dp.runtime.threads.configure_replica_threads`;
        a warning for pinning on GPUs)."""
        assert self.parallel_devices is not None
        if self._executor is None:
            self._executor = ReplicaExecutor(len(self.parallel_devices))
            weakref.finalize(self, self._executor.shutdown)
        executor = self._executor
        if self._thread_split is None:
            self._thread_split, self._core_groups = configure_replica_threads(
                executor, len(self.parallel_devices), pin, synchronized, self.root_device.type
            )

    def _replica_threads(self) -> ReplicaExecutor:
        """The replica threads: made at setup and shut down at teardown. A step run outside them (Lightning's loop
        driven by hand after ``fit``, as plain Lightning allows) runs each of its calls on threads that end with the
        call (a ``transient`` executor), so that nothing is left running after it."""
        if self._executor is not None:
            return self._executor
        if self._outside_fit is None:
            assert self.parallel_devices is not None
            self._outside_fit = ReplicaExecutor(len(self.parallel_devices), transient=True)
        return self._outside_fit

    def _say_in_replica(self, call: str) -> None:
        """Once per strategy: a collective called from a replica's step returns the replica's own value (its chunk's)."""
        if replicas_running() > 1:
            self._collective_warnings.warn(
                f"sparse_dp: {call} in a replica's step returns that replica's own value (its chunk's), not the whole "
                "batch's that one device's step sees, nor what DDP's ranks gather: the replicas are threads of one "
                "process, with no collective between their steps. Compute what needs the whole batch after the step "
                "(from the gathered outputs in on_train_batch_end / on_validation_batch_end), or use sparse_ddp."
            )

    @override
    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: Any = "mean") -> Tensor | Any:
        self._say_in_replica("strategy.reduce")
        return tensor  # one process: nothing to reduce across processes

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        self._say_in_replica("self.all_gather")
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._say_in_replica("strategy.broadcast")
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._say_in_replica("strategy.reduce_boolean_decision")
        return decision

    @override
    def teardown(self) -> None:
        """The replica threads stopped and the CPU threads given back; then ``Strategy.teardown`` (not
        ``ParallelStrategy``'s, which expects a cluster environment)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._thread_split is not None:
            self._thread_split.restore()
            self._thread_split = None
        Strategy.teardown(self)


__all__ = ["SingleProcessParallelStrategy"]
