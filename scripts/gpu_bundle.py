"""The GPU check's offline bundle: everything a GPU node without network (an HPC compute node) lacks to build ME and
run the GPU check, gathered where the package registries are reachable, and used on the node with no download, no
apt and no write outside temporary folders and the interpreter's site-packages.

    bash scripts/gpu_bundle.sh DIR [PYTHON]             # where the registries are reachable (about 30 s; 17 MB)
    bash scripts/gpu_check.sh python3 --bundle DIR      # on the GPU node, in the copied checkout (scripts/gpu_check.py)

The node must bring a Python with torch's CUDA build and numpy, and nvcc (``CUDA_HOME``, default ``/usr/local/cuda``);
it may lack a package registry and ``cblas.h`` (docs/cuda.md). DIR holds:

* ``sdist/MinkowskiEngine-0.5.4.tar.gz``: ME's source distribution (``build_minkowski.sh --fetch-sdist``);
* ``debs/``: Debian's OpenBLAS (``libopenblas0-pthread``, ``libopenblas-pthread-dev``) and the Fortran runtime it
  links (``libgfortran5``, ``libquadmath0``), from ``apt-get download`` (no root, nothing installed); unpacked on the
  GPU node under a temporary folder by :func:`unpack_openblas` (no dpkg needed);
* ``wheels/``: wheels, for the GPU node's Python (``--python-version``, default 3.12), of what the build and the
  tests import, at the versions installed where the bundle is made, so that one missing on the node can be installed
  with no index;
* ``cache/``: made on the GPU node: ``build_minkowski.sh`` keeps the built wheel there (``LSDP_CACHE``), so a
  second call on the same node installs it in seconds;
* ``bundle.json``: what is in it (file, bytes, sha256) and when it was made.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ME_SDIST = "MinkowskiEngine-0.5.4.tar.gz"
#: Debian packages: OpenBLAS with its headers (cblas.h) and the Fortran runtime libopenblas links
DEBS = ("libopenblas0-pthread", "libopenblas-pthread-dev", "libgfortran5", "libquadmath0")
#: module -> distribution, for what the ME build (setuptools, wheel, ninja) and the GPU tests and bench import
#: beyond torch and numpy, which the GPU node's Python must bring (a CUDA torch is gigabytes: install it on the node as
#: your site does)
MODULES = {
    "setuptools": "setuptools", "wheel": "wheel", "ninja": "ninja", "pytest": "pytest", "pluggy": "pluggy",
    "iniconfig": "iniconfig", "hypothesis": "hypothesis", "sortedcontainers": "sortedcontainers",
    "lightning": "lightning", "lightning_utilities": "lightning-utilities", "torchmetrics": "torchmetrics",
}
#: of :data:`MODULES`, those the check goes on without: setuptools >= 70.1 has bdist_wheel itself, and without ninja
#: the compile runs one file at a time
OPTIONAL = ("wheel", "ninja")
#: the most the bundle may weigh: it stays small enough to copy to the node beside the checkout (about 17 MiB as made)
LIMIT_BYTES = 40 * 2**20


def _say(message: str) -> None:
    print(f"[gpu_bundle] {message}", file=sys.stderr, flush=True)


def _pins(python: str) -> dict[str, str]:
    """``{distribution: version}`` of :data:`MODULES` as installed in ``python``'s environment (absent: unpinned)."""
    probe = ("import importlib.metadata as m, json, sys\nout = {}\nfor d in sys.argv[1:]:\n    try:\n"
             "        out[d] = m.version(d)\n    except m.PackageNotFoundError:\n        pass\nprint(json.dumps(out))")
    done = subprocess.run([python, "-c", probe, *MODULES.values()], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _debs_missing(bundle: Path) -> list[str]:
    """Of :data:`DEBS`, those with no ``<name>_*.deb`` in the bundle's ``debs/``."""
    have = {p.name.split("_")[0] for p in (bundle / "debs").glob("*.deb")}
    return [d for d in DEBS if d not in have]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make(bundle: Path, python: str, python_version: str = "3.12") -> dict:
    """Gather the bundle into ``bundle`` (kept parts are not fetched again) and write ``bundle.json``.

    Raises:
        SystemExit: a part could not be fetched (the message names it and what to do), or the bundle is over
            :data:`LIMIT_BYTES`.
    """
    for part in ("sdist", "debs", "wheels"):
        (bundle / part).mkdir(parents=True, exist_ok=True)
    if not (bundle / "sdist" / ME_SDIST).is_file():
        _say("ME's source distribution, through pip's configured index")
        done = subprocess.run(["bash", str(ROOT / "scripts" / "build_minkowski.sh"), "--fetch-sdist",
                               str(bundle / "sdist"), python])
        if done.returncode or not (bundle / "sdist" / ME_SDIST).is_file():
            sys.exit(f"gpu_bundle: could not fetch {ME_SDIST} (see above)")
    wanted = _debs_missing(bundle)
    if wanted:
        if shutil.which("apt-get") is None:
            sys.exit(f"gpu_bundle: no apt-get here to download {', '.join(wanted)}: run this on Debian or Ubuntu, or "
                     f"put those packages' .deb files (amd64) in {bundle / 'debs'}")
        _say(f"Debian's {', '.join(wanted)}, through apt's configured sources (downloaded, not installed)")
        done = subprocess.run(["apt-get", "download", *wanted], cwd=bundle / "debs", capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"gpu_bundle: apt-get download {' '.join(wanted)} failed:\n{done.stderr[-2000:]}\n"
                     "(an apt-get update as root may be needed first)")
    pins = _pins(python)
    specs = [f"{d}=={pins[d]}" if d in pins else d for d in MODULES.values()]
    _say(f"wheels for Python {python_version}: {' '.join(specs)}")
    done = subprocess.run([python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                           "--platform", "manylinux2014_x86_64", "-d", str(bundle / "wheels"), *specs],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"gpu_bundle: pip download of the wheels failed:\n{done.stderr[-2000:]}")
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.parts[len(bundle.parts)] in ("sdist", "debs", "wheels"))
    manifest = {
        "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python_version": python_version,
        "files": [{"path": str(p.relative_to(bundle)), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files],
    }
    total = sum(f["bytes"] for f in manifest["files"])
    manifest["bytes"] = total
    (bundle / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if total > LIMIT_BYTES:
        sys.exit(f"gpu_bundle: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB the bundle is meant "
                 "to stay under (it is copied to the GPU node beside the checkout)")
    _say(f"{len(files)} files, {total / 2**20:.1f} MiB in {bundle}")
    return manifest


def check(bundle: Path) -> list[str]:
    """What is wrong with ``bundle`` for the GPU machine (empty: nothing): missing parts, files that differ from
    ``bundle.json``."""
    manifest_path = bundle / "bundle.json"
    if not manifest_path.is_file():
        return [f"{bundle} has no bundle.json: make it with bash scripts/gpu_bundle.sh {bundle} where a registry "
                "is reachable, and copy it to this machine"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    for entry in manifest["files"]:
        path = bundle / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']} is missing")
        elif path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            problems.append(f"{entry['path']} differs from bundle.json")
    if not (bundle / "sdist" / ME_SDIST).is_file():
        problems.append(f"sdist/{ME_SDIST} is missing")
    problems += [f"debs/{d}_*.deb is missing" for d in _debs_missing(bundle)]
    return problems


def _ar_members(data: bytes):
    """``(name, bytes)`` of each member of an ``ar`` archive (a .deb is one: debian-binary, control, data)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + size % 2


def unpack_deb(deb: Path, prefix: Path) -> None:
    """Unpack ``deb``'s files under ``prefix`` as ``dpkg -x`` would (no dpkg needed; xz or gzip data).

    Raises:
        ValueError: not a .deb, or its data is compressed in a way Python's tarfile cannot read (zstd).
    """
    for name, body in _ar_members(deb.read_bytes()):
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ValueError(f"{deb.name}: zstd-compressed data; use Debian's packages (xz)")
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as archive:
                archive.extractall(prefix, filter="tar")
            return
    raise ValueError(f"{deb.name} has no data.tar member")


def unpack_openblas(bundle: Path, prefix: Path) -> tuple[Path, Path]:
    """Unpack the bundle's .deb files under ``prefix`` and return ``(include_dir, lib_dir)``: the folder with
    ``cblas.h`` and the one with ``libopenblas.so``, into which the Fortran runtime's libraries are copied, so that
    one folder on the extension's search path (``build_minkowski.sh`` writes it in as DT_RPATH) serves all.

    Raises:
        FileNotFoundError: the packages hold no ``cblas.h`` or no ``libopenblas.so``.
    """
    for deb in sorted((bundle / "debs").glob("*.deb")):
        unpack_deb(deb, prefix)
    headers = sorted(prefix.rglob("cblas.h"))
    libraries = sorted(prefix.rglob("libopenblas.so"))
    if not headers or not libraries:
        raise FileNotFoundError(f"the bundle's packages in {bundle / 'debs'} hold no cblas.h or no libopenblas.so")
    lib = libraries[0].parent
    for runtime in ("libgfortran.so.5*", "libquadmath.so.0*"):
        for path in prefix.rglob(runtime):
            if path.parent != lib and not (lib / path.name).exists():
                shutil.copy2(path, lib / path.name, follow_symlinks=False)
    return headers[0].parent, lib


def missing_modules(python: str) -> list[str]:
    """Of :data:`MODULES`, those ``python`` cannot import (found with ``importlib.util.find_spec``)."""
    probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    done = subprocess.run([python, "-c", probe, *MODULES], capture_output=True, text=True, check=True)
    return done.stdout.split()


def install_missing(python: str, bundle: Path) -> list[str]:
    """Install the bundle's wheels of the modules ``python`` lacks, with no index, one at a time; return those still
    missing that the check needs (:data:`OPTIONAL` ones are only said)."""
    missing = missing_modules(python)
    for module in missing:
        _say(f"installing {MODULES[module]} from {bundle / 'wheels'} (no index)")
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
                        "--find-links", str(bundle / "wheels"), MODULES[module]])
    still = missing_modules(python) if missing else []
    for module in set(still) & set(OPTIONAL):
        _say(f"going on without {module}")
    return [m for m in still if m not in OPTIONAL]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gather the GPU check's bundle (scripts/gpu_bundle.sh)")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                        help="an interpreter with torch (ME's setup.py imports it to read the sdist's metadata)")
    parser.add_argument("--python-version", default="3.12", help="the GPU node's Python, for the wheels")
    args = parser.parse_args(argv)
    make(args.bundle.resolve(), args.python, args.python_version)
    problems = check(args.bundle.resolve())
    for problem in problems:
        print(f"gpu_bundle: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
