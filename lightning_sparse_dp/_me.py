"""MinkowskiEngine, imported once, with a clear error when it is missing."""

from __future__ import annotations

from typing import Any

try:
    import MinkowskiEngine as ME
except ImportError as err:  # pragma: no cover - exercised only on a machine without ME
    raise ImportError(
        "lightning_sparse_dp needs MinkowskiEngine 0.5.4, which failed to import "
        f"({err}). Build and install it with `bash scripts/setup.sh` (or "
        "`bash scripts/build_minkowski.sh .venv/bin/python`) from the lightning-sparse-dp repository."
    ) from err


def is_sparse_tensor(x: Any) -> bool:
    """Whether ``x`` is an ``ME.SparseTensor``."""
    return isinstance(x, ME.SparseTensor)


def is_tensor_field(x: Any) -> bool:
    """Whether ``x`` is an ``ME.TensorField``."""
    return isinstance(x, ME.TensorField)


__all__ = ["ME", "is_sparse_tensor", "is_tensor_field"]
