"""Trainer flags users pass, each against plain Lightning on one device: fast_dev_run, the advanced and PyTorch
profilers, true half precision, devices="auto" / -1 on CPU, and a logger of one's own (W&B / MLflow style)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import Logger

from tests.support.exact import same_start
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer


def _batches():
    out = [collate_dict(random_samples(7, seed=s)) for s in (101, 102)]
    return [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in out]


def test_fast_dev_run_runs_one_step_as_on_one_device():
    ours, reference = same_start(SparseNet)
    t = trainer(strategy="sparse_dp", devices=3, fast_dev_run=True, precision="64-true")
    t.fit(ours.double(), loader(*_batches()))
    trainer(fast_dev_run=True, precision="64-true").fit(reference.double(), loader(*_batches()))
    assert t.global_step == 1
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("profiler", ["advanced", "pytorch"])
def test_the_profilers_run_and_see_the_stages(profiler, tmp_path):
    from lightning.pytorch.profilers import AdvancedProfiler, PyTorchProfiler

    chosen = (AdvancedProfiler if profiler == "advanced" else PyTorchProfiler)(dirpath=tmp_path, filename="p")
    t = trainer(strategy="sparse_dp", devices=3, max_steps=2, profiler=chosen)
    t.fit(SparseNet(), loader(*[collate_dict(random_samples(7, seed=s)) for s in (101, 102)]))
    assert t.global_step == 2
    report = "".join(f.read_text(errors="replace") for f in tmp_path.glob("*.txt"))
    assert "[sparse_dp]apply" in report  # the strategy's stages are profiler actions


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_true_half_precision_on_cpu_fails_as_on_one_device(precision):
    """ME's CPU convolution has no float16 / bfloat16 kernel: both fail alike, at the first convolution."""
    errors = []
    for kwargs in ({"strategy": "sparse_dp", "devices": 3}, {}):
        with pytest.raises(Exception) as caught:
            trainer(precision=precision, max_steps=1, **kwargs).fit(SparseNet(), loader(collate_dict(random_samples(6))))
        errors.append((type(caught.value), "convolution_forward_cpu" in str(caught.value)))
    assert errors[0] == errors[1] and errors[0][1]


def test_cpu_devices_auto_is_one_replica_and_minus_one_is_lightnings_error():
    assert len(trainer(strategy="sparse_dp", devices="auto").strategy.parallel_devices) == 1
    with pytest.raises(TypeError, match="should be an int > 0") as ours:
        trainer(strategy="sparse_dp", devices=-1)
    with pytest.raises(TypeError) as plain:
        trainer(devices=-1)
    assert str(ours.value) == str(plain.value)


class OwnLogger(Logger):
    """A W&B / MLflow-style logger that needs no network: it keeps what it is given."""

    def __init__(self):
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []
        self.params: list = []

    @property
    def name(self):
        return "own"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        self.params.append(params)

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))


def test_a_logger_of_ones_own_gets_one_devices_values_once_per_step():
    runs = []
    for model, kwargs in zip(same_start(SparseNet), ({"strategy": "sparse_dp", "devices": 3}, {})):
        model, logger = model.double(), OwnLogger()
        trainer(max_steps=2, precision="64-true", logger=logger, log_every_n_steps=1, **kwargs).fit(model, loader(*_batches()))
        runs.append([(step, m["train_loss"]) for step, m in logger.metrics if "train_loss" in m])
    ours, reference = runs
    assert [s for s, _ in ours] == [s for s, _ in reference] and len(ours) == 2
    assert [v for _, v in ours] == pytest.approx([v for _, v in reference], rel=1e-10)
