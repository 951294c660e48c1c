"""The CUDA code paths of tensors on several devices, checked as far as a machine without a GPU allows: parameters
broadcast to each GPU, metric states, step state and logged values moved or read with one copy per device, chunks
merged across devices, and ME tensors on the wrong device refused before CUDA is touched.

What cannot run without a GPU, and is replaced in the tests that say so: ``torch.nn.parallel.replicate``'s
broadcast (a CUDA kernel) and the copies into replicas on other GPUs; ``meta`` stands in for another GPU where
a move must show. Everything around them is the real code.

tests/strategies/test_gpu.py runs the same paths on real GPUs; scripts/gpu_check.py runs these tests there too
(the other CUDA paths: test_cuda_paths_devices.py, test_cuda_paths_tensors.py; the GPU check script and
bench: tests/project/test_cuda_paths_scripts.py).
"""

from __future__ import annotations

import importlib

import MinkowskiEngine as ME
import pytest
import torch

# the module (the package exports a function of the same name)
replicate_module = importlib.import_module("lightning_sparse_dp.step.replicate")


def test_parameters_are_broadcast_once_to_each_gpu_and_copied_into_every_replica_there(monkeypatch):
    """``Replicas._copy_parameters`` with two replicas on one GPU: torch's broadcast gets each GPU once (after the
    root's), and both replicas there take that GPU's copies. The replicas are built on CPU; their devices are then
    named CUDA ones and the broadcast and copy stood in (both are CUDA calls). torch's broadcast is reached through
    ``torch.nn.parallel.comm`` (``torch.cuda.comm``, used before, is imported by no module of torch: on two GPUs
    the first step raised AttributeError)."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    replicas = replicate_module.Replicas(module, [torch.device("cpu")] * 4)
    replicas.devices = [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1), torch.device("cuda", 2)]
    asked, copied = [], []

    def broadcast_coalesced(tensors, devices):
        asked.append(list(devices))
        return [[(d, j) for j in range(len(tensors))] for d in devices]

    monkeypatch.setattr(replicate_module.comm, "broadcast_coalesced", broadcast_coalesced)
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: copied.append((len(dst), src)))
    replicas._copy_parameters()
    assert asked == [[torch.device("cuda", i) for i in range(3)]]
    on = {1: torch.device("cuda", 1), 2: torch.device("cuda", 1), 3: torch.device("cuda", 2)}
    assert copied == [(4, [(on[r], j) for j in range(4)]) for r in (1, 2, 3)]
    # a frozen parameter (e.g. an EMA teacher's, changed in place): its copies on other GPUs are refreshed too
    module[1].bias.requires_grad_(False)
    replicas = replicate_module.Replicas(module, [torch.device("cpu")] * 3)
    replicas.devices = [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)]
    replicas._frozen_copies = [[], [torch.empty(2)], [torch.empty(2)]]  # as built on GPUs (CPU replicas share)
    asked.clear(), copied.clear()
    replicas._copy_parameters()
    assert replicas.frozen == [module[1].bias] and len(replicas.trainable) == 3
    assert copied == [(4, [(torch.device("cuda", r), j) for j in range(4)]) for r in (1, 2)]


@pytest.mark.parametrize("kind", ["sum", "cat", "mean_squared_error"])
def test_metric_states_from_a_replica_on_another_gpu_are_moved_before_the_merge(kind):
    """A replica's metric copy on another GPU is merged into the root's through its state moved to the root's device
    (torchmetrics adds, concatenates or stacks the two). Here the copy only says it is on cuda:1 (its tensors stay
    on CPU): the merge takes the moved path and gives what merging the copies themselves gives."""
    import torchmetrics
    from torchmetrics.aggregation import CatMetric, SumMetric

    from lightning_sparse_dp.replica.metric_merge import _on_device_of, merge_states

    make = {"sum": SumMetric, "cat": CatMetric, "mean_squared_error": torchmetrics.MeanSquaredError}[kind]
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([5.0, 7.0, 11.0])]
    ours, reference = make(), make()
    copies, plain = [make(), make()], [make(), make()]
    for metric_set in ((ours, *copies), (reference, *plain)):
        for m, v in zip(metric_set, values):
            m.update(v, v / 2) if kind == "mean_squared_error" else m.update(v)
    for c in copies:
        c._device = torch.device("cuda", 1)
        assert isinstance(_on_device_of(ours, c), dict)
    assert _on_device_of(reference, plain[0]) is plain[0]
    merge_states(ours, copies)
    merge_states(reference, plain)
    assert torch.equal(torch.as_tensor(ours.compute()), torch.as_tensor(reference.compute()))


def test_what_replicas_leave_on_self_reaches_the_module_on_its_device():
    """``ModuleChanges.merge``: a value only some replicas set, entries the replicas appended in different numbers, and
    values the output merge cannot read reach the module moved to its device (a replica on another GPU left them on
    its own). The module's device is ``meta`` here, so that a move shows on CPU."""
    from lightning.pytorch.utilities.rank_zero import WarningCache

    from lightning_sparse_dp.replica.changes import ModuleChanges

    class Holder(torch.nn.Module):
        device = torch.device("meta")  # as a LightningModule's .device says where the module is

    module = Holder()
    module.history = []
    replicas = [Holder(), Holder()]
    for r in replicas:
        r.__dict__.update(module.__dict__)
    state = ModuleChanges(module, replicas)
    replicas[1].__dict__["best"] = torch.ones(2)  # set by one replica only
    replicas[0].__dict__["history"].append(torch.zeros(1))  # appended in different numbers
    replicas[1].__dict__["history"] += [torch.zeros(1), torch.ones(1)]
    replicas[0].__dict__["odd"], replicas[1].__dict__["odd"] = torch.zeros(1), torch.ones(3)  # cannot be merged

    def combine(values):
        raise ValueError("not mergeable")

    state.merge(combine, WarningCache())
    assert module.best.device.type == "meta"
    assert len(module.history) == 3 and all(t.device.type == "meta" for t in module.history)
    assert module.odd.device.type == "meta" and module.odd.shape == (1,)  # the root replica's, as DDP keeps rank 0's


@pytest.fixture
def stacks(monkeypatch):
    """The sizes of the ``torch.stack`` calls made meanwhile (each one copy to the host in ``scalar_values``)."""
    sizes: list[int] = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: sizes.append(len(ts)) or real_stack(ts, *a, **k))
    return sizes


def test_a_logged_item_is_looked_up_among_the_steps_means_with_one_copy_per_device(stacks):
    """A logged ``.item()`` is matched to the step's means and loss terms on any device (GPU ones too: before,
    only CPU tensors were looked at, so on GPUs such a value was reduced by the loss weights instead of exactly),
    reading them with one device-to-host copy per device (one ``torch.stack``), not one per tensor."""
    from lightning_sparse_dp.loss import means
    from lightning_sparse_dp.loss.observer import StepObserver

    values = [torch.tensor(0.25), torch.tensor([1.5], dtype=torch.float16), torch.tensor(3.0, dtype=torch.float64)]
    assert means.scalar_values(values) == [0.25, 1.5, 3.0] and stacks == [3]

    def step():  # the step's own thread's observer counts its means
        torch.mean(torch.arange(4.0))  # 1.5, of 4 elements
        second = torch.mean(torch.arange(6.0))  # 2.5, of 6
        assert means.count_of(second.item()) == 6 and means.count_of(1.5) == 4 and means.count_of(9.0) is None

    StepObserver().run(step)


def test_a_replica_mixing_devices_is_told_about_plain_tensor_attributes():
    """torch's "Expected all tensors to be on the same device" raised in a replica (on GPUs: a tensor kept as a
    plain module attribute stays on the root's device for every replica) gets the likely cause and the fixes,
    keeping the note that names the replica and its device."""
    from lightning_sparse_dp.step.errors import explain_replica_error

    err = RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:1 and "
                       "cuda:0!")
    err.add_note("raised in replica 1 on device cuda:1 (lightning_sparse_dp)")
    new = explain_replica_error(err, plan=None)
    assert isinstance(new, RuntimeError) and new.__cause__ is err
    assert "register_buffer" in str(new) and "plain attribute" in str(new)
    assert new.__notes__ == err.__notes__
    other = RuntimeError("something else")
    assert explain_replica_error(other, plan=None) is other


def test_merging_chunks_from_several_devices_lands_on_the_first_pieces_device():
    """``merge_chunks`` (``merge_batch``'s tensors) of pieces on different devices: moved to the first piece's
    before the concatenation (replicas' pieces on other GPUs). ``meta`` stands in for the first GPU."""
    from lightning_sparse_dp.split.merge import merge_chunks

    merged = merge_chunks([torch.zeros(2, 3, device="meta"), torch.ones(1, 3)], [torch.tensor([0, 2]), torch.tensor([1])])
    assert merged.device.type == "meta" and merged.shape == (3, 3)
    on_cpu = merge_chunks([torch.zeros(2, 1), torch.ones(1, 1)], [torch.tensor([0, 2]), torch.tensor([1])])
    assert on_cpu.flatten().tolist() == [0.0, 1.0, 0.0]


def test_the_loss_terms_numbers_are_read_with_one_copy_per_device(stacks):
    """The terms' denominators and values (what the exact loss weights are decided from) are read to the host
    together, one ``torch.stack`` per device, not two waits on the GPU per term and reader; each term's numbers
    are then what ``float()`` gives, read once."""
    from lightning_sparse_dp.loss.capture import TermCapture
    from lightning_sparse_dp.loss.term import Term

    capture = TermCapture()
    for d, v in [(torch.tensor(4.0), 0.5), (None, 2.0), (3, 1.25), (torch.tensor(7.0, dtype=torch.float64), 0.1)]:
        term = Term("t", d, torch.ones(()))
        term.value = torch.tensor(v)
        capture.terms.append(term)
    capture.read_numbers()
    assert stacks == [6]  # four values and two tensor denominators, one device
    expected = [(4.0, 0.5), (1.0, 2.0), (3.0, 1.25), (7.0, float(torch.tensor(0.1)))]
    assert [t.numbers() for t in capture.terms] == expected and stacks == [6]


# --- ME tensors on the wrong device: a clear error, never ME's crash ----------------------------

def _cpu_field_batch():
    coordinates = torch.IntTensor([[0, 0, 0], [0, 1, 0], [1, 0, 1]])
    return {"x": ME.TensorField(torch.ones(3, 2), coordinates), "labels": torch.zeros(3)}


def test_an_me_tensor_built_elsewhere_is_refused_before_cuda_is_touched():
    """A chunk that still holds a CPU TensorField, bound for a GPU replica, is refused naming the entry and both
    devices (ME's CUDA build crashed the process on such a tensor: issue 33); no CUDA call is made first."""
    from lightning_sparse_dp.step.scatter import check_me_devices, place_chunk

    gpu = torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"batch\['x'\] is an ME.TensorField on cpu.*runs on cuda:1"):
        place_chunk(_cpu_field_batch(), gpu)
    check_me_devices(_cpu_field_batch(), torch.device("cpu"))  # where it is: nothing to say
    check_me_devices({"features": torch.ones(2)}, gpu)  # plain tensors are moved by place_chunk, not refused


def test_sparse_ddp_rebuilds_me_tensors_on_the_ranks_gpu(monkeypatch):
    """sparse_ddp's ``batch_to_device`` rebuilds a batch's ME tensors on the rank's GPU (DDP leaves them on the CPU)
    and leaves a CPU rank's batch as Lightning transfers it."""
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_sparse_dp.strategies.sparse_ddp as ddp

    placed = []
    monkeypatch.setattr(DDPStrategy, "batch_to_device", lambda self, batch, device=None, dataloader_idx=0: batch)
    monkeypatch.setattr(ddp, "place_batch", lambda batch, device, layout=None: placed.append(device) or "rebuilt")
    strategy = ddp.SparseDDPStrategy()
    assert strategy.batch_to_device(_cpu_field_batch(), torch.device("cuda", 0)) == "rebuilt"
    assert placed == [torch.device("cuda", 0)]
    batch = _cpu_field_batch()
    assert strategy.batch_to_device(batch, torch.device("cpu")) is batch
    assert placed == [torch.device("cuda", 0)]
