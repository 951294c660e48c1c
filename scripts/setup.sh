#!/usr/bin/env bash
# Set up lightning-sparse-dp on a Debian machine: Debian's libopenblas-dev, a virtual environment,
# torch, this package with its test and example extras, and MinkowskiEngine 0.5.4 built by
# scripts/build_minkowski.sh (the wheel cached under ~/.cache). Idempotent: a warm re-run only
# checks what is there.
#
# usage: scripts/setup.sh           CPU set-up in .venv/ (no GPU needed; what CI runs)
#        scripts/setup.sh --cuda    the CUDA build, from nothing, in a separate environment
#                                   (default .venv-cuda/); no GPU needed to build it
#
# --cuda does, in order: refuses early when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible;
# creates the CUDA venv; installs torch's CUDA build through pip's configured index (a CPU-only
# torch found there, e.g. taken from a local wheel folder, is replaced by the CUDA build of the
# same version); installs this package; builds, caches and installs ME with CUDA
# (scripts/build_minkowski.sh --cuda: NVIDIA's toolkit wheels, source patches, compile); checks
# that ME imports with its CUDA backend; runs the test suite against it on CPU (skipped on a
# re-run when neither ME nor the code changed since it passed; LSDP_RETEST=1 runs it anyway).
#
# Environment: PYTHON (default python3) creates the venv; TORCH_SPEC (default torch==2.13.0) is
# installed only when the venv has no torch yet; a torch already in the venv is never replaced,
# except a CPU-only one under --cuda. With --cuda: LSDP_CUDA_VENV (default .venv-cuda),
# TORCH_CUDA_ARCH_LIST (e.g. 9.0, or "8.0;9.0"; required without a GPU), MAX_JOBS (compile jobs),
# LSDP_CACHE (wheel, toolkit and build-environment cache, default ~/.cache/lightning-sparse-dp).
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA=0
case "${1:-}" in
    --cuda) CUDA=1; shift ;;
    --cpu | "") ;;
    *) printf 'usage: scripts/setup.sh [--cuda]\n' >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
[ "$CUDA" = 0 ] || VENV=${LSDP_CUDA_VENV:-.venv-cuda}
log() { printf '[setup] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
START=$SECONDS
step_start=$SECONDS
step_done() { log "$1 ($((SECONDS - step_start)) s)"; step_start=$SECONDS; }

# 0. --cuda: the GPU architectures must be known before anything is downloaded
if [ "$CUDA" = 1 ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] \
        && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    die "no GPU is visible to pick the CUDA architectures from, and TORCH_CUDA_ARCH_LIST is not set. \
Run: TORCH_CUDA_ARCH_LIST=9.0 bash scripts/setup.sh --cuda   (8.0 A100, 8.6 RTX 30xx, 8.9 L4 / RTX 40xx, \
9.0 H100, or several: \"8.0;9.0\")"
fi

# 1. Debian packages: cblas.h for the MinkowskiEngine build (not when an OpenBLAS is there already: conda's,
#    pkg-config's, named with LSDP_BLAS_INCLUDE, or the system's; scripts/find_blas.sh)
if ! bash scripts/find_blas.sh >/dev/null 2>&1 && ! dpkg -s libopenblas-dev >/dev/null 2>&1; then
    log "installing Debian's libopenblas-dev"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas-dev >/dev/null \
        || die "could not install libopenblas-dev"
fi

# 2. the virtual environment
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV" || die "could not create $VENV with $PYTHON"
fi
PY=$VENV/bin/python

# 3. torch, only when absent (under --cuda: also when it is a CPU-only build)
# torch.__version__ (2.13.0+cu130), torch.version.cuda, and the distribution's version, which pip
# compares (the registry's CUDA build says 2.13.0 there, a CPU build 2.13.0+cpu)
torch_info() {
    "$PY" -c "import importlib.metadata as m, torch
print(torch.__version__, torch.version.cuda or 'none', m.version('torch'))" 2>/dev/null
}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    spec=$TORCH_SPEC
    # torch==X also matches X+cpu, and pip prefers a local label (X+cpu sorts after X): where a
    # CUDA build is wanted, exclude the CPU one by name, whatever index or folder offers it.
    if [ "$CUDA" = 1 ] && [[ "$TORCH_SPEC" =~ ^torch==([0-9][0-9A-Za-z.]*)$ ]]; then
        spec="torch==${BASH_REMATCH[1]},!=${BASH_REMATCH[1]}+cpu"
    fi
    log "installing $spec"
    "$PY" -m pip install -q "$spec" || die "could not install $spec"
fi
read -r TORCH_VERSION TORCH_CUDA TORCH_DIST < <(torch_info) || die "torch does not import in $VENV"
if [ "$CUDA" = 1 ] && [ "$TORCH_CUDA" = none ]; then
    # A CPU-only torch where the CUDA build was asked for: the CUDA build of the same version,
    # through pip's configured index, the CPU build excluded by its local version label.
    base=${TORCH_VERSION%%+*}
    label=${TORCH_VERSION#"$base"}
    spec="torch==$base,!=$base${label:-+cpu}"
    fix="$PY -m pip install '$spec'"
    log "torch $TORCH_VERSION in $VENV is a CPU-only build: replacing it with the CUDA build of $base ($fix)"
    "$PY" -m pip install -q "$spec" || die "could not install torch's CUDA build of $base. pip takes \
the CPU build when only that one is offered (a local wheel folder, or an index of CPU builds such as \
PIP_INDEX_URL / pip.conf's index-url). Point pip at an index that has torch's CUDA builds (the \
registry's default torch for Linux x86_64 is one), then run: $fix"
    read -r TORCH_VERSION TORCH_CUDA TORCH_DIST < <(torch_info) || die "torch does not import in $VENV after reinstalling it"
    [ "$TORCH_CUDA" != none ] || die "pip installed torch $TORCH_VERSION, still a CPU-only build. \
Point pip at an index that has torch's CUDA builds, then run: $fix"
fi
[ "$CUDA" = 0 ] || step_done "torch $TORCH_VERSION (CUDA $TORCH_CUDA) in $VENV"

# 4. this package and its Python dependencies (skipped while pyproject.toml is unchanged)
stamp=$VENV/.lightning-sparse-dp-installed
want="$(sha256sum pyproject.toml | cut -c1-16) torch=$TORCH_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing lightning-sparse-dp (editable) with its test and example extras"
    constraints=$(mktemp)
    pin="torch==$TORCH_DIST"
    # a CUDA build's version may have no label to pin: keep pip from swapping in X+cpu
    [ "$TORCH_CUDA" = none ] || [ "${TORCH_DIST#*+}" != "$TORCH_DIST" ] || pin="$pin,!=$TORCH_DIST+cpu"
    echo "$pin" > "$constraints"
    "$PY" -m pip install -q -c "$constraints" -e ".[test]" || { rm -f "$constraints"; die "pip install failed"; }
    rm -f "$constraints"
    echo "$want" > "$stamp"
fi
[ "$CUDA" = 0 ] || step_done "lightning-sparse-dp and its test extras"

# 5. MinkowskiEngine 0.5.4
if [ "$CUDA" = 0 ]; then
    bash scripts/build_minkowski.sh "$PY" || die "MinkowskiEngine set-up failed (see above)"
    log "ready: $PY"
    exit 0
fi
bash scripts/build_minkowski.sh --cuda "$PY" || die "MinkowskiEngine CUDA set-up failed (see above)"
step_done "MinkowskiEngine CUDA build"

# 6. --cuda: the CUDA backend imports; the test suite passes against it on CPU
"$PY" - >&2 <<'PYEOF' || die "MinkowskiEngine's CUDA build does not import or has no CUDA backend"
import MinkowskiEngine as ME, torch
assert ME.is_cuda_available(), "ME.is_cuda_available() is False"
major = ME.cuda_version() // 1000
assert major == int(torch.version.cuda.split(".")[0]), (ME.cuda_version(), torch.version.cuda)
print(f"[setup] import check: MinkowskiEngine {ME.__version__}, ME.is_cuda_available() True, "
      f"ME.cuda_version() {ME.cuda_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPUs visible: {torch.cuda.device_count()}")
PYEOF
KEY=$(cat "$VENV/.lsdp-minkowski-build")
code=$(find lightning_sparse_dp tests examples pyproject.toml -type f \( -name '*.py' -o -name '*.toml' \) \
    | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
tests_stamp=$VENV/.lsdp-tests-passed
if [ "${LSDP_RETEST:-0}" != 1 ] && [ "$(cat "$tests_stamp" 2>/dev/null)" = "$KEY $code" ]; then
    log "the test suite passed against $KEY with this code before (LSDP_RETEST=1 runs it again)"
else
    log "running the test suite against the CUDA build, on CPU"
    rm -f "$tests_stamp"
    "$PY" -m pytest -q -p no:cacheprovider || die "the test suite failed against $KEY (see above)"
    echo "$KEY $code" > "$tests_stamp"
    step_done "test suite"
fi
wheel=$(ls "${LSDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-sparse-dp}/wheels/$KEY"/*.whl 2>/dev/null | head -n1 || true)
log "ready in $((SECONDS - START)) s: $PY, torch $TORCH_VERSION (CUDA $TORCH_CUDA), MinkowskiEngine $KEY${wheel:+, wheel $wheel ($(du -k "$wheel" | cut -f1) KiB)}"
