"""The GPU check's offline path, as far as a machine without a GPU allows (issue 33).

Run for real: unpacking Debian packages without dpkg (:func:`gpu_bundle.unpack_openblas`, on packages made here),
the bundle's self-check against its ``bundle.json``, ``build_minkowski.sh``'s offline refusals and its offline
path up to the compile (against tests/project/test_setup_scripts.py's stand-in interpreter, with pip's index switched
off), and gpu_check's refusal of a broken bundle. Making a real bundle (``scripts/gpu_bundle.sh``) downloads 17 MB;
it runs here too, since CI reaches the registries.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support.helpers import load_file
from tests.support.stand_in import StandIn

ROOT = Path(__file__).resolve().parents[2]
gpu_bundle = load_file("scripts/gpu_bundle.py")


def _deb(path: Path, files: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """A .deb (an ar archive of debian-binary, control.tar.xz, data.tar.xz) holding ``files`` and ``links``."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as archive:
        for name, body in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo("./" + name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b""), ("data.tar.xz", data.getvalue())]
    out = bytearray(b"!<arch>\n")
    for name, body in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body
        out += b"\n" if len(body) % 2 else b""
    path.write_bytes(bytes(out))
    return path


def _fake_bundle(root: Path) -> Path:
    bundle = root / "bundle"
    for part in ("sdist", "debs", "wheels"):
        (bundle / part).mkdir(parents=True)
    (bundle / "sdist" / gpu_bundle.ME_SDIST).write_bytes(b"not really an sdist")
    lib, inc = "usr/lib/x86_64-linux-gnu", "usr/include/x86_64-linux-gnu/openblas-pthread"
    _deb(bundle / "debs" / "libopenblas0-pthread_0.3.21_amd64.deb",
         {f"{lib}/openblas-pthread/libopenblasp-r0.3.21.so": b"\x7fELF"},
         {f"{lib}/openblas-pthread/libopenblas.so.0": "libopenblasp-r0.3.21.so"})
    _deb(bundle / "debs" / "libopenblas-pthread-dev_0.3.21_amd64.deb",
         {f"{inc}/cblas.h": b"/* cblas */", f"{inc}/openblas_config.h": b""},
         {f"{lib}/openblas-pthread/libopenblas.so": "libopenblas.so.0"})
    _deb(bundle / "debs" / "libgfortran5_12.2.0_amd64.deb", {f"{lib}/libgfortran.so.5.0.0": b"\x7fELF"},
         {f"{lib}/libgfortran.so.5": "libgfortran.so.5.0.0"})
    _deb(bundle / "debs" / "libquadmath0_12.2.0_amd64.deb", {f"{lib}/libquadmath.so.0.0.0": b"\x7fELF"})
    files = sorted(p for p in bundle.rglob("*") if p.is_file())
    manifest = {"files": [{"path": str(p.relative_to(bundle)), "bytes": p.stat().st_size,
                           "sha256": gpu_bundle._sha256(p)} for p in files]}
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    return bundle


def test_openblas_is_unpacked_from_the_debs_without_dpkg(tmp_path):
    """cblas.h's folder and libopenblas.so's folder come back, links intact, with the Fortran runtime copied beside
    libopenblas so one search path (the extension's DT_RPATH) finds all of it."""
    bundle = _fake_bundle(tmp_path)
    include, lib = gpu_bundle.unpack_openblas(bundle, tmp_path / "prefix")
    assert (include / "cblas.h").read_bytes() == b"/* cblas */"
    assert (lib / "libopenblas.so").resolve() == (lib / "libopenblasp-r0.3.21.so").resolve()
    assert (lib / "libopenblas.so").read_bytes() == b"\x7fELF"
    assert {"libgfortran.so.5", "libgfortran.so.5.0.0", "libquadmath.so.0.0.0"} <= {p.name for p in lib.iterdir()}
    with pytest.raises(ValueError, match="not an ar archive"):
        gpu_bundle.unpack_deb(bundle / "bundle.json", tmp_path / "x")


def test_a_bundle_checks_itself_against_its_manifest(tmp_path):
    bundle = _fake_bundle(tmp_path)
    assert gpu_bundle.check(bundle) == []
    (bundle / "sdist" / gpu_bundle.ME_SDIST).write_bytes(b"changed")
    next(iter((bundle / "debs").glob("libquadmath0*"))).unlink()
    problems = gpu_bundle.check(bundle)
    assert f"sdist/{gpu_bundle.ME_SDIST} differs from bundle.json" in problems
    assert "debs/libquadmath0_*.deb is missing" in problems
    assert "no bundle.json" in gpu_bundle.check(tmp_path / "elsewhere")[0]


def test_gpu_check_refuses_a_broken_bundle_before_building(tmp_path):
    gpu_check = load_file("scripts/gpu_check.py")
    inventory = {"torch": "2.11.0+cu130", "cuda": "13.0", "gpus": [("NVIDIA H200", "9.0")]}
    env, problems = gpu_check.bundle_env(tmp_path / "none", sys.executable, inventory, tmp_path / "scratch")
    assert env == {} and "gpu_bundle.sh" in problems[0]
    bundle = _fake_bundle(tmp_path)
    env, problems = gpu_check.bundle_env(bundle, sys.executable, inventory, tmp_path / "scratch")
    assert problems == []
    assert env["LSDP_OFFLINE"] == "1" and env["PIP_NO_INDEX"] == "1" and env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert Path(env["LSDP_BLAS_INCLUDE"], "cblas.h").is_file()
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == env["LSDP_BLAS_LIB"]
    assert env["LSDP_CACHE"] == str(bundle / "cache") and str(ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_offline_build_without_an_sdist_is_refused(tmp_path):
    fake = StandIn(tmp_path, "2.13.0+cpu", None)
    done = fake.run(str(ROOT / "scripts" / "build_minkowski.sh"), "--cpu", str(fake.python), LSDP_OFFLINE="1")
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "LSDP_OFFLINE=1 needs LSDP_ME_SDIST" in out and "gpu_bundle.sh" in out, out
    assert fake.pip_calls() == [], "an offline build asked pip for something"


@pytest.fixture(scope="module")
def me_sdist(tmp_path_factory) -> Path:
    """ME's sdist: the repository's bundle's, else fetched with ``build_minkowski.sh --fetch-sdist`` (the registry)."""
    kept = ROOT / "gpu_bundle" / "sdist" / gpu_bundle.ME_SDIST
    if kept.is_file():
        return kept
    folder = tmp_path_factory.mktemp("sdist")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build_minkowski.sh"), "--fetch-sdist", str(folder),
                           sys.executable], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / gpu_bundle.ME_SDIST


def test_offline_build_takes_the_given_sdist_and_asks_no_index(tmp_path, me_sdist):
    """With the registry switched off (PIP_NO_INDEX, and the stand-in's pip recording every call), the offline path
    unpacks and patches the given sdist and reaches the compile, which the stand-in's fake torch then fails."""
    sdist = me_sdist
    fake = StandIn(tmp_path, "2.13.0+cpu", None)
    (fake.site / "wheel").mkdir()  # bdist_wheel whatever this Python's setuptools (the refusal has its own test)
    (fake.site / "wheel" / "__init__.py").write_text("")
    done = fake.run(str(ROOT / "scripts" / "build_minkowski.sh"), "--cpu", str(fake.python), LSDP_OFFLINE="1",
                    LSDP_ME_SDIST=str(sdist), PIP_NO_INDEX="1")
    out = done.stdout + done.stderr
    assert "offline build" in out and f"source distribution {sdist}" in out, out
    assert "applying 14-cuda-global-max-pooling-one-sample.patch" in out and "compiling" in out, out
    assert "fetching" not in out and not [c for c in fake.pip_calls() if "download" in c["args"]], out


def _apt_knows(package: str) -> bool:
    """Whether apt can download ``package``: a source other than dpkg's own status lists it (``apt-get update``
    ran; an installed package alone is listed from /var/lib/dpkg/status)."""
    done = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True)
    sources = [line for line in done.stdout.splitlines() if line.strip()[:1].isdigit() and "Packages" in line]
    return done.returncode == 0 and bool(sources)


@pytest.mark.skipif(shutil.which("apt-get") is None or not _apt_knows("libopenblas0-pthread"),
                    reason="gathering the bundle's OpenBLAS needs apt-get download and apt's package lists")
def test_the_bundle_is_made_with_everything_the_gpu_machine_lacks(tmp_path):
    """``scripts/gpu_bundle.sh`` gathers the sdist, the four packages and the wheels, small enough to carry."""
    bundle = tmp_path / "bundle"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bundle.sh"), str(bundle), sys.executable], cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    assert gpu_bundle.check(bundle) == []
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["bytes"] <= gpu_bundle.LIMIT_BYTES
    wheels = {p.name.split("-")[0].lower().replace("_", "-") for p in (bundle / "wheels").glob("*.whl")}
    assert {d.lower().replace("_", "-") for d in gpu_bundle.MODULES.values()} <= wheels
    include, lib = gpu_bundle.unpack_openblas(bundle, tmp_path / "prefix")
    assert (include / "cblas.h").is_file() and (lib / "libopenblas.so").exists() and (lib / "libgfortran.so.5").exists()


def test_the_built_me_wheel_comes_back_with_the_logs_when_small_enough(tmp_path):
    """gpu_check copies the ME wheels build_minkowski.sh cached in the bundle to the logs (``<key>/<wheel>``, the
    layout the next bundle's ``cache/wheels/`` takes), and names one too big to carry back instead."""
    gpu_check = load_file("scripts/gpu_check.py")
    cache, out = tmp_path / "cache" / "wheels", tmp_path / "logs" / "me-wheel"
    assert gpu_check.keep_me_wheel(cache, out) == "no cached ME wheel"
    small = cache / "me0.5.4-r3-pX-torch2.11.0-cu130-sm90a-c1-cp312" / "minkowskiengine-0.5.4-cp312-cp312-linux_x86_64.whl"
    small.parent.mkdir(parents=True)
    small.write_bytes(b"w" * 1000)
    big = cache / "me0.5.4-r3-pX-torch2.11.0-cu130-sm80-c1-cp312" / "MinkowskiEngine-0.5.4-cp312-cp312-linux_x86_64.whl"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate((gpu_check.WHEEL_BACK_MIB + 1) * 2**20)  # sparse: takes no disk
    said = gpu_check.keep_me_wheel(cache, out)
    assert (out / small.parent.name / small.name).read_bytes() == small.read_bytes()
    assert not (out / big.parent.name).exists()
    assert "too big to bring back" in said and str(out / small.parent.name) in said
