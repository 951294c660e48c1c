"""One device: plain Lightning's step on the module itself, with nothing split, replicated, weighted or threaded.

With one device (``devices=1``, CPU or GPU) a step needs none of the stages: :func:`one_device_batch` gives the
batch as plain Lightning's ``batch_to_device`` leaves it (tensors moved with Lightning's ``move_data_to_device``),
and the strategy runs the module's own step on it, so metrics, logging, hooks and the state the step leaves are
plain Lightning's. The replica path runs instead (one replica, the module itself) when an ``ME.SparseTensor`` /
``ME.TensorField`` of the batch is on another device (it has no ``.to()``: placing rebuilds it), when the batch
was split in the DataLoader (:class:`~lightning_sparse_dp.split.presplit.PreSplitBatch`), or when ``split_fn`` is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_sparse_dp.split.presplit import PreSplitBatch
from lightning_sparse_dp.step.scatter import Transfer, me_tensors_elsewhere


def whole_batch_on(batch: Any, device: torch.device, transfer: Transfer | None = None) -> Any | None:
    """The whole batch on ``device`` as plain Lightning's ``batch_to_device`` leaves it (``transfer``: the module's
    batch-transfer hooks, :func:`~lightning_sparse_dp.step.scatter.batch_transfer`; else tensors moved with Lightning's
    ``move_data_to_device``), for a step on one device; ``None`` when an ``ME.SparseTensor`` / ``ME.TensorField`` of
    the batch is elsewhere (it has no ``.to()``: the split-and-place path rebuilds it on the device)."""
    if me_tensors_elsewhere(batch, device):
        return None
    return move_data_to_device(batch, device) if transfer is None else transfer(batch, device)


def one_device_batch(
    batch: Any, devices: Sequence[torch.device] | None, split_fn: Callable[..., Any] | None,
    transfer: Transfer | None = None,
) -> Any | None:
    """The batch on the one device for the module's own step, or ``None`` when the step takes the replica path
    (more than one device, a ``split_fn``, a batch split in the DataLoader, an ME tensor elsewhere)."""
    if devices is None or len(devices) != 1 or split_fn is not None or isinstance(batch, PreSplitBatch):
        return None
    return whole_batch_on(batch, devices[0], transfer)


__all__ = ["one_device_batch", "whole_batch_on"]
