#!/usr/bin/env bash
# Gather the GPU check's offline bundle into DIR, where the package registries are reachable: ME's sdist, Debian's
# OpenBLAS packages, and wheels for the GPU node's Python (scripts/gpu_bundle.py says what and why).
#
# usage: scripts/gpu_bundle.sh DIR [PYTHON]     PYTHON: an interpreter with torch (default .venv/bin/python)
# then copy DIR and the checkout to a GPU node without network (an HPC compute node) and run there, in the checkout:
#   bash scripts/gpu_check.sh python3 --bundle DIR
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: scripts/gpu_bundle.sh DIR [PYTHON]}
PY=${2:-.venv/bin/python}
exec "$PY" scripts/gpu_bundle.py "$DIR" --python "$PY"
