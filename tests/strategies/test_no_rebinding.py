"""Nothing outside a replica's step changes: torch's, builtins' and os' objects stay theirs in every thread while
replicas' steps run (each step is observed by its own thread's torch function mode), and what one device cannot
reproduce follows Lightning's DDP, the root replica as rank 0. Each scenario against plain Lightning on one device."""

from __future__ import annotations

import pickle
import threading

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from tests.support.exact import assert_same_states, relative_difference, same_start
from tests.support.helpers import SparseNet, loader, run_isolated, sample_loader, trainer
from tests.support.helpers import random_samples as samples_of


def batches(n: int = 2):
    from tests.support.helpers import collate_dict

    out = [collate_dict(samples_of(9, seed=30 + s)) for s in range(n)]
    return [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in out]


def fit(model, strategy="auto", devices=1, steps=2, **kwargs):
    t = trainer(strategy=strategy, devices=devices, precision="64-true", max_steps=steps, **kwargs)
    t.fit(model, loader(*batches(steps)))
    return t


def fit_both(cls, devices: int = 3):
    """``cls`` from the same start fitted on one device, then by sparse_dp on ``devices`` replicas, the states compared
    (:func:`assert_same_states`): ``(ours, our trainer, the one device's trainer)``."""
    ours, reference = same_start(cls)
    one = fit(reference)
    mine = fit(ours, "sparse_dp", devices)
    assert_same_states(ours, reference)
    return ours, mine, one


class LogsWithTorchMean(SparseNet):
    """``self.log(..., reduce_fx=torch.mean)``: Lightning checks ``reduce_fx is torch.mean``."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        frac = (batch["labels"] == 0).double().mean()
        self.log("frac", frac, reduce_fx=torch.mean, on_step=False, on_epoch=True, batch_size=len(batch["labels"]))
        return loss


@pytest.mark.parametrize("devices", [2, 3])
def test_log_with_reduce_fx_torch_mean_trains_and_logs_one_devices_value(devices):
    _, mine, one = fit_both(LogsWithTorchMean, devices)
    assert relative_difference(mine.callback_metrics["frac"], one.callback_metrics["frac"]) <= 1e-10


class PicklesItsConfig(SparseNet):
    """A step that pickles a config holding torch's functions (as ``torch.save(config)`` with a criterion does)."""

    def training_step(self, batch, batch_idx):
        config = {"criterion": F.cross_entropy, "reduce": torch.mean}
        assert config["criterion"] is F.cross_entropy
        self.restored = pickle.loads(pickle.dumps(config))
        return self.loss(batch)


def test_a_step_pickles_torchs_functions_as_on_one_device():
    ours, _, _ = fit_both(PicklesItsConfig)
    assert ours.restored == {"criterion": F.cross_entropy, "reduce": torch.mean}


def _mean_of(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x)


class ScriptsInTheStep(SparseNet):
    """A helper calling ``torch.mean`` compiled by ``torch.jit.script`` the first time a step runs."""

    def training_step(self, batch, batch_idx):
        scripted = torch.jit.script(_mean_of)
        self.scripted_mean = float(scripted(batch["features"]))
        return self.loss(batch)


def test_torch_jit_script_of_torch_mean_inside_a_step():
    fit_both(ScriptsInTheStep)


class Helper:
    def __call__(self, x):
        return x


class LazyHelper(SparseNet):
    """``if self.helper is None: self.helper = make_helper()`` in the step."""

    def __init__(self):
        super().__init__()
        self.helper = None

    def training_step(self, batch, batch_idx):
        if self.helper is None:
            self.helper = Helper()
        return self.loss({**batch, "features": self.helper(batch["features"])})


def test_a_lazy_attribute_keeps_the_root_replicas_object_and_trains_on():
    ours, reference = same_start(LazyHelper)
    fit(reference, steps=2)
    with pytest.warns(UserWarning, match=r"self\.helper was set to different values.*root replica's"):
        fit(ours, "sparse_dp", 3, steps=2)
    assert isinstance(ours.helper, Helper)
    assert_same_states(ours, reference)


def test_the_objects_other_threads_see_stay_torchs_during_a_multi_replica_fit(tmp_path):
    """In a fresh interpreter: the objects before ``import lightning_sparse_dp``, checked from another thread many times
    while a 3-replica fit runs, and after it; ``Tensor.__dict__`` gets no ``mean`` either."""
    run_isolated(
        """
        import builtins, os, threading
        import torch, torch.nn.functional as F, torch.distributed as dist
        before = {"torch.mean": torch.mean, "Tensor.mean": torch.Tensor.mean, "F.cross_entropy": F.cross_entropy,
                  "builtins.open": builtins.open, "os.open": os.open, "dist.all_reduce": dist.all_reduce}
        def now():
            return {"torch.mean": torch.mean, "Tensor.mean": torch.Tensor.mean, "F.cross_entropy": F.cross_entropy,
                    "builtins.open": builtins.open, "os.open": os.open, "dist.all_reduce": dist.all_reduce}
        import lightning_sparse_dp
        from tests.support.helpers import SparseNet, sample_loader, random_samples, trainer
        changed, looks, stop = [], [0], threading.Event()
        def watch():
            while not stop.is_set():
                seen = now()
                changed.extend(k for k in before if seen[k] is not before[k])
                looks[0] += 1
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            trainer(strategy="sparse_dp", devices=3, max_steps=3).fit(SparseNet(), sample_loader(random_samples(21)))
        finally:
            stop.set()
            watcher.join()
        assert not changed, sorted(set(changed))
        assert looks[0] > 10, looks
        assert all(now()[k] is before[k] for k in before)
        assert "mean" not in torch.Tensor.__dict__
        """,
        tmp_path,
    )


class Plain(L.LightningModule):
    """A module for a plain Lightning fit in another thread: logs with Lightning's default reduction (torch.mean)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plain_fit_in_another_thread_runs_as_alone_while_sparse_dp_fits():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, generator=g), int(torch.randint(0, 2, (1,), generator=g))) for _ in range(64)]
    errors: list[BaseException] = []

    def plain(model):
        try:
            trainer(max_steps=30).fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        except BaseException as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    for _ in range(2):
        torch.manual_seed(1)
        alone = Plain()
        plain(alone)
        torch.manual_seed(1)
        beside = Plain()
        thread = threading.Thread(target=plain, args=(beside,))
        thread.start()
        trainer(strategy="sparse_dp", devices=3, max_steps=4).fit(SparseNet(), sample_loader(samples_of(28)))
        thread.join()
        assert not errors, errors
        assert torch.equal(alone.layer.weight, beside.layer.weight)


def test_a_capture_observes_its_own_thread_only():
    """The step's mode counts means and captures losses in its own thread; another thread's calls are not seen."""
    from lightning_sparse_dp.loss.capture import TermCapture
    from lightning_sparse_dp.loss.means import count_of

    capture, seen = TermCapture(), {}
    x = torch.randn(5, 3)

    def other():
        F.cross_entropy(x, torch.zeros(5, dtype=torch.long))

    def step():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        loss = F.cross_entropy(x, torch.ones(5, dtype=torch.long))
        m = torch.mean(x)
        seen["count"] = count_of(m)
        return loss

    capture.run(step)
    assert len(capture.terms) == 1 and capture.terms[0].denominator == 5
    assert seen["count"] == 15
