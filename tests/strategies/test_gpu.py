"""sparse_dp on GPUs against plain Lightning on one GPU: the exactness tests of scripts/gpu_check.sh.

Every test runs sparse_dp with ``accelerator="gpu"`` and ``devices=n`` for each ``n`` from 1 to the
number of visible GPUs, and the same module with ``strategy="auto"`` on one GPU with the whole
batch, in float64, and compares every tensor of the state dict after the steps: max|diff| over
max|value| at most 1e-10. Skipped without a GPU or without a CUDA build of MinkowskiEngine.

``LSDP_GPU_TESTS_ON_CPU=1`` runs the same tests with ``accelerator="cpu"`` and n = 1..3 CPU
replicas, to check the tests themselves on a machine without a GPU (what they compare is then
what tests/strategies/test_exactness_*.py compare). ``LSDP_GPU_REPORT=FILE`` appends one JSON line per
comparison (test, devices, max relative difference) for scripts/gpu_check.py's summary.
"""

from __future__ import annotations

import json
import os

import MinkowskiEngine as ME
import pytest
import torch

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.step.scatter import place_batch
from tests.support.exact import same_start, state_differences
from tests.support.helpers import (
    SegNet,
    SparseNet,
    collate_dict,
    field_batch,
    loader,
    random_samples,
    trainer,
    unchecked,
)

ON_CPU = os.environ.get("LSDP_GPU_TESTS_ON_CPU") == "1"
ACCELERATOR = "cpu" if ON_CPU else "gpu"
NUM_DEVICES = 3 if ON_CPU else (torch.cuda.device_count() if torch.version.cuda else 0)
TOLERANCE = 1e-10

pytestmark = pytest.mark.skipif(
    not ON_CPU and (NUM_DEVICES == 0 or not ME.is_cuda_available()),
    reason="needs a GPU and MinkowskiEngine built with CUDA (scripts/gpu_check.sh); "
    "LSDP_GPU_TESTS_ON_CPU=1 runs these tests on CPU replicas",
)
DEVICE_COUNTS = list(range(1, max(NUM_DEVICES, 1) + 1))


def _double_field(batch):
    """``field_batch`` with float64 features (Lightning's 64-true precision converts tensors, not TensorFields)."""
    x = batch["x"]
    return {**batch, "x": ME.TensorField(x.F.double(), x.C)}


def _report(test: str, devices: int, value: float) -> None:
    path = os.environ.get("LSDP_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "devices": devices, "max_rel_diff": value}) + "\n")


def _compare(name, ours, reference, batches, devices, steps=2, **strategy_kwargs):
    start = {k: v.clone() for k, v in ours.state_dict().items()}
    strategy = SparseDataParallelStrategy(**strategy_kwargs)
    kwargs = dict(accelerator=ACCELERATOR, precision="64-true", max_steps=steps)
    trainer(strategy=strategy, devices=devices, **kwargs).fit(ours, loader(*batches))
    # plain Lightning does not move ME tensors (no .to()): the reference gets them built on its GPU, as users must
    root = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
    trainer(devices=1, **kwargs).fit(reference, loader(*[place_batch(b, root) for b in batches]))
    moved = [k for k, v in ours.state_dict().items() if v.dtype.is_floating_point and not torch.equal(v.cpu(), start[k])]
    assert moved, "the steps changed nothing: the comparison would prove nothing"
    diff = max(state_differences(ours, reference).values())
    _report(name, devices, diff)
    assert diff <= TOLERANCE, f"{name} on {devices} device(s): max relative difference {diff:.3e}"


# the multi-replica tests first: on a one-GPU machine they are what a short GPU window has not yet seen pass
@pytest.mark.parametrize("per_device", [2, 3])
@pytest.mark.parametrize("prepare_in_threads", [None, False])
def test_replicas_sharing_one_gpu_equal_one_device(per_device, prepare_in_threads):
    """2 and 3 replicas on one GPU (``replicas_per_device``): the multi-replica CUDA paths (replica threads, the
    replicas' backward passes in their own threads, gather, gradient reduction) on a one-GPU machine,
    labelled ``shared-<k>``. Each replica's backward runs in its own thread with autograd's device threads off.)"""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (3, 4)]
    ours, reference = same_start(SparseNet)
    _compare(f"classification-shared-{per_device}", ours, reference, batches, 1, replicas_per_device=per_device,
             prepare_in_threads=prepare_in_threads)


@pytest.mark.parametrize("per_device", [2, 3])
def test_synchronized_batch_norm_on_replicas_sharing_one_gpu_equals_one_device(per_device):
    """Replicas sharing one GPU meet in synchronized batch norm from their own threads, as CPU replicas do (one
    threading model: autograd's device threads off in replica threads), labelled ``shared-syncbn-<k>``."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (3, 4)]
    ours, reference = same_start(SparseNet, batch_norm=True)
    _compare(f"classification-shared-syncbn-{per_device}", ours, reference, batches, 1, replicas_per_device=per_device,
             sync_batchnorm=True)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_classification_steps_equal_one_device(devices):
    batches = [collate_dict(random_samples(7, seed=s)) for s in (1, 2)]  # uneven chunks
    ours, reference = same_start(SparseNet)
    _compare("classification", ours, reference, batches, devices)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_sync_batchnorm_steps_equal_one_device(devices):
    batches = [collate_dict(random_samples(7, seed=s)) for s in (3, 4)]
    ours, reference = same_start(SparseNet, batch_norm=True)
    _compare("sync_batchnorm", ours, reference, batches, devices, sync_batchnorm=True)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_segmentation_per_point_loss_equals_one_device(devices):
    batches = [_double_field(field_batch(5, seed=s)) for s in (5, 6)]
    ours, reference = same_start(SegNet)
    _compare("segmentation", ours, reference, batches, devices, sync_batchnorm=True, loss_weighting="points")


def test_replicas_run_on_distinct_devices():
    seen = []

    class Recording(SparseNet):
        def training_step(self, batch, batch_idx):
            seen.append((self.device, batch["features"].device))
            return super().training_step(batch, batch_idx)

    model = Recording()
    # unchecked: the exactness check's copies would record their own steps in ``seen`` too
    t = trainer(strategy=unchecked(), accelerator=ACCELERATOR, devices=NUM_DEVICES, precision="64-true")
    t.fit(model, loader(collate_dict(random_samples(2 * NUM_DEVICES, seed=7))))
    expected = [torch.device(ACCELERATOR if ACCELERATOR == "cpu" else "cuda", None if ON_CPU else i)
                for i in range(NUM_DEVICES)]
    assert sorted(seen, key=str) == sorted(zip(expected, expected), key=str)


@pytest.mark.parametrize("mode", [ME.PoolingMode.GLOBAL_MAX_POOLING_DEFAULT, ME.PoolingMode.GLOBAL_MAX_POOLING_KERNEL,
                                  ME.PoolingMode.GLOBAL_MAX_POOLING_PYTORCH_INDEX])
def test_cuda_one_sample_global_max_pooling_gradient(mode):
    """ME's global max pooling of a one-sample batch on the GPU sends each channel's gradient to that channel's
    maximum, as torch's max over the same features does (scripts/minkowski_patches/14; a chunk of one sample).
    Without the patch the gradient lands on element ``row_j`` of the flattened features instead."""
    device = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
    g = torch.Generator().manual_seed(3)
    coordinates = torch.cat([torch.zeros(9, 1, dtype=torch.int32), torch.randperm(60, generator=g)[:9, None].int(),
                             torch.randint(0, 4, (9, 2), generator=g, dtype=torch.int32)], 1)
    features = torch.randn(9, 5, generator=g, dtype=torch.float64)
    weights = torch.randn(1, 5, generator=g, dtype=torch.float64).to(device)
    ours = features.clone().to(device).requires_grad_()
    x = ME.SparseTensor(ours, coordinates.to(device), device=device)
    pooled = ME.MinkowskiGlobalMaxPooling(mode=mode)(x).F
    (pooled * weights).sum().backward()
    dense = features.clone().to(device).requires_grad_()
    expected = dense.max(0, keepdim=True).values
    (expected * weights).sum().backward()
    torch.testing.assert_close(pooled, expected, rtol=0, atol=0)
    torch.testing.assert_close(ours.grad, dense.grad, rtol=0, atol=0, msg=lambda m: f"{mode}: input gradient {m}")


_ASSERTION_PROBE = """
import sys, torch, MinkowskiEngine as ME
device = torch.device(sys.argv[1])
conv = ME.MinkowskiConvolution(3, 4, kernel_size=3, dimension=2).double().to(device)
coordinates = torch.IntTensor([[0, 0, 0], [0, 0, 1], [0, 1, 0]])
cases = {"float32 features into a float64 layer": (torch.ones(3, 3), device),
         "CPU features into a layer on " + str(device): (torch.ones(3, 3, dtype=torch.float64), torch.device("cpu"))}
for name, (features, where) in cases.items():
    if where == device and name.startswith("CPU"):
        continue
    x = ME.SparseTensor(features.to(where), coordinates.to(where), device=where)
    try:
        conv(x)
    except RuntimeError as err:
        print("raised:", name, "|", str(err).splitlines()[0][:120], flush=True)
    else:
        print("no error:", name, flush=True)
"""


def test_me_assertions_raise_instead_of_crashing():
    """An ME C++ assertion (dtype mismatch; CPU features into a CUDA layer) raises ``RuntimeError`` in a child process
    rather than killing it: ME's CUDA build was seen to segfault while formatting its assertion message (issue 33)."""
    import subprocess
    import sys

    device = "cpu" if ON_CPU else "cuda:0"
    done = subprocess.run([sys.executable, "-c", _ASSERTION_PROBE, device], capture_output=True, text=True, timeout=40)
    said = done.stdout + done.stderr[-2000:]
    assert done.returncode == 0, (
        f"the child process died (exit {done.returncode}; a negative number is the signal) on an ME assertion: {said}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(("raised:", "no error:"))]
    assert lines and all(line.startswith("raised:") for line in lines), said
