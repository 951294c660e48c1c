"""Devices: the replicas' devices checked, and the CUDA device and stream that a replica's work runs under.

The GPU-only code, kept thin: on CPU devices these functions only check the devices or do nothing. :func:`check_devices`
(at setup, and when replicas are built) accepts devices of one kind, CPU or CUDA, that this machine has;
:func:`check_default_streams` (at setup) refuses a Trainer started inside ``torch.cuda.stream(s)``, as what other
threads run on a replica's GPU, and MinkowskiEngine's kernels, go to its default stream. :func:`device_context` makes a
replica's CUDA device (and a stream) current in the calling thread, around its chunk's placement and its step;
:func:`current_stream` reads the calling thread's stream, which the replica threads take over as
``torch.nn.parallel.parallel_apply`` hands each device's current stream on (a new thread starts on the default stream);
:func:`replica_contexts` decides both once for a call of the replicas (nothing to enter on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def check_devices(devices: Sequence[torch.device]) -> None:
    """Check that ``devices`` can hold replicas: one kind, CPU or CUDA, and present on this machine.

    Raises:
        MisconfigurationException: no devices, mixed kinds, a device type other than CPU/CUDA, or a
            CUDA index the machine does not have.
    """
    if not devices:
        raise MisconfigurationException("sparse_dp needs at least one device.")
    kinds = {d.type for d in devices}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise MisconfigurationException(
            f"sparse_dp runs on CPU or CUDA devices of one kind, got {list(devices)}. Use accelerator='cpu' or 'gpu'."
        )
    if kinds == {"cuda"}:
        available = torch.cuda.device_count()
        missing = [d for d in devices if (d.index or 0) >= available]
        if missing:
            raise MisconfigurationException(
                f"sparse_dp was given devices {[str(d) for d in devices]} but this machine has {available} CUDA "
                f"device(s), so {[str(d) for d in missing]} do not exist. Pass devices=<at most {available}>."
            )


def check_default_streams(devices: Sequence[torch.device]) -> None:
    """Refuse a non-default current CUDA stream on a replica's GPU (e.g. ``Trainer.fit`` run inside
    ``torch.cuda.stream(s)``).

    The replica threads take the caller's stream, but what other threads do on that GPU (the gather, the autograd
    worker's gradient reduction, the synchronized batch norm's exchange) runs on the GPU's default stream, and
    MinkowskiEngine 0.5.4 launches its kernels and copies there too: without a wait between the two streams they
    could read unfinished data.

    Raises:
        MisconfigurationException: a CUDA device of ``devices`` whose current stream is not its default one.
    """
    for d in dict.fromkeys(d for d in devices if d.type == "cuda"):
        current = torch.cuda.current_stream(d)
        if current != torch.cuda.default_stream(d):
            raise MisconfigurationException(
                f"sparse_dp runs each GPU's work on its default stream (MinkowskiEngine launches its kernels there), "
                f"but the current stream on {d} is {current}: the Trainer was started inside "
                "torch.cuda.stream(...). Start it outside the stream context."
            )


def device_context(device: torch.device, stream: Any = None):
    """``torch.cuda.device(device)`` (and ``torch.cuda.stream(stream)`` when given) for a CUDA device, else a no-op.

    Args:
        device: the replica's device.
        stream: a CUDA stream of ``device`` to make current as well, e.g. the caller's
            :func:`current_stream` handed to a worker thread (current streams are per thread).
    """
    if device.type != "cuda":
        return nullcontext()
    if stream is None:
        return torch.cuda.device(device)
    stack = ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def current_stream(device: torch.device) -> Any:
    """The calling thread's current CUDA stream on ``device`` (``None`` for a CPU device).

    ``torch.nn.parallel.parallel_apply`` takes each device's current stream in the calling thread
    and makes it current in the worker thread, since a new thread starts on the default stream:
    work queued by the caller on another stream (e.g. inside ``torch.cuda.stream(s)``) would
    otherwise not be ordered before the replica's kernels.
    """
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def replica_contexts(devices: Sequence[torch.device]) -> list[Callable[[], AbstractContextManager[Any]]]:
    """What each replica's thread enters around its work, ``contexts[i]()`` for ``devices[i]``, decided once for a call
    of the replicas in the calling thread: on a CUDA device, :func:`device_context` with the calling thread's current
    stream of that device (read here, in the calling thread, as ``torch.nn.parallel.parallel_apply`` hands each
    device's current stream on: :func:`current_stream`); on a CPU device, ``contextlib.nullcontext`` (nothing to
    enter). A context is made when called, so in the replica's own thread (CUDA's current device and stream are per
    thread)."""
    return [partial(device_context, d, current_stream(d)) if d.type == "cuda" else nullcontext for d in devices]


__all__ = ["check_default_streams", "check_devices", "current_stream", "device_context", "replica_contexts"]
