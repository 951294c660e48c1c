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


def patch_prefetch_async(root: pathlib.Path) -> int:
    """Call ``cudaMemPrefetchAsync`` through a helper that speaks both signatures.

    CUDA 13 changed ``cudaMemPrefetchAsync(ptr, count, int device, stream)`` to
    ``cudaMemPrefetchAsync(ptr, count, cudaMemLocation location, unsigned flags, stream)``
    (error: ``no suitable constructor exists to convert from "int" to "cudaMemLocation"`` in
    src/3rdparty/concurrent_unordered_map.cuh). The helper passes a device location with flags 0,
    which is what the old call meant, and calls the old signature before CUDA 13.
    """
    path = root / "src" / "3rdparty" / "concurrent_unordered_map.cuh"
    text = path.read_text()
    calls = text.count("cudaMemPrefetchAsync(")
    if not calls or "lsdp_mem_prefetch_async" in text:
        return 0
    helper = (
        "\n// lightning-sparse-dp (scripts/me_cuda_patch.py): CUDA 13 takes a cudaMemLocation and flags.\n"
        "static inline cudaError_t lsdp_mem_prefetch_async(const void* ptr, size_t count, int device,\n"
        "                                                  cudaStream_t stream) {\n"
        "#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000\n"
        "  cudaMemLocation location{};\n"
        "  location.type = cudaMemLocationTypeDevice;\n"
        "  location.id = device;\n"
        "  return cudaMemPrefetchAsync(ptr, count, location, 0, stream);\n"
        "#else\n"
        "  return cudaMemPrefetchAsync(ptr, count, device, stream);\n"
        "#endif\n"
        "}\n"
    )
    anchor = "#include <cudf/detail/nvtx/ranges.hpp>\n"
    if anchor not in text:
        return 0
    text = text.replace("cudaMemPrefetchAsync(", "lsdp_mem_prefetch_async(")
    path.write_text(text.replace(anchor, anchor + helper, 1))
    return calls


def patch_shared_from_unique(root: pathlib.Path) -> int:
    """Hand the hash map's ``unique_ptr`` to the ``shared_ptr`` with ``reset(release(), deleter)``.

    ``m_map = map_type::create(...)`` assigns a ``unique_ptr`` to a ``shared_ptr``; libstdc++ 12 then
    calls ``__to_address`` unqualified, and in C++20 with CCCL 3 argument-dependent lookup finds
    ``cuda::std::__to_address`` as well as ``std::__to_address`` (the map's allocator is templated on
    ``cuda::std::pair``): ``more than one instance of overloaded function "std::__to_address"``
    (src/coordinate_map_gpu.cuh, CoordinateMapGPU::reserve). ``reset(pointer, deleter)`` makes the
    same shared_ptr, with the same deleter, through a constructor that does not call it.
    """
    path = root / "src" / "coordinate_map_gpu.cuh"
    text = path.read_text()
    old = (
        "      m_map = map_type::create(\n"
        "          compute_hash_table_size(size, m_hashtable_occupancy),\n"
        "          m_unused_element, m_unused_key, m_hasher, m_equal, m_map_allocator);\n"
    )
    new = (
        "      {\n"
        "        auto created = map_type::create(\n"
        "            compute_hash_table_size(size, m_hashtable_occupancy),\n"
        "            m_unused_element, m_unused_key, m_hasher, m_equal, m_map_allocator);\n"
        "        auto deleter = created.get_deleter();\n"
        "        m_map.reset(created.release(), std::move(deleter));\n"
        "      }\n"
    )
    if old not in text:
        return 0
    path.write_text(text.replace(old, new, 1))
    return 1


def patch_cccl_include_dir(root: pathlib.Path) -> int:
    """Add CUDA_HOME/include/cccl to the include path of every compiler, g++ included.

    CUDA 13 (toolkit and NVIDIA's wheels alike) moved thrust / CUB / libcu++ to include/cccl/, which
    nvcc searches by itself but g++ does not; ME's C++ files of the CUDA build include thrust
    through src/utils.hpp (``fatal error: thrust/host_vector.h: No such file or directory`` in
    src/direct_max_pool.cpp). The folder is added only where it exists, so older toolkits are
    unaffected.
    """
    path = root / "setup.py"
    text = path.read_text()
    old = '    libraries.append("cusparse")\n'
    new = old + (
        "    # lightning-sparse-dp (scripts/me_cuda_patch.py): CUDA 13 keeps thrust in include/cccl\n"
        "    from torch.utils.cpp_extension import CUDA_HOME as _LSDP_CUDA_HOME\n"
        "    if _LSDP_CUDA_HOME and os.path.isdir(os.path.join(_LSDP_CUDA_HOME, 'include', 'cccl')):\n"
        "        include_dirs.append(os.path.join(_LSDP_CUDA_HOME, 'include', 'cccl'))\n"
    )
    if old not in text or "_LSDP_CUDA_HOME" in text:
        return 0
    path.write_text(text.replace(old, new, 1))
    return 1


PATCHES = [patch_setup_flags, patch_thrust_includes, patch_unary_function, patch_cuda_utils_include,
           patch_prefetch_async, patch_shared_from_unique, patch_cccl_include_dir]


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
