#!/usr/bin/env bash
# Run MinkowskiEngine's own unit tests (tests/python of the v0.5.4 tag) against the ME installed in
# a Python environment, on CPU, and print pytest's summary.
#
# usage: scripts/run_me_upstream_tests.sh [PYTHON] [-- PYTEST_ARGS...]
#   PYTHON  the interpreter whose MinkowskiEngine is tested (default .venv/bin/python)
#
# The 0.5.4 sdist ships no tests, so the tests are taken from upstream's repository at the tag,
# at run time, into a temporary directory; nothing is kept or committed. Environment:
#   ME_UPSTREAM_REPO  where to clone from (default https://github.com/NVIDIA/MinkowskiEngine.git;
#                     a local clone or mirror works too, e.g. on a machine without GitHub access)
#   ME_UPSTREAM_TAG   the tag (default v0.5.4)
#   KEEP=1            keep the temporary directory and print its path
#
# What runs: every tests/python/*.py module that defines tests (pytest collects the unittest
# classes), from a scratch directory so the installed ME is imported, not the clone's sources.
# The clone's `tests` and `examples` packages are importable (the tests import tests.python.common
# and examples.common). tests/python/common.py downloads a 1.ply room scan at import; an empty
# placeholder is written instead so that the modules import without network: the cases that read
# the scan (they also need open3d) are reported as skipped, like the cases that need CUDA (a small
# conftest.py written next to them classifies failures by their error message). Cases written for
# CUDA that return early on a machine without it count as passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ $# -gt 0 ] && [ "$1" != "--" ]; then PY=$1; shift; fi
[ "${1:-}" = "--" ] && shift
REPO=${ME_UPSTREAM_REPO:-https://github.com/NVIDIA/MinkowskiEngine.git}
TAG=${ME_UPSTREAM_TAG:-v0.5.4}
log() { printf '[run_me_upstream_tests] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
"$PY" -c "import MinkowskiEngine, pytest" 2>/dev/null \
    || die "$PY cannot import MinkowskiEngine and pytest (run scripts/setup.sh first)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/me-upstream-tests.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then log "keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
log "cloning $REPO at $TAG"
git clone -q --depth 1 --branch "$TAG" "$REPO" "$WORK/src" 2>/dev/null \
    || git -c advice.detachedHead=false clone -q --branch "$TAG" "$REPO" "$WORK/src" \
    || die "could not clone $REPO at $TAG (set ME_UPSTREAM_REPO to a reachable clone)"

# Only what the tests import: the tests and examples packages, not the clone's MinkowskiEngine.
mkdir -p "$WORK/run"
cp -r "$WORK/src/tests" "$WORK/src/examples" "$WORK/run/"
touch "$WORK/run/examples/__init__.py" "$WORK/run/tests/__init__.py"
: > "$WORK/run/1.ply"
# Cases that fail only for want of CUDA, or of open3d and the scan, are reported as skipped with
# the reason (by their error message), so that failed means failed on CPU.
cat > "$WORK/run/conftest.py" <<'PYEOF'
import pytest

NEEDS = [
    ("needs CUDA", ("Torch not compiled with CUDA", "Cannot access accelerator device",
                    "CoordinateMapManagerGPU", "torch.cuda.")),
    ("needs open3d and upstream's 1.ply scan (downloaded)", ("open3d",)),
]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or call.excinfo is None:
        return
    text = f"{call.excinfo.typename}: {call.excinfo.value}"
    for reason, markers in NEEDS:
        if any(m in text for m in markers):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
            return
PYEOF

mapfile -t modules < <(cd "$WORK/run" && grep -l "def test" tests/python/*.py | sort)
log "running ${#modules[@]} modules with $("$PY" -c 'import MinkowskiEngine as ME, os; print(ME.__version__, "from", os.path.dirname(ME.__file__))')"
cd "$WORK/run"
# -p no:cacheprovider: nothing written next to the tests; rootdir here so the installed ME is used
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m pytest -q -p no:cacheprovider --rootdir "$WORK/run" \
    -o python_files='*.py' -o addopts='' -o testpaths='' -W ignore::DeprecationWarning -W ignore::UserWarning \
    --timeout 600 --continue-on-collection-errors -rfEs "${modules[@]}" "$@"
