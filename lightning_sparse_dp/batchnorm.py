"""Batch norm synchronized across ranks through a :class:`~lightning_sparse_dp.collective.Collective`.

The math only; the transport is the collective (replica threads in ``sparse_dp``, a process group in
``sparse_ddp``). Training-mode batch norm of ``input [N, C]`` or ``[N, C, *]`` over the union of every
rank's input, as ``torch.nn.SyncBatchNorm`` computes it (torch/nn/modules/_functions.py):

Forward. Rank ``r`` computes, per channel, its count ``n_r``, mean ``m_r`` and sum of squared
deviations ``M2_r`` over every dimension but dim 1; the ranks all-gather ``(n_r, m_r, M2_r)`` and each
combines them, in rank order, with Chan et al.'s parallel formula (``N = sum n_r``,
``mean = sum n_r m_r / N``, ``M2 = sum M2_r + n_r (m_r - mean)^2``; T. F. Chan, G. H. Golub,
R. J. LeVeque, "Updating formulae and a pairwise algorithm for computing sample variances", 1979).
The input is normalized with the biased variance ``M2 / N``, as ``torch.nn.functional.batch_norm``
does; the running statistics get the global mean and the unbiased variance ``M2 / (N - 1)``.

Backward. With ``x_hat = (x - mean) * invstd``, the ranks all-gather per-channel ``sum(dy)`` and
``sum(dy * (x - mean))`` (what ``SyncBatchNorm`` all-reduces) and each computes its input gradient
locally: ``dx = weight * invstd * (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N)`` with the
global sums; the weight and bias gradients are the rank's own ``sum(dy * x_hat)`` and ``sum(dy)``
(the ranks' parameter gradients are reduced afterwards, as any data-parallel gradient is).

Precision. Computed in the input's dtype, at least float32 (float16 / bfloat16 inputs are computed in
float32 and the output cast back); float64 stays float64. Per-channel sums accumulate in float64 on
CPU (``sum(dtype=torch.float64)``; torch's CPU batch norm accumulates float32 in float32 or double,
depending on the kernel) and in the compute dtype on CUDA (as torch's CUDA kernels do); the gathered
statistics are float64 on every device, so counts stay exact and the ranks' partial sums are added
without further rounding. The output is ``(x - mean) * (invstd * weight) + bias``, not torch's fused
``x * a + (bias - mean * a)``, which loses digits when ``|mean|`` is large against the deviation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_sparse_dp.collective import Collective


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype batch norm of an input of ``dtype`` is computed in: float64 stays, anything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype per-channel sums accumulate in: float64 on CPU or for float64 input, else the compute dtype."""
    return torch.float64 if device.type == "cpu" else compute_dtype(dtype)


def _dims(x: Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _expand(v: Tensor, like: Tensor) -> Tensor:
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def combine_statistics(gathered: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s parallel combination of the ranks' ``[3, C]`` statistics ``(count, mean, M2)``, in rank order.

    Args:
        gathered: one float64 tensor ``[3, C]`` per rank: row 0 the count (the same in every column),
            row 1 the per-channel mean, row 2 the per-channel sum of squared deviations.

    Returns:
        ``(total, mean, M2)``: total count ``[]``, global mean ``[C]`` and global ``M2`` ``[C]``, float64.

    Raises:
        ValueError: at most one value per channel in all (``torch.nn.functional.batch_norm`` refuses it too).
    """
    counts = [g[0, 0] for g in gathered]
    total = counts[0]
    for n in counts[1:]:
        total = total + n
    if float(total) < 2:
        raise ValueError(
            f"expected more than 1 value per channel when training, got {int(total)} across {len(gathered)} rank(s)"
        )
    weighted = gathered[0][1] * counts[0]
    for g, n in zip(gathered[1:], counts[1:]):
        weighted = weighted + g[1] * n
    mean = weighted / total
    m2 = None
    for g, n in zip(gathered, counts):
        term = g[2] + n * (g[1] - mean) ** 2
        m2 = term if m2 is None else m2 + term
    assert m2 is not None
    return total, mean, m2


def _sum_in_rank_order(gathered: list[Tensor]) -> Tensor:
    total = gathered[0]
    for g in gathered[1:]:
        total = total + g
    return total


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over every rank's input (see the module docstring).

    ``apply(input, weight, bias, collective, eps)`` with ``input [N, C]`` or ``[N, C, *]``, ``weight`` /
    ``bias`` ``[C]`` or ``None``, returns ``(output, mean, unbiased_var)``: the output in the input's
    dtype and shape, and the global per-channel mean and unbiased variance ``[C]`` (float64, no
    gradient) for the running statistics. Every rank must call it for the same layers in the same
    order, in forward and in backward (one all-gather each).
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None, collective: Collective, eps: float):
        cdt = compute_dtype(input.dtype)
        adt = accumulation_dtype(input.dtype, input.device)
        dims = _dims(input)
        count = input.numel() // input.shape[1]
        x = input.to(cdt)
        if count > 0:
            local_mean = x.sum(dim=dims, dtype=adt) / count
            rounded = local_mean.to(cdt)
            deviation = x - _expand(rounded, x)
            # sum (x - m~)^2 = M2 + n (m - m~)^2 for the mean m~ rounded to the compute dtype
            local_m2 = deviation.mul_(deviation).sum(dim=dims, dtype=adt) - count * (local_mean - rounded.to(adt)) ** 2
            del deviation
        else:  # an empty rank contributes nothing
            local_mean = local_m2 = torch.zeros(input.shape[1], dtype=adt, device=input.device)
        stats = torch.stack([torch.full_like(local_mean, count), local_mean, local_m2]).to(torch.float64)
        total, mean64, m2 = combine_statistics(collective.all_gather(stats))
        mean, invstd = mean64.to(cdt), torch.rsqrt(m2 / total + eps).to(cdt)
        # (x - mean) * (invstd * w) + b; not torch's fused x * a + (b - mean * a), which cancels when |mean| >> std
        scale = invstd if weight is None else (invstd.to(adt) * weight.to(adt)).to(cdt)
        output = (x - _expand(mean, x)).mul_(_expand(scale, x))
        if bias is not None:
            output.add_(_expand(bias.to(cdt), x))
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.collective, ctx.total = collective, total
        ctx.bias_dtype = None if bias is None else bias.dtype
        unbiased = m2 / (total - 1)
        ctx.mark_non_differentiable(mean64, unbiased)
        return output.to(input.dtype), mean64, unbiased

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor, _grad_mean: Any, _grad_var: Any):
        input, weight, mean, invstd = ctx.saved_tensors
        cdt = mean.dtype
        adt = accumulation_dtype(input.dtype, input.device)
        dims = _dims(input)
        x, dy = input.to(cdt), grad_output.to(cdt)
        deviation = x - _expand(mean, x)  # x - mean
        sum_dy = dy.sum(dim=dims, dtype=adt)
        sum_dy_xmu = (dy * deviation).sum(dim=dims, dtype=adt)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            gathered = ctx.collective.all_gather(torch.stack([sum_dy, sum_dy_xmu]).to(torch.float64))
            global_means = _sum_in_rank_order(gathered) / ctx.total  # mean(dy), mean(dy * (x - mean)), float64
            invstd64 = invstd.to(torch.float64)
            scale = invstd64 if weight is None else invstd64 * weight.to(torch.float64)
            # (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean))) * invstd * w
            grad_input = torch.addcmul(dy, deviation, _expand((-invstd64 * invstd64 * global_means[1]).to(cdt), dy))
            grad_input.sub_(_expand(global_means[0].to(cdt), dy)).mul_(_expand(scale.to(cdt), dy))
            grad_input = grad_input.to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd.to(adt)).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm synchronized through :attr:`collective` (see the module docstring).

    Input ``[N, C]`` or ``[N, C, *]`` (ME's batch norm passes the features ``[N, C]``). When
    :attr:`collective` is ``None`` or has one rank, it is ``torch.nn.BatchNorm`` exactly. Made by
    :func:`convert_sync_batchnorm` from an existing layer, sharing its parameters and buffers.

    Attributes:
        collective: the :class:`~lightning_sparse_dp.collective.Collective` of this rank, set by the
            strategy for each step (``sparse_dp``) or once (``sparse_ddp``); ``None``: no synchronization.
        update_running_stats: whether this rank's layer updates the running statistics (with the
            global ones) in a synchronized step. ``sparse_dp`` sets it on the root replica only, whose
            layer shares the module's buffers (once per step); ``sparse_ddp`` leaves it on for every
            rank, each updating its own copy identically.
    """

    collective: Collective | None = None
    update_running_stats: bool = True

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input [N, C] or [N, C, *], got shape {tuple(input.shape)}")

    def forward(self, input: Tensor) -> Tensor:
        collective = self.collective
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        if collective is None or collective.world_size == 1 or not batch_statistics:
            return super().forward(input)
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dim 1, got input of shape {tuple(input.shape)}")
        output, mean, unbiased_var = SyncBatchNormFunction.apply(input, self.weight, self.bias, collective, self.eps)
        if self.training and self.track_running_stats and self.update_running_stats:
            self._update_running_stats(mean, unbiased_var)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, unbiased_var: Tensor) -> None:
        """Update the running statistics as ``torch.nn.modules.batchnorm._BatchNorm`` does (momentum or cumulative)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if self.running_mean is not None:
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean), alpha=factor)
        if self.running_var is not None:
            self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var), alpha=factor)


#: The layers :func:`convert_sync_batchnorm` swaps: torch's BatchNorm1d/2d/3d and SyncBatchNorm, which
#: includes the ``bn`` inside ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``.
SWAPPED_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

Swap = tuple[nn.Module, str, nn.Module]


def convert_sync_batchnorm(module: nn.Module) -> list[Swap]:
    """Swap every batch-norm layer inside ``module`` for a :class:`SyncBatchNorm`, in place.

    Converts torch's ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` wherever they are children, which
    covers the ``.bn`` of ``ME.MinkowskiBatchNorm`` and ``ME.MinkowskiSyncBatchNorm``. The new layer
    shares the old one's ``weight``, ``bias`` and buffers (the same tensors), so the state dict keeps
    its keys and values and the optimizer its parameters. ``module`` itself is not swapped (it has no
    parent to hold the new layer).

    Returns:
        ``(parent, name, original)`` for every swap, for :func:`revert_sync_batchnorm`.
    """
    swaps: list[Swap] = []
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, SWAPPED_TYPES) and not isinstance(child, SyncBatchNorm):
                new = SyncBatchNorm.__new__(SyncBatchNorm)
                nn.Module.__init__(new)
                for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
                    setattr(new, attr, getattr(child, attr))
                new._parameters = child._parameters  # the same Parameter objects
                new._buffers = child._buffers  # the same running-statistic tensors
                new.train(child.training)
                parent._modules[name] = new
                swaps.append((parent, name, child))
    return swaps


def revert_sync_batchnorm(swaps: list[Swap]) -> None:
    """Put the original layers back (they share every tensor, so they hold the trained values)."""
    for parent, name, original in reversed(swaps):
        current = parent._modules[name]
        original.train(current.training)
        parent._modules[name] = original


__all__ = [
    "SWAPPED_TYPES",
    "SyncBatchNorm",
    "SyncBatchNormFunction",
    "accumulation_dtype",
    "combine_statistics",
    "compute_dtype",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]
