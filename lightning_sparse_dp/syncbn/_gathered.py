"""Gathered batch norm: a small synchronized layer of CPU replicas computed once, on the replicas' input together.

On a small layer (digits: about 1,000 points x 32 channels a replica) the per-rank path of
:mod:`lightning_sparse_dp.syncbn._functions` costs Python, not arithmetic: the statistics' exchange and
combination and the per-channel factors cost more than torch's whole ``BatchNorm1d``
(``benchmarks/syncbn_layer.py --points 1000 --channels 32``; docs/benchmarks.md, "Costs of the step's parts"),
and the replica threads take that Python in turn under the GIL. So when the replicas are threads of one process on the CPU
(:meth:`~lightning_sparse_dp.syncbn.collective.ThreadGroup.all_gather_apply`) and their inputs hold at most
:data:`GATHER_MAX_BYTES` bytes together, the rank that completes the layer's rendezvous does the layer
for all of them:

Forward. It concatenates the ranks' inputs ``[N_r, C, *]`` in rank order (the batch's order: chunks are
whole samples in batch order) and runs torch's native training-mode batch norm on the concatenation
(``torch.native_batch_norm(..., training=True)``, the kernel ``torch.nn.functional.batch_norm`` runs on one
device), which also updates the root replica's running statistics as the kernel does on one device; each
rank gets a copy of its own rows of the output (``torch.split_with_sizes_copy``: not views of a shared
tensor, so a rank's in-place ops, e.g. ``ME.MinkowskiReLU(inplace=True)``, touch its rows only).

Backward. The rank completing the backward rendezvous concatenates the ranks' output gradients and runs
torch's native batch-norm backward on them (``native_batch_norm_backward(..., train=True)`` with the
forward's saved mean and inverse standard deviation); each rank gets its rows of the input gradient, rank
0 the whole weight and bias gradients and the other ranks zeros, so the replicas' gradients, added in
replica order, are the one-device gradients.

The layer is then the one-device computation: the same kernels on the same values in the same order, bit
for bit where the kernels split their sums alike (the same number of intra-op threads, or a layer small
enough for one). Which replica completes the rendezvous changes nothing: every replica thread runs with the
same intra-op thread count (:mod:`lightning_sparse_dp.runtime.threads`), so runs repeat as the per-rank path's do. In
float32 the precision is then torch's own: input whose mean is thousands of times its deviation loses digits
here as on one device (the per-rank path centers such input first). At the cost
of a copy of the layer's input and output gradient (at most :data:`GATHER_MAX_BYTES` bytes each) and of
running the layer's arithmetic in one thread while the other replicas wait, which on a small layer is less
than the Python it saves. Larger layers, replicas on accelerators and process groups take the per-rank path; on CPU
replica threads a
layer's ranks bring their statistics to the same rendezvous when each expects the layer to be too large (its
own input times the ranks), so the per-rank path takes one rendezvous in forward there too, and a second only
when a rank's guess was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

#: Most bytes of input (``N x C x *`` values in the compute dtype, all replicas together) of a layer computed
#: gathered; above it each replica computes its own part (the per-rank path). 1 MiB: 262,144 float32 or 131,072
#: float64 values. Chosen as the crossover of the two paths in three replica threads
#: (``benchmarks/syncbn_layer.py --threads 3``; the figures: docs/benchmarks.md, "Costs of the step's parts").
GATHER_MAX_BYTES = 1 << 20


class Offer(NamedTuple):
    """What a rank hands the layer's forward rendezvous: its input (compute dtype); from the rank whose layer
    updates them, the running statistics and the update factor (``None`` from the others); and, when the rank
    expects the layer to be too large to gather (its own input times the ranks over :data:`GATHER_MAX_BYTES`),
    its per-rank statistics ``[3, C]`` float64 (count, mean, M2), so that the per-rank path needs no second
    rendezvous (``None`` otherwise)."""

    input: Tensor
    weight: Tensor | None
    bias: Tensor | None
    running: tuple[Tensor | None, Tensor | None, float] | None
    eps: float
    stats: Tensor | None = None


class Gathered(NamedTuple):
    """What a gathered layer's backward needs, shared by its ranks (each rank's ``ctx`` keeps it; not the outputs,
    whose autograd nodes hold the ``ctx``: that would make a reference cycle through autograd's C++ nodes)."""

    input: Tensor  # the ranks' inputs concatenated [sum N_r, C, *], compute dtype
    weight: Tensor | None
    save_mean: Tensor
    save_invstd: Tensor
    sizes: list[int]
    eps: float
    has_bias: bool


def forward_all(offers: Sequence[Offer], dtype: torch.dtype) -> tuple[list[Tensor], Gathered] | None:
    """Batch norm of every rank's input together, or ``None`` when the layer is too large to gather.

    Args:
        offers: one :class:`Offer` per rank, rank order; the inputs in the compute dtype, on the CPU.
        dtype: the dtype of the outputs (the inputs' own dtype before the cast to the compute dtype).

    Returns:
        ``(outputs, gathered)``: each rank's output rows (rank order) and the :class:`Gathered` state; ``None`` when
        the inputs hold more than :data:`GATHER_MAX_BYTES` bytes
        together or the running statistics are not in the compute dtype (the per-rank path updates those).

    Raises:
        ValueError: at most one value per channel in all, as ``torch.nn.functional.batch_norm`` refuses it.
    """
    inputs = [offer.input for offer in offers]
    if sum(x.numel() for x in inputs) * inputs[0].element_size() > GATHER_MAX_BYTES:
        return None
    first = offers[0]
    running = next((offer.running for offer in offers if offer.running is not None), None)
    mean, var, factor = (None, None, 0.0) if running is None else running
    cdt = first.input.dtype
    if any(t is not None and t.dtype != cdt for t in (mean, var)):
        return None
    x = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
    count = x.numel() // x.shape[1]
    if count < 2:
        raise ValueError(
            f"expected more than 1 value per channel when training, got {count} across {len(inputs)} replica(s)"
        )
    weight, bias = cast(first.weight, cdt), cast(first.bias, cdt)
    output, save_mean, save_invstd = torch.native_batch_norm(x, weight, bias, mean, var, True, factor, first.eps)
    if output.dtype != dtype:
        output = output.to(dtype)
    sizes = [t.shape[0] for t in inputs]
    outputs = torch.split_with_sizes_copy(output, sizes) if len(sizes) > 1 else [output]
    return list(outputs), Gathered(x, weight, save_mean, save_invstd, sizes, first.eps, bias is not None)


def backward_all(
    gathered: Gathered, grad_outputs: Sequence[Tensor], dtypes: tuple[Any, Any, Any]
) -> list[tuple[Tensor, Tensor | None, Tensor | None]]:
    """Every rank's ``(grad_input, grad_weight, grad_bias)`` of a gathered layer, rank order.

    Args:
        gathered: the layer's forward state (:func:`forward_all`).
        grad_outputs: each rank's output gradient ``[N_r, C, *]``, rank order.
        dtypes: the dtypes of the input, weight and bias (``None`` for an absent one): the gradients'.

    Returns:
        rank ``r``'s rows of the input gradient, and the weight and bias gradients for rank 0 (zeros for the
        others; ``None`` for an absent weight or bias).
    """
    x = gathered.input
    cdt = x.dtype
    dys = [dy if dy.dtype == cdt else dy.to(cdt) for dy in grad_outputs]
    dy = torch.cat(dys) if len(dys) > 1 else dys[0]
    affine = gathered.weight is not None
    grad_input, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        dy, x, gathered.weight, None, None, gathered.save_mean, gathered.save_invstd, True, gathered.eps,
        [True, affine, gathered.has_bias],
    )
    input_dtype, weight_dtype, bias_dtype = dtypes
    if grad_input.dtype != input_dtype:
        grad_input = grad_input.to(input_dtype)
    inputs = torch.split_with_sizes_copy(grad_input, gathered.sizes) if len(dys) > 1 else [grad_input]
    grad_weight = cast(grad_weight, weight_dtype) if affine else None
    grad_bias = cast(grad_bias, bias_dtype) if gathered.has_bias else None
    out = [(inputs[0], grad_weight, grad_bias)]
    for rank_input in inputs[1:]:
        out.append((
            rank_input,
            None if grad_weight is None else torch.zeros_like(grad_weight),
            None if grad_bias is None else torch.zeros_like(grad_bias),
        ))
    return out


def cast(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` in ``dtype`` (itself when it already is, or when either is ``None``: no op, no hand-over of the GIL)."""
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


__all__ = ["GATHER_MAX_BYTES", "Gathered", "Offer", "backward_all", "cast", "forward_all"]
