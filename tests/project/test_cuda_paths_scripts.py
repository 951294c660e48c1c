"""The GPU check script and the GPU benchmark on a machine without a GPU: the check's "no GPU" answer and how
it reads pytest's and the bench's outputs, the bench's refusal, and a failed case reported while the others run
(the cases' runs stood in). The CUDA code paths themselves: tests/runtime/test_cuda_paths_devices.py and
test_cuda_paths_tensors.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.devices import no_gpu
from tests.support.helpers import load_file

ROOT = Path(__file__).resolve().parents[2]


# --- the GPU check script without a GPU --------------------------------------------------------

@no_gpu
def test_gpu_check_says_clearly_that_there_is_no_gpu():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), sys.executable], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: NO GPU") and "torch.cuda.device_count() == 0" in last, done.stdout


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
