"""MinkowskiEngine, imported once, with a clear error when it is missing, and what built it.

The project's build (``scripts/build_minkowski.sh``) patches ME 0.5.4 and leaves a marker in the installed
package, ``MinkowskiEngine/lsdp_build.json`` (recipe, patches): :func:`build_info` reads it, and
:func:`missing_patches` says which of the patches replicas need are not in the installed ME. A stock ME
(pip's, conda's, a cluster's module) has no marker: with it, CPU replicas give results that depend on
which samples share a chunk, and the strategies say so before the first step (:func:`unpatched_message`).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

try:
    import MinkowskiEngine as ME
except ImportError as err:  # pragma: no cover - exercised only on a machine without ME
    raise ImportError(
        f"lightning_sparse_dp needs MinkowskiEngine 0.5.4, which failed to import ({err}). Build this project's patched "
        f"ME into this interpreter from a lightning-sparse-dp checkout: `bash scripts/build_minkowski.sh {sys.executable}` "
        "(`build_minkowski.sh --cuda PYTHON` for ME's CUDA extension); on a fresh Debian machine "
        "`bash scripts/setup.sh` sets everything up."
    ) from err

#: the patches of scripts/minkowski_patches/ whose defects make CPU replicas (and CPU ranks) differ from one
#: device, by their number, with what goes wrong without them
CPU_PATCHES = {
    "01": "global pooling rows come out in the CPU origin map's order, not batch order (`.F` after global pooling "
          "pairs samples with the wrong rows)",
    "02": "GLOBAL_*_POOLING_DEFAULT raises for batches of more than one sample",
    "03": "SparseTensor.slice(TensorField) from a strided tensor puts features on the wrong points",
    "08": "MAX_POOL quantization pools a voxel whose values are all negative to 0",
    "09": "average quantization computes its weights in float32 under float64",
    "10": "global max pooling of a one-sample chunk sends its gradient to the wrong elements",
    "12": "global pooling of TensorField.sparse() reads the field's rows",
}
#: the patches the replicas need on GPUs, with what is lost without them
GPU_PATCHES = {
    "05": "ME layers cannot be pickled or deep-copied (AveragedModel / SWA, checkpoints of whole modules)",
    "13": "each replica builds its coordinate maps while holding the GIL, so replicas build them one at a time",
    "14": "global max pooling of a one-sample chunk sends its gradient to the wrong elements (CUDA)",
    "16": "a convolution or pooling of a chunk with no rows (its samples pruned away whole) crashes the process",
}


@functools.cache
def build_info() -> dict[str, Any] | None:
    """The installed ME's build marker (``lsdp_build.json``: ``recipe``, ``patches``, ``key``, ...), or ``None``
    for an ME this project's recipe did not build."""
    path = os.path.join(os.path.dirname(ME.__file__), "lsdp_build.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def missing_patches(wanted: dict[str, str]) -> dict[str, str]:
    """Of ``wanted`` (patch number -> the defect it fixes), those the installed ME was not built with."""
    info = build_info()
    have = {str(p)[:2] for p in (info or {}).get("patches", [])}
    return {number: defect for number, defect in wanted.items() if number not in have}


def unpatched_message(strategy: str, device_type: str, missing: dict[str, str]) -> str:
    """What a strategy says about an ME without the patches it needs on ``device_type``, and the command that
    builds the patched ME into the running interpreter's environment."""
    import sys

    defects = "; ".join(f"{n}: {d}" for n, d in sorted(missing.items()))
    cls = "SparseDataParallelStrategy" if strategy == "sparse_dp" else "SparseDDPStrategy"
    what = "stock MinkowskiEngine (no lightning-sparse-dp build marker)" if build_info() is None else (
        f"a MinkowskiEngine built without patch(es) {', '.join(sorted(missing))}"
    )
    build = "bash scripts/build_minkowski.sh " + ("--cuda " if device_type == "cuda" else "") + sys.executable
    if device_type == "cpu":
        return (
            f"{strategy}: this is {what}, whose CPU backend makes each replica's result depend on which samples share "
            f"its chunk, so CPU replicas would not give the one-device step ({defects}). Build the patched ME into this "
            f"environment with `{build}` (from the lightning-sparse-dp repository), or pass {cls}(allow_unpatched_me=True) "
            "to go on anyway."
        )
    return (
        f"{strategy}: this is {what}; on GPUs the replicas still train exactly, but {defects}. `{build}` builds the "
        "patched ME into this environment."
    )


def is_sparse_tensor(x: Any) -> bool:
    """Whether ``x`` is an ``ME.SparseTensor``."""
    return isinstance(x, ME.SparseTensor)


def is_tensor_field(x: Any) -> bool:
    """Whether ``x`` is an ``ME.TensorField``."""
    return isinstance(x, ME.TensorField)


def is_me_tensor(x: Any) -> bool:
    """An ``ME.SparseTensor`` or ``ME.TensorField``."""
    return isinstance(x, (ME.SparseTensor, ME.TensorField))


def check_coordinate_manager_mode(num_replicas: int) -> None:
    """Refuse ME's ``SHARE_COORDINATE_MANAGER`` mode for two or more replica threads of one process.

    In that mode (``ME.set_sparse_tensor_operation_mode``) every ``ME.SparseTensor`` of the process inserts into one
    global coordinate manager, so the replicas' threads would write it at once, each with its own chunk's batch
    indices: ME 0.5.4 ended the process ("Invalid origin_coordinate_map", coordinate_map_cpu.hpp, 3 CPU replicas).

    Raises:
        MisconfigurationException: the mode is on and ``num_replicas > 1``; names the fixes.
    """
    if num_replicas > 1 and ME.sparse_tensor_operation_mode() == ME.SparseTensorOperationMode.SHARE_COORDINATE_MANAGER:
        raise MisconfigurationException(
            "sparse_dp: MinkowskiEngine is in SHARE_COORDINATE_MANAGER mode (ME.set_sparse_tensor_operation_mode), where "
            "every SparseTensor of the process uses one global coordinate manager, which the replicas' threads would "
            "write at once (ME crashes the process). Use ME's default mode with sparse_dp: "
            "ME.set_sparse_tensor_operation_mode(ME.SparseTensorOperationMode.SEPARATE_COORDINATE_MANAGER), or "
            "strategy='sparse_ddp' (one process per device, each with its own global coordinate manager)."
        )


__all__ = [
    "CPU_PATCHES", "GPU_PATCHES", "ME", "build_info", "check_coordinate_manager_mode", "is_me_tensor", "is_sparse_tensor",
    "is_tensor_field", "missing_patches", "unpatched_message",
]
