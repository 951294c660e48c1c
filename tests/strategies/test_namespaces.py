"""Modules written against the standalone ``pytorch_lightning`` (as ME's multigpu_lightning.py and most published ME
modules are): ``pytorch_lightning.Trainer(strategy="sparse_dp")`` and the strategy instances of
``lightning_sparse_dp.pl`` train them to one device's parameters (float64); one source, loaded twice."""

from __future__ import annotations

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import lightning_sparse_dp  # noqa: E402
from tests.support.exact import relative_difference  # noqa: E402
from tests.support.helpers import IN_CHANNELS, NUM_CLASSES, collate_dict, random_samples  # noqa: E402


def _network() -> torch.nn.Sequential:
    """The test network, the same weights every time (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3), ME.MinkowskiBatchNorm(8),
        ME.MinkowskiReLU(), ME.MinkowskiGlobalAvgPooling(), ME.MinkowskiLinear(8, NUM_CLASSES),
    )


class PLNet(pl.LightningModule):
    """ME's multigpu_lightning.py in small: a pytorch_lightning module, the SparseTensor built in the step."""

    def __init__(self):
        super().__init__()
        self.net = _network()

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        loss = F.cross_entropy(self.net(x).F, batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy, devices, model=None, precision="64-true", trainer_cls=None, **kwargs):
    """Two steps of ``model`` (default: a new PLNet) with ``trainer_cls`` (default: ``pytorch_lightning.Trainer``)."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (91, 92)]
    if precision == "64-true":
        batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    model = (PLNet().double() if precision == "64-true" else PLNet()) if model is None else model
    t = (trainer_cls or pl.Trainer)(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs
    )
    t.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    return model, t


def test_the_mirror_is_this_package_on_pytorch_lightnings_classes():
    mirror = lightning_sparse_dp.pl
    assert mirror is not None and mirror.__name__ == "lightning_sparse_dp.pl"
    assert issubclass(mirror.SparseDataParallelStrategy, pl.strategies.ParallelStrategy)
    assert issubclass(mirror.SparseDDPStrategy, pl.strategies.DDPStrategy)
    assert mirror.SparseDataParallelStrategy.__init__.__code__.co_filename == (
        lightning_sparse_dp.SparseDataParallelStrategy.__init__.__code__.co_filename
    )  # one source
    assert {"sparse_dp", "sparse_ddp"} <= set(pl.strategies.StrategyRegistry)


@pytest.mark.parametrize("strategy", ["sparse_dp", "instance"])
def test_a_pytorch_lightning_module_trains_to_one_devices_parameters(strategy):
    chosen = lightning_sparse_dp.pl.SparseDataParallelStrategy() if strategy == "instance" else "sparse_dp"
    ours, t = _fit(chosen, 3, sync_batchnorm=True)
    reference, r = _fit("auto", 1)
    assert type(t.strategy).__module__ == "lightning_sparse_dp.pl.strategies.sparse_dp"
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        if a.is_floating_point():
            assert relative_difference(a, b) <= 1e-10, name
    assert relative_difference(t.logged_metrics["train_loss"], r.logged_metrics["train_loss"]) <= 1e-10


def test_sparse_ddp_under_pytorch_lightning_trains_as_one_device(in_process_ddp):
    """One rank in this process (its process group and launch environment taken back after: ``in_process_ddp``):
    the pytorch_lightning mirror's sparse_ddp."""
    ours, t = _fit("sparse_ddp", 1)
    reference, _ = _fit("auto", 1)
    assert type(t.strategy).__module__ == "lightning_sparse_dp.pl.strategies.sparse_ddp"
    for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
        if a.is_floating_point():
            assert relative_difference(a, b) <= 1e-10, name


@pytest.mark.parametrize("first", ["lightning.pytorch", "pytorch_lightning", None])
def test_importing_the_package_leaves_lightnings_messages_where_they_went(first):
    """lightning_utilities logs every Lightning rank-zero line through one logger that each namespace sets to its own
    when imported: importing this package (which loads both) keeps the user's, or lightning.pytorch's by default."""
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import {first}\n" if first else "") + (
        "import lightning_sparse_dp\nimport lightning_utilities.core.rank_zero as r\nprint(r.log.name)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{first or 'lightning.pytorch'}.utilities.rank_zero"


def test_importing_the_package_imports_pytorch_lightning_only_once_the_process_does(tmp_path):
    """``import lightning_sparse_dp`` imports nothing the user's code did not (issue 58): ``pytorch_lightning`` (which
    changes Lightning's deprecation-warning class when imported) comes in only with the user's own import, whose
    registry then holds the strategies."""
    from tests.support.helpers import run_isolated

    run_isolated(
        """
        import sys
        import lightning_sparse_dp
        assert "pytorch_lightning" not in sys.modules and "lightning_sparse_dp.pl" not in sys.modules
        import pytorch_lightning as pl
        assert {"sparse_dp", "sparse_ddp"} <= set(pl.strategies.StrategyRegistry)
        assert lightning_sparse_dp.pl.SparseDataParallelStrategy.__module__ == "lightning_sparse_dp.pl.strategies.sparse_dp"
        """,
        tmp_path,
    )


class LNet(__import__("lightning").LightningModule):
    """PLNet on ``lightning.pytorch``'s classes."""

    def __init__(self):
        super().__init__()
        self.net = _network()

    training_step = PLNet.training_step
    configure_optimizers = PLNet.configure_optimizers


def _fit_lightning(strategy, devices, model=None, precision="64-true", **kwargs):
    """:func:`_fit` of an LNet on ``lightning.pytorch``'s Trainer; the model."""
    import lightning as L

    model = (LNet().double() if precision == "64-true" else LNet()) if model is None else model
    return _fit(strategy, devices, model, precision, L.Trainer, **kwargs)[0]


def test_a_pytorch_lightning_fit_and_a_lightning_fit_in_one_process_each_equal_one_device():
    """The mirror holds no process state that can disagree with the original's (issue 57): one after the other, each
    fit equals its plain one-device reference (float64); side by side in two threads, each equals the same fit run
    alone. The threads run in float32: Lightning's "64-true" sets torch's default dtype, one per process, around
    every step, so two float64 fits in one process would change each other's (Lightning's, not this package's)."""
    import threading

    ref_pl, ref_l = _fit("auto", 1)[0], _fit_lightning("auto", 1)
    runs = {"pl": _fit("sparse_dp", 3, sync_batchnorm=True)[0], "l": _fit_lightning("sparse_dp", 3, sync_batchnorm=True)}
    for name, model in runs.items():
        reference = ref_pl if name == "pl" else ref_l
        for (key, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            if a.is_floating_point():
                assert relative_difference(a, b) <= 1e-10, (name, key)

    def fit_pl(model):
        return _fit("sparse_dp", 3, model, precision="32-true", sync_batchnorm=True)[0]

    def fit_l(model):
        return _fit_lightning("sparse_dp", 3, model, precision="32-true", sync_batchnorm=True)

    alone = {"pl": fit_pl(PLNet()), "l": fit_l(LNet())}
    beside, errors = {}, []
    models = {"pl": PLNet(), "l": LNet()}  # made here: two threads seeding torch at once would interleave their draws

    def side(name, fit):
        try:
            beside[name] = fit(models[name])
        except BaseException as err:  # noqa: BLE001  (asserted below)
            errors.append(err)

    threads = [threading.Thread(target=side, args=("pl", fit_pl)), threading.Thread(target=side, args=("l", fit_l))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in ("pl", "l"):
        for (key, a), b in zip(beside[name].state_dict().items(), alone[name].state_dict().values()):
            if a.is_floating_point():
                assert relative_difference(a, b) <= 1e-6, (name, key)
    assert torch.get_default_dtype() == torch.float32
