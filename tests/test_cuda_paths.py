"""The CUDA code paths, checked as far as a machine without a GPU allows.

What runs for real here: Lightning's and the strategy's refusals of ``accelerator="gpu"`` and of
CUDA devices the machine does not have, the choice of ``torch.cuda.device(d)`` per replica, and
the GPU check script's "no GPU" answer.

What cannot run without a GPU, and is replaced in the tests that say so: entering
``torch.cuda.device`` / ``torch.cuda.stream``, asking for ``torch.cuda.current_stream`` (each
initializes CUDA, which fails with no device), and ``torch.nn.parallel.replicate`` (its broadcast
is a CUDA kernel). The replacements record what the code asked for; everything around them is the
real code. tests/test_gpu.py runs the same paths on real GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.apply import ReplicaExecutor
from lightning_sparse_dp.place import current_stream, device_context
from tests.helpers import load_file

ROOT = Path(__file__).resolve().parents[1]
# the module (the package exports a function of the same name)
replicate_module = importlib.import_module("lightning_sparse_dp.replicate")
CUDA3 = [torch.device("cuda", i) for i in range(3)]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")


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
    replicas._frozen_leaves = [[], [torch.empty(2)], [torch.empty(2)]]  # as built on GPUs (CPU replicas share)
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

    from lightning_sparse_dp.metrics import _on_device_of, merge_states

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
    """``StepState.merge``: a value only some replicas set, entries the replicas appended in different numbers, and
    values the output merge cannot read reach the module moved to its device (a replica on another GPU left them on
    its own). The module's device is ``meta`` here, so that a move shows on CPU."""
    from lightning.pytorch.utilities.rank_zero import WarningCache

    from lightning_sparse_dp.state import StepState

    class Holder(torch.nn.Module):
        device = torch.device("meta")  # as a LightningModule's .device says where the module is

    module = Holder()
    module.history = []
    replicas = [Holder(), Holder()]
    for r in replicas:
        r.__dict__.update(module.__dict__)
    state = StepState(module, replicas)
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
    from lightning_sparse_dp import means
    from lightning_sparse_dp.loss.capture import StepObserver

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
    from lightning_sparse_dp.hints import explain_replica_error

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
    from lightning_sparse_dp.loss.capture import Term, TermCapture

    capture = TermCapture()
    for d, v in [(torch.tensor(4.0), 0.5), (None, 2.0), (3, 1.25), (torch.tensor(7.0, dtype=torch.float64), 0.1)]:
        term = Term("t", d, torch.ones(()))
        term.value = torch.tensor(v)
        capture.terms.append(term)
    capture.read_numbers()
    assert stacks == [6]  # four values and two tensor denominators, one device
    expected = [(4.0, 0.5), (1.0, 2.0), (3.0, 1.25), (7.0, float(torch.tensor(0.1)))]
    assert [t.numbers() for t in capture.terms] == expected and stacks == [6]


def test_a_trainer_started_inside_a_side_stream_is_refused(monkeypatch):
    """Everything but the replica threads runs on each GPU's default stream (and ME launches its kernels there):
    a non-default current stream (``with torch.cuda.stream(s): trainer.fit(...)``) is refused, naming the device.
    The streams are stood in (asking for one initializes CUDA)."""
    from lightning_sparse_dp.place import check_default_streams

    current = {0: "default-0", 1: "side-1"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: current[torch.device(d).index])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d: f"default-{torch.device(d).index}")
    check_default_streams([torch.device("cpu")] * 2)
    check_default_streams(CUDA3[:1] * 2)
    with pytest.raises(MisconfigurationException, match=r"current stream on cuda:1 is side-1.*torch.cuda.stream"):
        check_default_streams(CUDA3[:2])


# --- the GPU check script without a GPU --------------------------------------------------------

@no_gpu
def test_gpu_check_says_clearly_that_there_is_no_gpu():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), sys.executable], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: NO GPU") and "torch.cuda.device_count() == 0" in last, done.stdout


def test_me_backend_kind_is_reported():
    """The ME in use answers whether it was built with CUDA (True for the CUDA build, GPU or not): its answer
    agrees with its compiled backend, which holds the GPU kernels only when built with CUDA."""
    import MinkowskiEngineBackend._C as backend

    assert ME.is_cuda_available() is hasattr(backend, "ConvolutionForwardGPU")
    if ME.is_cuda_available():
        assert ME.cuda_version() // 1000 == int(torch.version.cuda.split(".")[0])


def test_gpu_check_reads_pytest_and_bench_outputs():
    gpu_check = load_file("scripts/gpu_check.py")
    assert gpu_check.pytest_counts("....\n12 passed, 1 failed, 2 skipped in 3.2s\n") == {"passed": 12, "failed": 1, "skipped": 2}
    assert gpu_check.pytest_counts("E   boom\n1 error in 0.1s") == {"errors": 1}
    assert gpu_check.bench_headline('table\n{"speedup_sparse_dp_2_gpu": 1.8}\n') == {"speedup_sparse_dp_2_gpu": 1.8}
    assert gpu_check.bench_headline("Traceback ...") == {}
    line = gpu_check.no_gpu_line({"torch": "2.13.0+cpu", "cuda": None, "gpus": []})
    assert line.startswith("gpu_check: NO GPU") and "CPU build" in line


@no_gpu
def test_bench_on_gpu_without_a_gpu_says_so():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--accelerator", "gpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "no GPU visible" in done.stderr


# --- ME tensors on the wrong device: a clear error, never ME's crash ----------------------------

def _cpu_field_batch():
    coordinates = torch.IntTensor([[0, 0, 0], [0, 1, 0], [1, 0, 1]])
    return {"x": ME.TensorField(torch.ones(3, 2), coordinates), "labels": torch.zeros(3)}


def test_an_me_tensor_built_elsewhere_is_refused_before_cuda_is_touched():
    """A chunk that still holds a CPU TensorField, bound for a GPU replica, is refused naming the entry and both
    devices (ME's CUDA build crashed the process on such a tensor: issue 33); no CUDA call is made first."""
    from lightning_sparse_dp.place import check_me_devices, place_chunk

    gpu = torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"batch\['x'\] is an ME.TensorField on cpu.*runs on cuda:1"):
        place_chunk(_cpu_field_batch(), gpu)
    check_me_devices(_cpu_field_batch(), torch.device("cpu"))  # where it is: nothing to say
    check_me_devices({"features": torch.ones(2)}, gpu)  # plain tensors are moved by place_chunk, not refused


def test_sparse_ddp_rebuilds_me_tensors_on_the_ranks_gpu(monkeypatch):
    """sparse_ddp's ``batch_to_device`` rebuilds a batch's ME tensors on the rank's GPU (DDP leaves them on the CPU)
    and leaves a CPU rank's batch as Lightning transfers it."""
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_sparse_dp.ddp as ddp

    placed = []
    monkeypatch.setattr(DDPStrategy, "batch_to_device", lambda self, batch, device=None, dataloader_idx=0: batch)
    monkeypatch.setattr(ddp, "place_batch", lambda batch, device, layout=None: placed.append(device) or "rebuilt")
    strategy = ddp.SparseDDPStrategy()
    assert strategy.batch_to_device(_cpu_field_batch(), torch.device("cuda", 0)) == "rebuilt"
    assert placed == [torch.device("cuda", 0)]
    batch = _cpu_field_batch()
    assert strategy.batch_to_device(batch, torch.device("cpu")) is batch
    assert placed == [torch.device("cuda", 0)]


def test_gpu_bench_reports_a_failed_case_and_goes_on(monkeypatch, capsys):
    """bench.py --accelerator gpu on one GPU (stood in: the cases' runs are replaced): every case is tried, 2 and 3
    replicas share the GPU, a case that raises is named in the JSON line's ``failed`` and the others still run, and
    the ratios are always in the line (``null`` where a side is missing)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = load_file("benchmarks/bench.py")
    asked = []

    def run_case(model_name, strategy, devices, *args, **kwargs):
        per = getattr(strategy, "replicas_per_device", 1)
        label = f"{strategy if isinstance(strategy, str) else 'sparse_dp'}-{devices}x{per}"
        label += " main-prep" if getattr(strategy, "prepare_in_threads", None) is False else ""
        label += " syncBN" if getattr(strategy, "sync_batchnorm", False) else ""
        asked.append((model_name, label))
        if model_name == "digits" and label == "auto-1x1":
            raise RuntimeError("boom\nsegmentation fault")
        step = {"auto-1x1": 0.010, "sparse_dp-1x1": 0.011, "sparse_dp-1x3 main-prep": 0.025,
                "sparse_dp-1x3 syncBN": 0.023}.get(label, 0.02)
        return {"step_s": step, "times": [step], "stages": {}, "points_per_sample": 10.0, "rank": 0, "cpu_s": step}

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda i: "stand-in GPU")
    bench.main_gpu(bench._parser().parse_args(["--accelerator", "gpu", "--quick", "--case-timeout", "60"]))
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    assert "bench: segmentation sparse_dp-1: 11.000 ms a step" in out  # each case as it ends (a later hang keeps it)
    labels = {label for _, label in asked}
    assert labels == {"auto-1x1", "sparse_dp-1x1", "sparse_dp-1x2", "sparse_dp-1x3", "sparse_dp-1x3 syncBN",
                      "sparse_dp-1x3 main-prep"}
    assert len(asked) == 2 * 6  # per model: plain, one replica, 2 and 3 shared, 3 shared with sync BN, 3 main-prep
    assert line["segmentation_syncbn_cost_ratio_shared_gpu"] == 1.15  # 3 shared with sync BN over without
    assert line["overhead_ratio_gpu"] == 1.1 and line["digits_overhead_ratio_gpu"] is None
    assert line["segmentation_thread_prep_ratio_gpu"] == 0.8  # 3 shared (threads prepare) over 3 shared, main-prep
    assert list(line["failed"]) == ["digits auto-1"] and "segmentation fault" in line["failed"]["digits auto-1"]
    assert set(line["segmentation_step_ms"]) == {"auto-1", "sparse_dp-1", "sparse_dp-2 shared", "sparse_dp-3 shared",
                                                 "sparse_dp-3 shared syncBN", "sparse_dp-3 shared main-prep"}
    assert "auto-1" not in line["digits_step_ms"] and "sparse_dp-3 shared" in line["digits_step_ms"]


def test_cpu_bench_reports_a_failed_case_and_goes_on(monkeypatch, tmp_path):
    """bench.py on CPU: a case that fails (plain Lightning's DDP child was seen to die on a GPU machine) is named in
    ``failed``, dropped from every repetition, the other cases still run, and the ratios that need it are ``null``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = load_file("benchmarks/bench.py")
    ran = []

    class Runner:
        def __init__(self, mode):
            self.mode = mode

        def run(self, model_name, case, *args):
            ran.append((model_name, self.mode, case))
            if case == "ddp-2 (gloo)" and self.mode == "default" and model_name == "segmentation":
                raise RuntimeError("the case failed:\nterminate called without an active exception")
            step = 0.01 if case == "auto-1" else 0.011
            return {"step_s": step, "cpu_s": step, "stages": {}, "ceiling": 1.5, "peak_rss_mb": 100.0}

        def close(self):
            pass

    monkeypatch.setattr(bench, "CaseRunner", Runner)
    raw, failed = bench.run_all([("segmentation", 6), ("digits", 6)], 2, 1, repeats=2)
    assert failed == {"segmentation default ddp-2 (gloo)": "RuntimeError: terminate called without an active exception"}
    assert raw[("segmentation", "default")]["ddp-2 (gloo)"] == []
    assert ran.count(("segmentation", "default", "ddp-2 (gloo)")) == 1  # not tried again in the next repetition
    assert len(raw[("segmentation", "1 thread")]["ddp-2 (gloo)"]) == 2 and len(raw[("digits", "default")]["auto-1"]) == 2
    monkeypatch.setattr(bench, "dispatch_us", lambda *args: (1000.0, 1.0))  # a 1 ms hand-over
    line = bench.headline(raw, 6, 2, 1)
    assert line["ddp_throughput_ratio"] is None and line["ddp_throughput_ratio_spread"] is None
    assert line["ddp_throughput_ratio_1t"] == 1.0 and line["overhead_ratio"] == 1.1
    # no stages recorded: the floor is the ceiling's step (the ceiling case's 11 ms over its ceiling of 1.5) over itself
    # plus two 1 ms hand-overs
    assert line["digits_floor_fraction_2_1t"] == round((0.011 / 1.5) / (0.011 / 1.5 + 2e-3), 3) == 0.786
    # the plots leave out a line whose case failed (they stopped at a KeyError before)
    runs = {key: {case: bench.aggregate(reps, bench._devices(case)) for case, reps in cases.items() if reps}
            for key, cases in raw.items()}
    figures = bench.plot(runs, tmp_path)
    assert [f.name for f in figures] == ["speedup.png", "stages.png"] and all(f.stat().st_size > 0 for f in figures)
