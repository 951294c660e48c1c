"""The exactness check leaves no trace: a fit with it equals a fit without it, bit for bit, in what the user has
(parameters, optimizer state, metrics, logged values, loggers, callbacks, global_step, random generators); and it runs
where batches come split from DataLoader workers, with ME tensors in the batch, and every N steps when asked."""

from __future__ import annotations

import logging
from pathlib import Path

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import same_start
from tests.support.helpers import NUM_CLASSES, collate_dict, field_batch, loader, random_samples, trainer
from tests.support.step_forms import PooledNet


class Busy(PooledNet):
    """A metric updated and logged, a logger called from the step, a count kept on the module. (No dropout: replica
    threads sharing the CPU generator take its numbers in an order the threads decide, check or not.)"""

    def __init__(self):
        super().__init__()
        self.acc = MulticlassAccuracy(NUM_CLASSES)
        self.steps_seen = 0

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch))
        loss = F.cross_entropy(logits, batch["labels"])
        self.acc(logits, batch["labels"])
        self.log("acc", self.acc, on_step=True, on_epoch=True)
        self.log("train_loss", loss, on_epoch=True)
        self.logger.log_metrics({"from_step": float(batch_idx)}, step=self.global_step)
        self.steps_seen += 1
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Hooks(Callback):
    def __init__(self):
        self.calls: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append(f"start{batch_idx}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(f"end{batch_idx}:{float(outputs['loss']):.17g}")

    def on_before_backward(self, trainer, pl_module, loss):
        self.calls.append("before_backward")


def fit(model, check, tmp_path, precision):
    torch.manual_seed(1)
    hooks, logger = Hooks(), CSVLogger(tmp_path / str(check))
    samples = random_samples(14, seed=5)  # two batches an epoch: the second epoch's shuffle draws after the check
    t = trainer(strategy=SparseDataParallelStrategy(check_exactness=check), devices=3, max_steps=4, logger=logger,
                callbacks=[hooks], precision=precision)
    t.fit(model, DataLoader(samples, batch_size=7, collate_fn=collate_dict, shuffle=True))
    return t, hooks, logger


@pytest.fixture
def one_thread_each(monkeypatch):
    """Each replica (and ME's OpenMP, OpenBLAS) on one intra-op thread, as the user chooses with ``OMP_NUM_THREADS=1``
    set after the imports, whatever the machine's cores or what an earlier test left in ``os.environ``: ME's CPU
    kernel maps and OpenBLAS are not bitwise repeatable with several threads (on one device too), so a bitwise
    comparison of two fits runs where both use one. The main thread's torch threads are given back after the test."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["32-true", "64-true"])
def test_a_fit_with_the_check_equals_one_without_it_bit_for_bit(precision, tmp_path, caplog, one_thread_each):
    checked, unchecked = same_start(Busy, seed=0)
    with caplog.at_level(logging.INFO):
        t1, hooks1, logger1 = fit(checked, True, tmp_path, precision)
        rng1 = torch.get_rng_state()
    assert "exactness check of training step 0 on 3 replicas: equals one device's" in caplog.text
    t2, hooks2, logger2 = fit(unchecked, False, tmp_path, precision)
    rng2 = torch.get_rng_state()
    for (name, a), b in zip(checked.state_dict().items(), unchecked.state_dict().values()):
        assert torch.equal(a, b), name
    o1, o2 = t1.optimizers[0].state_dict()["state"], t2.optimizers[0].state_dict()["state"]
    assert all(torch.equal(o1[k]["momentum_buffer"], o2[k]["momentum_buffer"]) for k in o1) and o1.keys() == o2.keys()
    assert all(torch.equal(a, b) for a, b in zip(checked.acc.metric_state.values(), unchecked.acc.metric_state.values()))
    assert t1.global_step == t2.global_step == 4 and checked.steps_seen == unchecked.steps_seen == 4
    assert {k: float(v) for k, v in t1.callback_metrics.items()} == {k: float(v) for k, v in t2.callback_metrics.items()}
    assert hooks1.calls == hooks2.calls
    written = [(Path(lg.log_dir) / "metrics.csv").read_text() for lg in (logger1, logger2)]
    assert "from_step" in written[0] and written[0] == written[1]
    assert torch.equal(rng1, rng2)


class DrawsInStep(PooledNet):
    def training_step(self, batch, batch_idx):
        h = self.features(batch)
        return F.cross_entropy(self.head(h + 0.01 * torch.randn_like(h)), batch["labels"])


def test_a_step_that_draws_random_numbers_is_said_unchecked(caplog):
    ours, _ = same_start(DrawsInStep, seed=0)
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=2, max_steps=1).fit(ours, loader(collate_dict(random_samples(6))))
    assert "not compared, because the step draws random numbers (torch's generator)" in caplog.text


class _Hooked(Callback):
    """A forward hook, registered in the callback's setup, that counts the head's calls."""

    def setup(self, trainer, pl_module, stage):
        self.calls = 0

        def count(layer, args, out):
            self.calls += 1

        pl_module.head.register_forward_hook(count)


def test_a_module_with_hooks_is_said_unchecked_and_its_hooks_see_only_the_fit(caplog):
    """The check's deep copies would carry a hook and call it on the checked batch (a callback's count, list or file
    seeing the first batch twice more): it is not run on a module with hooks, and says so."""
    calls = []
    for check in (True, False):
        ours, _ = same_start(PooledNet, seed=0)
        hooked = _Hooked()
        strategy = SparseDataParallelStrategy(check_exactness=check)
        with caplog.at_level(logging.INFO):
            trainer(strategy=strategy, devices=3, max_steps=2, callbacks=[hooked]).fit(
                ours, loader(*[collate_dict(random_samples(6, seed=s)) for s in (1, 2)]))
        calls.append(hooked.calls)
    assert calls[0] == calls[1] == 2 * 3  # each replica's step, both steps
    assert "not compared, because the module has hooks (head), which its copies would call" in caplog.text


class _SpectralHead(PooledNet):
    """torch's spectral_norm on the head: a forward pre-hook of torch's own, which computes the weight."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.utils.spectral_norm(self.head)


def test_a_module_with_torchs_own_hooks_is_still_checked(caplog):
    """spectral_norm's (and legacy weight_norm's) hooks compute a weight from the copy's own parameters: not a user's
    hook that reaches what it holds, so the module is checked."""
    ours, _ = same_start(_SpectralHead, seed=0)
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(ours, loader(collate_dict(random_samples(6, seed=1))))
    assert "exactness check of training step 0 on 3 replicas: equals one device's" in caplog.text


def test_the_check_runs_every_n_steps_when_asked(caplog):
    ours, _ = same_start(PooledNet, seed=0)
    strategy = SparseDataParallelStrategy(check_exactness_every_n_steps=2)
    batches = [collate_dict(random_samples(6, seed=s)) for s in range(5)]
    with caplog.at_level(logging.INFO):
        trainer(strategy=strategy, devices=2, max_steps=5).fit(ours, loader(*batches))
    checked = [r.getMessage().split(" on ")[0] for r in caplog.records if "exactness check of" in r.getMessage()]
    assert checked == [f"sparse_dp: exactness check of training step {s}" for s in (0, 2, 4)]


def test_the_check_runs_on_batches_split_in_dataloader_workers(caplog):
    ours, _ = same_start(PooledNet, seed=0)
    samples = random_samples(14, seed=2)
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, max_steps=1, precision="64-true").fit(
            ours, DataLoader(samples, batch_size=7, collate_fn=collate_dict, num_workers=1)
        )
    assert "exactness check of training step 0 on 3 replicas: equals one device's on the same 7 samples" in caplog.text


class FieldNet(PooledNet):
    """A TensorField in the batch, sliced back to points: a per-point loss."""

    def __init__(self):
        super().__init__()
        self.point_head = nn.Linear(8, NUM_CLASSES)

    def training_step(self, batch, batch_idx):
        x = batch["x"]
        out = self.body[:2](x.sparse()).slice(x)
        return F.cross_entropy(self.point_head(out.F), batch["labels"])


@pytest.mark.parametrize("workers", [0, 1])
def test_the_check_runs_on_me_tensors_in_a_float32_batch(workers, caplog):
    ours, _ = same_start(FieldNet, seed=0)
    batch = field_batch(6, seed=1)
    assert isinstance(batch["x"], ME.TensorField) and batch["x"].F.dtype == torch.float32
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=2, max_steps=1).fit(
            ours, DataLoader([batch], batch_size=None, num_workers=workers)
        )
    assert "exactness check of training step 0 on 2 replicas: equals one device's" in caplog.text, caplog.text[-3000:]


def test_presplit_collate_keeps_the_collated_batch_as_asked():
    from lightning_sparse_dp import PreSplitCollate

    samples = random_samples(6, seed=4)
    first = PreSplitCollate(collate_dict, 2, keep_batch="first")
    kept = [first(samples).batch is not None for _ in range(3)]
    assert kept == [True, False, False]  # a worker's first batch only (a fit's first training batch is worker 0's)
    assert PreSplitCollate(collate_dict, 2)(samples).batch["labels"].tolist() == collate_dict(samples)["labels"].tolist()
    assert PreSplitCollate(collate_dict, 2, keep_batch="never")(samples).batch is None
    with pytest.raises(ValueError, match="keep_batch="):
        PreSplitCollate(collate_dict, 2, keep_batch="sometimes")
