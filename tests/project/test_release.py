"""The release artifacts: ``python -m build`` gives a wheel that holds the package alone (typed) and an sdist that
holds what its tests and its advice need; one source for the version. Nothing is uploaded."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import lightning_sparse_dp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_wheel_holds_the_package_alone_typed_and_versioned(dist):
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].name.startswith(f"lightning_sparse_dp-{lightning_sparse_dp.__version__}-")
    names = zipfile.ZipFile(wheels[0]).namelist()
    info = f"lightning_sparse_dp-{lightning_sparse_dp.__version__}.dist-info/"
    assert all(n.startswith(("lightning_sparse_dp/", info)) for n in names), [n for n in names if "/" not in n]
    assert "lightning_sparse_dp/py.typed" in names and "lightning_sparse_dp/loss/decide.py" in names
    metadata = zipfile.ZipFile(wheels[0]).read(info + "METADATA").decode()
    assert f"Version: {lightning_sparse_dp.__version__}" in metadata and "License-Expression: MIT" in metadata


def test_the_sdist_holds_the_tests_and_the_me_build_recipe(dist):
    sdists = list(dist.glob("*.tar.gz"))
    assert len(sdists) == 1
    names = {n.split("/", 1)[1] for n in tarfile.open(sdists[0]).getnames() if "/" in n}
    patches = {f"scripts/minkowski_patches/{p.name}" for p in (ROOT / "scripts" / "minkowski_patches").glob("*.patch")}
    assert patches and patches <= names
    assert {"tests/support/helpers.py", "tests/project/test_release.py", "scripts/build_minkowski.sh", "scripts/setup.sh",
            "examples/train_digits.py", "examples/cli_digits.yaml", "CHANGELOG.md", "LICENSE", ".ci/run"} <= names


def test_the_version_has_one_source():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
    assert f"## [{lightning_sparse_dp.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_installing_into_an_environment_with_torch_and_me_installs_the_package_alone(tmp_path):
    """pip's own resolution (offline, against what this environment has): ``pip install .`` would install this
    package and nothing else: torch (a CUDA build, in users' environments) and MinkowskiEngine are left as they are."""
    import json

    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet",
         "--report", str(report), str(ROOT)], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]] == ["lightning-sparse-dp"]
