"""What the benchmark scripts share without importing torch: each model's global batch, the wait settings of their
case processes, and the one JSON result a child process prints.

``bench.py`` applies :func:`wait_env` to every case's process; ``compare_trees.py`` gives it to both trees (an
older tree's ``bench.py`` may not set it); ``openblas_spin.py`` measures the OpenBLAS setting.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence

#: Samples per global batch of each model (segmentation: ``bench.py --global-batch``'s default), in every script.
GLOBAL_BATCH = {"segmentation": 12, "digits": 96}

#: ME's OpenMP runtime, torch's own copy of it and OpenBLAS each keep threads that spin while idle; on a
#: 2-core machine they take turns stealing the cores and step times become bimodal (seen: 11 ms vs 31 ms
#: for the same digits forward). Passive waiting makes the timings repeatable; set before torch loads.
OMP_WAIT_POLICY = "PASSIVE"

#: ``OPENBLAS_THREAD_TIMEOUT`` per model: how long (2**N cycles) OpenBLAS's idle pool threads spin after a call.
#: ME's CPU convolutions call the pthreads OpenBLAS, whose pool ignores ``OMP_WAIT_POLICY`` and spins on
#: ``sched_yield`` for 2**28 cycles by default. With 2 threads on this 2-core machine that made one-device
#: segmentation processes bimodal (``benchmarks/openblas_spin.py``, fresh processes: 7 of 20 at 685-748 ms a step
#: with twice the CPU time, the others 338-400 ms; 2**4 cycles: 19 of 20 at 328-408 ms, a quarter less CPU;
#: 2**22: 3 of 6 slow), while on digits the spin saves wake-ups between its many small GEMMs (one device 17.6-18.9
#: ms a step with the default, 24 ms with 2**4, 20.3 with 2**22). Each model runs with the setting under which its
#: one-device baseline is fastest, the same in all its cases; it matters only where OpenBLAS has 2 threads (plain
#: Lightning and sparse_dp-1 with default threads: more replicas and DDP ranks give it 1). Read when OpenBLAS
#: loads (with ME), so it must be in a process's environment before the imports.
OPENBLAS_THREAD_TIMEOUT = {"segmentation": "4"}


def wait_env(env: MutableMapping[str, str], model_name: str | None = None, openblas: bool = True) -> MutableMapping[str, str]:
    """``env`` with :data:`OMP_WAIT_POLICY` and, for ``model_name`` (when ``openblas``), its
    :data:`OPENBLAS_THREAD_TIMEOUT`, each unless ``env`` sets it already; ``env`` is updated and returned."""
    env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    if openblas and model_name in OPENBLAS_THREAD_TIMEOUT:
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT[model_name])
    return env


#: The prefix of the line that carries a child's result (JSON).
RESULT = "RESULT"


def child_result(command: Sequence[str], what: str, env: Mapping[str, str] | None = None, cwd=None) -> dict:
    """Run ``command`` and return the JSON of the last line of its standard output that starts with :data:`RESULT`.

    Raises:
        RuntimeError: the command failed or printed no such line (``what`` names it; the end of its stderr).
    """
    done = subprocess.run(list(command), capture_output=True, text=True, env=env, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])
