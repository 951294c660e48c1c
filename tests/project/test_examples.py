"""The examples run end to end (tiny settings) and end with their result line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, args, last_line",
    [
        ("train_digits.py", ["--max-epochs", "1"], r"val_acc=0\.\d{4}"),
        ("train_segmentation.py", ["--max-epochs", "1", "--train-scenes", "6", "--val-scenes", "3"], r"val_miou=0\.\d{4}"),
        ("train_completion.py", ["--max-epochs", "2", "--train-shapes", "16", "--val-shapes", "6", "--grid", "12"],
         r"val_iou=0\.\d{4}"),
        ("train_registration.py", ["--max-epochs", "1", "--train-pairs", "24", "--val-pairs", "8"], r"val_loss=\d+\.\d{4}"),
    ],
)
def test_example_runs(script, args, last_line, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--devices", "3", "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(last_line, lines[-1]), lines[-3:]
    assert list(tmp_path.glob("csv/*/version_0/metrics.csv")) and list(tmp_path.glob("tensorboard/*/version_0/events.*"))


def test_digits_under_sparse_ddp_prints_its_global_result_once(tmp_path):
    """Two processes (the launcher starts the second): the final figure is printed by rank zero alone."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--strategy", "sparse_ddp", "--devices", "2",
         "--accelerator", "cpu", "--max-epochs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line for line in lines if line.startswith("val_acc=")] == lines[-1:], lines[-4:]
    assert re.fullmatch(r"val_acc=0\.\d{4}", lines[-1]), lines[-3:]


@pytest.mark.parametrize("how", ["config", "command line"])
def test_lightning_cli_takes_the_strategy_and_its_options(how, tmp_path):
    """examples/cli_digits.py through LightningCLI: the strategy as a class path with init_args in the YAML config,
    or by class path and options on the command line."""
    pytest.importorskip("jsonargparse")
    short = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
             "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    if how == "config":
        args, expected = ["--config", str(ROOT / "examples" / "cli_digits.yaml")], "loss_weighting=terms devices=3"
    else:
        args = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
                "--trainer.enable_checkpointing=false", "--trainer.strategy=lightning_sparse_dp.SparseDataParallelStrategy",
                "--trainer.strategy.loss_weighting=samples"]
        expected = "loss_weighting=samples devices=2"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cli_digits.py"), "fit", *args, *short], cwd=tmp_path,
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2] == f"strategy=SparseDataParallelStrategy {expected}" and re.fullmatch(r"val_acc=0\.\d{4}", lines[-1])


def test_registration_example_is_exact_against_one_device():
    """examples/train_registration.py's module and batches (FCGF-style pairs, negatives named with the 'indices'
    layout, the loss weighted by pairs): two float64 steps on 3 replicas with sync batch norm equal one device's."""
    import torch

    from tests.support.exact import relative_difference, same_start
    from tests.support.helpers import load_file, trainer

    reg = load_file(ROOT / "examples" / "train_registration.py")
    data = reg.ScanPairs(16, seed=5)
    batches = [reg.collate_pairs([data[i] for i in range(s, s + 8)]) for s in (0, 8)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    ours, reference = same_start(reg.FeatureNet, seed=0)  # not the start the tests before left in the generator
    strategy = reg.SparseDataParallelStrategy(layout=reg.LAYOUT, loss_weighting=reg.pairs_in)
    loader = lambda: torch.utils.data.DataLoader(batches, batch_size=None)  # noqa: E731
    trainer(strategy=strategy, devices=3, max_steps=2, precision="64-true", sync_batchnorm=True).fit(ours.double(), loader())
    trainer(max_steps=2, precision="64-true").fit(reference.double(), loader())
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        if a.is_floating_point():
            assert relative_difference(a, b) <= 1e-10, name


def test_completion_example_validation_is_exact_against_one_device():
    """examples/train_completion.py's module and data on 3 replicas (float64, sync batch norm, its own Adam, 12 shapes a
    batch): the val_loss and val_iou it logs at every epoch are one device's. Its validation loss was taken with the
    decoder pruning by its own scores alone, which stops at a level its chunk has pruned empty while one device goes on
    with the other samples: the second epoch's val_loss was 8.8e-4 off one device's (3.8e-3 at the first epoch under
    sparse_ddp, 4 shapes a rank). The loss now keeps the target voxels in validation too, as in training, and val_iou
    is of the shapes the network completes alone. The parameters are not compared: Adam's eps turns last-digit
    rounding of near-zero gradients into 4e-10 (docs/exactness.md); tests/strategies/test_point_set_networks.py trains
    the same network with SGD against one device."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from tests.support.exact import relative_difference, same_start
    from tests.support.helpers import load_file, trainer

    comp = load_file(ROOT / "examples" / "train_completion.py")
    train, val = comp.Shapes(24, 1, 16), comp.Shapes(16, 2, 16)

    class Logged(L.Callback):
        def __init__(self):
            self.epochs = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.epochs.append({k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_iou")})

    runs = []
    for model, kwargs in zip(same_start(comp.Completion, seed=0), ({"strategy": "sparse_dp", "devices": 3}, {})):
        model.val_iou.set_dtype(torch.float64)  # torchmetrics keeps float32 states under "64-true" (docs/exactness.md)
        logged = Logged()
        t = trainer(max_epochs=2, max_steps=-1, precision="64-true", sync_batchnorm=True, limit_val_batches=None,
                    callbacks=[logged], **kwargs)
        t.fit(model, DataLoader(train, batch_size=12, collate_fn=comp.collate),
              DataLoader(val, batch_size=12, collate_fn=comp.collate))
        runs.append(logged.epochs)
    ours, reference = runs
    assert len(ours) == len(reference) == 2
    for epoch, (a, b) in enumerate(zip(ours, reference)):
        for name in b:
            assert relative_difference(a[name], b[name]) <= 1e-10, (epoch, name, a[name], b[name])
