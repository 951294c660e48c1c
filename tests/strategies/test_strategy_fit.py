"""The sparse_dp strategy through Lightning's Trainer, against one device with the whole batch: registration, the
step on several replicas and its logged values, errors and options, checkpoints, the batch kinds it splits, one
device and several replicas on one device. What a step leaves on the module: tests/replica/test_module_state.py."""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_sparse_dp
from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.runtime.devices import check_devices
from tests.support.exact import assert_same_states, same_start
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


def _fit_one_step(model, batch, **trainer_kwargs):
    t = trainer(**trainer_kwargs)
    t.fit(model, loader(batch))
    return t


def _assert_same_step(ours, reference, batch, devices=3, **strategy_kwargs):
    """One step of ``ours`` under sparse_dp equals one step of ``reference`` on one device with the whole batch."""
    initial = [p.detach().clone() for p in ours.parameters()]
    strategy = SparseDataParallelStrategy(**strategy_kwargs) if strategy_kwargs else "sparse_dp"
    _fit_one_step(ours, batch, strategy=strategy, devices=devices)
    _fit_one_step(reference, batch, devices=1)
    for (name, p), q, p0 in zip(ours.named_parameters(), reference.parameters(), initial):
        assert not torch.equal(p, p0), f"{name} did not move"
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_strategy_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "sparse_dp" in StrategyRegistry
    t = trainer(strategy="sparse_dp", devices=3)
    assert isinstance(t.strategy, SparseDataParallelStrategy)
    assert t.strategy.parallel_devices == [torch.device("cpu")] * 3
    assert t.strategy.root_device == torch.device("cpu") and t.world_size == 1


def test_one_step_on_three_replicas_equals_one_step_on_one_device_uneven_batch():
    batch = collate_dict(random_samples(7, seed=1))  # chunks of 3, 2 and 2 samples
    _assert_same_step(*same_start(), batch)


def test_replicas_really_run_on_several_threads_and_parameters_change():
    batch = collate_dict(random_samples(7, seed=2))
    model, untouched = same_start()
    seen = []

    class Spy(SparseNet):
        def training_step(self, batch, batch_idx):
            seen.append((threading.get_ident(), batch["labels"].shape[0]))
            return super().training_step(batch, batch_idx)

    spy = Spy()
    spy.load_state_dict(model.state_dict())
    _fit_one_step(spy, batch, strategy=SparseDataParallelStrategy(split="contiguous", check_exactness=False), devices=3)
    assert sorted(n for _, n in seen) == [2, 2, 3]
    assert len({tid for tid, _ in seen}) == 3
    assert any(not torch.equal(p, q) for p, q in zip(spy.parameters(), untouched.parameters()))


def test_logged_loss_equals_whole_batch_loss(tmp_path):
    batch = collate_dict(random_samples(7, seed=3))
    model, reference = same_start()
    expected = reference.loss(batch).item()
    t = _fit_one_step(model, batch, strategy="sparse_dp", devices=3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    assert t.callback_metrics["train_loss"].item() == pytest.approx(expected, rel=1e-5)
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header, row = metrics[0].split(","), metrics[1].split(",")
    assert float(row[header.index("train_loss")]) == pytest.approx(expected, rel=1e-5)


def test_validation_loss_is_the_whole_batch_mean_over_an_epoch():
    batches = [collate_dict(random_samples(7, seed=4)), collate_dict(random_samples(5, seed=5))]
    model, reference = same_start()
    t = trainer(strategy="sparse_dp", devices=3, limit_val_batches=1.0)
    t.validate(model, loader(*batches), verbose=False)
    with torch.no_grad():
        losses = [reference.loss(b).item() for b in batches]
    expected = (7 * losses[0] + 5 * losses[1]) / 12  # Lightning weights epoch means by batch size in samples
    assert t.callback_metrics["val_loss"].item() == pytest.approx(expected, rel=1e-5)


def test_exception_in_one_replica_surfaces_without_hang():
    batch = collate_dict(random_samples(7, seed=6))
    model = SparseNet(fail_on_replica_with=3)  # only the first chunk (3 samples) fails
    result = {}

    def run():
        try:
            _fit_one_step(model, batch, strategy=SparseDataParallelStrategy(split="contiguous"), devices=3)
        except BaseException as err:  # noqa: BLE001
            result["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the failing step hung"
    err = result["err"]
    assert isinstance(err, RuntimeError) and "boom in the chunk of 3 samples" in str(err)
    assert any("replica 0" in note for note in getattr(err, "__notes__", []))


def test_fewer_samples_than_devices():
    _assert_same_step(*same_start(), collate_dict(random_samples(2, seed=7)))


def test_loss_weighting_equal_differs_from_samples_on_uneven_batches():
    batch = collate_dict(random_samples(7, seed=8))
    equal, samples = same_start()
    _fit_one_step(equal, batch, strategy=SparseDataParallelStrategy(loss_weighting="equal"), devices=3)
    _fit_one_step(samples, batch, strategy=SparseDataParallelStrategy(loss_weighting="samples"), devices=3)
    assert any(not torch.allclose(p, q) for p, q in zip(equal.parameters(), samples.parameters()))


def test_bad_loss_weighting():
    with pytest.raises(ValueError, match="loss_weighting='voxels'"):
        SparseDataParallelStrategy(loss_weighting="voxels")


def test_more_cuda_devices_than_the_machine_has(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(MisconfigurationException, match=r"has 2 CUDA device\(s\).*cuda:2"):
        check_devices([torch.device("cuda", i) for i in range(3)])
    with pytest.raises(MisconfigurationException, match="one kind"):
        check_devices([torch.device("cpu"), torch.device("cuda", 0)])


def test_bad_batch_error_reaches_the_user():
    batch = collate_dict(random_samples(4))
    batch["coordinates"] = batch["coordinates"].float()
    batch["coordinates"][0, 0] = -1
    with pytest.raises(lightning_sparse_dp.BatchLayoutError, match="negative batch index"):
        _fit_one_step(SparseNet(), batch, strategy="sparse_dp", devices=3)


def test_checkpoint_from_three_replicas_loads_with_one_device_and_into_the_bare_module(tmp_path):
    batch = collate_dict(random_samples(7, seed=9))
    model = SparseNet()
    t = _fit_one_step(model, batch, strategy="sparse_dp", devices=3)
    path = tmp_path / "three.ckpt"
    t.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == set(model.state_dict())  # no prefixes

    bare = SparseNet()
    bare.load_state_dict(state)
    for p, q in zip(bare.parameters(), model.parameters()):
        assert torch.equal(p, q)

    restored = SparseNet.load_from_checkpoint(path, map_location="cpu")
    one = trainer(devices=1, max_steps=2)
    one.fit(restored, loader(batch), ckpt_path=path)  # resumes from step 1 on one device
    assert one.global_step == 2


def test_sparse_tensor_batches_are_built_on_each_replica():
    import MinkowskiEngine as ME

    base = collate_dict(random_samples(5, seed=10))
    batch = {"x": ME.SparseTensor(base["features"], base["coordinates"]), "labels": base["labels"]}
    built = []

    class FromSparse(SparseNet):
        def loss(self, batch):
            built.append((threading.current_thread().name, batch["x"]))
            return torch.nn.functional.cross_entropy(self(batch["x"]), batch["labels"])

    _assert_same_step(*same_start(FromSparse), batch, devices=2, split="contiguous", check_exactness=False)
    replicas = sorted(built[:2], key=lambda b: b[0])  # the replica threads' order ("sparse_dp-replica<i>")
    assert [x.C[:, 0].max().item() for _, x in replicas] == [2, 1]  # two replicas, batch indices renumbered
    assert len({id(x.coordinate_manager) for _, x in replicas}) == 2


def test_dense_batches_split_like_data_parallel():
    class Dense(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    batch = (torch.randn(7, 3), torch.randint(0, 2, (7,)))
    _assert_same_step(*same_start(Dense), batch)


def test_tensor_field_batches_quantize_on_each_replica():
    import MinkowskiEngine as ME

    base = collate_dict(random_samples(5, seed=11))
    coords = base["coordinates"].float()
    coords[:, 1:] += 0.3  # continuous coordinates; batch index stays in column 0
    batch = {"x": ME.TensorField(base["features"], coords), "labels": base["labels"]}

    class FromField(SparseNet):
        def loss(self, batch):
            return torch.nn.functional.cross_entropy(self(batch["x"].sparse()), batch["labels"])

    _assert_same_step(*same_start(FromField), batch)


def test_values_show_in_tensorboard_and_the_progress_bar(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class WithBar(SparseNet):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("bar_loss", loss, prog_bar=True)
            return loss

    batch = collate_dict(random_samples(7, seed=12))
    model, reference = same_start(WithBar)
    expected = reference.loss(batch).item()
    t = _fit_one_step(
        model, batch, strategy="sparse_dp", devices=3, logger=TensorBoardLogger(tmp_path), log_every_n_steps=1
    )
    assert t.progress_bar_metrics["bar_loss"] == pytest.approx(expected, rel=1e-5)
    events = EventAccumulator(t.logger.log_dir)
    events.Reload()
    assert events.Scalars("bar_loss")[0].value == pytest.approx(expected, rel=1e-5)


def test_bad_split_option():
    with pytest.raises(ValueError, match="split='random'"):
        SparseDataParallelStrategy(split="random")


def test_a_trainer_deep_copies_during_a_sparse_dp_fit():
    """A callback that deep-copies the Trainer (as some do to snapshot it) works as under plain Lightning."""
    import copy

    copies = []

    class DeepCopies(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            copies.append(copy.deepcopy(trainer))

    t = trainer(strategy="sparse_dp", devices=3, max_steps=2, callbacks=[DeepCopies()])
    t.fit(SparseNet(), loader(collate_dict(random_samples(6, seed=3))))
    assert len(copies) == 2 and all(c.strategy is not t.strategy for c in copies)


def test_one_device_is_plain_lightning():
    """devices=1: the module's own step on the batch, nothing split, replicated or weighed (no stage ran), and the
    same parameters and logged values as plain Lightning (float64; the strategy's thread settings may change the
    order of float sums, so not bit for bit)."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (121, 122)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    ours, reference = same_start(SparseNet)
    strategy = SparseDataParallelStrategy(record_stage_times=True)
    t = trainer(strategy=strategy, devices=1, max_steps=2, precision="64-true")
    t.fit(ours.double(), loader(*batches))
    r = trainer(max_steps=2, precision="64-true")
    r.fit(reference.double(), loader(*batches))
    assert not list(strategy.stage_times.steps)  # the fast path: no stage of the data path ran
    assert_same_states(ours, reference)
    assert float(t.logged_metrics["train_loss"]) == pytest.approx(float(r.logged_metrics["train_loss"]), rel=1e-12)


def test_several_replicas_share_one_device():
    """replicas_per_device=3 on one device: three replicas (the multi-replica paths, as on one GPU), exact."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (141, 142)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    ours, reference = same_start(SparseNet, batch_norm=True)
    strategy = SparseDataParallelStrategy(replicas_per_device=3, record_stage_times=True)
    t = trainer(strategy=strategy, devices=1, max_steps=2, precision="64-true", sync_batchnorm=True)
    t.fit(ours.double(), loader(*batches))
    trainer(max_steps=2, precision="64-true").fit(reference.double(), loader(*batches))
    assert len(t.strategy.parallel_devices) == 3 and {"replica0", "replica2"} <= set(
        list(strategy.stage_times.steps)[0]
    )
    assert_same_states(ours, reference)
    with pytest.raises(ValueError, match="replicas_per_device"):
        SparseDataParallelStrategy(replicas_per_device=0)


def test_mes_shared_coordinate_manager_mode_is_refused_for_replicas_and_fine_for_one(monkeypatch):
    """ME's SHARE_COORDINATE_MANAGER mode: one global coordinate manager for every SparseTensor of the process,
    which replica threads would write at once (ME ended the process with 3 CPU replicas): refused at setup and at
    every step's placing, with the fixes; one replica runs as it would on one device."""
    import MinkowskiEngine as ME
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_sparse_dp.step import scatter as place

    monkeypatch.setattr(ME, "sparse_tensor_operation_mode", lambda: ME.SparseTensorOperationMode.SHARE_COORDINATE_MANAGER)
    batches = [collate_dict(random_samples(4, seed=1))]
    with pytest.raises(MisconfigurationException, match=r"SHARE_COORDINATE_MANAGER.*SEPARATE_COORDINATE_MANAGER.*sparse_ddp"):
        trainer(strategy="sparse_dp", devices=2, max_steps=1).fit(SparseNet(), loader(*batches))
    with pytest.raises(MisconfigurationException, match="SHARE_COORDINATE_MANAGER"):
        place.place_chunks([{}, {}], [torch.device("cpu")] * 2)  # the mode set after setup: caught at the step
    assert place.place_chunks([{}], [torch.device("cpu")]) == [{}]
