"""The hub reads what a step needs of the strategy once: the devices, when the step starts (its ``StepCall``), not again
at each stage; and enters the skipped stage only where some chunk's step returned ``None``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.strategies import sparse_dp as sparse_dp_module
from lightning_sparse_dp.strategies.single_process import SingleProcessParallelStrategy
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

CPU = torch.device("cpu")


class _Counting(SparseDataParallelStrategy):
    """Counts the reads of ``parallel_devices`` and ``root_device`` in its steps outside the four stages (the hub's
    own), and keeps each step's devices as its ``StepCall`` holds them."""

    def __init__(self, **kwargs):
        super().__init__(check_exactness=False, **kwargs)
        self.hub_reads = {"parallel_devices": 0, "root_device": 0}
        self.held: list[tuple[torch.device, ...]] = []
        self._hub = False

    @property
    def parallel_devices(self):
        if getattr(self, "_hub", False):  # not while the base class sets up
            self.hub_reads["parallel_devices"] += 1
        return SingleProcessParallelStrategy.parallel_devices.fget(self)

    @parallel_devices.setter
    def parallel_devices(self, devices):
        SingleProcessParallelStrategy.parallel_devices.fset(self, devices)

    @property
    def root_device(self):
        if getattr(self, "_hub", False):
            self.hub_reads["root_device"] += 1
        return SingleProcessParallelStrategy.root_device.fget(self)

    def _step(self, name, args, kwargs):
        self._hub = True
        try:
            return super()._step(name, args, kwargs)
        finally:
            self._hub = False

    def _through_stages(self, step):
        self.held.append(step.call.parallel_devices)
        return super()._through_stages(step)

    def _stage(self, stage, *args, **kwargs):
        hub, self._hub = self._hub, False
        try:
            return getattr(super(), stage)(*args, **kwargs)
        finally:
            self._hub = hub

    def scatter(self, *args, **kwargs):
        return self._stage("scatter", *args, **kwargs)

    def replicate(self, *args, **kwargs):
        return self._stage("replicate", *args, **kwargs)

    def parallel_apply(self, *args, **kwargs):
        return self._stage("parallel_apply", *args, **kwargs)

    def gather(self, *args, **kwargs):
        return self._stage("gather", *args, **kwargs)


def _batches(n=2):
    return [collate_dict(random_samples(9, seed=90 + i)) for i in range(n)]


class _Fewer(Callback):
    """Gives the strategy two devices after the first step (as a new fit on fewer devices would)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            trainer.strategy.parallel_devices = [CPU, CPU]


def test_the_hub_reads_the_devices_once_a_step_and_each_step_anew():
    strategy = _Counting()
    trainer(strategy=strategy, devices=3, max_steps=2, callbacks=[_Fewer()]).fit(SparseNet(), loader(*_batches()))
    assert strategy.hub_reads == {"parallel_devices": 2, "root_device": 0}  # one read when each step starts
    assert strategy.held == [(CPU,) * 3, (CPU,) * 2]  # devices changed between steps: the next step's are read anew


class _Skips(SparseNet):
    """A training step that returns ``None`` in every chunk (Lightning then skips the optimization step)."""

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return None


@pytest.mark.parametrize(("module", "entered"), [(SparseNet, 0), (_Skips, 2)], ids=["outputs", "none"])
def test_the_skipped_stage_is_entered_only_where_a_chunk_returned_none(monkeypatch, module, entered):
    calls = []
    skipped = sparse_dp_module.skipped_outputs
    monkeypatch.setattr(sparse_dp_module, "skipped_outputs", lambda step: calls.append(step) or skipped(step))
    model = module()
    before = [p.detach().clone() for p in model.parameters()]
    strategy = SparseDataParallelStrategy(check_exactness=False)
    trainer(strategy=strategy, devices=3, max_steps=2, max_epochs=1).fit(model, loader(*_batches()))
    assert len(calls) == entered
    trained = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert trained == (module is SparseNet)  # every step skipped: nothing trained, as on one device


class _OwnDevices(SparseDataParallelStrategy):
    """A subclass whose ``parallel_devices`` is its own property (not what the base class's setter stored)."""

    own = [torch.device("cpu", 1), torch.device("cpu", 2)]

    @property
    def parallel_devices(self):
        return self.own

    @parallel_devices.setter
    def parallel_devices(self, devices):
        SingleProcessParallelStrategy.parallel_devices.fset(self, devices)


def test_the_root_device_is_the_first_of_a_subclass_own_parallel_devices():
    strategy = _OwnDevices(check_exactness=False)
    strategy.parallel_devices = [CPU, CPU, CPU]  # stored by the base class's setter, which the subclass does not read
    assert strategy.root_device == torch.device("cpu", 1)
