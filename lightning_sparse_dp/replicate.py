"""Replicate: one copy of the module per device for this step, MinkowskiEngine layers included.

On CUDA devices this is ``torch.nn.parallel.replicate`` (parameters broadcast with autograd, so
gradients flow back to the root's parameters). On CPU devices it builds the same kind of replica
without copying: with grad enabled, each replica's parameters are aliases made by one
:class:`BroadcastAlias` node, whose backward sums the replicas' gradients in replica order (as
torch's ``Broadcast`` / ``ReduceAddCoalesced`` do), so the sum does not depend on which replica's
backward ran first; with grad disabled, replicas use the root's parameters themselves.

As with ``nn.DataParallel``, a replica's parameters are plain attributes, not ``Parameter``
objects; the replica's top module answers ``parameters()`` / ``named_parameters()`` with them,
so a weight penalty computed in the step reaches the root's parameters.

Buffers follow ``torch.nn.DataParallel``: replica 0 (the root device) shares the root's buffers,
so its in-place updates (batch-norm running statistics) persist; the other replicas get copies.

``Module._replicate_for_data_parallel`` copies only ``__dict__``, but ME's convolution, channel-wise
convolution and pooling layers keep ``dimension``, ``kernel_generator``, ``conv``, ``use_mm``, ...
in ``__slots__`` (upstream MinkowskiEngine issues #264, #366, #618). :func:`copy_slots` carries
every ``__slots__`` attribute over to the replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


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


class BroadcastAlias(torch.autograd.Function):
    """``num_replicas`` aliases of each parameter; backward adds their gradients in replica order.

    ``apply(num_replicas, *params)`` returns ``num_replicas * len(params)`` tensors, replica-major.
    """

    @staticmethod
    def forward(ctx: Any, num_replicas: int, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.num_replicas, ctx.num_params = num_replicas, len(params)
        ctx.set_materialize_grads(False)
        return tuple(p.view_as(p) for _ in range(num_replicas) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        n = ctx.num_params
        sums: list[Tensor | None] = []
        for j in range(n):
            total = None
            for r in range(ctx.num_replicas):
                g = grads[r * n + j]
                if g is not None:
                    total = g if total is None else total + g
            sums.append(total)
        return (None, *sums)


def _replicate_cpu(module: nn.Module, num_replicas: int) -> list[nn.Module]:
    modules = list(module.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    trainable = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    aliases = BroadcastAlias.apply(num_replicas, *trainable) if trainable else ()
    replicas: list[nn.Module] = []
    for r in range(num_replicas):
        alias_of = {id(p): aliases[r * len(trainable) + j] for j, p in enumerate(trainable)}
        copies = [m._replicate_for_data_parallel() for m in modules]
        for m, c in zip(modules, copies):
            c._parameters = {}
            for key, param in m._parameters.items():
                if param is None or id(param) not in alias_of:
                    c._parameters[key] = param  # no gradient to route: share the root's Parameter
                else:
                    setattr(c, key, alias_of[id(param)])  # a plain attribute, as torch's replicate does
            if r > 0:
                c._buffers = {k: (None if b is None else b.detach().clone()) for k, b in m._buffers.items()}
            c._modules = {k: (None if child is None else copies[index[id(child)]]) for k, child in m._modules.items()}
        replicas.append(copies[0])
    return replicas


def _expose_parameters(module: nn.Module, replica: nn.Module) -> None:
    """Let ``replica.parameters()`` / ``named_parameters()`` yield the replica's copies of ``module``'s parameters."""
    copies = dict(replica.named_modules())
    named = []
    for name, _ in module.named_parameters():
        owner, _, attr = name.rpartition(".")
        named.append((name, getattr(copies[owner], attr)))

    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return iter([(prefix + ("." if prefix else "") + n, p) for n, p in named])

    def parameters(recurse: bool = True):
        return iter([p for _, p in named])

    replica.named_parameters = named_parameters
    replica.parameters = parameters


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
        _expose_parameters(module, replica)
        if hasattr(replica, "_device"):  # Lightning's DeviceDtypeModuleMixin: `self.device` in the replica
            replica._device = device
    return replicas


__all__ = ["BroadcastAlias", "copy_slots", "replicate"]
