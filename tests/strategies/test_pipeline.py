"""The strategy as a pipeline: overridable stages, Lightning's profiler and LayerSync plugin points,
per-step replica state that is undone after the step."""

from __future__ import annotations

import dataclasses
import logging

import MinkowskiEngine as ME
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.ddp.exchange import local_count
from lightning_sparse_dp.replica.recorder import LogRecorder
from lightning_sparse_dp.step.context import StepCall, StepContext
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm, SyncBatchNorm1d
from lightning_sparse_dp.syncbn.layer_sync import SyncBatchNormSwap
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

STAGES = ("split", "replicate", "apply", "gather", "log", "backward")  # once per step each


def _batch(n=7, seed=3):
    return collate_dict(random_samples(n, seed=seed))


def test_stages_are_lightning_profiler_actions(both_preparations):
    t = trainer(strategy="sparse_dp", devices=3, profiler="simple", max_steps=2)
    t.fit(SparseNet(), loader(_batch(), _batch(seed=4)))
    durations = t.profiler.recorded_durations
    for stage in STAGES:
        assert len(durations[f"[sparse_dp]{stage}"]) == 2, stage
    # placing runs in the replicas' threads when they prepare (stage scatter<i>, no profiler action), else here
    assert len(durations["[sparse_dp]place"]) == (0 if both_preparations else 2)
    assert len(durations["[sparse_dp]state"]) == 6  # installed, undone and merged back into the module, each step
    step = durations["[Strategy]SparseDataParallelStrategy.training_step"]
    apply = durations["[sparse_dp]apply"]
    assert all(a <= s for a, s in zip(apply, step))  # the stage runs inside Lightning's own training_step action


class _Recording(SparseDataParallelStrategy):
    """Records the order its stages are called in; ``gather`` doubles the loss to show an override takes effect (no
    exactness check: its run goes through the stages too)."""

    def __init__(self, **kwargs):
        super().__init__(**{"check_exactness": False, **kwargs})
        self.calls: list[str] = []

    def scatter(self, batch, step=None):
        self.calls.append("scatter")
        return super().scatter(batch, step)

    def replicate(self, module, devices, step=None):
        self.calls.append("replicate")
        return super().replicate(module, devices, step)

    def parallel_apply(self, replicas, inputs, step, *args, **kwargs):
        self.calls.append(f"parallel_apply:{step.call.name}:{len(replicas)}")
        return super().parallel_apply(replicas, inputs, step, *args, **kwargs)

    def gather(self, outputs, step):
        self.calls.append("gather")
        return 2 * super().gather(outputs, step)


def test_overridden_stages_are_called_in_order_and_take_effect():
    batch = _batch()
    plain, doubled = SparseNet(), SparseNet()
    doubled.load_state_dict(plain.state_dict())
    start = [p.detach().clone() for p in plain.parameters()]
    ours = _Recording()
    trainer(strategy=ours, devices=3).fit(doubled, loader(batch))
    assert ours.calls == ["scatter", "replicate", "parallel_apply:training_step:3", "gather"]
    trainer(strategy="sparse_dp", devices=3).fit(plain, loader(batch))
    # plain SGD: the doubled loss moves every parameter twice as far from the same start
    for (name, p), q, p0 in zip(doubled.named_parameters(), plain.parameters(), start):
        assert not torch.equal(q, p0), name
        torch.testing.assert_close(p - p0, 2 * (q - p0), rtol=1e-4, atol=1e-7, msg=name)


class _BatchNormTypes(Callback):
    def __init__(self):
        self.during: list[type] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during = [type(m) for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def test_trainer_sync_batchnorm_goes_through_the_layer_sync_plugin():
    model, types = SparseNet(batch_norm=True), _BatchNormTypes()
    t = trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, callbacks=[types])
    t.fit(model, loader(_batch()))
    assert type(t.strategy._layer_sync) is SyncBatchNormSwap  # Lightning's TorchSyncBatchNorm was replaced at setup
    assert types.during == [SyncBatchNorm1d]  # swapped while fitting (a BatchNorm1d still, for isinstance)
    assert [type(m) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] == [
        torch.nn.BatchNorm1d
    ]  # and reverted at teardown


@pytest.mark.parametrize("option", [True, False])
def test_strategy_sync_batchnorm_survives_the_trainer_without_the_flag(option):
    types = _BatchNormTypes()
    t = trainer(strategy=SparseDataParallelStrategy(sync_batchnorm=option), devices=3, callbacks=[types])
    t.fit(SparseNet(batch_norm=True), loader(_batch()))
    assert types.during == [SyncBatchNorm1d if option else torch.nn.BatchNorm1d]
    assert type(t.strategy._layer_sync) is (SyncBatchNormSwap if option else type(None))


class _OwnLayerSync(LayerSync):
    def __init__(self):
        self.applied = self.reverted = 0

    def apply(self, model):
        self.applied += 1
        return model

    def revert(self, model):
        self.reverted += 1
        return model


def test_a_layer_sync_plugin_of_the_users_own_is_applied_and_reverted():
    plugin = _OwnLayerSync()
    t = trainer(strategy="sparse_dp", devices=3, plugins=[plugin])
    t.fit(SparseNet(), loader(_batch()))
    assert t.strategy._layer_sync is plugin
    assert (plugin.applied, plugin.reverted) == (1, 1)


class _WithMetric(SparseNet):
    def __init__(self):
        super().__init__()
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.acc(self(x).argmax(1), batch["labels"])
        self.log("acc", self.acc, True)  # prog_bar given positionally, as LightningModule.log allows
        return loss


def test_per_step_replica_state_is_undone_after_the_step():
    model = _WithMetric()
    strategy = SparseDataParallelStrategy()
    seen = {}

    class Peek(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            replicas = strategy._replicas.modules
            seen["log"] = ["log" in r.__dict__ for r in [pl_module, *replicas]]
            seen["print"] = ["print" in r.__dict__ for r in replicas]
            copies = {id(c) for c in strategy._replica_metrics._copies.values()}
            seen["metric copies left in replicas"] = [id(r.acc) in copies for r in replicas]
            seen["root acc updates"] = pl_module.acc._update_count

    t = trainer(strategy=strategy, devices=3, callbacks=[Peek()])
    t.fit(model, loader(_batch()))
    assert seen["log"] == [False] * 4 and seen["print"] == [False] * 3
    assert seen["metric copies left in replicas"] == [False] * 3
    assert seen["root acc updates"] == 1  # the replicas' updates merged into the root metric, counted as one device's
    assert "acc" in t.progress_bar_metrics  # prog_bar=True, given positionally, reached Lightning


def test_log_recorder_binds_lightning_module_log_signature():
    rec = LogRecorder()
    rec("a", 1.0, True, False, batch_size=3)
    assert rec.calls["a"].kwargs == {"prog_bar": True, "logger": False, "batch_size": 3}
    with pytest.raises(TypeError, match="prog_bra"):
        rec("b", 1.0, prog_bra=True)


class _SnapshotAtTeardown(SparseDataParallelStrategy):
    """Notes each replica batch-norm layer's group membership when teardown begins."""

    def teardown(self):
        self.memberships = [
            (layer.collective, layer.update_running_stats) for layers in self._replica_sync_layers for layer in layers
        ]
        super().teardown()


def test_a_failed_step_leaves_no_layer_in_its_batch_norm_group():
    model = SparseNet(batch_norm=True, fail_on_replica_with=2)
    strategy = _SnapshotAtTeardown(sync_batchnorm=True)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(strategy=strategy, devices=3).fit(model, loader(_batch()))
    # the step raised in one replica; the group the step made must not stay attached to the layers
    assert len(strategy.memberships) == 3  # one synchronized layer per replica
    assert strategy.memberships == [(None, True)] * 3
    assert not any(isinstance(m, SyncBatchNorm) for m in model.modules())  # reverted at teardown


def test_a_successful_step_keeps_its_group_for_the_backward_pass():
    strategy = _SnapshotAtTeardown(sync_batchnorm=True)
    trainer(strategy=strategy, devices=3).fit(SparseNet(batch_norm=True), loader(_batch()))
    # the replicas' backward passes were the group's second phase; the next step's group would replace it
    assert [m is not None for m, _ in strategy.memberships] == [True] * 3
    assert [root for _, root in strategy.memberships] == [True, False, False]  # only the root replica updates stats


def test_a_step_outside_setup_makes_its_replica_threads_and_one_without_devices_says_so():
    """A step run before setup or after teardown (Lightning's loop driven by hand) runs, as under plain Lightning; a
    strategy no Trainer gave devices says what is missing (issue 58)."""
    with pytest.raises(RuntimeError, match="no devices yet.*through a Trainer"):
        SparseDataParallelStrategy().parallel_apply([SparseNet()], [_batch()], hook="training_step", args=(0,))
    strategy = SparseDataParallelStrategy(parallel_devices=[torch.device("cpu")] * 2)
    modules, batches = [SparseNet(), SparseNet()], [_batch(), _batch(seed=5)]
    got = strategy.parallel_apply(modules, batches, hook="validation_step", args=(0,))
    with pytest.raises(TypeError, match="name the step hook"):
        strategy.parallel_apply(modules, batches)
    want = [m.validation_step(b, 0) for m, b in zip(modules, batches)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_step_is_given_apart_from_its_results_and_gather_needs_them():
    """What a step is given (``step.call``) is read-only; ``gather`` reads the plan and weights the stages made, and a
    context without them is refused naming what is missing (issue 68)."""
    strategy = SparseDataParallelStrategy(parallel_devices=[torch.device("cpu")] * 2)
    call = StepCall(name="validation_step", batch=None, source=None, module=SparseNet(), args=(0,), kwargs={},
                    manual=False, in_threads=False, timer=strategy._timer, warnings=WarningCache())
    step = StepContext(call)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.call.name = "training_step"
    with pytest.raises(ValueError, match="gather\\(outputs, step\\) merges by the step's split plan and weights"):
        strategy.gather([torch.tensor(1.0), torch.tensor(2.0)], step)


class _OldGather(SparseDataParallelStrategy):
    def gather(self, outputs, plan, weights):  # the signature before the stages took the step's context
        return super().gather(outputs, plan)


def test_a_gather_written_for_the_old_signature_is_refused_at_setup():
    with pytest.raises(MisconfigurationException, match=r"def gather\(self, outputs, step\).*step\.plan"):
        trainer(strategy=_OldGather(), devices=3).fit(SparseNet(), loader(_batch()))


def test_sparse_ddp_says_what_auto_chose(caplog):
    warning_cache = WarningCache()
    with caplog.at_level(logging.INFO):
        n = local_count(_batch(), "auto", warning_cache=warning_cache)
        local_count(_batch(seed=5), "auto", warning_cache=warning_cache)
    assert n == 7.0  # the batch has per-sample labels: samples
    assert caplog.text.count("sparse_ddp: loss_weighting='auto' weights each rank's loss by its samples") == 1


class _PassesStep(SparseDataParallelStrategy):
    """Stages of its own that hand the step's context on to the strategy's."""

    def scatter(self, batch, step=None):
        return super().scatter(batch, step)

    def replicate(self, module, devices, step=None):
        return super().replicate(module, devices, step)


class _DropsStep(SparseDataParallelStrategy):
    """Stages of its own that do not hand the step's context on: they run as written, on the main thread."""

    def scatter(self, batch, step=None):
        return super().scatter(batch)

    def replicate(self, module, devices, step=None):
        return super().replicate(module, devices)


def test_an_overridden_stage_prepares_where_its_docstring_says():
    """Overriding a stage does what its docstring says (issue 60), with no check of which class defined it: one that
    hands ``step`` on keeps each replica cutting and placing its chunk in its own thread (stage ``scatter<i>``, none
    ``place``); one that does not cuts and places on the main thread (stage ``place``); both train exactly as the
    strategy itself does."""
    reference = SparseNet()
    trained, stages = {}, {}
    for name, cls in (("own", SparseDataParallelStrategy), ("passes", _PassesStep), ("drops", _DropsStep)):
        model = SparseNet()
        model.load_state_dict(reference.state_dict())
        strategy = cls(record_stage_times=True, prepare_in_threads=True)
        trainer(strategy=strategy, devices=3, max_steps=2).fit(model, loader(_batch(), _batch(seed=4)))
        trained[name], stages[name] = model, [set(step) for step in strategy.stage_times.steps]
    for name in ("own", "passes"):
        assert all({"scatter0", "scatter2"} <= s and "place" not in s for s in stages[name]), name
    assert all("place" in s and "scatter0" not in s for s in stages["drops"])
    for name in ("passes", "drops"):
        for (key, p), q in zip(trained[name].named_parameters(), trained["own"].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8, msg=f"{name}: {key}")
