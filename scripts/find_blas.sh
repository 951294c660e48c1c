#!/usr/bin/env bash
# Find the OpenBLAS that MinkowskiEngine's build links against (cblas.h and libopenblas), wherever the
# environment has it, and print "INCLUDE_DIR LIBRARY_DIR" (either may be empty: the compiler's defaults).
#
# usage: scripts/find_blas.sh      exit 0 and one line when found; exit 1 and what to do when not
#
# Looked for, in order:
#   1. LSDP_BLAS_INCLUDE / LSDP_BLAS_LIB: folders you name (the one with cblas.h, the one with libopenblas.so);
#   2. the active conda environment: $CONDA_PREFIX/include/cblas.h (conda-forge's openblas / libcblas);
#   3. pkg-config's openblas (or cblas) module: RHEL-family openblas-devel, Spack, EasyBuild modules;
#   4. the system's include folders (LSDP_BLAS_SYSTEM_DIRS, default /usr/include and its subfolders):
#      Debian's libopenblas-dev.
set -uo pipefail
has_cblas() { [ -n "$1" ] && [ -f "$1/cblas.h" ]; }
say() { printf '%s %s\n' "$1" "$2"; exit 0; }

if [ -n "${LSDP_BLAS_INCLUDE:-}" ]; then
    has_cblas "$LSDP_BLAS_INCLUDE" || { echo "find_blas: LSDP_BLAS_INCLUDE=$LSDP_BLAS_INCLUDE has no cblas.h" >&2; exit 1; }
    say "$LSDP_BLAS_INCLUDE" "${LSDP_BLAS_LIB:-}"
fi
if [ -n "${CONDA_PREFIX:-}" ] && has_cblas "$CONDA_PREFIX/include"; then
    say "$CONDA_PREFIX/include" "$CONDA_PREFIX/lib"
fi
if command -v pkg-config >/dev/null 2>&1; then
    for module in openblas cblas; do
        pkg-config --exists "$module" 2>/dev/null || continue
        include=$(pkg-config --variable=includedir "$module")
        for dir in "$include" "$include/openblas" $(pkg-config --cflags-only-I "$module" | sed 's/-I//g'); do
            has_cblas "$dir" && say "$dir" "$(pkg-config --variable=libdir "$module")"
        done
    done
fi
for dir in ${LSDP_BLAS_SYSTEM_DIRS:-/usr/include /usr/include/*}; do
    has_cblas "$dir" && say "" ""
done
cat >&2 <<'MSG'
find_blas: no cblas.h (OpenBLAS) found for the MinkowskiEngine build. Install OpenBLAS where the build looks:
  conda:        conda install -c conda-forge openblas     (then run the build with the environment active)
  Debian/Ubuntu: apt-get install libopenblas-dev
  RHEL/Rocky:   dnf install openblas-devel
or name the folders: LSDP_BLAS_INCLUDE=<folder with cblas.h> LSDP_BLAS_LIB=<folder with libopenblas.so>
MSG
exit 1
