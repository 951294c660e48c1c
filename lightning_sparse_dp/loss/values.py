"""The loss of a step's output, and whether a logged value is that loss: the one definition the backward,
log and weighting stages share (Lightning's rule: the output itself, or ``output["loss"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def loss_of(output: Any) -> Tensor | None:
    """The loss Lightning takes from a ``training_step`` output: the tensor itself, or ``output["loss"]``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def is_loss_value(value: Any, loss: Any) -> bool:
    """Whether a logged or stored ``value`` is ``loss`` itself or its ``.item()`` / ``float()`` (a Python float equal to
    the one-element loss tensor's value)."""
    if value is loss:
        return True
    return isinstance(value, float) and isinstance(loss, Tensor) and loss.numel() == 1 and value == float(loss.detach())


__all__ = ["is_loss_value", "loss_of"]
