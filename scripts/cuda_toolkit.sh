#!/usr/bin/env bash
# Find or install a CUDA toolkit (nvcc, CCCL's thrust/CUB, the runtime, cuBLAS and cuSPARSE
# headers and libraries) that matches the CUDA version a given torch was built with, and print its
# CUDA_HOME on stdout. No GPU is needed: nvcc compiles for any architecture on any machine.
#
# usage: scripts/cuda_toolkit.sh PYTHON
#   PYTHON  an interpreter whose torch is a CUDA build (torch.version.cuda is not None).
#
# Where the toolkit comes from, first match wins:
#  1. CUDA_HOME (or CUDA_PATH) from the environment, when its bin/nvcc reports the same
#     major.minor as torch.version.cuda. A different version is refused (set LSDP_CUDA_ANY=1 to
#     accept it): an extension compiled by another major CUDA than torch's does not load, and
#     within one major NVIDIA only promises minor-version compatibility forward.
#  2. NVIDIA's toolkit wheels through pip's configured index, installed with `pip install --target`
#     into ${LSDP_CACHE:-~/.cache/lightning-sparse-dp}/cuda-toolkit-VERSION, never into PYTHON's
#     environment:
#       * CUDA >= 13: the `cuda-toolkit` meta package at exactly the version torch's own metadata
#         pins (torch 2.13.0+cu130 pins cuda-toolkit==13.0.3), extras nvcc, crt, cccl, cudart,
#         cublas, cusparse, curand, cusolver, nvtx (ME includes curand.h and nvtx3/nvToolsExt.h, torch's CUDA headers cusolverDn.h). The wheels unpack to nvidia/cu13/{bin,include,lib,nvvm}.
#       * CUDA 12: refused with what to do. NVIDIA publishes no nvcc for CUDA 12 as a wheel
#         (nvidia-cuda-nvcc-cu12 holds ptxas only), so CUDA_HOME must name a CUDA 12 toolkit.
#     A wheel layout is not quite a CUDA_HOME: torch.utils.cpp_extension links with
#     -L CUDA_HOME/lib64 -lcudart and ME adds -lcusparse, while the wheels ship lib/ with versioned
#     names only (libcudart.so.13). The script adds lib64/ with unversioned links.
# A system nvcc of another version on PATH is not used (a machine may have, say, CUDA 13.0 in
# /usr/local/cuda without cuSPARSE headers, for instance).
set -euo pipefail

PY=${1:?usage: cuda_toolkit.sh PYTHON}
CACHE=${LSDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-sparse-dp}
log() { printf '[cuda_toolkit] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

read -r TORCH_CUDA TOOLKIT_PIN < <("$PY" - <<'PYEOF'
import importlib.metadata as m, re, torch
cuda = torch.version.cuda or "none"
pin = "none"  # torch's own metadata pins the toolkit it was built with (cuda-toolkit[...]==X, CUDA >= 13)
for req in m.requires("torch") or []:
    found = re.match(r"cuda-toolkit\[[^\]]*\]\s*==\s*([0-9.]+)", req)
    if found:
        pin = found.group(1)
print(cuda, pin)
PYEOF
) || die "could not read torch's CUDA version from $PY"
[ "$TORCH_CUDA" != none ] || die "the torch of $PY is a CPU build (torch.version.cuda is None): \
run bash scripts/setup.sh --cuda (a separate environment with torch's CUDA build)"
CUDA_MAJOR=${TORCH_CUDA%%.*}

nvcc_version() {  # prints major.minor of the nvcc given, or nothing
    "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -n1
}

# 1. a CUDA_HOME given by the user
GIVEN=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -n "$GIVEN" ]; then
    have=$(nvcc_version "$GIVEN/bin/nvcc")
    [ -n "$have" ] || die "CUDA_HOME=$GIVEN has no working bin/nvcc"
    if [ "$have" != "$TORCH_CUDA" ] && [ "${LSDP_CUDA_ANY:-0}" != 1 ]; then
        die "CUDA_HOME=$GIVEN has nvcc $have but torch was built with CUDA $TORCH_CUDA. Run without it to use \
NVIDIA's CUDA $TORCH_CUDA wheels: env -u CUDA_HOME -u CUDA_PATH bash scripts/setup.sh --cuda   (or point \
CUDA_HOME at a CUDA $TORCH_CUDA toolkit; LSDP_CUDA_ANY=1 tries anyway)"
    fi
    log "using CUDA_HOME=$GIVEN (nvcc $have, torch built with CUDA $TORCH_CUDA)"
    echo "$GIVEN"
    exit 0
fi

# 2. NVIDIA's wheels
if [ "$CUDA_MAJOR" -ge 13 ]; then
    [ "$TOOLKIT_PIN" != none ] || die "torch's metadata pins no cuda-toolkit version; set CUDA_HOME to a CUDA $TORCH_CUDA toolkit"
    VERSION=$TOOLKIT_PIN
    SPECS=("cuda-toolkit[nvcc,crt,cccl,cudart,cublas,cusparse,curand,cusolver,nvtx]==$TOOLKIT_PIN")
    SUBDIR=nvidia/cu$CUDA_MAJOR
elif [ "$CUDA_MAJOR" -eq 12 ]; then
    # NVIDIA publishes CUDA 12's compiler driver as no wheel: nvidia-cuda-nvcc-cu12 (and the
    # cuda-toolkit[nvcc] 12.x meta package, which installs it) holds ptxas, libnvvm and libdevice
    # only (checked: 12.8.93, 12.9.86). A CUDA 12 build needs a CUDA 12 toolkit of your own.
    die "torch was built with CUDA $TORCH_CUDA, and NVIDIA's CUDA 12 wheels have no nvcc (nvidia-cuda-nvcc-cu12 \
holds ptxas only). Point CUDA_HOME at a CUDA $TORCH_CUDA toolkit (a cluster's module load cuda/$TORCH_CUDA, NVIDIA's \
installer, conda-forge's cuda-nvcc) and run: CUDA_HOME=/path/to/cuda-$TORCH_CUDA bash scripts/setup.sh --cuda   \
(or use torch's CUDA 13 build, whose toolkit comes as wheels: the default torch==2.13.0)"
else
    die "torch was built with CUDA $TORCH_CUDA; NVIDIA's toolkit wheels serve CUDA 13 and later: set CUDA_HOME to a CUDA $TORCH_CUDA toolkit"
fi

TOOLKIT="$CACHE/cuda-toolkit-$VERSION"
HOME_DIR="$TOOLKIT/$SUBDIR"
if [ ! -f "$TOOLKIT/.complete" ]; then
    log "installing NVIDIA's CUDA $TORCH_CUDA toolkit wheels (${SPECS[*]}) into $TOOLKIT"
    rm -rf "$TOOLKIT"
    mkdir -p "$CACHE"
    # Through pip's configured index (a mirror a cluster reaches, say), at the version torch pins.
    # A constraints file meant for environments does not apply to this folder.
    PIP_CONSTRAINT= "$PY" -m pip install -q --disable-pip-version-check \
        --target "$TOOLKIT" "${SPECS[@]}" >&2 \
        || die "could not install ${SPECS[*]} through pip's configured index (or set CUDA_HOME to a CUDA $TORCH_CUDA toolkit)"
    [ -x "$HOME_DIR/bin/nvcc" ] || die "the wheels did not provide $HOME_DIR/bin/nvcc"
    # lib64/ with unversioned names, as torch.utils.cpp_extension and -lcusparse expect.
    mkdir -p "$HOME_DIR/lib64"
    for lib in "$HOME_DIR"/lib/*.so* "$HOME_DIR"/lib/*.a; do
        [ -e "$lib" ] || continue
        name=$(basename "$lib")
        ln -sf "$lib" "$HOME_DIR/lib64/$name"
        case "$name" in *.so.*) ln -sf "$lib" "$HOME_DIR/lib64/${name%%.so.*}.so" ;; esac
    done
    for need in include/cuda_runtime.h include/cusparse.h include/cublas_v2.h include/curand.h include/cusolverDn.h include/nvtx3/nvToolsExt.h lib64/libcudart.so lib64/libcusparse.so; do
        [ -e "$HOME_DIR/$need" ] || die "the toolkit in $HOME_DIR lacks $need"
    done
    [ -e "$HOME_DIR/include/cccl/thrust/version.h" ] || [ -e "$HOME_DIR/include/thrust/version.h" ] \
        || die "the toolkit in $HOME_DIR lacks thrust (CCCL)"
    touch "$TOOLKIT/.complete"
fi
have=$(nvcc_version "$HOME_DIR/bin/nvcc")
[ "$have" = "$TORCH_CUDA" ] || die "nvcc in $HOME_DIR reports ${have:-nothing}, torch was built with CUDA $TORCH_CUDA. \
Reinstall the toolkit wheels: rm -rf $TOOLKIT && bash scripts/setup.sh --cuda"
log "CUDA $have toolkit at $HOME_DIR"
echo "$HOME_DIR"
