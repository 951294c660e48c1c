"""The CUDA set-up's refusals and its choice of torch build, without building or downloading.

``scripts/setup.sh --cuda`` and ``scripts/build_minkowski.sh --cuda`` are run for real, against a
stand-in interpreter: a shell script that runs this test's Python with a fake ``torch`` package
first on its path (version, ``torch.version.cuda``, and a ``torch`` distribution's metadata set by
the test) and answers ``python -m pip ...`` by recording the call (and, where the test says so,
"installing" the CUDA build by switching the fake torch to it). A stand-in ``nvcc`` reports a
chosen CUDA release and a stand-in ``nvidia-smi`` reports no GPU. Each refusal must stop before the
compile step, with the command that fixes it.

The last test runs pip's own resolver, offline, on two tiny wheels named like torch's CPU and CUDA
builds: the specifier setup.sh passes takes the CUDA build where ``torch==X`` alone takes ``X+cpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.stand_in import StandIn

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def assert_refused_before_compiling(done: subprocess.CompletedProcess, *fix: str) -> str:
    """The script failed, said how to fix it (each `fix` text appears), and compiled nothing."""
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ERROR" in out and "compiling" not in out and "fetching" not in out, out
    for text in fix:
        assert text in out, f"{text!r} not in:\n{out}"
    return out


@pytest.fixture
def stand_in(tmp_path):
    def make(version="2.13.0+cu130", cuda="13.0", pip="installs the CUDA build"):
        return StandIn(tmp_path, version, cuda, pip)

    return make


def test_cuda_build_with_a_cpu_only_torch_is_refused(stand_in):
    fake = stand_in(version="2.13.0+cpu", cuda=None)
    done = fake.run("scripts/build_minkowski.sh", "--cuda", str(fake.python), TORCH_CUDA_ARCH_LIST="9.0")
    assert_refused_before_compiling(
        done,
        "torch 2.13.0+cpu, CPU only",
        "bash scripts/setup.sh --cuda",
        f"{fake.python} -m pip install 'torch==2.13.0,!=2.13.0+cpu'",
    )
    assert not fake.cache.exists()
    done = fake.run("scripts/cuda_toolkit.sh", str(fake.python))
    assert_refused_before_compiling(done, "CPU build", "bash scripts/setup.sh --cuda")


def test_a_cuda_home_whose_nvcc_differs_from_torchs_cuda_is_refused(stand_in):
    fake = stand_in(version="2.13.0+cu128", cuda="12.8")
    done = fake.run(
        "scripts/build_minkowski.sh",
        "--cuda",
        str(fake.python),
        TORCH_CUDA_ARCH_LIST="9.0",
        CUDA_HOME=str(fake.nvcc("13.0")),
    )
    assert_refused_before_compiling(
        done,
        "has nvcc 13.0 but torch was built with CUDA 12.8",
        "env -u CUDA_HOME -u CUDA_PATH bash scripts/setup.sh --cuda",
    )
    assert not (fake.cache / "wheels").exists()
    # the same toolkit is taken when the versions agree (LSDP_CUDA_ANY=1 overrides the refusal)
    done = fake.run("scripts/cuda_toolkit.sh", str(fake.python), CUDA_HOME=str(fake.nvcc("12.8")))
    assert done.returncode == 0 and done.stdout.strip() == str(fake.root / "cuda-12.8"), done.stderr
    done = fake.run("scripts/cuda_toolkit.sh", str(fake.python), CUDA_HOME=str(fake.nvcc("13.0")), LSDP_CUDA_ANY="1")
    assert done.returncode == 0 and done.stdout.strip() == str(fake.root / "cuda-13.0"), done.stderr


def test_cuda_12_without_a_cuda_home_is_refused(stand_in):
    """NVIDIA's CUDA 12 wheels hold no nvcc (ptxas only): a CUDA 12 torch needs a CUDA_HOME."""
    fake = stand_in(version="2.10.0+cu128", cuda="12.8")
    done = fake.run("scripts/build_minkowski.sh", "--cuda", str(fake.python), TORCH_CUDA_ARCH_LIST="9.0")
    assert_refused_before_compiling(
        done, "CUDA 12 wheels have no nvcc", "CUDA_HOME=/path/to/cuda-12.8 bash scripts/setup.sh --cuda"
    )
    assert fake.pip_calls() == [] and not fake.cache.exists()


def test_a_cached_toolkit_whose_nvcc_differs_is_refused(stand_in):
    fake = stand_in(version="2.13.0+cu130", cuda="13.0")
    toolkit = fake.cache / "cuda-toolkit-13.0.3"  # the version torch's metadata pins
    home = toolkit / "nvidia" / "cu13"
    (home / "bin").mkdir(parents=True)
    fake._script(home / "bin" / "nvcc", "echo 'Cuda compilation tools, release 12.9, V12.9.86'")
    (toolkit / ".complete").touch()
    done = fake.run("scripts/build_minkowski.sh", "--cuda", str(fake.python), TORCH_CUDA_ARCH_LIST="9.0")
    assert_refused_before_compiling(
        done, "reports 12.9, torch was built with CUDA 13.0", f"rm -rf {toolkit} && bash scripts/setup.sh --cuda"
    )


def test_no_arch_list_and_no_gpu_is_refused(stand_in):
    fake = stand_in(version="2.13.0+cu130", cuda="13.0")
    done = fake.run("scripts/build_minkowski.sh", "--cuda", str(fake.python), CUDA_HOME=str(fake.nvcc("13.0")))
    assert_refused_before_compiling(
        done,
        "no GPU is visible",
        "TORCH_CUDA_ARCH_LIST is not set",
        f"TORCH_CUDA_ARCH_LIST=9.0 bash scripts/build_minkowski.sh --cuda {fake.python}",
    )
    # setup.sh refuses before anything is created or downloaded
    venv = fake.root / "new-venv"
    done = fake.run("scripts/setup.sh", "--cuda", LSDP_CUDA_VENV=str(venv))
    assert_refused_before_compiling(done, "TORCH_CUDA_ARCH_LIST=9.0 bash scripts/setup.sh --cuda")
    assert not venv.exists() and fake.pip_calls() == []


def test_setup_replaces_a_cpu_only_torch_with_the_cuda_build_of_the_same_version(stand_in):
    fake = stand_in(version="2.13.0+cpu", cuda=None)
    # stops at the toolkit (an nvcc of another CUDA), after the torch and package installs
    done = fake.run("scripts/setup.sh", "--cuda", TORCH_CUDA_ARCH_LIST="9.0", CUDA_HOME=str(fake.nvcc("12.8")))
    out = assert_refused_before_compiling(done, "has nvcc 12.8 but torch was built with CUDA 13.0")
    assert "torch 2.13.0+cpu in" in out and "is a CPU-only build: replacing it" in out
    assert "torch 2.13.0+cu130 (CUDA 13.0) in" in out
    torch_install, package_install = fake.pip_calls()
    assert torch_install["args"] == ["install", "-q", "torch==2.13.0,!=2.13.0+cpu"]
    assert package_install["args"][-2:] == ["-e", ".[test]"]
    assert package_install["constraints"] == ["torch==2.13.0,!=2.13.0+cpu\n"]  # pip may not swap +cpu back in


@pytest.mark.parametrize("pip", ["fails", "offers the CPU build only"])
def test_setup_stops_with_the_command_when_the_cuda_build_cannot_be_had(stand_in, pip):
    fake = stand_in(version="2.13.0+cpu", cuda=None, pip=pip)
    done = fake.run("scripts/setup.sh", "--cuda", TORCH_CUDA_ARCH_LIST="9.0")
    assert_refused_before_compiling(
        done,
        "index that has torch's CUDA builds",
        f"then run: {fake.python} -m pip install 'torch==2.13.0,!=2.13.0+cpu'",
    )
    assert len(fake.pip_calls()) == 1  # nothing else installed


def _tiny_wheel(folder: Path, version: str) -> None:
    name = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{name}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{name}/RECORD", "")


@pytest.mark.parametrize(
    ("spec", "chosen"), [("torch==2.13.0", "2.13.0+cpu"), ("torch==2.13.0,!=2.13.0+cpu", "2.13.0")]
)
def test_pip_takes_the_cuda_build_with_the_cpu_build_excluded(tmp_path, spec, chosen):
    """Real pip, offline: a folder holding both builds, as a machine whose find-links has the CPU one."""
    _tiny_wheel(tmp_path, "2.13.0+cpu")
    _tiny_wheel(tmp_path, "2.13.0")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--isolated",
            "--dry-run",
            "--ignore-installed",
            "--no-index",
            "--find-links",
            str(tmp_path),
            "--report",
            str(report),
            "-q",
            spec,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [i["metadata"]["version"] for i in json.loads(report.read_text())["install"]] == [chosen]


def _find_blas(tmp_path, env=None, pkg_config=None):
    """scripts/find_blas.sh with a PATH of its own (sed, cat and, when given, a fake pkg-config) and no system BLAS."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("sed", "cat"):
        target = bin_dir / tool
        if not target.exists():
            target.symlink_to(shutil.which(tool))
    if pkg_config is not None:
        script = bin_dir / "pkg-config"
        script.write_text("#!/bin/sh\n" + pkg_config)
        script.chmod(0o755)
    full = {"PATH": str(bin_dir), "LSDP_BLAS_SYSTEM_DIRS": str(tmp_path / "no-system"), **(env or {})}
    bash = shutil.which("bash")
    return subprocess.run([bash, str(ROOT / "scripts" / "find_blas.sh")], env=full, capture_output=True, text=True)


def test_find_blas_finds_openblas_where_the_environment_has_it(tmp_path):
    """Named folders, the active conda environment, pkg-config (RHEL, Spack, modules): no apt, no sudo."""
    conda = tmp_path / "conda"
    (conda / "include").mkdir(parents=True)
    (conda / "include" / "cblas.h").write_text("")
    named = _find_blas(tmp_path, {"LSDP_BLAS_INCLUDE": str(conda / "include"), "LSDP_BLAS_LIB": "/opt/lib"})
    assert named.returncode == 0 and named.stdout.split() == [str(conda / "include"), "/opt/lib"]
    assert _find_blas(tmp_path, {"CONDA_PREFIX": str(conda)}).stdout.split() == [
        str(conda / "include"),
        str(conda / "lib"),
    ]
    spack = tmp_path / "spack"
    (spack / "include" / "openblas").mkdir(parents=True)
    (spack / "include" / "openblas" / "cblas.h").write_text("")
    fake = (
        'case "$*" in *--exists*openblas*) exit 0;; *--exists*) exit 1;; '
        f"*includedir*) echo {spack}/include;; *libdir*) echo {spack}/lib;; *) echo;; esac\n"
    )
    found = _find_blas(tmp_path, pkg_config=fake)
    assert found.returncode == 0 and found.stdout.split() == [str(spack / "include" / "openblas"), str(spack / "lib")]


def test_find_blas_says_what_to_install_or_pass_when_there_is_none(tmp_path):
    missing = _find_blas(tmp_path)
    assert missing.returncode == 1
    for advice in (
        "conda install -c conda-forge openblas",
        "apt-get install libopenblas-dev",
        "dnf install openblas-devel",
        "LSDP_BLAS_INCLUDE=",
    ):
        assert advice in missing.stderr
    wrong = _find_blas(tmp_path, {"LSDP_BLAS_INCLUDE": str(tmp_path)})
    assert wrong.returncode == 1 and "has no cblas.h" in wrong.stderr
