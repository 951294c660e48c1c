#!/usr/bin/env bash
# Set up lightning-sparse-dp for development on a Debian machine: Debian's libopenblas-dev, a
# virtual environment at .venv/, torch, this package with its test and example extras, and
# MinkowskiEngine 0.5.4 built by scripts/build_minkowski.sh (cached under ~/.cache). Idempotent:
# a warm re-run only checks what is there.
#
# Environment: PYTHON (default python3) creates the venv; TORCH_SPEC (default torch==2.13.0) is
# installed only when the venv has no torch yet; a torch already in the venv is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
log() { printf '[setup] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. Debian packages: cblas.h for the MinkowskiEngine build
if ! dpkg -s libopenblas-dev >/dev/null 2>&1; then
    log "installing Debian's libopenblas-dev"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas-dev >/dev/null \
        || die "could not install libopenblas-dev"
fi

# 2. the virtual environment
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv || die "could not create .venv with $PYTHON"
fi
PY=.venv/bin/python

# 3. torch, only when absent
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    log "installing $TORCH_SPEC"
    "$PY" -m pip install -q "$TORCH_SPEC" || die "could not install $TORCH_SPEC"
fi
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)

# 4. this package and its Python dependencies (skipped while pyproject.toml is unchanged)
stamp=.venv/.lightning-sparse-dp-installed
want="$(sha256sum pyproject.toml | cut -c1-16) torch=$TORCH_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing lightning-sparse-dp (editable) with its test and example extras"
    constraints=$(mktemp)
    echo "torch==$TORCH_VERSION" > "$constraints"
    "$PY" -m pip install -q -c "$constraints" -e ".[test]" || { rm -f "$constraints"; die "pip install failed"; }
    rm -f "$constraints"
    echo "$want" > "$stamp"
fi

# 5. MinkowskiEngine 0.5.4
bash scripts/build_minkowski.sh "$PY" || die "MinkowskiEngine set-up failed (see above)"
log "ready: $PY"
