"""The CUDA code paths of devices, streams and replica threads, checked as far as a machine without a GPU allows.

What runs for real here: Lightning's and the strategy's refusals of ``accelerator="gpu"`` and of
CUDA devices the machine does not have, the choice of ``torch.cuda.device(d)`` per replica, and
what the ME in use says of its backend.

What cannot run without a GPU, and is replaced in the tests that say so: entering
``torch.cuda.device`` / ``torch.cuda.stream`` and asking for ``torch.cuda.current_stream`` (each
initializes CUDA, which fails with no device). The replacements record what the code asked for;
everything around them is the real code.

tests/strategies/test_gpu.py runs the same paths on real GPUs; scripts/gpu_check.py runs these tests there too
(the other CUDA paths: test_cuda_paths_devices.py, test_cuda_paths_tensors.py; the GPU check script and
bench: tests/project/test_cuda_paths_scripts.py).
"""

from __future__ import annotations

import contextlib
import threading

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.runtime.devices import current_stream, device_context
from lightning_sparse_dp.runtime.executor import ReplicaExecutor
from tests.support.devices import no_gpu

CUDA3 = [torch.device("cuda", i) for i in range(3)]


# --- refusals, real calls ----------------------------------------------------------------------

@no_gpu
@pytest.mark.parametrize(
    ("accelerator", "message"),
    [("gpu", "No supported gpu backend found"), ("cuda", "CUDAAccelerator.*can not run on your system")],
)
def test_accelerator_gpu_without_a_gpu_is_refused_by_lightning(accelerator, message):
    """Lightning refuses before the strategy exists; docs/cuda.md quotes these messages."""
    with pytest.raises(MisconfigurationException, match=message):
        L.Trainer(accelerator=accelerator, devices=2, strategy="sparse_dp", logger=False)


@no_gpu
def test_cuda_devices_the_machine_does_not_have_are_refused_at_setup():
    strategy = SparseDataParallelStrategy(parallel_devices=CUDA3[:2])
    with pytest.raises(MisconfigurationException, match=r"has 0 CUDA device\(s\).*'cuda:0', 'cuda:1'.*devices=<at most 0>"):
        strategy.setup_environment()


def test_device_context_picks_the_replica_device_without_touching_cuda():
    ctx = device_context(torch.device("cuda", 2))
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 2  # built, not entered: no CUDA call
    assert isinstance(device_context(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(device_context(torch.device("cpu"), stream=object()), contextlib.nullcontext)
    assert current_stream(torch.device("cpu")) is None


# --- the per-replica CUDA context, CUDA calls replaced -----------------------------------------

class FakeCuda:
    """Stands in for torch.cuda.device / stream / current_stream (entering them needs a GPU).

    Keeps a per-thread current device and stream, as CUDA does, and records every enter / exit.
    """

    def __init__(self) -> None:
        self.local = threading.local()
        self.events: list[tuple[str, str, object]] = []
        self.lock = threading.Lock()
        fake = self

        class device:  # noqa: N801 - mirrors torch.cuda.device
            def __init__(self, d):
                self.idx = torch.device(d).index if not isinstance(d, int) else d

            def __enter__(self):
                fake._record("enter device", self.idx)
                self.prev = getattr(fake.local, "device", 0)
                fake.local.device = self.idx

            def __exit__(self, *exc):
                fake.local.device = self.prev
                fake._record("exit device", self.idx)

        class stream:  # noqa: N801 - mirrors torch.cuda.stream
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                fake._record("enter stream", self.s)
                self.prev = getattr(fake.local, "stream", None)
                fake.local.stream = self.s

            def __exit__(self, *exc):
                fake.local.stream = self.prev
                fake._record("exit stream", self.s)

        self.device, self.stream = device, stream

    def current_stream(self, d):
        # the caller's stream on each device: a distinct marker per device
        return f"caller-stream-{torch.device(d).index}"

    def _record(self, what, value):
        with self.lock:
            self.events.append((threading.current_thread().name, what, value))

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "device", self.device)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)


def test_each_replica_runs_in_its_own_thread_on_its_device_and_the_callers_stream(monkeypatch):
    """CUDA calls replaced (FakeCuda): entering a CUDA device or stream needs a GPU."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    seen = {}

    def step(i):
        def run():
            seen[i] = (threading.current_thread().name, fake.local.device, fake.local.stream)
            return i * 10
        return run

    executor = ReplicaExecutor(3)
    try:
        assert executor.run([step(i) for i in range(3)], CUDA3) == [0, 10, 20]
    finally:
        executor.shutdown()
    for i in range(3):
        thread, device, stream = seen[i]
        assert thread.startswith(f"sparse_dp-replica{i}")
        assert device == i and stream == f"caller-stream-{i}"
    for i in range(3):  # every context entered was left again, in its own thread
        mine = [(what, v) for t, what, v in fake.events if t.startswith(f"sparse_dp-replica{i}")]
        assert mine == [("enter device", i), ("enter stream", f"caller-stream-{i}"),
                        ("exit stream", f"caller-stream-{i}"), ("exit device", i)]


def test_one_replica_runs_in_the_calling_thread_on_its_device(monkeypatch):
    """CUDA calls replaced (FakeCuda): entering a CUDA device needs a GPU."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    executor = ReplicaExecutor(2)
    try:
        out = executor.run([lambda: (threading.current_thread().name, fake.local.device)], [torch.device("cuda", 1)])
    finally:
        executor.shutdown()
    assert out == [(threading.current_thread().name, 1)]


def test_a_failing_cuda_replica_names_its_device(monkeypatch):
    """CUDA calls replaced (FakeCuda): entering a CUDA device needs a GPU."""
    FakeCuda().install(monkeypatch)

    def boom():
        raise ValueError("bad chunk")

    executor = ReplicaExecutor(2)
    try:
        with pytest.raises(ValueError, match="bad chunk") as info:
            executor.run([lambda: 1, boom], CUDA3[:2])
    finally:
        executor.shutdown()
    assert "raised in replica 1 on device cuda:1" in "".join(getattr(info.value, "__notes__", []))


def test_a_trainer_started_inside_a_side_stream_is_refused(monkeypatch):
    """Everything but the replica threads runs on each GPU's default stream (and ME launches its kernels there):
    a non-default current stream (``with torch.cuda.stream(s): trainer.fit(...)``) is refused, naming the device.
    The streams are stood in (asking for one initializes CUDA)."""
    from lightning_sparse_dp.runtime.devices import check_default_streams

    current = {0: "default-0", 1: "side-1"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: current[torch.device(d).index])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d: f"default-{torch.device(d).index}")
    check_default_streams([torch.device("cpu")] * 2)
    check_default_streams(CUDA3[:1] * 2)
    with pytest.raises(MisconfigurationException, match=r"current stream on cuda:1 is side-1.*torch.cuda.stream"):
        check_default_streams(CUDA3[:2])


def test_me_backend_kind_is_reported():
    """The ME in use answers whether it was built with CUDA (True for the CUDA build, GPU or not): its answer
    agrees with its compiled backend, which holds the GPU kernels only when built with CUDA."""
    import MinkowskiEngineBackend._C as backend

    assert ME.is_cuda_available() is hasattr(backend, "ConvolutionForwardGPU")
    if ME.is_cuda_available():
        assert ME.cuda_version() // 1000 == int(torch.version.cuda.split(".")[0])
