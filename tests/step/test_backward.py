"""Per-replica backward through Lightning's backward path, against one device with the whole batch (float64)."""

from __future__ import annotations

import threading

import MinkowskiEngine as ME
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.step.check import DeferredCheck
from lightning_sparse_dp.step.copies import BufferHandOff
from tests.support.exact import assert_same_states, relative_difference, same_start
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples, run_isolated, trainer
from tests.support.step_forms import ManualOptimization

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

F64 = dict(precision="64-true")


def _batches(n=3, samples=7, seed=70):
    return [collate_dict(random_samples(samples, seed=seed + i)) for i in range(n)]


class _ThreadProbe(SparseNet):
    """Records, in each replica's backward, its thread; the hooks pass a barrier only if all run at once."""

    def __init__(self):
        super().__init__(batch_norm=True)
        self.barrier = threading.Barrier(3, timeout=30)
        self.backward_threads: list[str] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)

        def hook(grad):
            self.backward_threads.append(threading.current_thread().name)
            self.barrier.wait()  # a BrokenBarrierError unless the three replicas' backward passes overlap
            return grad

        loss.register_hook(hook)
        return loss


def test_each_replica_runs_its_backward_in_its_own_thread_at_once():
    model = _ThreadProbe()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=2).fit(model, loader(*_batches(2)))
    assert sorted(model.backward_threads) == sorted(f"sparse_dp-replica{i}_0" for i in range(3) for _ in range(2))


class _Hooks(SparseNet):
    """Records the loss seen by on_before_backward and the gradients seen by on_after_backward."""

    def __init__(self):
        super().__init__(batch_norm=True)
        self.before: list[torch.Tensor] = []
        self.after: list[list[torch.Tensor]] = []

    def on_before_backward(self, loss):
        self.before.append(loss.detach().clone())

    def on_after_backward(self):
        self.after.append([p.grad.clone() for p in self.parameters()])


def test_backward_hooks_see_the_one_device_loss_and_gradients():
    ours, reference = same_start(_Hooks)
    batches = _batches()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=3, **F64).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=3, **F64).fit(reference, loader(*batches))
    assert len(ours.before) == len(ours.after) == len(reference.before) == len(reference.after) == 3
    for got, want in zip(ours.before, reference.before):
        assert relative_difference(got, want) < 1e-10
    for got, want in zip(ours.after, reference.after):
        for g, w in zip(got, want):
            assert relative_difference(g, w) < 1e-10
    assert_same_states(ours, reference)


class _ScaledBackward(SparseNet):
    """A LightningModule.backward override that changes the loss before its backward pass; records its threads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backward_threads = []

    def backward(self, loss, *args, **kwargs):
        self.backward_threads.append(threading.current_thread())
        (loss * 3.0 + 0.5).backward(*args, **kwargs)


def test_a_backward_override_runs_in_the_main_thread_and_its_changes_reach_every_replica():
    ours, reference = same_start(_ScaledBackward, batch_norm=True)
    batches = _batches()
    kwargs = dict(max_steps=3, gradient_clip_val=0.5, **F64)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, **kwargs).fit(ours, loader(*batches))
    trainer(devices=1, **kwargs).fit(reference, loader(*batches))
    assert ours.backward_threads == [threading.main_thread()] * 3
    assert_same_states(ours, reference)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accumulate_grad_batches": 3},
        {"gradient_clip_val": 0.05},
        {"gradient_clip_algorithm": "value", "gradient_clip_val": 0.01},
    ],
    ids=["accumulate", "clip-norm", "clip-value"],
)
def test_accumulation_and_clipping_in_float64(kwargs):
    ours, reference = same_start(batch_norm=True)
    batches = _batches(6)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=2, **kwargs, **F64).fit(
        ours, loader(*batches)
    )
    trainer(devices=1, max_steps=2, **kwargs, **F64).fit(reference, loader(*batches))
    assert_same_states(ours, reference)


def test_loss_scaling_of_a_precision_plugin_reaches_the_replicas():
    """16-mixed with a GradScaler: the scaled loss's gradient reaches every replica, and the unscaled step is right.

    The first step starts from equal parameters, and the first convolution's gradient differs only by float32
    sums in another order (~1e-7). From the second step on the parameters differ by float16 rounding: each
    replica's linear layer computes its chunk's weight gradient as a float16 matmul, rounded before the
    replicas' sum (as each DDP rank's is), 3e-4 apart from the whole batch's. That is within 1e-3 of the
    reference, but not for every start: a batch-norm output within ~1e-5 of 0 can land on the other side of the
    ReLU and move one channel's gradient by 20 % (1 of 400 random starts, seed 287, measured). The start is
    seeded so the test is deterministic: seed 0's steps differ by 7e-8, 1e-4 and 2e-5.
    """
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)]
    ours, reference = same_start(batch_norm=True, seed=0)
    batches = _batches()
    seen = []

    class Scale(Callback):
        def on_after_backward(self, trainer, pl_module):
            seen.append(pl_module.net[0].kernel.grad.abs().max().item())

    for model, strategy, devices, scaler in [(ours, "sparse_dp", 3, scalers[0]), (reference, "auto", 1, scalers[1])]:
        trainer(
            strategy=strategy,
            devices=devices,
            sync_batchnorm=devices > 1,
            max_steps=3,
            callbacks=[Scale()],
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        ).fit(model, loader(*batches))
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert len(seen) == 6  # three steps each
    ours_seen, ref_seen = seen[:3], seen[3:]
    assert ours_seen[0] == pytest.approx(ref_seen[0], rel=1e-5)  # equal parameters: float32 sums apart
    for a, b in zip(ours_seen, ref_seen):
        assert a == pytest.approx(b, rel=1e-3) and a > 10  # scaled gradients (the unscaled ones are < 1)
    ref = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=1e-3, atol=1e-4, msg=name)  # float16 autocast rounding


class _TwiceBackward(SparseNet):
    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=True)
        loss.backward()


def test_a_second_backward_through_the_loss_is_a_clear_error():
    with pytest.raises(RuntimeError, match="backward ran twice"):
        trainer(strategy="sparse_dp", devices=3).fit(_TwiceBackward(), loader(*_batches(1)))


class _FailingBackward(SparseNet):
    """Replica ``fail`` (by chunk size) raises in its backward pass."""

    def __init__(self, fail: int):
        super().__init__(batch_norm=True)
        self.fail = fail

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch["labels"].shape[0] == self.fail:

            def hook(grad):
                raise ValueError("backward fails in one replica")

            loss.register_hook(hook)
        return loss


def test_an_error_in_one_replica_backward_stops_the_others_and_surfaces(tmp_path):
    # in a child process killed after 120 s: replicas left waiting in batch norm's backward fail here
    run_isolated(
        """
        import pytest
        from lightning_sparse_dp import SparseDataParallelStrategy
        from tests.step.test_backward import _FailingBackward, _batches, loader, trainer
        with pytest.raises(ValueError, match="backward fails in one replica") as info:
            trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, sync_batchnorm=True).fit(
                _FailingBackward(fail=3), loader(*_batches(1))
            )
        assert "raised in replica 0" in "".join(getattr(info.value, "__notes__", []))
        """,
        tmp_path,
        timeout=120,
    )


class _Freeze(Callback):
    """Freezes the first convolution before the second step; records the replicas object of every step."""

    def __init__(self):
        self.replicas = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            pl_module.net[0].kernel.requires_grad_(False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.replicas.append(getattr(trainer.strategy, "_replicas", None))


def test_replicas_persist_across_steps_and_are_rebuilt_when_layers_are_frozen():
    ours, reference = same_start(batch_norm=True)
    frozen_start = ours.net[0].kernel.detach().clone()
    batches = _batches(4)
    record = _Freeze()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=4, callbacks=[record], **F64).fit(
        ours, loader(*batches)
    )
    trainer(devices=1, max_steps=4, callbacks=[_Freeze()], **F64).fit(reference, loader(*batches))
    first, second, third, fourth = record.replicas
    assert first is not None and second is not first and third is second and fourth is second
    assert not torch.equal(ours.net[0].kernel, frozen_start.double())  # moved in step 1, then frozen
    assert_same_states(ours, reference)


class _Reshape(Callback):
    """Before every step, a buffer of a new shape; before the second, a new head (new parameters, seeded): the module
    changes under its replicas, which the main thread's check finds while the replicas' threads cut their chunks."""

    def __init__(self):
        self.replicas = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.register_buffer("seen", torch.zeros(batch_idx + 1, dtype=pl_module.dtype))
        if batch_idx == 1:
            torch.manual_seed(5)
            pl_module.net[-1] = ME.MinkowskiLinear(16, NUM_CLASSES).to(pl_module.dtype)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.replicas.append(getattr(trainer.strategy, "_replicas", None))


def test_a_module_changed_under_its_replicas_gets_new_ones_before_any_replica_uses_them(monkeypatch, both_preparations):
    """A buffer of another shape and a replaced layer between steps: the replicas' threads would copy the buffer into
    the old replicas' (a shape error) or run the old layer, unless the check the main thread takes meanwhile stops
    them first (replicate.DeferredCheck: StaleReplicas, replicas rebuilt, the step run again). As one device."""
    stale = []
    run = DeferredCheck.run
    monkeypatch.setattr(DeferredCheck, "run", lambda self: run(self) or stale.append(not self._fits))
    ours, reference = same_start(batch_norm=True)
    batches = _batches(4)
    record = _Reshape()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=4, callbacks=[record], **F64).fit(
        ours, loader(*batches)
    )
    trainer(devices=1, max_steps=4, callbacks=[_Reshape()], **F64).fit(reference, loader(*batches))
    assert len({id(r) for r in record.replicas}) == 4  # rebuilt every step
    assert stale == ([True, True, True] if both_preparations else [])  # steps 2-4 found stale, run again
    assert ours.seen.shape == (4,)
    assert_same_states(ours, reference)


def test_a_chunk_that_fails_in_its_replica_fails_the_step_at_once(monkeypatch):
    """Replica 1's chunk fails to be placed (in its thread): its error, not replica 0's wait for its buffer copies."""
    place = __import__("lightning_sparse_dp.step.scatter", fromlist=["place_chunk"])
    placing = place.place_chunk

    def fails_in_replica_1(chunk, device, transfer=None):
        if threading.current_thread().name.startswith("sparse_dp-replica1"):
            raise MemoryError("no room for replica 1's chunk")
        return placing(chunk, device, transfer)

    monkeypatch.setattr(place, "place_chunk", fails_in_replica_1)
    monkeypatch.setattr(BufferHandOff.__init__, "__defaults__", (5.0,))  # replica 0's wait, were it left waiting
    model = SparseNet(batch_norm=True)
    with pytest.raises(MemoryError, match="no room for replica 1"):
        trainer(strategy=SparseDataParallelStrategy(prepare_in_threads=True), devices=3, max_steps=2).fit(
            model, loader(*_batches(2))
        )


def test_stage_times_hold_each_synchronized_layer_and_the_wait():
    strategy = SparseDataParallelStrategy(record_stage_times=True)
    model = SparseNet(batch_norm=True)
    layers = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    trainer(strategy=strategy, devices=3, sync_batchnorm=True, max_steps=2).fit(model, loader(*_batches(2)))
    for step in strategy.stage_times.steps:
        per_layer = [step[f"syncbn{j}"] for j in range(layers)]
        assert f"syncbn{layers}" not in step and all(t > 0 for t in per_layer)
        assert step["syncbn"] == pytest.approx(sum(per_layer))
        assert 0 <= step["syncbn_wait"] <= step["syncbn"]  # the wait is part of the layers' time
        assert step["syncbn"] <= step["apply"] + step["backward"]
        assert "emit" in step and "log" in step  # Lightning's own self.log apart from sparse_dp's reduction


BACKWARD_THREADS: list[tuple[str, str, bool]] = []  # outside the module: what a step appends there is merged


class _BackwardThreads(SparseNet):
    """Records, during each replica's backward (a hook on its loss), the thread it runs in and whether autograd's
    device threads are on there (``torch._C._is_multithreading_enabled()``): the threading model GPUs run too."""

    def __init__(self, batch_norm=True):
        super().__init__(batch_norm=batch_norm)
        BACKWARD_THREADS.clear()

    @property
    def backward_threads(self) -> list[tuple[str, str, bool]]:
        return BACKWARD_THREADS

    def _probe(self, loss):
        replica = threading.current_thread().name
        loss.register_hook(
            lambda g: BACKWARD_THREADS.append(
                (replica, threading.current_thread().name, torch._C._is_multithreading_enabled())
            ) or g
        )

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self._probe(loss)
        return loss


class _ManualBackwardThreads(ManualOptimization, _BackwardThreads):
    def manual_loss(self, batch, batch_idx):
        loss = self.loss(batch)
        self._probe(loss)
        return loss

    def after_step(self, loss):
        return loss


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("sync", [False, True], ids=["plain-bn", "sync-bn"])
@pytest.mark.parametrize("per_device", [2, 3])
def test_every_replica_runs_its_backward_in_its_own_thread_with_autograds_device_threads_off(manual, sync, per_device):
    """One threading model on every device type (issue 55): each replica's backward runs in that replica's own thread
    with ``torch.autograd.set_multithreading_enabled(False)`` (on a GPU torch would otherwise run it in the device's
    worker thread), replicas sharing one device included (``replicas_per_device``), with and without synchronized
    batch norm, automatic and manual optimization; the parameters equal one device's."""
    cls = _ManualBackwardThreads if manual else _BackwardThreads
    ours, reference = same_start(cls, batch_norm=sync)
    batches = _batches(2)
    strategy = SparseDataParallelStrategy(replicas_per_device=per_device, check_exactness=False)  # counts the passes
    trainer(strategy=strategy, devices=1, sync_batchnorm=sync, max_steps=2, **F64).fit(ours, loader(*batches))
    ran = sorted(set(ours.backward_threads))
    trainer(devices=1, max_steps=2, **F64).fit(reference, loader(*batches))
    assert_same_states(ours, reference)
    assert ran == [(f"sparse_dp-replica{i}_0", f"sparse_dp-replica{i}_0", False) for i in range(per_device)]


def test_gradient_accumulation_keeps_the_threading_model_and_one_devices_parameters():
    ours, reference = same_start(_BackwardThreads)
    batches = _batches(4)
    strategy = SparseDataParallelStrategy(replicas_per_device=3, check_exactness=False)  # counts the passes
    kwargs = dict(max_steps=2, accumulate_grad_batches=2, **F64)
    trainer(strategy=strategy, devices=1, sync_batchnorm=True, **kwargs).fit(ours, loader(*batches))
    ran = list(ours.backward_threads)
    trainer(devices=1, **kwargs).fit(reference, loader(*batches))
    assert_same_states(ours, reference)
    assert {(a == b, a.startswith("sparse_dp-replica"), on) for a, b, on in ran} == {(True, True, False)}
    assert len(ran) == 4 * 3
