#!/usr/bin/env bash
# The GPU checklist in one command, for a machine with GPUs (see scripts/gpu_check.py):
# finds or builds MinkowskiEngine with CUDA, runs the exactness tests on accelerator="gpu" with
# 1..N GPUs against one GPU, runs the benchmark on GPUs, and prints one summary line.
#
# usage: scripts/gpu_check.sh [PYTHON] [--quick] [--logs DIR] [--bundle DIR] [--budget SECONDS]
#   PYTHON  an interpreter with a CUDA build of torch (default: .venv/bin/python, else python3); without --bundle
#           it must have lightning-sparse-dp installed
#   --bundle DIR  a GPU node without network (an HPC compute node): everything else from DIR (made by
#           scripts/gpu_bundle.sh where the registries are reachable, copied over with the checkout)
# Exit status: 0 all passed, 1 a step failed, 3 no GPU visible (nothing was run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then PY=$1; shift; fi
[ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || { echo "gpu_check: FAIL | no interpreter $PY (pass one: scripts/gpu_check.sh PYTHON)"; exit 1; }
exec "$PY" scripts/gpu_check.py "$@"
