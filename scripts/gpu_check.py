"""The GPU checklist of lightning-sparse-dp, in one command: run it on a machine with GPUs.

    bash scripts/gpu_check.sh [PYTHON] [--quick]
    bash scripts/gpu_check.sh python3 --bundle DIR [--quick]    # a GPU node without network (an HPC compute node)

With ``--bundle DIR`` (made by ``scripts/gpu_bundle.sh DIR`` where the package registries are reachable, then copied
to the node with the checkout; see scripts/gpu_bundle.py and docs/cuda.md) PYTHON is the node's ``python3``, which
must hold a CUDA torch; the bundle's OpenBLAS is unpacked under a temporary folder, missing Python modules are
installed from its wheels with no index, ME is built offline from its sdist with the node's nvcc (``CUDA_HOME``,
default ``/usr/local/cuda``) and every core, and the wheel is kept in ``DIR/cache`` for the next call. The steps share
a time budget (``--budget``, default 450 s) so that the whole check ends within about 8 minutes, even where ME must
be built first; a step cut short by it is reported as such.

(or ``PYTHON scripts/gpu_check.py [--quick]``). PYTHON (default ``.venv/bin/python``) must have a
CUDA build of torch and this package installed. Steps:

1. What is here: torch and its CUDA version, the visible GPUs. With no GPU it says so and stops
   (exit status 3): nothing else can be checked.
2. MinkowskiEngine with CUDA: the installed one if its backend was built with CUDA, else
   ``scripts/build_minkowski.sh --cuda PYTHON`` builds and caches one for the visible GPUs'
   architectures (20 to 40 minutes for one architecture on 2 cores, 2 to 3.5 minutes with 16 jobs).
3. Exactness on GPUs: ``tests/strategies/test_gpu.py`` (sparse_dp on ``accelerator="gpu"`` with 1..N devices
   against plain Lightning on one GPU with the whole batch, float64, 1e-10 relative per tensor) and
   the CUDA paths' tests (``tests/runtime/test_cuda_paths_*.py``, ``tests/project/test_cuda_paths_scripts.py``).
4. Speed: ``benchmarks/bench.py --accelerator gpu`` (``--quick`` for a short run).
5. One summary line, ``gpu_check: PASS ...`` or ``gpu_check: FAIL ...``; the full outputs are in
   ``gpu_check_logs/`` (or ``--logs DIR``), the line also in ``summary.txt`` there.

Exit status: 0 all passed, 1 a step failed, 3 no GPU visible (nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
        why = (f"torch {inv['torch']} in {sys.executable} is a CPU build; install a CUDA build of torch there "
               "(bash scripts/setup.sh --cuda makes .venv-cuda)")
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"torch {inv['torch']} (CUDA {inv['cuda']}) finds no GPU" + (
            f"; CUDA_VISIBLE_DEVICES={visible!r}"
            if visible is not None
            else "; is the NVIDIA driver loaded? (nvidia-smi lists the GPUs it sees)"
        )
    return f"gpu_check: NO GPU (torch.cuda.device_count() == 0): {why}. Nothing was run."


def me_cuda_state(python: str, env: dict | None = None) -> str:
    """``"cuda"`` when PYTHON's MinkowskiEngine has a CUDA backend, ``"cpu"`` for a CPU-only one, ``"missing"``."""
    probe = "import MinkowskiEngine as ME; print('cuda' if ME.is_cuda_available() else 'cpu')"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env)
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


#: the most a built ME wheel may weigh to be copied into the logs folder, so that the logs stay small enough to copy
#: back from the node (a CUDA wheel for one architecture is about 7 MB)
WHEEL_BACK_MIB = 45


def keep_me_wheel(cache: Path, out: Path) -> str:
    """Copy the ME wheels that ``build_minkowski.sh`` cached under ``cache`` (``<key>/<wheel>``) to ``out`` (same
    layout), each at most :data:`WHEEL_BACK_MIB`, so that they can be copied back with the logs: put into the
    bundle's ``cache/wheels/`` (docs/cuda.md), the next GPU check on a node with the same software installs ME in
    seconds instead of building it (about 200 s on an H200 node). Returns a few words for the summary."""
    said = []
    for wheel in sorted(cache.glob("*/*.whl")):
        mib = wheel.stat().st_size / 2**20
        if mib > WHEEL_BACK_MIB:
            said.append(f"ME wheel {mib:.0f} MiB, too big to bring back")
            continue
        (out / wheel.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, out / wheel.parent.name / wheel.name)
        said.append(f"ME wheel ({mib:.0f} MiB) in {out / wheel.parent.name}")
    return "; ".join(said) or "no cached ME wheel"


def _importable(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module``."""
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _run(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
    """Run ``cmd`` in the repository, its output to ``log``; ``(exit status, stdout)``. A run past ``timeout``
    seconds is killed and gets status 124; one killed by a signal has the negative signal number (pytest's
    segmentation fault: -11), and the log's last lines say where it was."""
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as late:
        code = 124
        out = late.stdout.decode(errors="replace") if isinstance(late.stdout, bytes) else (late.stdout or "")
        err = late.stderr.decode(errors="replace") if isinstance(late.stderr, bytes) else (late.stderr or "")
    log.write_text(f"$ {' '.join(cmd)}\n# exit {code} after {time.monotonic() - start:.0f} s\n{out}{err}")
    print(
        f"[gpu_check] {' '.join(cmd[1:3])[:60]}: exit {code} after {time.monotonic() - start:.0f} s, log {log}",
        file=sys.stderr,
    )
    return code, out


def ended(code: int, out: str) -> str:
    """How a step ended, for the summary: ``""`` when it exited normally, else a few words (cut by the budget,
    killed by signal N after the last test pytest named)."""
    if code == 124:
        return "cut by the time budget"
    if code < 0:
        started = [word for line in out.splitlines() for word in line.split() if "::" in word]
        return f"killed by signal {-code}" + (f" in or after {started[-1]}" if started else "")
    return ""


def bundle_env(bundle: Path, python: str, inv: dict, scratch: Path) -> tuple[dict, list[str]]:
    """The environment for an offline build and the tests from ``bundle`` (scripts/gpu_bundle.py), and what is
    wrong (empty: nothing): OpenBLAS unpacked under ``scratch``, missing modules installed from the wheels."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_bundle

    problems = gpu_bundle.check(bundle)
    if problems:
        return {}, problems
    include, lib = gpu_bundle.unpack_openblas(bundle, scratch / "openblas")
    still = gpu_bundle.install_missing(python, bundle)
    if still:
        return {}, [f"{python} lacks {', '.join(still)} and the bundle has no wheel of it for this Python"]
    env = dict(os.environ)
    env.update(
        LSDP_OFFLINE="1",
        LSDP_ME_SDIST=str(bundle / "sdist" / gpu_bundle.ME_SDIST),
        LSDP_CACHE=str(bundle / "cache"),
        LSDP_BLAS_INCLUDE=str(include),
        LSDP_BLAS_LIB=str(lib),
        PIP_NO_INDEX="1",
        MAX_JOBS=env.get("MAX_JOBS", str(os.cpu_count() or 1)),
        TORCH_CUDA_ARCH_LIST=env.get("TORCH_CUDA_ARCH_LIST", ";".join(sorted({cap for _, cap in inv["gpus"]}))),
        LD_LIBRARY_PATH=os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    if "CUDA_HOME" not in env and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDA_HOME"] = "/usr/local/cuda"
    return env, []


_DIAGNOSIS = """
import glob, os, subprocess, sys, torch, MinkowskiEngine as ME, MinkowskiEngineBackend._C as backend
maps = open("/proc/self/maps").read().split(chr(10))
print("libstdc++ loaded:", sorted({l.split()[-1] for l in maps if "libstdc++" in l}))
print("libgcc_s loaded:", sorted({l.split()[-1] for l in maps if "libgcc_s" in l}))
print("ME extension:", backend.__file__)
print(subprocess.run(["ldd", backend.__file__], capture_output=True, text=True).stdout)
for tool in ("g++", "gcc", os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
    done = subprocess.run([tool, "--version"], capture_output=True, text=True)
    print(tool, "->", (done.stdout or done.stderr).strip().splitlines()[:1] if done.returncode == 0 else "absent")
print("torch", torch.__version__, "built with", torch.__config__.show().splitlines()[1:3])
"""


def diagnose(python: str, env: dict, log: Path) -> None:
    """What the CUDA build of ME runs with, for the crash of its C++ assertions seen on a GPU (issue 33): the
    libstdc++ and libgcc_s a process with torch and ME has loaded, the extension's libraries, the compilers."""
    _run([python, "-c", _DIAGNOSIS], log, env, timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short benchmark run")
    parser.add_argument("--logs", type=Path, default=ROOT / "gpu_check_logs")
    parser.add_argument("--bundle", type=Path, help="a folder made by scripts/gpu_bundle.sh: build and test offline")
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds for all steps together (default 450: the check ends within 8 minutes)",
    )
    args = parser.parse_args(argv)
    python = sys.executable
    deadline = time.monotonic() + args.budget

    def left(cap: float) -> float:
        return max(10.0, min(cap, deadline - time.monotonic()))

    inv = gpu_inventory()
    if not inv["gpus"]:
        print(no_gpu_line(inv))
        return NO_GPU
    names = sorted({n for n, _ in inv["gpus"]})
    print(
        f"[gpu_check] torch {inv['torch']} (CUDA {inv['cuda']}), {len(inv['gpus'])} GPU(s): {inv['gpus']}",
        file=sys.stderr,
    )
    args.logs.mkdir(parents=True, exist_ok=True)
    parts = [f"{len(inv['gpus'])}x {'/'.join(names)}", f"torch {inv['torch']}"]
    ok = True
    env = dict(os.environ)
    if args.bundle is not None:
        scratch = Path(tempfile.mkdtemp(prefix="lsdp-gpu-check-"))
        env, problems = bundle_env(args.bundle.resolve(), python, inv, scratch)
        if problems:
            print(f"gpu_check: FAIL | {' | '.join(parts)} | bundle: {'; '.join(problems)}")
            return 1
        parts.append(f"bundle {args.bundle}")

    me = me_cuda_state(python, env)
    if me != "cuda":
        print(
            f"[gpu_check] MinkowskiEngine is {me} here: building the CUDA one (scripts/build_minkowski.sh --cuda)",
            file=sys.stderr,
        )
        started = time.monotonic()
        code, out = _run(
            ["bash", str(ROOT / "scripts" / "build_minkowski.sh"), "--cuda", python],
            args.logs / "build.log",
            env,
            timeout=left(360),
        )
        me = (
            me_cuda_state(python, env)
            if code == 0
            else f"build failed{', ' + ended(code, out) if ended(code, out) else ''}"
        )
        parts.append(f"ME built in {time.monotonic() - started:.0f} s")
    parts.append(f"ME {'CUDA' if me == 'cuda' else me}")
    if me != "cuda":
        print(f"gpu_check: FAIL | {' | '.join(parts)} (see {args.logs / 'build.log'})")
        return 1

    if args.bundle is not None:
        parts.append(keep_me_wheel(args.bundle / "cache" / "wheels", args.logs / "me-wheel"))
    diagnose(python, env, args.logs / "diagnosis.log")
    report = args.logs / "exactness.jsonl"
    report.unlink(missing_ok=True)
    env = {**env, "LSDP_GPU_REPORT": str(report)}
    # with pytest-xdist, a test that kills its worker (ME's segmentation fault) is one failure, not the whole run
    xdist = ["-n", "1"] if _importable(python, "xdist") else []
    # a test that hangs (the first GPU run's multi-replica backward did) ends its worker after 45 s: one failure,
    # not the whole budget (xdist starts a new worker; up to 20 times). pytest-timeout's own stack dump goes to the
    # worker's lost terminal, so pytest's faulthandler dumps every thread's stack into the log first, at 35 s.
    hang = ["--timeout", "45", "-o", "timeout_method=thread", "-o", "faulthandler_timeout=35",
            "--max-worker-restart", "20"] if xdist and _importable(python, "pytest_timeout") else []
    code, out = _run(
        [
            python,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            *xdist,
            *hang,
            "--durations=12",
            "tests/strategies/test_gpu.py",
            "tests/runtime/test_cuda_paths_devices.py",
            "tests/runtime/test_cuda_paths_tensors.py",
            "tests/project/test_cuda_paths_scripts.py",
        ],
        args.logs / "tests.log",
        env,
        timeout=left(240),
    )
    counts = pytest_counts(out)
    if ended(code, out):
        parts.append(f"tests {ended(code, out)}")
    diffs = [json.loads(line)["max_rel_diff"] for line in report.read_text().splitlines()] if report.exists() else []
    worst = f", max rel diff {max(diffs):.1e} over {len(diffs)} comparisons" if diffs else ""
    parts.append(
        f"tests {counts.get('passed', 0)} passed, {counts.get('failed', 0) + counts.get('errors', 0)} failed, "
        f"{counts.get('skipped', 0)} skipped{worst}"
    )
    ok &= code == 0 and counts.get("passed", 0) > 0

    bench = [python, "benchmarks/bench.py", "--accelerator", "gpu", "--case-timeout", "45"]
    code, out = _run(bench + (["--quick"] if args.quick else []), args.logs / "bench.log", env, timeout=left(300))
    headline = bench_headline(out)
    parts.append(
        f"bench {json.dumps(headline)}"
        if code == 0 and headline
        else f"bench failed{', ' + ended(code, out) if ended(code, out) else ''}"
    )
    ok &= code == 0 and bool(headline)

    line = f"gpu_check: {'PASS' if ok else 'FAIL'} | " + " | ".join(parts) + f" | logs {args.logs}"
    (args.logs / "summary.txt").write_text(line + "\n")
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
