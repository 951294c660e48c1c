"""benchmarks/ceiling.py: what its clock and its bare threads measure, checked on a small module.

The ceiling figure itself is a benchmark (``benchmarks/bench.py``, ``digits_ceiling_*``); these tests check that its
parts measure what the docstring says: the network part of each plain Lightning step without its ``self.log`` calls,
each bare thread on its own share of the samples with its own copy of the module, and the process's thread settings
back as they were afterwards.
"""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_sparse_dp.runtime.threads import me_coordinate_manager_module
from tests.support.helpers import load_file

ceiling = load_file("benchmarks/ceiling.py")

# the module's self.log takes at least this long in a Trainer (patched below): far above the network part of a step
# (about 0.2-1.3 ms here), so that a stall of the machine cannot put the network part above it
LOG_SLEEP_S = 0.25


class Recorder(L.LightningModule):
    """A linear model that records, per call of ``training_step``, the thread and the number of samples."""

    calls: list[tuple[int, int, int]] = []  # (thread id, samples, id of the module): shared by deep copies

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        Recorder.calls.append((threading.get_ident(), len(batch), id(self)))
        loss = self.layer(batch).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_network_clock_times_each_step_without_its_log_calls(monkeypatch):
    log = L.LightningModule.log

    def slow_log(self, *args, **kwargs):
        time.sleep(LOG_SLEEP_S)
        return log(self, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", slow_log)
    clock, steps = ceiling.NetworkClock(), []

    class StepClock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(time.perf_counter() - self.start)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, StepClock()])
    trainer.fit(Recorder(), DataLoader(torch.randn(40, 4), batch_size=8))
    assert len(clock.times) == len(steps) == 5
    for network, step in zip(clock.times, steps):
        assert 0 < network < LOG_SLEEP_S  # the 0.25 s of self.log are not in it
        assert step - network >= LOG_SLEEP_S  # they are in the step's serial part


def test_bare_threads_run_each_share_on_its_own_copy_and_restore_the_thread_settings():
    module = Recorder()
    before = [p.detach().clone() for p in module.parameters()]
    cpu_count = me_coordinate_manager_module().CPU_COUNT
    threads = torch.get_num_threads()
    samples = list(torch.randn(10, 4))
    Recorder.calls = []
    times = ceiling.bare_thread_times(module, samples, torch.stack, replicas=3, steps=4, warmup=1)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert len(Recorder.calls) == 5 * 3
    for i in range(5):  # each pass: three threads, three copies, the samples split 3 / 4 / 3 (round(k * 10 / 3))
        rows = Recorder.calls[3 * i : 3 * i + 3]
        assert sorted(n for _, n, _ in rows) == [3, 3, 4]
        assert len({t for t, _, _ in rows}) == 3 and threading.get_ident() not in {t for t, _, _ in rows}
        assert len({m for _, _, m in rows}) == 3 and id(module) not in {m for _, _, m in rows}
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # the module itself untouched
    assert all(p.grad is None for p in module.parameters())
    assert me_coordinate_manager_module().CPU_COUNT == cpu_count and torch.get_num_threads() == threads


def test_bare_threads_refuse_fewer_than_two_threads_or_samples():
    with pytest.raises(ValueError, match="replicas >= 2"):
        ceiling.bare_thread_times(Recorder(), list(torch.randn(4, 4)), torch.stack, replicas=1, steps=1, warmup=0)
    with pytest.raises(ValueError, match="at least that many samples"):
        ceiling.bare_thread_times(Recorder(), list(torch.randn(2, 4)), torch.stack, replicas=3, steps=1, warmup=0)


def test_ceiling_is_the_plain_step_over_its_serial_part_plus_the_bare_threads():
    # plain steps of 10 ms with 8 ms of network part (2 ms serial), bare threads 5 ms: 10 / (2 + 5)
    assert ceiling.ceiling([0.010, 0.011, 0.010], [0.008, 0.009, 0.008], [0.005, 0.005, 0.006]) == pytest.approx(10 / 7)
    with pytest.raises(ValueError):  # one network part per plain step
        ceiling.ceiling([0.010, 0.011], [0.008], [0.005])


def test_unavoidable_work_is_the_plan_the_slowest_cut_the_reduction_and_two_hand_overs():
    stages = {
        "split": 0.00034, "place": 0.0, "reduce": 0.00013,
        "scatter0": 0.00040, "scatter1": 0.00048, "scatter2": 0.00021,
        # the rest of a step: none of it counts
        "replicate": 0.0001, "state": 0.0002, "weigh": 0.0001, "gather": 0.00004, "log": 0.00005, "emit": 0.0009,
        "apply": 0.007, "backward": 0.005, "replica0": 0.0068, "backward1": 0.0043, "syncbn": 0.004,
    }
    assert ceiling.unavoidable_seconds(stages, 0.00014) == pytest.approx(0.00034 + 0.00048 + 0.00013 + 2 * 0.00014)
    # a step whose chunks the main thread cut and placed (prepare_in_threads=False): no scatter<i>, `place` counts
    assert ceiling.unavoidable_seconds({"split": 0.0009, "place": 0.0002, "reduce": 0.0001}, 0.0) == pytest.approx(0.0012)


def test_the_floor_fraction_bounds_every_step_with_that_unavoidable_work():
    ceiling_step, unavoidable = 0.0116, 0.0012  # digits figures of a full bench run (docs/benchmarks.md)
    best = ceiling.floor_fraction(ceiling_step, unavoidable)
    assert best == pytest.approx(11.6 / 12.8)
    for rest in (0.0, 0.0005, 0.004):  # the step's other own costs: its ceiling fraction is ceiling step / step
        step = ceiling_step + unavoidable + rest
        assert ceiling_step / step <= best + 1e-12
    assert ceiling_step / (ceiling_step + unavoidable) == pytest.approx(best)
