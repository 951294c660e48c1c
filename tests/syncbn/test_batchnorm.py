"""The synchronized batch-norm math against torch's batch norm on the concatenated input (float64, plain threads)."""

from __future__ import annotations

import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse_dp.syncbn import _functions, _gathered
from lightning_sparse_dp.syncbn._functions import combine_statistics, compute_dtype
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from lightning_sparse_dp.syncbn.collective import ReplicaAborted, ThreadGroup
from tests.support.exact import relative_difference
from tests.support.helpers import run_ranks


@pytest.fixture(params=["gathered", "per-rank"])
def path(request, monkeypatch):
    """Both ways a synchronized layer of CPU replica threads is computed: gathered (small layers: every replica's
    input at once, by one thread) and per rank (each replica its part; what larger layers, accelerators and
    process groups take). The threshold of :mod:`~lightning_sparse_dp.syncbn._gathered` picks one."""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 1 << 40 if request.param == "gathered" else 0)
    return request.param


def make_layer(cls, channels, dtype, momentum=0.1, affine=True):
    layer = cls(channels, momentum=momentum, affine=affine).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if affine:
            layer.weight.copy_(torch.rand(channels, generator=g) + 0.5)
            layer.bias.copy_(torch.randn(channels, generator=g))
        layer.running_mean.copy_(torch.randn(channels, generator=g))
        layer.running_var.copy_(torch.rand(channels, generator=g) + 0.5)
    return layer


def sync_step(rows, channels, shape_tail=(), dtype=torch.float64, momentum=0.1, affine=True, seed=0):
    """One training step of SyncBatchNorm on ``len(rows)`` ranks (threads) and of BatchNorm on the concatenation.

    Each rank has its own copy of the layer with leaf parameters (as replicas do); rank 0's layer shares
    the reference layer's starting buffers and updates them. Returns ours and the reference: outputs,
    input gradients, weight / bias gradients (ranks' summed in rank order), running statistics.
    """
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(n, channels, *shape_tail, generator=g, dtype=torch.float64) * 3 + 1).to(dtype) for n in rows]
    dys = [torch.randn(n, channels, *shape_tail, generator=g, dtype=torch.float64).to(dtype) for n in rows]
    reference = make_layer(nn.BatchNorm1d if not shape_tail else nn.BatchNorm2d, channels, dtype, momentum, affine)
    ours = [make_layer(SyncBatchNorm, channels, dtype, momentum, affine) for _ in rows]
    group = ThreadGroup(len(rows))
    for rank, layer in enumerate(ours):
        layer.collective = group.member(rank)
        layer.update_running_stats = rank == 0

    inputs = [x.clone().requires_grad_() for x in xs]
    outputs = run_ranks(group, lambda rank, member: ours[rank](inputs[rank]))
    for out in outputs:
        if isinstance(out, BaseException):
            raise out
    errors = run_ranks(group, lambda rank, member: torch.autograd.backward(outputs[rank], dys[rank]))
    for err in errors:
        if err is not None:
            raise err

    whole = torch.cat(xs).requires_grad_()
    expected = reference(whole)
    expected.backward(torch.cat(dys))
    got = {
        "output": torch.cat([o.detach() for o in outputs]),
        "grad_input": torch.cat([i.grad for i in inputs]),
        "running_mean": ours[0].running_mean,
        "running_var": ours[0].running_var,
        "num_batches_tracked": ours[0].num_batches_tracked,
    }
    want = {
        "output": expected.detach(),
        "grad_input": whole.grad,
        "running_mean": reference.running_mean,
        "running_var": reference.running_var,
        "num_batches_tracked": reference.num_batches_tracked,
    }
    if affine:
        for name in ("weight", "bias"):
            summed = getattr(ours[0], name).grad
            for layer in ours[1:]:
                summed = summed + getattr(layer, name).grad
            got[f"grad_{name}"], want[f"grad_{name}"] = summed, getattr(reference, name).grad
    return got, want, ours


@pytest.mark.parametrize(
    "rows, tail",
    [([5, 3, 8], ()), ([1, 1], ()), ([7], ()), ([40, 2, 17, 9], ()), ([4, 6, 3], (5, 2)), ([0, 6, 3], ())],
    ids=["3-ranks", "one-row-each", "one-rank", "4-ranks", "NCHW", "empty-rank"],
)
def test_equals_batch_norm_of_the_concatenated_input_float64(rows, tail, path):
    got, want, _ = sync_step(rows, channels=6, shape_tail=tail)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        if name == "num_batches_tracked":
            assert int(got[name]) == int(want[name]) == 1
        else:
            assert relative_difference(got[name], want[name]) < 1e-10, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_channel_values_as_tensors_give_what_numpy_gives(monkeypatch, dtype):
    """The per-channel arithmetic of CUDA input (tensors, no numpy) is the CPU's (numpy): forced here on CPU. CUDA
    input below float64 is always centered (the CPU's test of whether to center would wait for the device): the CPU
    is made to center too (``CANCELLATION = 0``), so the two differ in their arithmetic only."""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 0)  # the per-rank path, which CUDA replicas take
    monkeypatch.setattr(_functions, "CANCELLATION", 0.0)
    cpu, _, _ = sync_step([5, 3, 8], channels=6, shape_tail=(2, 3), dtype=dtype)
    monkeypatch.setattr(_functions, "HOST_DEVICE_TYPES", ())
    tensors, want, _ = sync_step([5, 3, 8], channels=6, shape_tail=(2, 3), dtype=dtype)
    for name in want:
        assert relative_difference(tensors[name], cpu[name]) < 1e-12, name
        assert relative_difference(tensors[name], want[name]) < (1e-10 if dtype == torch.float64 else 1e-5), name


def test_the_per_rank_backward_gives_torchs_kernel_its_saved_statistics_defined(monkeypatch):
    """torch's CUDA ``native_batch_norm_backward`` asserts that ``save_mean`` and ``save_invstd`` are defined
    (Normalization.cu: "save_mean should always be defined"; empty means "use the running statistics") and, given
    no weight, returns the weight and bias gradients empty, where the CPU kernel takes ``None`` for all three: the
    per-rank path, which GPUs take, passes empty statistics and a weight of ones. Checked here with the CUDA
    kernel's demands put in front of the CPU kernel; the values are the one-device ones still."""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 0)
    kernel, calls = torch.ops.aten.native_batch_norm_backward, []

    def as_on_cuda(*args):
        calls.append(args)
        assert args[5] is not None and args[6] is not None, "save_mean should always be defined"
        assert args[2] is not None, "without a weight the CUDA kernel's sums come back empty"
        return kernel(*args)

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", as_on_cuda)
    got, want, _ = sync_step([5, 3, 8], channels=6, shape_tail=(2, 3))
    assert calls
    for name in want:
        assert relative_difference(got[name], want[name]) < 1e-10, name


def test_cumulative_average_and_no_affine(path):
    got, want, _ = sync_step([5, 4], channels=3, momentum=None, affine=False)
    for name in want:
        assert relative_difference(got[name], want[name]) < 1e-10, name


def test_only_the_rank_that_updates_touches_its_running_statistics(path):
    _, _, layers = sync_step([5, 4, 3], channels=3)
    fresh = make_layer(SyncBatchNorm, 3, torch.float64)
    assert not torch.equal(layers[0].running_mean, fresh.running_mean)
    for layer in layers[1:]:
        assert torch.equal(layer.running_mean, fresh.running_mean) and int(layer.num_batches_tracked) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_inputs_are_computed_in_at_least_float32(dtype, path):
    got, want, _ = sync_step([30, 20, 11], channels=4, dtype=dtype)
    assert got["output"].dtype == dtype and got["grad_input"].dtype == dtype
    # the reference ran in ``dtype`` too; both are rounded results of the same float64 math
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var"):
        assert relative_difference(got[name], want[name]) < bound, name


def test_float32_statistics_accumulate_in_float64_on_cpu(monkeypatch):
    """The per-rank path centers each rank's float32 input before its statistics, so a large offset costs no
    digits. (The gathered path runs torch's own float32 kernel on the whole batch, as one device does: there such
    input loses what it loses on one device, about 1e-4 relative here, with the kernel's thread count deciding
    the last digits.)"""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 0)
    assert compute_dtype(torch.float32) == torch.float32 and compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64
    # a large offset: single-pass float32 sums lose the variance, the float64 accumulation does not
    x = torch.full((4000, 1), 1000.0) + torch.linspace(-1, 1, 4000).unsqueeze(1)
    group = ThreadGroup(2)
    layers = [SyncBatchNorm(1).float() for _ in range(2)]
    for rank, layer in enumerate(layers):
        layer.collective = group.member(rank)
    parts = x.split(2000)
    outs = run_ranks(group, lambda rank, member: layers[rank](parts[rank]).detach())
    expected = F.batch_norm(x.double(), None, None, training=True).float()
    assert relative_difference(torch.cat(outs), expected) < 1e-6


@pytest.mark.parametrize("offset, centered", [(0.5, False), (3.0, False), (20.0, True), (1000.0, True)])
def test_cpu_float32_input_is_centered_only_where_its_mean_outweighs_its_deviation(offset, centered):
    """The per-rank path's statistics of CPU float32 input: centered (a copy, then statistics again) only where a
    channel's mean is over 8 of its standard deviations, where float32 sums would lose the mean's digits; either
    way the statistics are the float64 ones to float32's precision (the mean to 1e-5 of a deviation of 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 4, generator=g)
    x[:, 2] += offset  # one channel's mean, against a deviation of about 1
    shift, used, stats = _functions._local_statistics(x)
    assert (shift is not None) == centered
    assert (used is x) == (not centered)
    reference = x.double()
    assert stats[0].eq(3000).all()
    assert (stats[1] - reference.mean(0)).abs().max() < 1e-5
    assert relative_difference(stats[2], reference.var(0, unbiased=False) * 3000) < 1e-6


def test_combine_statistics_refuses_a_single_value_per_channel():
    one = torch.tensor([[1.0], [2.0], [0.0]], dtype=torch.float64)
    none = torch.tensor([[0.0], [0.0], [0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        combine_statistics([one, none])
    total, mean, m2 = combine_statistics([one, one])
    assert total.item() == 2 and mean.item() == 2.0 and m2.item() == 0.0


@pytest.mark.parametrize("rows", [(1, 0, 0), (0, 1, 0), (0, 0, 0)])
def test_a_layer_with_fewer_than_two_values_in_all_ranks_is_refused_whichever_rank_combines(rows, monkeypatch):
    """The per-rank path of GPU input reads the total count (a wait on the GPU) only where a rank's own rows do not
    settle it: the rank that completes the rendezvous combines, and when the ranks hold fewer than 2 values in all, every rank has
    fewer than 2 itself, so whichever completes still refuses. With 2 or more in one rank the total is not read."""
    from lightning_sparse_dp.syncbn import _functions as functions

    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 0)
    monkeypatch.setattr(functions, "HOST_DEVICE_TYPES", ())  # the path of CUDA input (tensors, per rank)
    group = ThreadGroup(3)
    layers = [SyncBatchNorm(2).double() for _ in range(3)]
    for rank, layer in enumerate(layers):
        layer.collective = group.member(rank)
    parts = [torch.randn(n, 2, dtype=torch.float64) for n in rows]
    results = run_ranks(group, lambda rank, member: layers[rank](parts[rank]))
    assert any(isinstance(r, ValueError) and "more than 1 value per channel" in str(r) for r in results), results
    checked = []
    real = functions._combine_stacked
    monkeypatch.setattr(functions, "_combine_stacked", lambda stats, check=True: checked.append(check) or real(stats, check))
    group = ThreadGroup(3)
    for rank, layer in enumerate(layers):
        layer.collective = group.member(rank)
    parts = [torch.randn(n, 2, dtype=torch.float64) for n in (3, 2, 4)]
    results = run_ranks(group, lambda rank, member: layers[rank](parts[rank]).detach())
    assert all(isinstance(r, torch.Tensor) for r in results) and checked == [False]


def test_eval_mode_uses_running_statistics_without_communicating():
    class Refuses:
        rank, world_size = 0, 2

        def all_gather(self, tensor):
            raise AssertionError("eval mode must not communicate")

    layer = make_layer(SyncBatchNorm, 3, torch.float64).eval()
    plain = make_layer(nn.BatchNorm1d, 3, torch.float64).eval()
    layer.collective = Refuses()
    x = torch.randn(5, 3, dtype=torch.float64)
    assert torch.equal(layer(x), plain(x))


def test_without_a_collective_it_is_torch_batch_norm():
    layer, plain = make_layer(SyncBatchNorm, 3, torch.float64), make_layer(nn.BatchNorm1d, 3, torch.float64)
    x = torch.randn(9, 3, dtype=torch.float64)
    assert torch.equal(layer(x), plain(x)) and torch.equal(layer.running_var, plain.running_var)


def test_a_failing_rank_stops_the_others_in_backward(path):
    group = ThreadGroup(2)
    layers = [SyncBatchNorm(2).double() for _ in range(2)]
    for rank, layer in enumerate(layers):
        layer.collective = group.member(rank)
    xs = [torch.randn(4, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    outs = run_ranks(group, lambda rank, member: layers[rank](xs[rank]))

    def backward(rank, member):
        if rank == 1:
            raise RuntimeError("rank 1 fails before its backward")
        outs[rank].sum().backward()

    results = run_ranks(group, backward)
    assert isinstance(results[0], ReplicaAborted) and isinstance(results[1], RuntimeError)


def test_convert_and_revert_keep_parameters_buffers_and_state_dict_keys():
    model = nn.Sequential(
        ME.MinkowskiBatchNorm(4), ME.MinkowskiSyncBatchNorm(4), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm3d(2))
    )
    before = model.state_dict()
    tensors = [model[0].bn.weight, model[1].bn.running_mean, model[2].bias, model[3][0].num_batches_tracked]
    swaps = convert_sync_batchnorm(model)
    assert len(swaps) == 4
    converted = [model[0].bn, model[1].bn, model[2], model[3][0]]
    assert all(isinstance(m, SyncBatchNorm) for m in converted)  # a BatchNorm1d stays one too (isinstance)
    assert model[0].bn.weight is tensors[0] and model[1].bn.running_mean is tensors[1]
    assert model[2].bias is tensors[2] and model[3][0].num_batches_tracked is tensors[3]
    assert list(model.state_dict()) == list(before)
    revert_sync_batchnorm(swaps)
    assert [type(m) for m in (model[0].bn, model[1].bn, model[2], model[3][0])] == [
        nn.BatchNorm1d, nn.SyncBatchNorm, nn.BatchNorm2d, nn.BatchNorm3d,
    ]
    assert model[0].bn.weight is tensors[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gathered_layer_is_torch_batch_norm_of_the_concatenation_bit_for_bit(dtype, monkeypatch):
    """A small layer of CPU replica threads runs torch's kernels once on the ranks' input together: the one-device
    values exactly (a layer this small is summed in one intra-op thread), the summed weight / bias gradients
    included (rank 0 gets them, the other ranks zeros)."""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", 1 << 40)
    got, want, ours = sync_step([5, 3, 8], channels=6, shape_tail=(2, 3), dtype=dtype)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for layer in ours[1:]:
        assert not layer.weight.grad.any() and not layer.bias.grad.any()


def test_a_layer_above_the_gather_threshold_is_computed_per_rank(monkeypatch):
    """The threshold counts the ranks' input bytes together: at it the layer is gathered, one byte less per rank."""
    results = []
    forward_all = _gathered.forward_all
    monkeypatch.setattr(_gathered, "forward_all", lambda *a, **k: results.append(forward_all(*a, **k)) or results[-1])
    size = (5 + 3 + 8) * 6 * 8  # rows x channels x float64 bytes
    for threshold, gathered in ((size, True), (size - 1, False)):
        monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", threshold)
        got, want, _ = sync_step([5, 3, 8], channels=6)
        assert (results.pop() is not None) is gathered and not results
        for name in want:
            assert relative_difference(got[name], want[name]) < 1e-10, name


def test_in_place_ops_on_a_rank_output_touch_its_rows_only(path):
    """Each rank's output is its own tensor (not a view of the gathered one), so ``ReLU(inplace=True)`` after the
    layer, as ME's ResNet blocks have it, gives the one-device values and gradients."""
    g = torch.Generator().manual_seed(3)
    rows, channels = [6, 4, 5], 3
    xs = [torch.randn(n, channels, generator=g, dtype=torch.float64) for n in rows]
    dys = [torch.randn(n, channels, generator=g, dtype=torch.float64) for n in rows]
    group = ThreadGroup(len(rows))
    ours = [make_layer(SyncBatchNorm, channels, torch.float64) for _ in rows]
    for rank, layer in enumerate(ours):
        layer.collective, layer.update_running_stats = group.member(rank), rank == 0
    inputs = [x.clone().requires_grad_() for x in xs]
    outs = run_ranks(group, lambda rank, member: F.relu(ours[rank](inputs[rank]), inplace=True))
    run_ranks(group, lambda rank, member: outs[rank].backward(dys[rank]))
    reference = make_layer(nn.BatchNorm1d, channels, torch.float64)
    whole = torch.cat(xs).requires_grad_()
    expected = F.relu(reference(whole))
    expected.backward(torch.cat(dys))
    assert relative_difference(torch.cat([o.detach() for o in outs]), expected.detach()) < 1e-10
    assert relative_difference(torch.cat([i.grad for i in inputs]), whole.grad) < 1e-10


def test_a_synchronized_step_leaves_no_reference_cycle(path):
    """The outputs and what the backward keeps are freed by reference counting alone (a cycle through autograd's
    C++ nodes would keep every step's activations until the garbage collector runs, if it can free them at all)."""
    import gc
    import weakref

    group = ThreadGroup(2)
    layers = [SyncBatchNorm(4).double() for _ in range(2)]
    for rank, layer in enumerate(layers):
        layer.collective = group.member(rank)
    xs = [torch.randn(7, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gc.disable()
    try:
        outs = run_ranks(group, lambda rank, member: layers[rank](xs[rank]))
        refs = [weakref.ref(o) for o in outs]
        run_ranks(group, lambda rank, member, outs=outs: outs[rank].sum().backward())
        del outs
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("rows, threshold, calls", [([5, 3, 8], 0, 1), ([5, 3, 8], 6 * 8 * 3 * 3 + 1, 2)],
                         ids=["every-guess-right", "one-guess-wrong"])
def test_the_per_rank_path_brings_its_statistics_to_the_first_rendezvous(rows, threshold, calls, monkeypatch):
    """A rank whose own input times the ranks is over the threshold brings its statistics along: when every rank does,
    the forward takes one rendezvous; a rank that expected the layer gathered (3 rows x 3 ranks under the
    threshold) makes the ranks meet again for the statistics. The values are the one-device values either way."""
    monkeypatch.setattr(_gathered, "GATHER_MAX_BYTES", threshold)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 6, generator=g, dtype=torch.float64) for n in rows]
    group = ThreadGroup(len(rows))
    ours = [make_layer(SyncBatchNorm, 6, torch.float64) for _ in rows]
    for rank, layer in enumerate(ours):
        layer.collective, layer.update_running_stats = group.member(rank), rank == 0
    outs = run_ranks(group, lambda rank, member: ours[rank](xs[rank]))
    assert group._calls == [calls] * len(rows)
    expected = make_layer(nn.BatchNorm1d, 6, torch.float64)(torch.cat(xs))
    assert relative_difference(torch.cat([o.detach() for o in outs]), expected.detach()) < 1e-10
