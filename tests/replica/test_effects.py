"""What a step does outside the module (lightning_sparse_dp/replica/effects.py): its loggers' calls run once a step, as on
one device, and files two replicas write in one step are said; against plain Lightning's run of the same module."""

from __future__ import annotations

import csv
import os
import warnings

import lightning as L
import MinkowskiEngine as ME
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_sparse_dp.replica.effects import StepEffects, trainer_view
from tests.support.helpers import SparseNet, random_samples, sample_loader, trainer


class LogsFromTheStep(SparseNet):
    """A test step that logs through the logger's experiment and the logger itself, and reads what replicas need."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[bool, bool, str]] = []

    def test_step(self, batch, batch_idx):
        logits = self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))
        self.logger.experiment.log_metrics({"rows": float(len(logits))}, step=batch_idx)
        self.loggers[0].log_metrics({"again": 1.0}, step=batch_idx)
        # what every replica reads as on one device: the logger's type, its folder, the trainer's state
        self.seen.append((isinstance(self.logger, CSVLogger), isinstance(self.trainer, L.Trainer), self.logger.log_dir))
        if batch_idx == 1:
            self.trainer.should_stop = True  # set through the replica's trainer: the trainer's own
        return None


def _test_run(module, tmp_path, strategy, devices):
    logger = CSVLogger(tmp_path, name=strategy)
    run = trainer(strategy=strategy, devices=devices, logger=logger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.test(module, sample_loader(random_samples(14)), verbose=False)
    logger.experiment.save()
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return run, rows, [str(w.message) for w in caught if "sparse_dp" in str(w.message)]


def test_a_loggers_calls_in_the_step_run_once_a_step_and_are_said(tmp_path):
    one = LogsFromTheStep()
    run_one, rows_one, said_one = _test_run(one, tmp_path, "auto", 1)
    ours = LogsFromTheStep()
    run_ours, rows_ours, said = _test_run(ours, tmp_path, "sparse_dp", 3)
    # one row per call as on one device (the rows' values are replica 0's chunk's: said)
    assert [r["step"] for r in rows_ours] == [r["step"] for r in rows_one] == ["0", "0", "1", "1"]
    assert sorted(r for r in rows_ours[0] if rows_ours[0][r]) == sorted(r for r in rows_one[0] if rows_one[0][r])
    assert not said_one
    calls = [m for m in said if "called self.logger" in m]
    assert len(calls) == 2, said  # each call said once, for both steps
    assert any("self.logger.experiment.log_metrics in replicas [0, 1, 2]" in m for m in calls)
    assert any("self.logger.log_metrics" in m for m in calls)
    assert all("on_test_batch_end(outputs, batch, batch_idx)" in m for m in calls)
    # every replica read what one device reads; what the step set on its trainer is the trainer's
    assert ours.seen and all(s == (True, True, run_ours.logger.log_dir) for s in ours.seen)
    assert {s for s in one.seen} == {(True, True, run_one.logger.log_dir)}
    assert run_ours.should_stop and run_one.should_stop
    # and the replicas' trainer is the trainer again after a refresh: the module's own stays the trainer
    assert ours.trainer is run_ours


class WritesFiles(SparseNet):
    """Saves each sample's logits in the test step, named by ``name`` (``"position"``: batch_idx and the row in the
    step's batch; ``"sample"``: an id each sample carries)."""

    def __init__(self, out, name):
        super().__init__()
        self.out, self.name = out, name

    def test_step(self, batch, batch_idx):
        logits = self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))
        for i, row in enumerate(logits):
            label = f"{batch_idx}_{i}" if self.name == "position" else f"id{int(batch['ids'][i])}"
            np.save(os.path.join(self.out, f"{label}.npy"), row.detach().numpy())


def _with_ids(samples):
    def collate(items):
        batch = collate_ids([s for s, _ in items])
        batch["ids"] = torch.tensor([i for _, i in items])
        return batch

    from tests.support.helpers import collate_dict as collate_ids

    return torch.utils.data.DataLoader(list(zip(samples, range(len(samples)))), batch_size=7, collate_fn=collate)


def _written(tmp_path, strategy, devices, name):
    out = tmp_path / f"{strategy}-{name}"
    out.mkdir()
    torch.manual_seed(0)
    module = WritesFiles(str(out), name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy=strategy, devices=devices, precision="64-true").test(
            module, _with_ids(random_samples(14)), verbose=False
        )
    files = {f: np.load(out / f) for f in sorted(os.listdir(out))}
    return files, [str(w.message) for w in caught if "wrote the same file" in str(w.message)]


@pytest.mark.parametrize("name", ["position", "sample"])
def test_files_a_step_writes_are_written_by_each_replica_as_ddp_ranks_write_them(tmp_path, name):
    """Nothing intercepts ``open`` (issue 57): files named by what the sample carries are one device's; files named
    by a position in the chunk are written by every replica, as every DDP rank writes them (the rule the docs give)."""
    one, said_one = _written(tmp_path, "auto", 1, name)
    ours, said = _written(tmp_path, "sparse_dp", 3, name)
    assert len(one) == 14 and not said_one and not said
    if name == "sample":
        assert ours.keys() == one.keys()
        for f in one:
            np.testing.assert_allclose(ours[f], one[f], rtol=1e-10, atol=0)
    else:  # each replica wrote its chunk's rows under the chunk's positions: fewer files than one device's
        assert len(ours) < len(one)


def test_replica_zeros_calls_run_and_the_others_are_skipped_and_noted():
    from lightning_sparse_dp.replica import effects

    calls = []

    class Experiment:
        log_dir = "/logs"

        def add(self, value):
            calls.append(value)
            return "added"

        def get_logdir(self):
            return self.log_dir

    class Logger:
        def __init__(self):
            self.experiment = Experiment()

    class Trainer:
        def __init__(self, loggers):
            self._loggers = loggers

        @property
        def loggers(self):
            return self._loggers

        @property
        def logger(self):
            return self.loggers[0] if self.loggers else None

    real = Trainer([Logger()])
    step = StepEffects("validation_step", 2)
    shown = trainer_view(real)
    assert isinstance(shown, Trainer) and shown.__dict__ is real.__dict__ and trainer_view(shown) is shown

    def run(i):
        experiment = shown.logger.experiment
        return experiment.add(i), experiment.get_logdir(), experiment.log_dir

    assert step.watch(0, lambda: run(0)) == ("added", "/logs", "/logs")
    assert step.watch(1, lambda: run(1)) == (None, "/logs", "/logs")  # skipped, but what it reads is read
    assert calls == [0]
    assert step.calls == [{"self.logger.experiment.add"}, {"self.logger.experiment.add"}]
    assert shown.logger.experiment.add(5) == "added" and calls == [0, 5]  # outside a replica's step: as it is
    assert effects._context() is None
