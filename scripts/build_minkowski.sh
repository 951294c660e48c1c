#!/usr/bin/env bash
# Build MinkowskiEngine 0.5.4 from its source distribution for the torch in a given Python
# environment, cache the wheel outside the repository, and install it there.
#
# usage: scripts/build_minkowski.sh [--cuda | --cpu] PYTHON
#   PYTHON  the interpreter of the target environment (e.g. .venv/bin/python); it must have torch.
#   --cuda  build the CUDA extension (same as LSDP_CUDA=1): PYTHON's torch must be a CUDA build;
#           the CUDA toolkit matching torch's CUDA version comes from scripts/cuda_toolkit.sh
#           (NVIDIA's wheels, or CUDA_HOME); no GPU is needed to build. The GPU architectures are
#           TORCH_CUDA_ARCH_LIST (e.g. "8.0" or "8.0;9.0"), or those of the visible GPUs.
#   --cpu   build the CPU-only extension (same as LSDP_CUDA=0) even where a GPU is visible.
#   Neither: CUDA when PYTHON's torch is a CUDA build and sees a GPU, CPU otherwise.
#   OpenBLAS: found by scripts/find_blas.sh (LSDP_BLAS_INCLUDE / LSDP_BLAS_LIB, the active conda
#   environment, pkg-config, the system); PYTHON may be any interpreter (a venv's, conda's, a module's).
#   Offline (a machine that reaches no package registry, e.g. an HPC compute node; scripts/gpu_check.sh --bundle
#   sets these from scripts/gpu_bundle.sh's bundle): LSDP_ME_SDIST=FILE uses that ME 0.5.4 source distribution
#   instead of downloading one; LSDP_OFFLINE=1 also builds with PYTHON's own setuptools, wheel and ninja instead
#   of a pinned build environment (with --blas given ME's setup.py needs no numpy.distutils) and lets pip reach
#   no index. A BLAS library folder named by LSDP_BLAS_LIB is written into the extension's search path.
#   usage: scripts/build_minkowski.sh --fetch-sdist DIR PYTHON   only puts the ME sdist into DIR (for a bundle).
#   Environment: LSDP_CACHE (cache folder), MAX_JOBS (compile jobs), LSDP_KEEP_BUILD=1 (keep the
#   scratch folder with the patched sources and torch's build.ninja, e.g. to compile one file:
#   ninja -C <folder>/MinkowskiEngine-0.5.4/build/temp.linux-x86_64-cpython-311 <object>).
#
# What it does, and why (docs/minkowskiengine.md has the account):
#  * ME 0.5.4 is on the registry only as a source distribution. Its setup.py imports
#    numpy.distutils unless --blas is given, and pip runs setup.py without build options to read
#    metadata, so the sdist is fetched in a small build environment pinned to numpy 1.26.4 and
#    setuptools 69.5.1 that sees the target's torch (the extension must match that torch's ABI).
#  * The sources are patched for Python >= 3.10 (`from collections import Sequence` ->
#    `collections.abc`) and, for CUDA >= 12, the missing thrust includes are added.
#  * ME 0.5.4's defects that break batch-composition invariance on CPU, and others met on the way,
#    are fixed by the patches in scripts/minkowski_patches/ (each file says what it fixes, why, and
#    how it was found; see "fixing ME 0.5.4's defects" below).
#  * CUDA builds (see "CUDA build" below and docs/cuda.md):
#    scripts/me_cuda_patch.py patches ME's CUDA sources for CUDA 12/13 and current torch, the
#    toolkit is the one matching torch (scripts/cuda_toolkit.sh), and the cache key holds the CUDA
#    version and the GPU architectures compiled for.
#  * setup.py runs `pip uninstall MinkowskiEngine` and `rm -rf build`: it runs in a scratch copy
#    with the build environment's pip first on PATH.
#  * The wheel is cached under ${LSDP_CACHE:-~/.cache/lightning-sparse-dp} keyed by ME version,
#    Python, torch version and CPU/CUDA, and reused on the next run.
set -euo pipefail

WANT_CUDA=${LSDP_CUDA:-auto}
FETCH_TO=
case "${1:-}" in
    --cuda) WANT_CUDA=1; shift ;;
    --cpu) WANT_CUDA=0; shift ;;
    --fetch-sdist) FETCH_TO=${2:?usage: build_minkowski.sh --fetch-sdist DIR PYTHON}; WANT_CUDA=0; shift 2 ;;
esac
PY=${1:?usage: build_minkowski.sh [--cuda | --cpu] PYTHON}
OFFLINE=${LSDP_OFFLINE:-0}
SDIST=${LSDP_ME_SDIST:-}
[ "$OFFLINE" != 1 ] || export PIP_NO_INDEX=1
HERE=$(cd "$(dirname "$0")" && pwd)
# Bump when the CUDA part of the recipe (scripts/me_cuda_patch.py, CUDA flags) changes.
CUDA_RECIPE=1
ME_VERSION=0.5.4
# Bump when the recipe (patches, flags) changes, so cached wheels of an older recipe are not reused.
# 3: the defect fixes of scripts/minkowski_patches/ (the cache key also holds a hash of those files).
RECIPE=3
PATCHES=$(cd "$(dirname "$0")" && pwd)/minkowski_patches
CACHE=${LSDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning-sparse-dp}
log() { printf '[build_minkowski] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

"$PY" -c "import torch" 2>/dev/null || die "torch is not importable from $PY; install torch first"

read -r TORCH_VERSION_FULL TORCH_CUDA PYTAG SITE GPU_ARCHS < <("$PY" - <<'PYEOF'
import sys, sysconfig, torch
archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}) \
    if torch.version.cuda and torch.cuda.is_available() else []
print(torch.__version__, torch.version.cuda or "none",
      f"cp{sys.version_info.major}{sys.version_info.minor}", sysconfig.get_paths()["purelib"],
      ";".join(archs) or "none")
PYEOF
)
TORCH_VERSION=${TORCH_VERSION_FULL%%+*}
VARIANT=cpu
case "$WANT_CUDA" in
    1)
        [ "$TORCH_CUDA" != none ] || die "--cuda needs a CUDA build of torch in $PY (it has torch $TORCH_VERSION_FULL, \
CPU only). Run: bash scripts/setup.sh --cuda   (a separate environment with torch's CUDA build), or replace \
this torch: $PY -m pip install 'torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu'"
        VARIANT=cuda ;;
    auto)
        if [ "$GPU_ARCHS" != none ]; then
            VARIANT=cuda
        elif [ "$TORCH_CUDA" != none ]; then
            log "torch in $PY is a CUDA $TORCH_CUDA build but sees no GPU: building CPU-only (pass --cuda to build for CUDA without a GPU)"
        fi ;;
    0) ;;
    *) die "LSDP_CUDA=$WANT_CUDA: use 1 (CUDA), 0 (CPU) or auto" ;;
esac
if [ "$VARIANT" = cuda ]; then
    # CUDA build: the toolkit that matches torch's CUDA version, and the architectures to compile.
    ARCHS=${TORCH_CUDA_ARCH_LIST:-}
    if [ -z "$ARCHS" ]; then
        [ "$GPU_ARCHS" != none ] || die "no GPU is visible to pick the CUDA architectures from, and TORCH_CUDA_ARCH_LIST \
is not set. Run: TORCH_CUDA_ARCH_LIST=9.0 bash scripts/build_minkowski.sh --cuda $PY   (8.0 A100, 8.6 RTX 30xx, \
8.9 L4 / RTX 40xx, 9.0 H100, or several: \"8.0;9.0\")"
        ARCHS=$GPU_ARCHS
    fi
    export TORCH_CUDA_ARCH_LIST=$ARCHS
    CUDA_HOME=$(bash "$HERE/cuda_toolkit.sh" "$PY") || die "no CUDA $TORCH_CUDA toolkit (see above)"
    export CUDA_HOME
    arch_tag=$(printf '%s' "$ARCHS" | tr -d '.' | tr -c '0-9A-Za-z' '_')
    VARIANT="cu${TORCH_CUDA//./}-sm${arch_tag}-c${CUDA_RECIPE}"
    log "CUDA build: CUDA $TORCH_CUDA from $CUDA_HOME, TORCH_CUDA_ARCH_LIST=$ARCHS"
fi
PATCH_HASH=$(cat "$PATCHES"/*.patch | sha256sum | cut -c1-8)
KEY="me${ME_VERSION}-r${RECIPE}-p${PATCH_HASH}-torch${TORCH_VERSION}-${VARIANT}-${PYTAG}"
WHEEL_DIR="$CACHE/wheels/$KEY"
# The key of the installed build is kept next to the environment, so that an ME built by an older
# recipe (or another build) is replaced.
STAMP=$("$PY" -c "import sys; print(sys.prefix)")/.lsdp-minkowski-build
installed=$("$PY" - <<'PYEOF'
import importlib.metadata as m
try:
    print(m.version("MinkowskiEngine"))
except m.PackageNotFoundError:
    print("")
PYEOF
)
# The marker lightning_sparse_dp reads (lightning_sparse_dp/runtime/me.py: build_info): which recipe and patches
# built the installed MinkowskiEngine, written into its package folder at every install of this script's wheel.
write_marker() {
    "$PY" - "$KEY" "$RECIPE" "$PATCH_HASH" "$VARIANT" "$PATCHES"/*.patch <<'PYEOF' || die "could not write the build marker"
import json, os, sys
import MinkowskiEngine
key, recipe, patch_hash, variant, *patches = sys.argv[1:]
marker = {
    "builder": "lightning-sparse-dp scripts/build_minkowski.sh", "key": key, "recipe": int(recipe),
    "patch_hash": patch_hash, "variant": variant, "me_version": MinkowskiEngine.__version__,
    "patches": sorted(os.path.basename(p).split(".patch")[0] for p in patches),
}
with open(os.path.join(os.path.dirname(MinkowskiEngine.__file__), "lsdp_build.json"), "w") as f:
    json.dump(marker, f, indent=1)
PYEOF
}
# The pinned build environment: ME's setup.py imports numpy.distutils unless --blas is given, and pip runs
# setup.py without build options to read the sdist's metadata, so numpy 1.26.4 and setuptools 69.5.1; it sees
# the target's torch (the extension must match that torch's ABI) after its own pins.
build_env() {
    BUILD_ENV="$CACHE/build-env-$PYTAG"
    # A CUDA build's environment sees a CUDA torch: kept apart, so that a CPU build running at the
    # same time does not see it (the .pth below names one target).
    [ "$VARIANT" = cpu ] || BUILD_ENV="$CACHE/build-env-$PYTAG-cuda"
    if [ ! -x "$BUILD_ENV/bin/python" ]; then
        log "creating build environment $BUILD_ENV"
        BASE_PY=$("$PY" -c "import sys, os; print(os.path.join(sys.base_prefix, 'bin', 'python3'))")
        "$BASE_PY" -m venv "$BUILD_ENV"
        "$BUILD_ENV/bin/python" -m pip install -q --disable-pip-version-check \
            "numpy==1.26.4" "setuptools==69.5.1" "wheel<0.46" ninja \
            || die "could not install the build environment's tools (numpy 1.26.4, setuptools 69.5.1, wheel, ninja)"
    fi
    BSITE=$("$BUILD_ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$SITE" > "$BSITE/zz_lsdp_target_site.pth"
    "$BUILD_ENV/bin/python" -c "import torch, numpy; assert numpy.__version__ == '1.26.4'" \
        || die "the build environment cannot import the target's torch with numpy 1.26.4"
}
# The sdist through pip's configured index, into folder $1 (run with the build environment first on PATH).
fetch_sdist() {
    log "fetching the MinkowskiEngine $ME_VERSION source distribution"
    "$BUILD_ENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
        --no-binary :all: --no-build-isolation "MinkowskiEngine==$ME_VERSION" -d "$1" \
        || die "could not download the MinkowskiEngine $ME_VERSION sdist"
}
# LSDP_OFFLINE=1: PYTHON's own build tools, `python` and `pip` on PATH meaning PYTHON (ME's setup.py calls them),
# and no index for pip.
offline_tools() {
    [ -n "$SDIST" ] || die "LSDP_OFFLINE=1 needs LSDP_ME_SDIST=<path of MinkowskiEngine-$ME_VERSION.tar.gz> \
(bash scripts/gpu_bundle.sh DIR puts one in DIR/sdist where a registry is reachable)"
    local missing
    missing=$("$PY" -c "
import importlib.util as u
if u.find_spec('setuptools') is None:
    print('setuptools wheel')
elif u.find_spec('wheel') is None and u.find_spec('setuptools.command.bdist_wheel') is None:
    print('wheel')  # setuptools >= 70.1 has bdist_wheel itself
")
    [ -z "$missing" ] || die "LSDP_OFFLINE=1 builds with $PY's own build tools, and it lacks: $missing. Carry their \
wheels (bash scripts/gpu_bundle.sh DIR puts them in DIR/wheels) and install them: $PY -m pip install --no-index \
--find-links DIR/wheels $missing"
    "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('ninja') is None)" \
        || log "no ninja in $PY: the compile runs one file at a time (carry a ninja wheel for MAX_JOBS)"
    mkdir -p "$WORK/bin"
    # a wrapper, not a link: a venv's interpreter found through a link elsewhere loses its environment
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v "$PY")" > "$WORK/bin/python"
    chmod +x "$WORK/bin/python"
    # setup.py's `pip uninstall MinkowskiEngine -y` is skipped: the install below replaces it, and a failed build
    # leaves the environment's ME as it was
    printf '#!/bin/sh\n[ "$1" = uninstall ] && exit 0\nexec "%s" -m pip "$@"\n' "$(command -v "$PY")" > "$WORK/bin/pip"
    chmod +x "$WORK/bin/pip"
    export PATH="$WORK/bin:$("$PY" -c "import sys, os; print(os.path.dirname(sys.executable))"):$PATH" PIP_NO_INDEX=1
    log "offline build: $PY's own setuptools and wheel, the sdist $SDIST, no package index"
}
if [ -n "$FETCH_TO" ]; then
    mkdir -p "$FETCH_TO"
    build_env
    fetch_sdist "$FETCH_TO"
    exit 0
fi
if [ "$installed" = "$ME_VERSION" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] \
        && "$PY" -c "import MinkowskiEngine" >/dev/null 2>&1; then
    write_marker
    log "MinkowskiEngine $ME_VERSION ($KEY) already installed and importable"
    exit 0
fi
wheel=$(ls "$WHEEL_DIR"/[Mm]inkowski[Ee]ngine-*.whl 2>/dev/null | head -n1 || true)

if [ -z "$wheel" ]; then
    took="CPU-only takes about 5 to 8 minutes on 2 cores"
    [ "$VARIANT" = cpu ] || took="CUDA takes 20 to 40 minutes for one architecture on 2 cores, 2 to 3.5 with 16 jobs"
    log "no cached wheel for $KEY: building ($took)"
    case "$(uname -s)" in Linux) ;; *) die "only Linux builds are supported by this script";; esac
    # OpenBLAS from wherever the environment has it (scripts/find_blas.sh: named folders, conda, pkg-config,
    # the system): no sudo or apt needed when it is there
    blas=$(bash "$(dirname "$0")/find_blas.sh") || die "no OpenBLAS for the build (see the lines above)"
    read -r BLAS_INCLUDE BLAS_LIB <<< "$blas"
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/lsdp-me-build.XXXXXX")
    if [ "${LSDP_KEEP_BUILD:-0}" = 1 ]; then  # the patched sources and build.ninja (every compile command), for a look or one file
        trap 'log "build folder kept (LSDP_KEEP_BUILD=1): $WORK"' EXIT
    else
        trap 'rm -rf "$WORK"' EXIT
    fi
    if [ "$OFFLINE" = 1 ]; then
        offline_tools
    else
        build_env
        export PATH="$BUILD_ENV/bin:$PATH"
    fi
    mkdir -p "$WORK/sdist"
    if [ -n "$SDIST" ]; then
        log "using the MinkowskiEngine $ME_VERSION source distribution $SDIST"
        cp "$SDIST" "$WORK/sdist/MinkowskiEngine-$ME_VERSION.tar.gz"
    else
        fetch_sdist "$WORK/sdist"
    fi
    tar -xzf "$WORK"/sdist/MinkowskiEngine-"$ME_VERSION".tar.gz -C "$WORK"
    SRC="$WORK/MinkowskiEngine-$ME_VERSION"

    log "patching sources for Python >= 3.10 (Sequence lives in collections.abc)"
    python - "$SRC/MinkowskiEngine" <<'PYEOF' || die "the collections.abc patch did not apply"
import collections.abc, pathlib, re, sys
pattern = re.compile(r"^from collections import (.+)$", re.M)
def fix(match):
    names = [n.strip() for n in match.group(1).split(",")]
    abc = [n for n in names if hasattr(collections.abc, n)]
    rest = [n for n in names if n not in abc]
    lines = ([f"from collections import {', '.join(rest)}"] if rest else []) + \
            ([f"from collections.abc import {', '.join(abc)}"] if abc else [])
    return "\n".join(lines)
patched = 0
for path in pathlib.Path(sys.argv[1]).rglob("*.py"):
    text = path.read_text()
    new = pattern.sub(fix, text)
    if new != text:
        path.write_text(new)
        patched += 1
left = [str(p) for p in pathlib.Path(sys.argv[1]).rglob("*.py")
        if re.search(r"^from collections import .*\b(Sequence|Mapping|Iterable)\b", p.read_text(), re.M)]
if patched == 0 or left:
    sys.exit(f"patched {patched} files; still importing ABCs from collections: {left}")
print(f"patched {patched} files", file=sys.stderr)
PYEOF

    # Fixing ME 0.5.4's defects (CPU and common code; each patch file starts with its own account):
    #  01 CPU global pooling: origin-map rows (one per sample) in ascending batch index as on GPU,
    #     not hash order; the PYTORCH_INDEX modes (MinkowskiGlobalPooling's default) wrote sample
    #     b's reduction to the wrong row. Output row b is now sample b in every mode.
    #  02 CPU global pooling: GLOBAL_*_POOLING_DEFAULT raised for batches > 1; they now run as the
    #     KERNEL modes, as on GPU.
    #  03 TensorField.inverse_mapping (SparseTensor.slice from tensor stride > 1): stride_map's
    #     pairs were indexed as if sorted by stride-1 row; they are scattered into a map first.
    #  04 MinkowskiSyncBatchNorm.convert_sync_batchnorm put the old BatchNorm1d back into each
    #     converted layer; converted layers are no longer searched for children.
    #  05 pickle / copy.deepcopy / torch.save of ME layers lost their __slots__ state and failed on
    #     their autograd Function instances; MinkowskiModuleBase now carries both.
    #  06 MinkowskiEngine.utils.gradcheck imported torch._six (gone in torch 2); it now wraps
    #     torch.autograd.gradcheck (ME's own tests use it).
    #  07 MinkowskiToSparseTensor refused remove_zeros=False (its documented use with cached
    #     coordinates): the argument check now refuses only coordinates with remove_zeros=True.
    #  08 CPU MAX_POOL quantization started its running maximum at 0: all-negative voxels pooled
    #     to 0 and sent their gradient to element 0 of the batch; it now starts at -inf.
    #  09 CPU UNWEIGHTED_AVERAGE quantization made its 1/count weights in the default dtype
    #     (float32): float64 means were off by ~1e-8. The counts are cast to the features' dtype.
    #  10 CPU global max pooling of a one-sample batch returned row indices as its argmax where the
    #     backward reads flat indices: the gradient went to the wrong elements. Now flat indices.
    #  11 SparseTensor(..., quantization_mode=MAX_POOL) with duplicate coordinates left the
    #     features unpooled; it now pools like TensorField.sparse(), other modes raise.
    #  12 CPU global pooling of a TensorField.sparse() tensor at stride 1 (which shares the field's
    #     key) used the field's maps: out-of-bounds reads and writes. The maps now follow the input.
    #  13 Building a coordinate map (SparseTensor, TensorField.sparse()) hashed the coordinates with
    #     the GIL held: replica threads built their maps in turn. The hashing releases it now.
    #  14 CUDA global max pooling of a one-sample batch: patch 10's defect in global_pooling_gpu.cu.
    #  15 CPU origin maps (global pooling, decomposed_features) asserted more points than samples: a
    #     tensor whose samples have one point each failed. Equal counts are now accepted.
    #  16 A convolution, pooling or global pooling of an empty SparseTensor (a chunk pruned away whole)
    #     crashed: the kernel map of an empty map was a reference to a temporary, and the CPU origin
    #     map walked an empty hash table. The empty kernel map is cached; an empty origin map has no pairs.
    #  17 Global pooling / broadcasting of a tensor pruned of whole samples gave rows for the pruned samples
    #     (-DBL_MAX from max pooling, a crashing backward; "invalid kernel map" from average pooling): the manager's
    #     one origin map came from another coordinate map. The origin map now follows the input's samples.
    # Found with tests/project/test_me_invariance.py, tests/project/test_me_layers.py and ME's own tests
    # (scripts/run_me_upstream_tests.sh); docs/minkowskiengine.md has the account.
    for patch_file in "$PATCHES"/*.patch; do
        log "applying $(basename "$patch_file")"
        if command -v patch >/dev/null 2>&1; then
            patch -d "$SRC" -p1 --batch --forward --quiet < "$patch_file"
        else
            (cd "$SRC" && git apply -p1 "$patch_file")
        fi || die "$(basename "$patch_file") did not apply to the MinkowskiEngine $ME_VERSION sdist"
    done

    args=(--blas=openblas)
    [ -z "${BLAS_INCLUDE:-}" ] || args+=("--blas_include_dirs=$BLAS_INCLUDE")
    if [ -n "${BLAS_LIB:-}" ]; then
        args+=("--blas_library_dirs=$BLAS_LIB")
        # found at run time without LD_LIBRARY_PATH; DT_RPATH (not RUNPATH) also serves libopenblas's own
        # libraries (libgfortran) when they sit in the same folder, as in the GPU bundle
        export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$BLAS_LIB -Wl,--disable-new-dtags"
    fi
    if [ "$VARIANT" = cpu ]; then
        args+=(--cpu_only)
    else
        args+=(--force_cuda)
        # CUDA 12/13 and torch 2.x patches (thrust includes, CCCL 3 removals, NVTX clash, ...):
        # each is explained in scripts/me_cuda_patch.py and docs/cuda.md.
        log "CUDA build: patching ME's CUDA sources for CUDA $TORCH_CUDA (scripts/me_cuda_patch.py)"
        python "$HERE/me_cuda_patch.py" "$SRC" || die "scripts/me_cuda_patch.py did not apply"
    fi
    log "compiling ($VARIANT, ${MAX_JOBS:-$(nproc)} jobs); log in $CACHE/build-$KEY.log"
    mkdir -p "$CACHE"
    if ! (cd "$SRC" && MAX_JOBS=${MAX_JOBS:-$(nproc)} python setup.py bdist_wheel "${args[@]}" \
            > "$CACHE/build-$KEY.log" 2>&1); then
        tail -n 40 "$CACHE/build-$KEY.log" >&2
        die "MinkowskiEngine build failed (full log: $CACHE/build-$KEY.log)"
    fi
    mkdir -p "$WHEEL_DIR"
    cp "$SRC"/dist/[Mm]inkowski[Ee]ngine-*.whl "$WHEEL_DIR"/
    wheel=$(ls "$WHEEL_DIR"/[Mm]inkowski[Ee]ngine-*.whl | head -n1)
    log "cached $wheel"
fi

log "installing $(basename "$wheel")"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
"$PY" -m pip install -q --disable-pip-version-check "numpy" >/dev/null
"$PY" -c "import MinkowskiEngine as ME; print('MinkowskiEngine', ME.__version__, 'imports')" >&2 \
    || die "MinkowskiEngine was installed but does not import"
if [ "$VARIANT" != cpu ]; then
    "$PY" -c "import MinkowskiEngine as ME, torch; assert ME.is_cuda_available(); print('MinkowskiEngine CUDA build; GPUs visible:', torch.cuda.device_count())" >&2 \
        || die "MinkowskiEngine was built with --cuda but its backend says it has no CUDA support"
fi
write_marker
echo "$KEY" > "$STAMP"
