"""A stand-in interpreter for the set-up scripts' tests (tests/project/test_setup_scripts.py,
tests/project/test_gpu_bundle.py): a shell script that runs this test's Python with a fake ``torch`` package first
on its path (version, ``torch.version.cuda``, and a ``torch`` distribution's metadata set by the test) and answers
``python -m pip ...`` by recording the call (and, where the test says so, "installing" the CUDA build by switching
the fake torch to it); a stand-in ``nvcc`` reports a chosen CUDA release and a stand-in ``nvidia-smi`` reports no
GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


FAKE_TORCH = '''
import json, os
_state = json.load(open(os.environ["LSDP_FAKE_STATE"]))
__version__ = _state["version"]
class version:
    cuda = _state["cuda"]
class cuda:
    @staticmethod
    def is_available():
        return False
    @staticmethod
    def device_count():
        return 0
'''


# `python -m pip ...` of the stand-in: record the call; a torch install "installs" the CUDA build
# unless the test made pip fail or offer the CPU build only.
FAKE_PIP = """
import json, os, sys
state_file = os.environ["LSDP_FAKE_STATE"]
state = json.load(open(state_file))
args = sys.argv[1:]
with open(os.path.join(os.path.dirname(state_file), "pip.log"), "a") as log:
    constraints = [open(a).read() for i, a in enumerate(args) if i and args[i - 1] == "-c"]
    log.write(json.dumps({"args": args, "constraints": constraints}) + "\\n")
if any(a.startswith("torch==") for a in args):
    if state["pip"] == "fails":
        sys.exit("ERROR: No matching distribution found for torch")
    if state["pip"] == "installs the CUDA build":  # as the registry's: 2.13.0+cu130, "2.13.0" to pip
        base = state["version"].split("+")[0]
        state.update(version=base + "+cu130", cuda="13.0")
        json.dump(state, open(state_file, "w"))
        with open(state["metadata"], "w") as metadata:
            metadata.write(state["metadata_text"].replace("Version: " + state["dist_version"], "Version: " + base))
"""


class StandIn:
    """A directory with the stand-in interpreter (bin/python), fake torch, nvcc and nvidia-smi."""

    def __init__(self, root: Path, version: str, cuda: str | None, pip: str = "installs the CUDA build") -> None:
        self.root = root
        self.site = root / "site"
        (self.site / "torch").mkdir(parents=True)
        (self.site / "torch" / "__init__.py").write_text(FAKE_TORCH)
        dist = self.site / "torch-0.dist-info"
        dist.mkdir()
        # the distribution's version, which pip compares: 2.13.0+cpu for the CPU build, 2.13.0 for
        # the registry's CUDA build; torch 2.13.0+cu130 pins the toolkit like this
        dist_version = version if version.endswith("+cpu") else version.split("+")[0]
        metadata = (
            f"Metadata-Version: 2.1\nName: torch\nVersion: {dist_version}\n"
            'Requires-Dist: cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"\n'
        )
        (dist / "METADATA").write_text(metadata)
        self.state = root / "state.json"
        self.state.write_text(
            json.dumps(
                {
                    "version": version,
                    "cuda": cuda,
                    "pip": pip,
                    "metadata": str(dist / "METADATA"),
                    "metadata_text": metadata,
                    "dist_version": dist_version,
                }
            )
        )
        (root / "fake_pip.py").write_text(FAKE_PIP)
        self.python = root / "venv" / "bin" / "python"
        self.python.parent.mkdir(parents=True)
        self.python.write_text(
            "#!/usr/bin/env bash\n"
            f'if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = pip ]; then shift 2; '
            f'exec "{sys.executable}" "{root / "fake_pip.py"}" "$@"; fi\n'
            f'PYTHONPATH="{self.site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n'
        )
        self.python.chmod(0o755)
        self.bin = root / "bin"  # first on PATH: no GPU
        self.bin.mkdir()
        self._script(self.bin / "nvidia-smi", "echo 'NVIDIA-SMI has failed: no devices were found' >&2; exit 9")
        self.cache = root / "cache"

    def nvcc(self, release: str) -> Path:
        """A CUDA_HOME whose bin/nvcc reports this release."""
        home = self.root / f"cuda-{release}"
        (home / "bin").mkdir(parents=True, exist_ok=True)
        self._script(home / "bin" / "nvcc", f"echo 'Cuda compilation tools, release {release}, V{release}.88'")
        return home

    @staticmethod
    def _script(path: Path, body: str) -> None:
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(0o755)

    def pip_calls(self) -> list[dict]:
        log = self.root / "pip.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def run(self, *command: str, **env: str) -> subprocess.CompletedProcess:
        full = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH", "LSDP_CUDA", "PYTHONPATH")
        }
        full.update(
            {
                "PATH": f"{self.bin}:{os.environ['PATH']}",
                "LSDP_FAKE_STATE": str(self.state),
                "LSDP_CACHE": str(self.cache),
                "LSDP_CUDA_VENV": str(self.python.parents[1]),
                **env,
            }
        )
        return subprocess.run(["bash", *command], cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)
