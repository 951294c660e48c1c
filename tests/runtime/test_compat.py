"""lightning_sparse_dp/runtime/compat.py: every private Lightning and torchmetrics name the package uses, exercised on
real objects of the installed versions (scripts/min_versions.sh runs this file at the lowest ones too)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.utilities import dim_zero_sum

from lightning_sparse_dp.runtime import compat


class Probe(L.LightningModule):
    """Records what the compat entries read inside a real fit on one CPU device."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[str, object] = {}
        self.order: list[str] = []

    def training_step(self, batch, batch_idx):
        trainer = compat.trainer_of(self)
        self.seen.update(trainer=trainer, results=compat.results_of(trainer), hook=compat.current_hook(self),
                         named=compat.has_hook_name(self))
        moved = compat.apply_batch_transfer(self, [torch.ones(1)], torch.device("cpu"), 0)
        self.seen["moved"] = moved
        self.seen["before"] = compat.call_batch_hook(self, "on_before_batch_transfer", [torch.ones(1)], 0)
        return self.layer(batch[0]).sum()

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.order.append("on_before_batch_transfer")
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.order.append("transfer")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_backward(self):
        self.order.append("on_after_backward")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Ordered(L.pytorch.strategies.SingleDeviceStrategy):
    def batch_to_device(self, batch, device=None, dataloader_idx=0):
        self.lightning_module.order.append("batch_to_device")
        return super().batch_to_device(batch, device, dataloader_idx)


@pytest.fixture(scope="module")
def fitted():
    model = Probe()
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = L.Trainer(strategy=Ordered(device=torch.device("cpu")), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model, data)
    return trainer, model


def test_lightning_module_entries_read_the_running_trainer_and_hook(fitted):
    trainer, model = fitted
    assert model.seen["trainer"] is trainer and model.seen["named"] is True
    assert isinstance(model.seen["results"], _ResultCollection)
    assert model.seen["hook"] == "training_step"
    assert model.seen["moved"][0].device.type == "cpu" and "transfer" in model.order  # the module's own hook ran
    assert torch.equal(model.seen["before"][0], torch.ones(1))
    compat.set_current_hook(model, "validation_step")
    assert compat.current_hook(model) == "validation_step"
    twin = Probe()
    compat.set_trainer(twin, trainer)
    assert compat.trainer_of(twin) is trainer and compat.trainer_of(Probe()) is None


def test_loops_call_before_transfer_says_where_lightning_runs_on_before_batch_transfer(fitted):
    _, model = fitted
    first = model.order.index("on_before_batch_transfer"), model.order.index("batch_to_device")
    assert compat.LOOPS_CALL_BEFORE_TRANSFER == (first[0] < first[1])


def test_call_after_backward_runs_the_modules_hook(fitted):
    trainer, model = fitted
    before = model.order.count("on_after_backward")
    compat.call_after_backward(trainer)
    assert model.order.count("on_after_backward") == before + 1


def test_uses_distributed_sampler_reads_the_trainers_option(fitted):
    trainer, _ = fitted
    assert compat.uses_distributed_sampler(trainer) is False and compat.uses_distributed_sampler(None) is True


def test_result_entries_hold_synced_means_and_read_the_inferred_batch_size():
    results = _ResultCollection(training=True)
    results.batch = {"x": torch.zeros(5, 2)}
    held: list[tuple[str, float, int]] = []

    def hold(update, key, value, batch_size):
        if compat.synced_reduction(results[key]) == "mean":
            held.append((key, float(value), batch_size))
        else:
            update(key, value, batch_size)

    def log(name, value, **options):
        results.log("training_step", name, torch.tensor(value), sync_dist_fn=lambda v, **_: v, **options)

    with compat.shadow_result_updates(results, hold):
        log("mean", 2.0, on_step=False, on_epoch=True, sync_dist=True)
        log("local", 3.0, on_step=False, on_epoch=True)
    assert "update_metrics" not in vars(results)
    assert held == [("training_step.mean", 2.0, 5)] and compat.inferred_batch_size(results) == 5
    assert float(results["training_step.local"].value) == 15.0


def test_dataloader_entries_unwrap_and_reinstantiate():
    inner = BatchSampler(SequentialSampler(range(6)), batch_size=2, drop_last=False)
    wrapper = compat.IndexBatchSamplerWrapper(inner)
    assert compat.inner_batch_sampler(wrapper) is inner
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=3)
    again = compat.reinstantiate_loader(loader, sampler=None, shuffle=False, batch_sampler=inner, batch_size=1,
                                        drop_last=False)
    assert type(again) is DataLoader and again.batch_sampler is inner and again.dataset is loader.dataset


def test_metric_entries_read_and_write_what_forward_and_compute_leave():
    metric = MeanMetric()
    assert set(compat.RESET_ATTRIBUTES) <= set(vars(metric))
    out = metric(torch.tensor([1.0, 3.0]))
    assert compat.update_count(metric) == 1 and compat.forward_cache(metric) is out
    result = metric.compute()
    assert compat.computed(metric) is result
    assert list(compat.state_defaults(metric)) == ["mean_value", "weight"]
    assert compat.state_reduction(metric, "weight") is dim_zero_sum and not compat.own_reduce_states(metric)
    compat.reduce_states(metric, {"mean_value": torch.tensor(4.0), "weight": torch.tensor(2.0)})
    assert float(metric.mean_value) == 8.0 and float(metric.weight) == 4.0
    compat.set_step_results(metric, count=5, forward=None, result=None)
    assert compat.update_count(metric) == 5 and compat.forward_cache(metric) is None and compat.computed(metric) is None
    metric.reset()
    assert {k: getattr(metric, k) for k in compat.RESET_ATTRIBUTES} == compat.RESET_ATTRIBUTES
