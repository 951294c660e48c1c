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
#  2. NVIDIA's toolkit wheels from the package registry, installed with `pip install --target`
#     into ${LSDP_CACHE:-~/.cache/lightning-sparse-dp}/cuda-toolkit-VERSION, never into PYTHON's
#     environment:
#       * CUDA >= 13: the `cuda-toolkit` meta package at exactly the version torch's own metadata
#         pins (torch 2.13.0+cu130 pins cuda-toolkit==13.0.3), extras nvcc, crt, cccl, cudart,
#         cublas, cusparse, curand, cusolver, nvtx (ME includes curand.h and nvtx3/nvToolsExt.h, torch's CUDA headers cusolverDn.h). The wheels unpack to nvidia/cu13/{bin,include,lib,nvvm}.
#       * CUDA 12: the per-component wheels nvidia-cuda-{nvcc,cccl}-cu12 at torch's CUDA minor
#         (12.8.*), nvidia-cuda-runtime-cu12 and nvidia-{cublas,cusparse,curand,cusolver,nvtx}-cu12
#         at the versions torch's metadata pins; their folders are merged into one CUDA_HOME.
#     A wheel layout is not quite a CUDA_HOME: torch.utils.cpp_extension links with
#     -L CUDA_HOME/lib64 -lcudart and ME adds -lcusparse, while the wheels ship lib/ with versioned
#     names only (libcudart.so.13). The script adds lib64/ with unversioned links.
# A system nvcc of another version on PATH is not used (this machine has CUDA 13.0 in
# /usr/local/cuda without cuSPARSE headers, for instance).
set -euo pipefail

PY=${1:?usage: cuda_toolkit.sh PYTHON}
CACHE=${LSDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-sparse-dp}
log() { printf '[cuda_toolkit] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

read -r TORCH_CUDA TOOLKIT_PIN CU12_PINS < <("$PY" - <<'PYEOF'
import importlib.metadata as m, re, torch
cuda = torch.version.cuda or "none"
# torch's own metadata pins the CUDA wheels it was built against (whether installed or not):
# cuda-toolkit[...]==X for CUDA >= 13, nvidia-*-cu12==X per component for CUDA 12.
pin, cu12 = "none", []
for req in m.requires("torch") or []:
    found = re.match(r"cuda-toolkit\[[^\]]*\]\s*==\s*([0-9.]+)", req)
    if found:
        pin = found.group(1)
    found = re.match(r"(nvidia-[a-z-]+-cu12)\s*==\s*([0-9.]+)", req)
    if found:
        cu12.append(f"{found.group(1)}=={found.group(2)}")
print(cuda, pin, ",".join(cu12) or "none")
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
    # the components torch pins at their pinned versions, the compiler and CCCL at torch's minor
    pinned() {  # the spec torch pins for the wheel named $1, else the name alone
        local spec
        for spec in ${CU12_PINS//,/ }; do [ "${spec%%==*}" = "$1" ] && { echo "$spec"; return; }; done
        echo "$1"
    }
    minor="${TORCH_CUDA}.*"
    SPECS=("nvidia-cuda-nvcc-cu12==$minor" "nvidia-cuda-cccl-cu12==$minor")
    for name in nvidia-cuda-runtime-cu12 nvidia-cublas-cu12 nvidia-cusparse-cu12 nvidia-curand-cu12 \
            nvidia-cusolver-cu12 nvidia-nvtx-cu12; do
        SPECS+=("$(pinned "$name")")
    done
    runtime=$(pinned nvidia-cuda-runtime-cu12)
    case "$runtime" in *==*) VERSION=${runtime#*==} ;; *) VERSION=$TORCH_CUDA ;; esac
    SUBDIR=nvidia/cuda_nvcc  # CUDA 12 wheels unpack one folder per component; merged below
else
    die "torch was built with CUDA $TORCH_CUDA; this script handles CUDA 12 and 13 (set CUDA_HOME to a $TORCH_CUDA toolkit)"
fi

TOOLKIT="$CACHE/cuda-toolkit-$VERSION"
HOME_DIR="$TOOLKIT/$SUBDIR"
[ "$CUDA_MAJOR" -eq 12 ] && HOME_DIR="$TOOLKIT/cuda_home"
if [ ! -f "$TOOLKIT/.complete" ]; then
    log "installing NVIDIA's CUDA $TORCH_CUDA toolkit wheels (${SPECS[*]}) into $TOOLKIT"
    rm -rf "$TOOLKIT"
    mkdir -p "$CACHE"
    # Through pip's configured index (a mirror a cluster reaches, say), at the versions torch pins
    # (nvcc and CCCL at torch's CUDA minor). A constraints file meant for environments does not
    # apply to this folder.
    PIP_CONSTRAINT= "$PY" -m pip install -q --disable-pip-version-check \
        --target "$TOOLKIT" "${SPECS[@]}" >&2 \
        || die "could not install ${SPECS[*]} through pip's configured index (or set CUDA_HOME to a CUDA $TORCH_CUDA toolkit)"
    if [ "$CUDA_MAJOR" -eq 12 ]; then
        # One CUDA_HOME out of the per-component folders: bin and nvvm from nvcc, include and lib
        # merged by links.
        mkdir -p "$HOME_DIR/include" "$HOME_DIR/lib"
        ln -s "$TOOLKIT/nvidia/cuda_nvcc/bin" "$HOME_DIR/bin"
        ln -s "$TOOLKIT/nvidia/cuda_nvcc/nvvm" "$HOME_DIR/nvvm"
        for part in "$TOOLKIT"/nvidia/*/; do
            [ -d "$part/include" ] && cp -rs "$part/include/." "$HOME_DIR/include/"
            [ -d "$part/lib" ] && cp -rs "$part/lib/." "$HOME_DIR/lib/"
        done
    fi
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
