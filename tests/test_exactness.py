"""Exact data parallelism: sync batch norm, per-point weighting, torchmetrics, ordered outputs, Trainer features.

Every test compares sparse_dp on CPU replicas with an independent reference: the same module on one
device with the whole batch (plain Lightning, strategy="auto").
"""

from __future__ import annotations

import os
from functools import partial
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import MinkowskiEngine as ME
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from lightning_sparse_dp.sync import ReplicaSyncBatchNorm
from tests.helpers import (
    NUM_CLASSES, SegNet, SparseNet, assert_same_states, collate_dict, field_batch, loader, random_samples,
    same_start, state_differences
)
from tests.helpers import trainer as _trainer

#: Exactness is judged in float64: float32 rounding, amplified by cancellation in batch-norm gradient sums,
#: reaches 1e-4 relative and can hide a real difference. Every Trainer here runs "64-true" unless told otherwise.
trainer = partial(_trainer, precision="64-true")
REL = 1e-10


def _close_states(ours, reference, rtol, atol):
    ref = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol, msg=name)


# --- synchronized batch norm ------------------------------------------------------------------------

class WithMESync(SparseNet):
    """SparseNet with ME's own MinkowskiSyncBatchNorm (which in one process runs plain batch norm)."""

    def __init__(self):
        super().__init__(batch_norm=True)
        self.net[3] = ME.MinkowskiSyncBatchNorm(16)


def test_sync_batchnorm_step_equals_one_device_uneven_batch():
    batch = collate_dict(random_samples(7, seed=21))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)  # parameters and running mean / var / num_batches_tracked
    bn = ours.net[3].bn
    assert type(bn) is nn.BatchNorm1d  # reverted at teardown
    assert int(bn.num_batches_tracked) == 1


def test_without_sync_batchnorm_the_step_differs():  # the comparison above can fail
    batch = collate_dict(random_samples(7, seed=21))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert max(state_differences(ours, reference).values()) > 1e-4


def test_strategy_option_and_me_sync_batchnorm_layers():
    batch = collate_dict(random_samples(7, seed=22))
    ours, reference = same_start(WithMESync)
    trainer(strategy=SparseDataParallelStrategy(sync_batchnorm=True), devices=3).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)
    assert type(ours.net[3].bn) is nn.SyncBatchNorm


def test_me_sync_batchnorm_without_the_flag_warns():
    with pytest.warns(UserWarning, match="sync_batchnorm is off"):
        trainer(strategy="sparse_dp", devices=3).fit(WithMESync(), loader(collate_dict(random_samples(5))))


def test_sync_batchnorm_with_fewer_samples_than_devices():
    batch = collate_dict(random_samples(2, seed=23))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)


def test_eval_uses_running_statistics_without_sync():
    batches = [collate_dict(random_samples(7, seed=24)), collate_dict(random_samples(4, seed=25))]
    ours, reference = same_start(batch_norm=True)
    with torch.no_grad():  # non-trivial running statistics
        ours.net[3].bn.running_mean.uniform_(-1, 1)
        ours.net[3].bn.running_var.uniform_(0.5, 2)
    reference.load_state_dict(ours.state_dict())
    t = trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, limit_val_batches=1.0)
    t.validate(ours, loader(*batches), verbose=False)
    r = trainer(devices=1, limit_val_batches=1.0)
    r.validate(reference, loader(*batches), verbose=False)
    assert t.callback_metrics["val_loss"].item() == pytest.approx(r.callback_metrics["val_loss"].item(), rel=REL)
    assert_same_states(ours, reference, rel=0.0)  # running statistics untouched


class _TwoNorms(SparseNet):
    """Two batch norms; the replica whose chunk has ``odd`` samples misbehaves between them."""

    def __init__(self, odd: int, mode: str):
        super().__init__()
        self.norm1 = ME.MinkowskiBatchNorm(8)
        self.norm2 = ME.MinkowskiBatchNorm(8)
        self.odd, self.mode = odd, mode

    def loss(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        h = self.norm1(self.net[0](x))
        is_odd = batch["labels"].shape[0] == self.odd
        if is_odd and self.mode == "raise":
            raise RuntimeError("replica fails between batch norms")
        if not (is_odd and self.mode == "skip"):
            h = self.norm2(h)
        out = self.net[4:](self.net[2](self.net[1](h)))
        out = out.F[out.C[:, 0].argsort()]
        return nn.functional.cross_entropy(out, batch["labels"])


@pytest.mark.parametrize(
    "mode, error, message",
    [
        ("raise", RuntimeError, "replica fails between batch norms"),
        ("skip", RuntimeError, "different numbers of batch-norm calls"),
    ],
)
def test_replicas_never_wait_forever_in_batch_norm(mode, error, message):
    model = _TwoNorms(odd=3, mode=mode)  # chunks of 3, 2, 2 samples: replica 0 misbehaves
    start = time.perf_counter()
    with pytest.raises(error, match=message):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, sync_batchnorm=True).fit(
            model, loader(collate_dict(random_samples(7)))
        )
    assert time.perf_counter() - start < 30  # a bound against a hang, not a speed target


# --- per-point losses ------------------------------------------------------------------------------

def test_points_weighting_is_exact_for_per_point_losses_with_sync_batchnorm():
    batch = field_batch(7, seed=26, dtype=torch.float64)
    ours, reference = same_start(SegNet)
    strategy = SparseDataParallelStrategy(loss_weighting="points", sync_batchnorm=True)
    t = trainer(strategy=strategy, devices=3)
    t.fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)


def test_samples_weighting_is_not_exact_for_per_point_losses():  # the comparison above can fail
    batch = field_batch(7, seed=26, dtype=torch.float64)
    ours, reference = same_start(SegNet)
    trainer(strategy=SparseDataParallelStrategy(loss_weighting="samples", sync_batchnorm=True), devices=3).fit(
        ours, loader(batch)
    )
    trainer(devices=1).fit(reference, loader(batch))
    assert max(state_differences(ours, reference).values()) > 1e-5


# --- torchmetrics ----------------------------------------------------------------------------------

class _WithMetrics(SparseNet):
    def __init__(self):
        super().__init__()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="macro")
        self.val_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.train_acc(logits, batch["labels"])  # forward: update + batch value
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        return nn.functional.cross_entropy(logits, batch["labels"])

    def on_train_batch_end(self, outputs, batch, batch_idx):  # Lightning resets logged metrics at epoch end
        self.after_step = {s: getattr(self.train_acc, s).clone() for s in ("tp", "fp", "tn", "fn")}

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.val_acc.update(logits, batch["labels"])
        self.val_mean.update(logits.max(1).values)
        self.log("val_acc", self.val_acc, on_epoch=True)


def test_metric_state_after_a_step_equals_one_update_with_the_whole_batch():
    batch = collate_dict(random_samples(7, seed=27))
    ours, reference = same_start(_WithMetrics)
    t = trainer(strategy="sparse_dp", devices=3, logger=False)
    with torch.no_grad():
        whole = reference(ME.SparseTensor(batch["features"], batch["coordinates"]))
    t.fit(ours, loader(batch))
    expected = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
    expected.update(whole, batch["labels"])
    for state in ("tp", "fp", "tn", "fn"):
        assert torch.equal(ours.after_step[state], getattr(expected, state)), state
    assert t.callback_metrics["train_acc"].item() == pytest.approx(expected.compute().item(), rel=REL)


def test_epoch_level_metric_compute_equals_single_device():
    batches = [collate_dict(random_samples(7, seed=28)), collate_dict(random_samples(5, seed=29))]
    ours, reference = same_start(_WithMetrics)
    t = trainer(strategy="sparse_dp", devices=3, limit_val_batches=1.0)
    t.validate(ours, loader(*batches), verbose=False)
    r = trainer(devices=1, limit_val_batches=1.0)
    r.validate(reference, loader(*batches), verbose=False)
    assert t.callback_metrics["val_acc"].item() == pytest.approx(r.callback_metrics["val_acc"].item(), rel=REL)
    # torchmetrics keeps metric states float32 under "64-true" (Metric._apply leaves dtypes alone): float32 sums
    assert ours.val_mean.compute().item() == pytest.approx(reference.val_mean.compute().item(), rel=1e-6)


# --- ordered outputs -------------------------------------------------------------------------------

def _reversed_split(batch, num_chunks):
    """Chunks of samples in reverse order, so gathering must reorder."""
    def assignment(sizes, k):
        ids = torch.arange(sizes.numel()).flip(0)
        return list(ids.tensor_split(min(k, sizes.numel())))

    return split_batch(batch, num_chunks, assignment=assignment)


def test_predict_returns_per_point_outputs_in_the_original_order():
    batches = [field_batch(7, seed=30, dtype=torch.float64), field_batch(4, seed=31, dtype=torch.float64)]
    ours, reference = same_start(SegNet)
    ours.eval(), reference.eval()
    got = trainer(strategy=SparseDataParallelStrategy(split_fn=_reversed_split), devices=3).predict(ours, loader(*batches))
    want = trainer(devices=1).predict(reference, loader(*batches))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_predict_returns_per_sample_outputs_in_the_original_order():
    class Classify(SparseNet):
        def predict_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            return {"logits": self(x), "labels": batch["labels"]}

    batch = collate_dict(random_samples(7, seed=32))
    ours, reference = same_start(Classify)
    got = trainer(strategy=SparseDataParallelStrategy(split_fn=_reversed_split), devices=3).predict(ours, loader(batch))
    want = trainer(devices=1).predict(reference, loader(batch))
    assert torch.equal(got[0]["labels"], batch["labels"])
    torch.testing.assert_close(got[0]["logits"], want[0]["logits"], rtol=1e-5, atol=1e-6)


# --- the rest of the Trainer -----------------------------------------------------------------------

def test_bf16_autocast_reaches_the_replicas():
    seen = []

    class Probe(SparseNet):
        def training_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            logits = self.net[-1](self.net[:-1](x)).F
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), logits.dtype))
            return super().training_step(batch, batch_idx)

    batch = collate_dict(random_samples(7, seed=33))
    ours, reference = same_start(Probe)
    trainer(strategy="sparse_dp", devices=3, precision="bf16-mixed").fit(ours, loader(batch))
    assert seen == [(True, torch.bfloat16, torch.bfloat16)] * 3
    seen.clear()
    trainer(devices=1, precision="bf16-mixed").fit(reference, loader(batch))
    assert seen == [(True, torch.bfloat16, torch.bfloat16)]  # and the reference ran under the same autocast
    _close_states(ours, reference, rtol=2e-2, atol=2e-3)  # bf16 rounding differs between chunk and whole batch


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2, "max_steps": 2},
    ],
    ids=["clip-norm", "clip-value", "accumulate"],
)
def test_clipping_and_accumulation_equal_one_device(kwargs):
    batches = [collate_dict(random_samples(7, seed=34 + i)) for i in range(4)]
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, **kwargs).fit(ours, loader(*batches))
    trainer(devices=1, **kwargs).fit(reference, loader(*batches))
    assert_same_states(ours, reference)


_REPEATABLE_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _run_isolated(code: str, tmp_path) -> None:
    """Run ``code`` in a fresh interpreter with one OpenMP / OpenBLAS thread.

    ME's CPU kernel maps (OpenMP, thread count read from OMP_NUM_THREADS at import and set again on
    every coordinate manager) and OpenBLAS are not bitwise repeatable with several threads, on one
    device too, so bitwise comparisons run where both use one thread.
    """
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, **_REPEATABLE_ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_deterministic_runs_repeat_exactly(tmp_path):
    _run_isolated(
        """
        import torch, lightning_sparse_dp
        from tests.helpers import SparseNet, collate_dict, loader, random_samples, trainer
        batches = [collate_dict(random_samples(7, seed=40 + i)) for i in range(3)]
        runs = []
        for _ in range(3):
            torch.manual_seed(0)
            model = SparseNet(batch_norm=True)
            trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, deterministic=True, max_steps=3).fit(
                model, loader(*batches))
            runs.append(model.state_dict())
        for name in runs[0]:
            assert torch.equal(runs[0][name], runs[1][name]) and torch.equal(runs[0][name], runs[2][name]), name
        """,
        tmp_path,
    )


class _Scheduled(SparseNet):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.loss(batch), batch_size=batch["labels"].shape[0])


def _fit_epochs(model, strategy, devices, epochs, tmp_path, callbacks=(), ckpt_path=None, **kwargs):
    train = [collate_dict(random_samples(7, seed=50 + i)) for i in range(3)]
    val = [collate_dict(random_samples(5, seed=60)), collate_dict(random_samples(3, seed=61))]
    t = trainer(
        strategy=strategy, devices=devices, max_steps=-1, max_epochs=epochs, limit_val_batches=1.0,
        default_root_dir=tmp_path, callbacks=list(callbacks), **kwargs,
    )
    t.fit(model, loader(*train), [loader(val[0]), loader(val[1])], ckpt_path=ckpt_path)
    return t


def test_schedulers_several_val_loaders_checkpointing_and_early_stopping(tmp_path):
    ours, reference = same_start(_Scheduled, batch_norm=True)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss/dataloader_idx_0", mode="min")
    stop = EarlyStopping(monitor="val_loss/dataloader_idx_1", patience=0, mode="min", check_finite=True)
    t = _fit_epochs(ours, "sparse_dp", 3, 4, tmp_path / "a", [best, stop], sync_batchnorm=True, enable_checkpointing=True)
    r_best = ModelCheckpoint(dirpath=tmp_path / "ref", monitor="val_loss/dataloader_idx_0", mode="min")
    r_stop = EarlyStopping(monitor="val_loss/dataloader_idx_1", patience=0, mode="min", check_finite=True)
    r = _fit_epochs(reference, "auto", 1, 4, tmp_path / "b", [r_best, r_stop], enable_checkpointing=True)
    assert t.current_epoch == r.current_epoch and t.global_step == r.global_step
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(r.optimizers[0].param_groups[0]["lr"])
    for key in ("val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"):
        assert t.callback_metrics[key].item() == pytest.approx(r.callback_metrics[key].item(), rel=REL)
    assert best.best_model_score.item() == pytest.approx(r_best.best_model_score.item(), rel=REL)
    assert_same_states(ours, reference)
    saved = torch.load(best.best_model_path, weights_only=False)["state_dict"]
    assert set(saved) == set(reference.state_dict())  # the user's layer types and keys


def test_resuming_continues_exactly_as_an_uninterrupted_run(tmp_path):
    _run_isolated(
        """
        import torch, lightning_sparse_dp
        from pathlib import Path
        from tests.helpers import same_start
        from tests.test_exactness import _Scheduled, _fit_epochs
        tmp = Path(".")
        straight, first_half = same_start(_Scheduled, batch_norm=True)
        straight, first_half = straight.double(), first_half.double()
        _fit_epochs(straight, "sparse_dp", 3, 4, tmp / "straight", sync_batchnorm=True)
        t = _fit_epochs(first_half, "sparse_dp", 3, 2, tmp / "half", sync_batchnorm=True)
        t.save_checkpoint(tmp / "half.ckpt")
        resumed = _Scheduled(batch_norm=True).double()  # float64 before the checkpoint is loaded into it
        _fit_epochs(resumed, "sparse_dp", 3, 4, tmp / "resumed", ckpt_path=tmp / "half.ckpt", sync_batchnorm=True)
        ref = straight.state_dict()
        for name, value in resumed.state_dict().items():
            assert torch.equal(value, ref[name]), name
        """,
        tmp_path,
    )


def test_sync_batchnorm_swap_keeps_parameters_and_state_dict():
    model = SparseNet(batch_norm=True)
    from lightning_sparse_dp.sync import convert_sync_batchnorm, revert_sync_batchnorm

    before = {k: v for k, v in model.state_dict().items()}
    weight = model.net[3].bn.weight
    swaps = convert_sync_batchnorm(model)
    assert isinstance(model.net[3].bn, ReplicaSyncBatchNorm) and model.net[3].bn.weight is weight
    assert list(model.state_dict()) == list(before)
    revert_sync_batchnorm(swaps)
    assert type(model.net[3].bn) is nn.BatchNorm1d and model.net[3].bn.weight is weight
