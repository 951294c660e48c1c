"""The GPU checklist of lightning-sparse-dp, in one command: run it on a machine with GPUs.

    bash scripts/gpu_check.sh [PYTHON] [--quick]

(or ``PYTHON scripts/gpu_check.py [--quick]``). PYTHON (default ``.venv/bin/python``) must have a
CUDA build of torch and this package installed. Steps:

1. What is here: torch and its CUDA version, the visible GPUs. With no GPU it says so and stops
   (exit status 3): nothing else can be checked.
2. MinkowskiEngine with CUDA: the installed one if its backend was built with CUDA, else
   ``scripts/build_minkowski.sh --cuda PYTHON`` builds and caches one for the visible GPUs'
   architectures (about 20 minutes for one architecture on 2 cores; minutes on a large machine).
3. Exactness on GPUs: ``tests/test_gpu.py`` (sparse_dp on ``accelerator="gpu"`` with 1..N devices
   against plain Lightning on one GPU with the whole batch, float64, 1e-10 relative per tensor) and
   ``tests/test_cuda_paths.py``.
4. Speed: ``benchmarks/bench.py --accelerator gpu`` (``--quick`` for a short run).
5. One summary line, ``gpu_check: PASS ...`` or ``gpu_check: FAIL ...``; the full outputs are in
   ``gpu_check_logs/`` (or ``--logs DIR``). Put its figures in docs/cuda.md.

Exit status: 0 all passed, 1 a step failed, 3 no GPU visible (nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = 3


def gpu_inventory() -> dict:
    """torch's view of the machine: version, CUDA version, and ``[(name, "major.minor")]`` per visible GPU."""
    import torch

    count = torch.cuda.device_count() if torch.version.cuda else 0
    gpus = [(torch.cuda.get_device_name(i), "%d.%d" % torch.cuda.get_device_capability(i)) for i in range(count)]
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus}


def no_gpu_line(inv: dict) -> str:
    """The summary line for a machine where torch sees no GPU (says why, and what was not run)."""
    if inv["cuda"] is None:
        why = f"torch {inv['torch']} in {sys.executable} is a CPU build; install a CUDA build of torch there (bash scripts/setup.sh --cuda makes .venv-cuda)"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"torch {inv['torch']} (CUDA {inv['cuda']}) finds no GPU" + (
            f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "; is the NVIDIA driver loaded? (nvidia-smi lists the GPUs it sees)"
        )
    return f"gpu_check: NO GPU (torch.cuda.device_count() == 0): {why}. Nothing was run."


def me_cuda_state(python: str) -> str:
    """``"cuda"`` when PYTHON's MinkowskiEngine has a CUDA backend, ``"cpu"`` for a CPU-only one, ``"missing"``."""
    probe = "import MinkowskiEngine as ME; print('cuda' if ME.is_cuda_available() else 'cpu')"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "missing"


def pytest_counts(output: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, ...}`` from pytest's closing line."""
    counts: dict[str, int] = {}
    for line in reversed(output.strip().splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)
        if found:
            for number, word in found:
                counts["errors" if word.startswith("error") else word] = int(number)
            break
    return counts


def bench_headline(output: str) -> dict:
    """The last JSON line that benchmarks/bench.py prints."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    return {}


def _run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str]:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    text = done.stdout + done.stderr
    log.write_text(f"$ {' '.join(cmd)}\n# exit {done.returncode} after {time.monotonic() - start:.0f} s\n{text}")
    print(f"[gpu_check] {' '.join(cmd[1:3])}: exit {done.returncode}, log {log}", file=sys.stderr)
    return done.returncode, done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short benchmark run")
    parser.add_argument("--logs", type=Path, default=ROOT / "gpu_check_logs")
    args = parser.parse_args(argv)
    python = sys.executable

    inv = gpu_inventory()
    if not inv["gpus"]:
        print(no_gpu_line(inv))
        return NO_GPU
    names = sorted({n for n, _ in inv["gpus"]})
    print(f"[gpu_check] torch {inv['torch']} (CUDA {inv['cuda']}), {len(inv['gpus'])} GPU(s): {inv['gpus']}", file=sys.stderr)
    args.logs.mkdir(parents=True, exist_ok=True)
    parts = [f"{len(inv['gpus'])}x {'/'.join(names)}", f"torch {inv['torch']}"]
    ok = True

    me = me_cuda_state(python)
    if me != "cuda":
        print(f"[gpu_check] MinkowskiEngine is {me} here: building the CUDA one (scripts/build_minkowski.sh --cuda)",
              file=sys.stderr)
        code, _ = _run(["bash", str(ROOT / "scripts" / "build_minkowski.sh"), "--cuda", python], args.logs / "build.log")
        me = me_cuda_state(python) if code == 0 else "build failed"
    parts.append(f"ME {'CUDA' if me == 'cuda' else me}")
    if me != "cuda":
        print(f"gpu_check: FAIL | {' | '.join(parts)} (see {args.logs / 'build.log'})")
        return 1

    report = args.logs / "exactness.jsonl"
    report.unlink(missing_ok=True)
    env = {**os.environ, "LSDP_GPU_REPORT": str(report)}
    code, out = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py",
                      "tests/test_cuda_paths.py"], args.logs / "tests.log", env)
    counts = pytest_counts(out)
    diffs = [json.loads(line)["max_rel_diff"] for line in report.read_text().splitlines()] if report.exists() else []
    worst = f", max rel diff {max(diffs):.1e} over {len(diffs)} comparisons" if diffs else ""
    parts.append(f"tests {counts.get('passed', 0)} passed, {counts.get('failed', 0) + counts.get('errors', 0)} failed, "
                 f"{counts.get('skipped', 0)} skipped{worst}")
    ok &= code == 0 and counts.get("passed", 0) > 0

    bench = [python, "benchmarks/bench.py", "--accelerator", "gpu"] + (["--quick"] if args.quick else [])
    code, out = _run(bench, args.logs / "bench.log")
    headline = bench_headline(out)
    speedups = {k: v for k, v in headline.items() if k.startswith("speedup")}
    parts.append(f"bench {json.dumps(speedups)}" if code == 0 and headline else "bench failed")
    ok &= code == 0 and bool(headline)

    print(f"gpu_check: {'PASS' if ok else 'FAIL'} | " + " | ".join(parts) + f" | logs {args.logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
