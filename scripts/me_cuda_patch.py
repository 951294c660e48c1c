"""Patch MinkowskiEngine 0.5.4's unpacked source distribution so that its CUDA extension compiles
with CUDA 12 and 13 (CCCL 2.x / 3.x thrust and CUB) and the current torch C++ API.

usage: python scripts/me_cuda_patch.py SRC
    SRC  the unpacked sdist (the folder holding setup.py and src/).

Run by scripts/build_minkowski.sh for a CUDA build, after the Python-side patches. Each patch
below says what breaks without it (the compiler's message) and why the change keeps ME's
behaviour. Every patch must apply: a patch that finds nothing to change stops the build, so a
different sdist is noticed instead of silently half-patched. Older CUDA (11.x) keeps compiling:
the added includes exist there too and the removed base classes only supplied typedefs ME never
uses.

Exit status 0 when every patch applied; 1 with the names of those that did not.
"""

from __future__ import annotations

import pathlib
import re
import sys

# Headers that CUDA <= 11's thrust pulled in transitively and CUDA >= 12's CCCL no longer does
# (errors: "namespace thrust has no member device", "... has no member sort_by_key", ...;
# upstream MinkowskiEngine issues #543, #594, #601, #638).
THRUST_HEADERS = (
    "thrust/execution_policy.h",
    "thrust/unique.h",
    "thrust/remove.h",
    "thrust/sort.h",
    "thrust/reduce.h",
    "thrust/functional.h",
)


def patch_setup_flags(root: pathlib.Path) -> int:
    """Add -DCCCL_DISABLE_NVTX to ME's nvcc flags.

    CCCL >= 2.x includes NVTX's own C++ wrapper <nvtx3/nvtx3.hpp> from cub/detail/nvtx.cuh when the
    toolkit has NVTX headers; ME bundles cuDF's older copy of the same wrapper
    (src/3rdparty/cudf/detail/nvtx/nvtx3.hpp), and the two definitions of namespace nvtx3 clash
    ("nvtx3::domain is ambiguous"). CCCL_DISABLE_NVTX (documented in cub/detail/nvtx.cuh) only turns
    off CUB's profiler ranges; ME's own ranges stay.
    """
    path = root / "setup.py"
    text = path.read_text()
    old = 'NVCC_FLAGS += ["--expt-relaxed-constexpr", "--expt-extended-lambda"]'
    if old not in text:
        return 0
    path.write_text(
        text.replace(old, old[:-1] + ', "-DCCCL_DISABLE_NVTX"]', 1)
    )
    return 1


def patch_thrust_includes(root: pathlib.Path) -> int:
    """Include the thrust headers ME uses in every CUDA source and CUDA header of src/."""
    src = root / "src"
    block = "".join(f"#include <{h}>\n" for h in THRUST_HEADERS)
    count = 0
    for path in sorted([*src.glob("*.cu"), *src.glob("*.cuh"),
                        src / "3rdparty" / "concurrent_unordered_map.cuh"]):
        text = path.read_text()
        if text.startswith(block):
            continue
        path.write_text(block + text)
        count += 1
    return count


def patch_unary_function(root: pathlib.Path) -> int:
    """Drop `: public thrust::unary_function<A, R>` base classes.

    thrust::unary_function / binary_function were deprecated in CCCL 2 and removed in CCCL 3
    (CUDA 13): "namespace thrust has no member class unary_function". They only declared
    argument_type / result_type typedefs, which ME's functors do not use (their call operators
    declare their own return types), so removing the base changes nothing else.
    """
    pattern = re.compile(
        r"\s*:\s*public\s+thrust::(?:unary|binary)_function<(?:[^<>]|<(?:[^<>]|<[^<>]*>)*>)*>\s*\{",
        re.S,
    )
    count = 0
    for path in sorted((root / "src").rglob("*.cu*")):
        text = path.read_text()
        new, n = pattern.subn(" {", text)
        if n:
            path.write_text(new)
            count += n
    return count


def patch_cuda_utils_include(root: pathlib.Path) -> int:
    """Include ``<ATen/core/Tensor.h>`` before ``<ATen/cuda/CUDAUtils.h>``.

    torch 2.x's ATen/cuda/CUDAUtils.h uses ``at::Tensor`` (``check_device``) but no longer includes
    its definition; where nothing before it did (src/spmm.cu, src/spmm.cuh) nvcc stops with
    ``incomplete type "at::Tensor" is not allowed``. Including the definition first is what the
    header's other users get by accident.
    """
    old = "#include <ATen/cuda/CUDAUtils.h>"
    new = "#include <ATen/core/Tensor.h>\n" + old
    count = 0
    for path in sorted([*(root / "src").glob("*.cu"), *(root / "src").glob("*.cuh")]):
        text = path.read_text()
        if old in text and new not in text:
            path.write_text(text.replace(old, new))
            count += 1
    return count


PATCHES = [patch_setup_flags, patch_thrust_includes, patch_unary_function, patch_cuda_utils_include]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(argv[1])
    if not (root / "setup.py").is_file() or not (root / "src").is_dir():
        print(f"{root} is not an unpacked MinkowskiEngine sdist (no setup.py and src/)", file=sys.stderr)
        return 2
    failed = []
    for patch in PATCHES:
        changed = patch(root)
        print(f"[me_cuda_patch] {patch.__name__}: {changed} change(s)", file=sys.stderr)
        if not changed:
            failed.append(patch.__name__)
    if failed:
        print(f"[me_cuda_patch] ERROR: patches that changed nothing: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
