"""The rest of the Trainer under sparse_dp: bf16 autocast, clipping and accumulation, deterministic runs,
schedulers with several validation loaders, checkpointing, early stopping, and resuming.

Each feature is run by sparse_dp on CPU replicas and by plain Lightning (strategy="auto") on one device with the
whole batch, from the same start; every Trainer here runs "64-true" unless told otherwise (tests/support/exact.py).
"""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torchmetrics import MeanMetric

from lightning_sparse_dp.runtime.randomness import shared_generators
from tests.support.exact import REL, assert_same_states, fit_pair, same_start
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, run_isolated, unchecked
from tests.support.step_forms import PooledNet


def _close_states(ours, reference, rtol, atol):
    ref = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol, msg=name)


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
    trainer(strategy=unchecked(), devices=3, precision="bf16-mixed").fit(ours, loader(batch))  # counts the steps
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
    run_isolated(code, tmp_path, env=_REPEATABLE_ENV)


def test_deterministic_runs_repeat_exactly(tmp_path):
    _run_isolated(
        """
        import torch, lightning_sparse_dp
        from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer
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


class _Dropout(SparseNet):
    """Dropout on the logits: random numbers drawn from torch's CPU generator, which CPU replicas share."""

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return F.cross_entropy(F.dropout(self(x), 0.5), batch["labels"])


class _NumpyScale(SparseNet):
    """A random scale of the features drawn from NumPy's global generator, which every replica shares (GPUs too)."""

    def training_step(self, batch, batch_idx):
        scale = float(np.random.uniform(0.9, 1.1))
        x = ME.SparseTensor(batch["features"] * scale, batch["coordinates"], device=self.device)
        return F.cross_entropy(self(x), batch["labels"])


@pytest.mark.parametrize(("module", "deterministic", "said"), [
    (_Dropout, True, "torch's generator of cpu"),  # drawn from the shared generator: the runs would not repeat, said
    (_NumpyScale, True, "NumPy's global generator (np.random)"),
    (SparseNet, True, None),  # nothing drawn: the runs repeat (the test above)
    (_Dropout, False, None),  # no repeatability asked for
], ids=["dropout-deterministic", "numpy-deterministic", "no-draws", "dropout-not-deterministic"])
def test_draws_from_a_generator_the_replicas_share_are_said_under_deterministic(module, deterministic, said):
    batches = [collate_dict(random_samples(9, seed=70 + i)) for i in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy="sparse_dp", devices=3, deterministic=deterministic, max_steps=2).fit(module(), loader(*batches))
    messages = [str(w.message) for w in caught if "draws random numbers" in str(w.message)]
    assert len(messages) == int(said is not None), messages
    assert said is None or f"from {said}, which" in messages[0]


class _DrawsInValidation(SparseNet):
    """A bootstrap-like draw in the validation step (torchmetrics' BootStrapper draws so), from the shared generator."""

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        picked = torch.randint(0, len(logits), (len(logits),))
        self.log("val_boot", F.cross_entropy(logits[picked], batch["labels"][picked]), batch_size=len(logits))


def test_draws_in_a_validation_step_are_said_under_deterministic():
    """Only training passes (grad mode on) were looked at: draws in validation were silent (a bootstrap's spread 1.05
    off, the runs not repeating). Evaluation passes are looked at too, counted apart from the training ones."""
    batch = collate_dict(random_samples(9, seed=75))
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy="sparse_dp", devices=3, deterministic=True, limit_val_batches=None).validate(
                _DrawsInValidation(), loader(batch), verbose=False)
    finally:
        torch.use_deterministic_algorithms(deterministic)  # Lightning leaves it set for the process
    assert [w for w in caught if "draws random numbers" in str(w.message)]


class _OwnGenerator(SparseNet):
    """A VAE-style draw from a generator made and seeded in the step (reproducible on one device)."""

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        g = torch.Generator().manual_seed(1234 + batch_idx)
        noise = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
        self.log("val_noisy", (logits + noise).pow(2).mean(), batch_size=len(logits))


def test_draws_from_a_generator_of_the_steps_own_are_said():
    """Every replica made the same generator and drew its stream's first rows for its chunk, where one device draws
    rows 0..B-1 for the batch: 0.43 off, silent even under deterministic=True. It is said."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "torch.Generator of its own" in m})
    with pytest.warns(UserWarning, match=r"draws random numbers from a torch.Generator of its own.*on_before_batch"):
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(
            _OwnGenerator(), loader(collate_dict(random_samples(7, seed=76))), verbose=False)


def test_the_generators_replicas_share():
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert shared_generators([cpu, cpu, cpu]) == [cpu]
    assert shared_generators([gpu0, gpu1]) == []  # one generator per GPU, as nn.DataParallel's replicas have
    assert shared_generators([gpu0, gpu0, gpu1]) == [gpu0]  # replicas_per_device=2 on GPU 0
    assert shared_generators([cpu]) == []


class _GathersInTheStep(SparseNet):
    """DDP-style code: ``self.all_gather`` in the step (a contrastive loss over every rank's batch), or another of the
    strategy's collectives (a threshold broadcast from rank 0, a decision agreed on by every rank)."""

    def __init__(self, call: str = "self.all_gather"):
        super().__init__()
        self.call = call

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        strategy = self.trainer.strategy
        if self.call == "self.all_gather":
            self.gathered_rows = self.all_gather(logits.detach()).shape[-2]
        elif self.call == "strategy.broadcast":
            self.threshold = strategy.broadcast(float(logits.detach().max()))
        else:
            self.decided = strategy.reduce_boolean_decision(bool(logits.detach().max() > 0))
        return F.cross_entropy(logits, batch["labels"])


@pytest.mark.parametrize("call", ["self.all_gather", "strategy.broadcast", "strategy.reduce_boolean_decision"])
@pytest.mark.parametrize(("devices", "said"), [(3, True), (1, False)])
def test_a_collective_in_a_replicas_step_is_said(devices, said, call):
    """A replica's all_gather returns its chunk's rows (no collective between the replica threads), said once; so do
    broadcast and reduce_boolean_decision (each replica's own value, where DDP's ranks get rank 0's or agree: they
    said nothing)."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "in a replica's step returns" in m})
    batches = [collate_dict(random_samples(9, seed=80 + i)) for i in range(2)]
    module = _GathersInTheStep(call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy="sparse_dp", devices=devices, max_steps=2).fit(module, loader(*batches))
    messages = [str(w.message) for w in caught if "in a replica's step returns" in str(w.message)]
    assert len(messages) == int(said), messages
    assert not said or call in messages[0]


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
        from tests.support.exact import same_start
        from tests.strategies.test_trainer_features import _Scheduled, _fit_epochs
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


class _Metered(SparseNet):
    """Per-sample losses into a torchmetrics metric in training and in validation (each logged per epoch)."""

    def __init__(self) -> None:
        super().__init__(batch_norm=True)
        self.train_mean = MeanMetric()
        self.val_mean = MeanMetric()

    def _per_sample(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return F.cross_entropy(self(x), batch["labels"], reduction="none")

    def training_step(self, batch, batch_idx):
        losses = self._per_sample(batch)
        self.train_mean.update(losses.detach())
        self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        return losses.mean()

    def validation_step(self, batch, batch_idx):
        self.val_mean.update(self._per_sample(batch))
        self.log("val_mean", self.val_mean, batch_size=batch["labels"].shape[0])


def test_validate_then_fit_then_validate_with_metrics_equals_one_device():
    # Lightning runs trainer.validate in torch.inference_mode: the replicas and metric copies made there (for
    # every metric, the training one too) must serve the training steps of a later fit on the same Trainer.
    # (One device cannot update the validation metric in fit's validation after that: torchmetrics' reset at
    # the end of trainer.validate leaves it inference tensors, which fit's validation loop, outside inference
    # mode, cannot update in place; so fit runs no validation here.)
    batch = collate_dict(random_samples(7, seed=35))
    figures = {}
    ours_module, reference_module = same_start(_Metered)
    for name, module, kwargs in (("sparse_dp", ours_module, {"strategy": "sparse_dp", "devices": 3, "sync_batchnorm": True}),
                                 ("one device", reference_module, {"devices": 1})):
        run = trainer(limit_val_batches=1, max_steps=2, **kwargs)
        first = run.validate(module, loader(batch), verbose=False)[0]["val_mean"]
        run.fit(module, loader(batch))  # no validation inside fit (see below)
        fitted = {k: float(v) for k, v in run.callback_metrics.items()}
        last = run.validate(module, loader(batch), verbose=False)[0]["val_mean"]
        figures[name] = (first, fitted, last, module)
    ours, theirs = figures["sparse_dp"], figures["one device"]
    # the metrics add float32 values (torchmetrics casts to its own dtype, float32 here): equal to float32 rounding
    metric_rel = 1e-6
    assert abs(ours[0] - theirs[0]) <= metric_rel * abs(theirs[0])
    assert ours[1].keys() == theirs[1].keys() >= {"train_mean"}
    for key in theirs[1]:
        assert abs(ours[1][key] - theirs[1][key]) <= metric_rel * abs(theirs[1][key]), key
    assert abs(ours[2] - theirs[2]) <= metric_rel * abs(theirs[2])
    assert ours[2] != ours[0]  # the model trained in between
    assert_same_states(ours[3], theirs[3])  # float64 throughout


class _FrozenInTheStep(PooledNet):
    """The body frozen inside the step for the rest of the first epoch (a head-only warm-up), unfrozen at each epoch's
    start by the module's hook."""

    def on_train_epoch_start(self):
        self.body.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx >= 1:
            self.body.requires_grad_(False)
        return super().training_step(batch, batch_idx)


def test_requires_grad_changed_in_the_step_is_the_modules():
    """requires_grad_() in the step changed the replicas' own parameters only: the module's stayed, and the hook that
    unfroze the module's changed nothing the replicas had, so the body stayed frozen for the rest of the fit (6.9e-3
    off one device), silently. The root replica's flags are the module's after the step now, and the next step's
    replicas are built from them."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (63, 64)]
    ours, reference = same_start(_FrozenInTheStep, seed=0)
    trainer(strategy="sparse_dp", devices=3, max_epochs=2, max_steps=-1).fit(ours, loader(*batches))
    trainer(max_epochs=2, max_steps=-1).fit(reference, loader(*batches))
    assert [p.requires_grad for p in ours.parameters()] == [p.requires_grad for p in reference.parameters()]
    assert_same_states(ours, reference)


class _StopsInTheStep(PooledNet):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


def test_should_stop_set_in_the_step_is_said_and_the_check_leaves_it_unset(caplog):
    """A stop decided in the step is each replica's, from its chunk (any replica's stops the fit, as any DDP rank's):
    said once. The exactness check's runs of the first step no longer leave the trainer stopping."""
    import logging

    batches = [collate_dict(random_samples(7, seed=s)) for s in (68, 69, 70)]
    ours, reference = same_start(_StopsInTheStep, seed=0)
    with caplog.at_level(logging.INFO):
        t, r = fit_pair(ours, reference, batches, max_steps=3)
    assert t.global_step == r.global_step == 2
    said = [m.getMessage() for m in caplog.records if "set self.trainer.should_stop" in m.getMessage()]
    assert len(said) == 1
    assert_same_states(ours, reference)
