#!/usr/bin/env bash
# Run the test suite on the lowest versions pyproject.toml admits (or those given), in a venv of their own.
#
# usage: scripts/min_versions.sh [VENV [PYTEST ARGS...]]     (default .venv-min; the whole suite)
#   e.g. scripts/min_versions.sh .venv-min tests/runtime/test_compat.py   (the private names of Lightning and
#   torchmetrics the package uses, lightning_sparse_dp/runtime/compat.py)
#   Environment: MIN_TORCH (default 2.13.0; 2.4.1 is the lowest that passes the suite; each torch needs its
#   own ME build, ~5 minutes on 2 cores), MIN_LIGHTNING (2.4.0), MIN_TORCHMETRICS (1.6.0: Metric.merge_state), PYTHON (python3).
# Prints the versions it ran and pytest's summary line; exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-min}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -q "torch==${MIN_TORCH:-2.13.0}" "setuptools>=77"  # setuptools: the build backend pyproject names
"$PY" -m pip install -q -e ".[test,examples]" "lightning==${MIN_LIGHTNING:-2.4.0}" \
    "pytorch-lightning==${MIN_LIGHTNING:-2.4.0}" "torchmetrics==${MIN_TORCHMETRICS:-1.6.0}"
bash scripts/build_minkowski.sh "$PY"
"$PY" - <<'PYEOF'
import importlib.metadata as m
print("min_versions:", ", ".join(f"{p} {m.version(p)}" for p in ("torch", "lightning", "torchmetrics", "MinkowskiEngine")))
PYEOF
"$PY" -m pytest -q -p no:cacheprovider "${@:2}"
