"""The replicate stage as plain functions, without a Trainer: replicas that share the module's parameters as
leaves of their own, their buffers refreshed and copied, the deferred check that they still fit, and their
gradients added in replica order."""

from __future__ import annotations

import threading

import MinkowskiEngine as ME
import pytest
import torch

from lightning_sparse_dp.loss.weights import chunk_weights
from lightning_sparse_dp.split import split_batch
from lightning_sparse_dp.step.check import DeferredCheck, StaleReplicas
from lightning_sparse_dp.step.copies import BufferHandOff, BufferMirror
from lightning_sparse_dp.step.gather import gather_outputs
from lightning_sparse_dp.step.replicate import Replicas, make_replicas
from lightning_sparse_dp.step.scatter import place_chunks
from tests.support.devices import CPU3
from tests.support.helpers import SparseNet, collate_dict, random_samples


def test_me_layers_work_in_replicas_and_share_parameters():
    torch.manual_seed(0)
    model = SparseNet()
    replicas = Replicas(model, CPU3)
    conv = model.net[0]
    for r in replicas.modules:
        assert r.net[0].dimension == conv.dimension == 3  # a __slots__ attribute
        assert r.net[0].kernel_generator is conv.kernel_generator
        assert r.net[0].kernel.data_ptr() == conv.kernel.data_ptr()  # shared storage, not a copy
        assert r.net[0].kernel is not conv.kernel  # but a leaf of its own, for its own gradient
    batch = collate_dict(random_samples(6))
    chunks, plan = split_batch(batch, 3)
    losses = [r.loss(c) for r, c in zip(replicas.modules, place_chunks(chunks, CPU3))]
    loss = gather_outputs(losses, plan, chunk_weights(plan, "samples"), torch.device("cpu"))
    loss.backward()
    grads = replicas.reduce_gradients()
    reference = SparseNet()
    reference.load_state_dict(model.state_dict())
    reference.loss(batch).backward()
    assert all(p.grad is None for p in model.parameters())  # gradients stay on the replicas until reduced
    for g, q in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for leaves in replicas.parameters for p in leaves)


def test_replica_parameters_are_leaves_whose_gradients_add_up_in_replica_order():
    torch.manual_seed(0)
    model = SparseNet()
    replicas = Replicas(model, CPU3)
    names = [n for n, _ in model.named_parameters()]
    for r in replicas.modules:
        assert [n for n, _ in r.named_parameters()] == names
        assert len(list(r.net[0].parameters())) == 1  # real Parameters, also in submodules
    penalty = sum(sum(p.pow(2).sum() for p in r.parameters()) for r in replicas.modules)  # a weight penalty per replica
    penalty.backward()
    for g, p in zip(replicas.reduce_gradients(), model.parameters()):
        torch.testing.assert_close(g, 3 * 2 * p.detach())
    with torch.no_grad():  # the optimizer's in-place update is seen by every replica at once
        model.net[0].kernel.add_(1.0)
    assert all(torch.equal(r.net[0].kernel, model.net[0].kernel) for r in replicas.modules)


def test_replicas_are_refreshed_each_step_and_rebuilt_when_the_module_changes():
    model = SparseNet(batch_norm=True)
    replicas = Replicas(model, CPU3)
    assert replicas.matches(model, CPU3) and replicas.matches(model, CPU3[:2])
    model.eval()
    model.note = "set after replication"
    with torch.no_grad():
        model.net[3].bn.running_mean.fill_(3.0)
    refreshed = replicas.refresh()
    assert all(not r.training and not r.net[3].bn.training and r.note == "set after replication" for r in refreshed)
    assert all(torch.equal(r.net[3].bn.running_mean, model.net[3].bn.running_mean) for r in refreshed)
    assert replicas.matches(model, CPU3)
    model.net[0].kernel.requires_grad_(False)  # fine-tuning freezes a layer
    assert not replicas.matches(model, CPU3)
    replicas = Replicas(model, CPU3)
    assert replicas.modules[1].net[0].kernel is model.net[0].kernel
    assert len(replicas.trainable) == len(list(model.parameters())) - 1
    model.double()  # new storage for every parameter
    assert not replicas.matches(model, CPU3)
    fresh = Replicas(model, CPU3)
    model.net[1] = ME.MinkowskiReLU()  # a new submodule
    assert not fresh.matches(model, CPU3)


def test_replica_buffers_follow_data_parallel():
    model = torch.nn.BatchNorm1d(4)
    replicas = make_replicas(model, CPU3)
    assert replicas[0].running_mean is model.running_mean
    assert replicas[1].running_mean is not model.running_mean
    torch.testing.assert_close(replicas[2].running_var, model.running_var)


class _ManyBuffers(torch.nn.Module):
    """Every kind of buffer the mirror handles: fused (float32, int64 0-dim, empty) and copied one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)  # running_mean / running_var float32 [3], num_batches_tracked int64 []
        self.register_buffer("table", torch.arange(12, dtype=torch.float64).reshape(3, 4).t())  # not contiguous
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("absent", None)
        self.register_buffer("scale", torch.ones(2, requires_grad=True))  # a buffer that needs a gradient


def _buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: b.clone() for k, b in module.named_buffers()}


def test_replica_buffers_are_refreshed_from_the_module_and_stay_each_replicas_own():
    model = _ManyBuffers()
    replicas = Replicas(model, CPU3)
    with torch.no_grad():  # the module's buffers change between steps (e.g. running statistics of the last step)
        for b in model.buffers():
            b.add_(torch.arange(b.numel()).reshape(b.shape).to(b.dtype) + 1)
    expected = _buffers_of(model)
    stale = _buffers_of(replicas.modules[2])
    replicas.refresh(2)  # a step with 2 chunks: replica 2 is left as it was
    for r, replica in enumerate(replicas.modules):
        got = dict(replica.named_buffers())
        assert got.keys() == expected.keys()
        for k, value in (stale if r == 2 else expected).items():
            assert got[k].dtype == value.dtype and got[k].shape == value.shape and torch.equal(got[k], value), (r, k)
    assert replicas.modules[1].table.shape == (4, 3) and not replicas.modules[1].table.requires_grad
    replicas.refresh()
    with torch.no_grad():  # a replica's in-place update (its batch norm's running statistics) is its own
        replicas.modules[1].bn.running_mean.add_(5.0)
        replicas.modules[1].bn.num_batches_tracked.add_(1)
    for other in (model, replicas.modules[2]):
        assert torch.equal(other.bn.running_mean, expected["bn.running_mean"])
        assert torch.equal(other.bn.num_batches_tracked, expected["bn.num_batches_tracked"])
    replicas.refresh()
    assert torch.equal(replicas.modules[1].bn.running_mean, expected["bn.running_mean"])
    assert replicas.matches(model, CPU3)
    model.double()  # new storage for every floating-point buffer and parameter
    assert not replicas.matches(model, CPU3)


def test_replica_buffer_copies_have_version_counters_of_their_own():
    # as torch's broadcast_coalesced gives DataParallel's replicas: an in-place update of one buffer (running_mean)
    # is not a modification of another the step saved for its backward (running_var)
    replica = Replicas(torch.nn.BatchNorm1d(4), CPU3).modules[1]
    before = replica.running_var._version
    replica.running_mean.add_(1.0)
    assert replica.running_var._version == before


def test_replica_threads_copy_their_own_buffers_and_replica_0_waits_for_every_copy():
    model = _ManyBuffers()
    replicas = Replicas(model, CPU3)
    with torch.no_grad():  # the module's buffers after a step
        for b in model.buffers():
            b.add_(torch.arange(b.numel()).reshape(b.shape).to(b.dtype) + 1)
    expected, stale = _buffers_of(model), _buffers_of(replicas.modules[1])
    hand_off = replicas.buffer_hand_off(3)
    assert replicas.buffers_in_threads and hand_off is not None
    waiting = threading.Thread(target=hand_off.wait, daemon=True)
    waiting.start()
    hand_off.copy(2)  # replica 2's thread: its copies only
    for r, want in ((1, stale), (2, expected)):
        got = dict(replicas.modules[r].named_buffers())
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items()), r
    waiting.join(0.2)
    assert waiting.is_alive()  # replica 0 (whose step writes the module's buffers) still waits for replica 1
    hand_off.copy(1)
    waiting.join(10)
    assert not waiting.is_alive()
    got = dict(replicas.modules[1].named_buffers())
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert replicas.modules[0].bn.running_mean is model.bn.running_mean  # the root replica's are the module's
    with pytest.raises(RuntimeError, match="buffer copies were not made within"):
        BufferHandOff(replicas._buffer_mirror, 2, timeout=0.01).wait()  # replica 1 never copied


@pytest.mark.parametrize("others", [["cpu", "meta"], ["meta", "cpu"], ["meta"]])
def test_buffers_are_copied_in_the_replicas_threads_only_where_every_copy_is_on_the_modules_device(others):
    # "meta" stands in for another GPU: replicas_per_device > 1 on several GPUs puts replica 1 on the module's device
    # and replica 2 on another, whose copy a thread's torch.cat(..., out=) could not make
    buffers = list(torch.nn.BatchNorm1d(3).buffers())  # fused ones only (float32 and int64 groups)
    assert BufferMirror(buffers, [torch.device("cpu")] * 2).per_replica
    assert not BufferMirror(buffers, [torch.device(d) for d in others]).per_replica


def _waiting(check: DeferredCheck) -> tuple[threading.Thread, list]:
    """A thread blocked in ``check.wait()`` (as a replica's, before it touches the module); ``[error or None]`` once done."""
    out: list = []

    def wait():
        try:
            check.wait()
            out.append(None)
        except StaleReplicas as err:
            out.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def test_a_deferred_check_refreshes_replicas_that_fit_and_says_stale_ones_to_the_waiting_replicas(monkeypatch):
    model = SparseNet(batch_norm=True)
    replicas = Replicas(model, CPU3)
    with torch.no_grad():
        model.net[3].bn.running_mean.fill_(3.0)  # the step before updated the module's buffers
    check = DeferredCheck(replicas, 3, buffers=True)
    thread, out = _waiting(check)
    thread.join(0.2)
    assert thread.is_alive()  # the replica waits for the check
    check.run()
    thread.join(10)
    assert out == [None]
    assert all(torch.equal(r.net[3].bn.running_mean, model.net[3].bn.running_mean) for r in replicas.modules)
    model.net[0].kernel.requires_grad_(False)  # fine-tuning froze a layer since the replicas were built
    stale = DeferredCheck(replicas, 3, buffers=True)
    thread, out = _waiting(stale)
    stale.run()
    thread.join(10)
    assert len(out) == 1 and isinstance(out[0], StaleReplicas)
    fresh = Replicas(model, CPU3)
    prepared = DeferredCheck(fresh, 3, buffers=True, prepare=lambda: "the step's replica state")
    thread, out = _waiting(prepared)
    prepared.run()
    thread.join(10)
    assert out == [None] and prepared.wait() == "the step's replica state"  # what each replica gets
    monkeypatch.setattr(fresh, "refresh_tensors", lambda count, buffers=True: 1 / 0)
    failing = DeferredCheck(fresh, 3, buffers=True)
    thread, out = _waiting(failing)
    with pytest.raises(ZeroDivisionError):
        failing.run()  # the caller's error; the waiting replica is released, told not to go on
    thread.join(10)
    assert len(out) == 1 and isinstance(out[0], StaleReplicas)


def test_a_buffer_only_module_converted_in_place_is_seen_as_changed():
    model = torch.nn.BatchNorm1d(4, affine=False)  # no parameters: only the buffers tell
    replicas = Replicas(model, CPU3)
    assert replicas.matches(model, CPU3)
    model.double()
    assert not replicas.matches(model, CPU3)


def test_replicas_built_in_inference_mode_serve_training_steps_after_it():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with torch.inference_mode():  # a validation step (Lightning's inference mode) builds the replicas
        replicas = Replicas(model, CPU3)
        replicas.refresh()
    with torch.no_grad():
        model[1].running_mean.fill_(2.0)
    refreshed = replicas.refresh()  # a training step: the replicas' buffers are updated in place
    assert all(torch.equal(r[1].running_mean, model[1].running_mean) for r in refreshed)
    refreshed[1](torch.randn(4, 3)).sum().backward()
    assert replicas.parameters[1][0].grad is not None and model[0].weight.grad is None


@pytest.mark.parametrize("missing", [False, True], ids=["every-gradient", "one-missing"])
def test_replica_gradients_are_added_in_replica_order(missing):
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) * 10 ** r for p in replicas.trainable] for r in range(3)]
    if missing:
        grads[1][2] = None  # replica 1 did not use the second layer's weight
    for leaves, per_replica in zip(replicas.parameters, grads):
        for leaf, grad in zip(leaves, per_replica):
            leaf.grad = None if grad is None else grad.clone()
    expected = []
    for j in range(len(replicas.trainable)):
        present = [grads[r][j] for r in range(3) if grads[r][j] is not None]
        total = present[0]
        for grad in present[1:]:
            total = total + grad  # replica order, as one reference sum
        expected.append(total)
    reduced = replicas.reduce_gradients()
    assert all(torch.equal(a, b) for a, b in zip(reduced, expected))  # bit for bit
    assert all(leaf.grad is None for leaves in replicas.parameters for leaf in leaves)


def test_a_module_with_an_unbuilt_lazy_layer_is_refused_naming_the_fix():
    """A ``nn.LazyLinear`` head not yet built failed deep in the replicas' build with torch's 'uninitialized parameter'
    error; the refusal names the layer's tensors and how to build them (DDP refuses such a module too). Once built by a
    forward, the module replicates."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from tests.support.helpers import NUM_CLASSES, loader, trainer

    class LazyHead(SparseNet):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.LazyLinear(NUM_CLASSES)

        def forward(self, x):
            return self.head(super().forward(x))

    batch = collate_dict(random_samples(6, seed=5))
    with pytest.raises(MisconfigurationException, match=r"uninitialized parameters.*head\.weight.*configure_model"):
        trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(LazyHead(), loader(batch))
    built = LazyHead()
    built(ME.SparseTensor(batch["features"], batch["coordinates"]))
    trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(built, loader(batch))
