"""Replicate: one copy of the module per device for this step, MinkowskiEngine layers included.

On CUDA devices this is ``torch.nn.parallel.replicate`` (parameters broadcast with autograd, so
gradients flow back to the root's parameters). On CPU devices it builds the same kind of replica
without broadcasting: replicas share the root's ``Parameter`` objects, so every replica's
gradient accumulates into the root's ``.grad`` in the single backward pass.

Buffers follow ``torch.nn.DataParallel``: replica 0 (the root device) shares the root's buffers,
so its in-place updates (batch-norm running statistics) persist; the other replicas get copies.

``Module._replicate_for_data_parallel`` copies only ``__dict__``, but ME's convolution, channel-wise
convolution and pooling layers keep ``dimension``, ``kernel_generator``, ``conv``, ``use_mm``, ...
in ``__slots__`` (upstream MinkowskiEngine issues #264, #366, #618). :func:`copy_slots` carries
every ``__slots__`` attribute over to the replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(s for s in slots if s not in ("__dict__", "__weakref__") and s not in names)
    return names


def copy_slots(source: nn.Module, replica: nn.Module) -> None:
    """Copy every ``__slots__`` attribute of every submodule of ``source`` to the matching one of ``replica``.

    Both module trees must have the same structure (``replica`` made from ``source``); values are
    shared, not copied (ME's kernel generators and functions hold no per-call state).
    """
    for src, dst in zip(source.modules(), replica.modules(), strict=True):
        for name in _slot_names(type(src)):
            try:
                value = object.__getattribute__(src, name)
            except AttributeError:
                continue
            object.__setattr__(dst, name, value)


def _replicate_cpu(module: nn.Module, num_replicas: int) -> list[nn.Module]:
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    replicas: list[nn.Module] = []
    for r in range(num_replicas):
        copies = [m._replicate_for_data_parallel() for m in modules]
        for m, c in zip(modules, copies):
            # share the Parameter objects themselves: gradients accumulate in the root's .grad
            c._parameters = dict(m._parameters)
            if r > 0:
                c._buffers = {k: (None if b is None else b.detach().clone()) for k, b in m._buffers.items()}
            c._modules = {k: (None if child is None else copies[index[id(child)]]) for k, child in m._modules.items()}
        replicas.append(copies[0])
    return replicas


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Replicas of ``module`` for ``devices`` (all CPU or all CUDA, the root device first).

    Args:
        module: the root module, on ``devices[0]``.
        devices: one device per replica.

    Returns:
        ``len(devices)`` modules; replica ``i`` lives on ``devices[i]``.

    Raises:
        ValueError: no devices, or CPU and CUDA devices mixed.
    """
    if not devices:
        raise ValueError("replicate needs at least one device.")
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"replicate needs devices of one kind, got {sorted(kinds)}.")
    if kinds == {"cuda"}:
        replicas = nn.parallel.replicate(module, list(devices), detach=not torch.is_grad_enabled())
    else:
        replicas = _replicate_cpu(module, len(devices))
    for replica, device in zip(replicas, devices):
        copy_slots(module, replica)
        if hasattr(replica, "_device"):  # Lightning's DeviceDtypeModuleMixin: `self.device` in the replica
            replica._device = device
    return replicas


__all__ = ["copy_slots", "replicate"]
