"""README's Python code blocks run as they stand (issue 67): each block in a fresh interpreter, in an empty folder, so
the quick start cannot drift from the package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) >= 2  # the strategy line at the top and the quick start


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs_as_written(index, tmp_path):
    run = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    if "trainer.fit(" in BLOCKS[index]:  # a block that trains: its first step checked against one device, and equal
        said = run.stdout + run.stderr
        assert "exactness check of training step 0 on 3 replicas: equals one device's" in said, said[-4000:]
