"""Where sparse_dp must behave as plain Lightning on one device does, found by running Lightning's own tests with the
strategy swapped in (issue 58): threads left after teardown, a cluster environment read by one process, a step run
after ``fit`` returned. Each against plain Lightning."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.exact import relative_difference, same_start
from tests.support.helpers import SparseNet, collate_dict, random_samples, sample_loader, trainer


def test_no_thread_is_left_running_after_any_of_twenty_fits():
    before = set(threading.enumerate())
    for i in range(20):
        strategy = "sparse_dp" if i % 2 else __import__("lightning_sparse_dp").SparseDataParallelStrategy(
            sync_batchnorm=True
        )
        trainer(strategy=strategy, devices=3, max_steps=1).fit(SparseNet(batch_norm=True), sample_loader(random_samples(14)))
        left = [t.name for t in set(threading.enumerate()) - before]
        assert not left, (i, left)


SLURM = {
    "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "2",
}
TORCHELASTIC = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                "MASTER_ADDR": "localhost", "MASTER_PORT": "29555", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(("environment", "kind"), [(SLURM, "SLURMEnvironment"), (TORCHELASTIC, "TorchElasticEnvironment")],
                         ids=["slurm", "torchelastic"])
def test_one_process_inside_a_cluster_job_is_rank_zero_of_one(environment, kind, monkeypatch):
    """Inside a job step of several tasks, sparse_dp (one process) is world size 1, rank 0: it logs and saves, as plain
    Lightning on one device does there; Lightning's cluster environment is still detected (requeue, signals)."""
    for k, v in environment.items():
        monkeypatch.setenv(k, v)
    ours, reference = same_start(SparseNet)
    t = trainer(strategy="sparse_dp", devices=3, max_steps=1)
    plain = trainer(devices=1, max_steps=1)
    assert type(t.strategy.cluster_environment).__name__ == kind  # detected: requeue and signals as Lightning sets them
    assert (t.world_size, t.global_rank, t.local_rank, t.node_rank, t.is_global_zero) == (1, 0, 0, 0, True)
    loader = sample_loader(random_samples(14))
    t.fit(ours, loader)
    plain.fit(reference, loader)
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        assert relative_difference(a, b) <= 1e-5, name  # float32: the same step; exactness is tested in float64


class Quiet(SparseNet):
    def validation_step(self, batch, batch_idx):  # no self.log: Lightning refuses logging outside its loops
        return self.loss(batch)


def test_a_step_run_by_hand_after_fit_runs_as_on_one_device():
    """Lightning's loop driven by hand after ``fit`` returned (three of Lightning's own tests do): the replica threads
    come back for the step, as plain Lightning runs it."""
    ours, reference = same_start(Quiet)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in collate_dict(random_samples(9, seed=4)).items()}
    mine = trainer(strategy="sparse_dp", devices=3, max_steps=1, precision="64-true")
    one = trainer(devices=1, max_steps=1, precision="64-true")
    from tests.support.helpers import loader

    mine.fit(ours, loader(batch))
    one.fit(reference, loader(batch))
    with torch.no_grad():
        got = mine.strategy.validation_step(batch, 0)
        want = one.strategy.validation_step(batch, 0)
    assert relative_difference(got, want) <= 1e-10
    assert not [t.name for t in threading.enumerate() if t.name.startswith("sparse_dp")]  # none left (issue 66)


def test_a_training_step_driven_by_hand_after_fit_leaves_no_thread_and_equals_one_device():
    """Lightning's loop tests drive the optimization by hand after ``fit`` (step, backward, optimizer step): the
    replica threads serve each call and end with it, and the step is one device's."""
    from lightning.pytorch.trainer.states import RunningStage

    from tests.support.helpers import loader

    ours, reference = same_start(SparseNet)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in collate_dict(random_samples(9, seed=4)).items()}
    before = set(threading.enumerate())
    losses = []
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3}), (reference, {"devices": 1})):
        t = trainer(max_steps=1, precision="64-true", **kwargs)
        t.fit(model, loader(batch))
        t.state.stage = RunningStage.TRAINING
        out = t.fit_loop.epoch_loop.automatic_optimization.run(t.optimizers[0], 0, {"batch": batch, "batch_idx": 0})
        losses.append(out["loss"])
    assert not [t.name for t in set(threading.enumerate()) - before]
    assert relative_difference(losses[0], losses[1]) <= 1e-10
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        assert relative_difference(a, b) <= 1e-10, name


class LogsBadly(SparseNet):
    """``self.log`` calls Lightning refuses, each caught in the step so the refusal's type and words are compared."""

    def __init__(self, what):
        super().__init__()
        self.what, self.caught = what, []
        if what != "metric-none":  # a metric attribute, so the stray one is not the only one
            self.loose = __import__("torchmetrics").MeanMetric()

    def _try(self, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (compared below)
            self.caught.append((type(err).__name__, str(err)))

    def training_step(self, batch, batch_idx):
        if self.what == "none":
            self._try(lambda: self.log("foo", None))
        elif self.what == "shape":
            self._try(lambda: self.log("foo", torch.ones(3)))
        elif self.what in ("metric", "metric-none"):
            stray = __import__("torchmetrics").MeanMetric()
            self._try(lambda: self.log("foo", stray))
        elif self.what == "twice":  # one name, different options, in one step
            self._try(lambda: (self.log("foo", 1.0), self.log("foo", 2.0, prog_bar=True)))
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self._try(lambda: self.log("foo", 1.0))
        return self.net(__import__("MinkowskiEngine").SparseTensor(batch["features"], batch["coordinates"])).F


@pytest.mark.parametrize("what", ["none", "shape", "metric", "metric-none", "twice", "predict"])
def test_lightnings_own_errors_for_what_self_log_refuses_raised_at_the_call(what):
    runs = {}
    for name, strategy, devices in (("plain", "auto", 1), ("ours", "sparse_dp", 3)):
        module = LogsBadly(what)
        t = trainer(strategy=strategy, devices=devices, max_steps=1)
        data = sample_loader(random_samples(14))
        t.predict(module, data) if what == "predict" else t.fit(module, data)
        runs[name] = sorted(set(module.caught))
    assert runs["plain"] and runs["ours"] == runs["plain"]


def test_lightnings_workers_advice_for_one_process(monkeypatch):
    """Lightning suggests ``cpus // devices - 1`` workers, assuming a process per device; sparse_dp is one process,
    so a loader without workers gets the advice plain Lightning gives on one device, in Lightning's words."""
    import warnings

    import lightning.fabric.utilities.data as data

    monkeypatch.setattr(data, "_num_cpus_available", lambda: 8)
    said = {}
    for name, strategy, devices in (("plain", "auto", 1), ("ours", "sparse_dp", 3)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy=strategy, devices=devices, max_steps=1).fit(SparseNet(), sample_loader(random_samples(14)))
        said[name] = [str(w.message) for w in caught if "does not have many workers" in str(w.message)]
    assert said["plain"] and said["ours"] == said["plain"]
    assert "num_workers=7" in said["ours"][0]


def test_lightnings_backward_wrapped_on_the_base_class_runs_once_per_step_as_on_one_device():
    """Lightning's own tests wrap ``Strategy.backward`` on the base class (``mock.patch.object(Strategy, "backward",
    wraps=trainer.strategy.backward)``, its SWA tests): the strategy's backward is Lightning's, so the wrapper sees one
    call per optimizer step and no recursion, as under plain Lightning."""
    from unittest import mock

    from lightning.pytorch.strategies import Strategy

    calls = {}
    for name, strategy, devices in (("plain", "auto", 1), ("ours", "sparse_dp", 3)):
        t = trainer(strategy=strategy, devices=devices, max_steps=3)
        with mock.patch.object(Strategy, "backward", wraps=t.strategy.backward) as wrapped:
            t.fit(SparseNet(), sample_loader(random_samples(28)))
        calls[name] = wrapped.call_count
    assert calls["plain"] == 3 and calls["ours"] == calls["plain"]


class LogsInTransfer(SparseNet):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.log("moved", 1.0)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_self_log_in_a_transfer_hook_is_refused_with_lightnings_words():
    """The transfer hooks run through Lightning's own hook call (issue 66): ``self.log`` there is refused as there."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    said = {}
    for name, strategy, devices in (("plain", "auto", 1), ("ours", "sparse_dp", 3)):
        with pytest.raises(MisconfigurationException) as raised:
            trainer(strategy=strategy, devices=devices, max_steps=1).fit(LogsInTransfer(), sample_loader(random_samples(14)))
        said[name] = str(raised.value)
    assert "You can't `self.log()` inside `transfer_batch_to_device`" in said["plain"] and said["ours"] == said["plain"]
