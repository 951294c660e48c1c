"""The devices tests name: three CPU replicas for the stages run without a Trainer, and the mark of the tests of
what happens on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

#: three replicas on the CPU (the stage tests: tests/step/, tests/runtime/test_stages_executor.py)
CPU3 = [torch.device("cpu")] * 3

#: a test of what happens on a machine without a GPU (tests/runtime/test_cuda_paths_devices.py,
#: tests/project/test_cuda_paths_scripts.py)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")
