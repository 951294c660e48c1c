"""The math of batch norm synchronized across ranks through a :class:`~lightning_sparse_dp.syncbn.collective.Collective`.

As torch keeps ``SyncBatchNorm``'s autograd function in ``torch/nn/modules/_functions.py`` apart from the
module (:mod:`lightning_sparse_dp.syncbn.batchnorm`). The math only; the transport is the collective (replica threads
in ``sparse_dp``, a process group in
``sparse_ddp``). Training-mode batch norm of ``input [N, C]`` or ``[N, C, *]`` over the union of every
rank's input, as ``torch.nn.SyncBatchNorm`` computes it (torch/nn/modules/_functions.py):

Forward. Rank ``r`` computes, per channel, its count ``n_r``, mean ``m_r`` and sum of squared
deviations ``M2_r`` over every dimension but dim 1, with torch's native batch-norm statistics kernel
(``torch.batch_norm_update_stats``: fused, no Python per channel; ``torch.batch_norm_stats`` is
CUDA-only); the ranks all-gather ``(n_r, m_r, M2_r)`` (one rendezvous per layer) and each combines
them with Chan et al.'s parallel formula as tensor ops over the stacked ranks (``N = sum n_r``,
``mean = sum n_r m_r / N``, ``M2 = sum M2_r + n_r (m_r - mean)^2``; T. F. Chan, G. H. Golub,
R. J. LeVeque, "Updating formulae and a pairwise algorithm for computing sample variances", 1979).
The input is normalized with the biased variance ``M2 / N`` by torch's native eval-mode kernel
(``torch.native_batch_norm(..., training=False)`` with the global statistics), as
``torch.nn.functional.batch_norm`` does; the running statistics get the global mean and the unbiased
variance ``M2 / (N - 1)``.

Backward. With ``x_hat = (x - mean) * invstd``, each rank takes its per-channel ``sum(dy)`` and
``sum(dy * (x - mean))`` from torch's native eval-mode backward kernel (one fused pass,
``native_batch_norm_backward(..., train=False)``), the ranks all-gather them (what
``SyncBatchNorm`` all-reduces; one rendezvous per layer) and each computes its input gradient locally:
``dx = weight * invstd * (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N)`` with the
global sums, as ``a * dy + b * x + c`` per channel (two fused passes); the weight and bias gradients
are the rank's own ``sum(dy * x_hat)`` and ``sum(dy)`` (the ranks' parameter gradients are reduced
afterwards, as any data-parallel gradient is).

Precision. Computed in the input's dtype, at least float32 (float16 / bfloat16 inputs are computed in
float32 and the output cast back); float64 stays float64. The native kernels accumulate in the
compute dtype; on the per-rank path, below float64, input whose mean outweighs its deviation (on the CPU where a
channel's ``|mean|`` is over 8 standard deviations, :data:`CANCELLATION`; on other devices always) is centered on a
shift and the statistics taken from the centered values (the shifted-data algorithm, :func:`_local_statistics`), so a
large ``|mean|`` against the deviation costs no digits, and the layer normalizes and saves the centered values (no
further copy of the features). The gathered statistics are float64 on every device, so counts stay
exact and the ranks' partial sums are combined without further rounding.

Per-channel arithmetic on CPU. The ``[C]``-sized values (the statistics and their combination, the
normalization's and the gradient's per-channel factors) are computed in float64 numpy arrays when the
input is on the CPU (:data:`HOST_DEVICE_TYPES`), torch tensors elsewhere, with the same formulas. Each
torch op costs Python and dispatch and releases the GIL and takes it back; on vectors of a few dozen
values that is the whole cost, and replica threads running the same layer queued for the GIL at every
one of some 50 such ops per layer (``benchmarks/syncbn_layer.py --threads 2`` shows a small layer's time
in two threads; docs/benchmarks.md, "Costs of the step's parts", has the figures before and after).
numpy keeps the GIL through such small operations and costs far less each. The
input-sized work (centering, statistics, normalization, backward sums, input gradient) stays in
torch's native kernels.

Small layers of CPU replica threads. Over a :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` of
CPU replicas the forward's one rendezvous hands over each rank's input, and when they hold at most
:data:`~lightning_sparse_dp.syncbn._gathered.GATHER_MAX_BYTES` together the rank completing it computes the
layer for all ranks with torch's own kernels on the concatenation, forward and (at the backward's rendezvous)
backward (:mod:`lightning_sparse_dp.syncbn._gathered`): the one-device computation, float32 included, and
a fraction of the per-rank path's Python, which replica threads take in turn under the GIL. Larger layers take
the per-rank path above: each rank brings its statistics to that rendezvous when it expects the layer to be
too large (its own input times the ranks), and a second rendezvous exchanges them only where a rank's guess was
wrong.

Timing. Over a :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` each layer's forward and backward
time (its own work plus the wait for the other replicas at its rendezvous) is recorded per replica
(:meth:`~lightning_sparse_dp.syncbn.collective.ThreadGroup.timings`); ``sparse_dp`` puts it in its stage
times (``syncbn<j>``, ``syncbn_wait``).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sparse_dp.syncbn import _gathered
from lightning_sparse_dp.syncbn.collective import Collective, gather_reduce, is_fused


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype batch norm of an input of ``dtype`` is computed in: float64 stays, anything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_shape(dim: int) -> list[int]:
    """The shape that broadcasts per-channel ``[C]`` values against an ``[N, C, *]`` input of ``dim`` dimensions
    (``[C]`` itself against ``[N, C]``)."""
    return [-1] if dim == 2 else [1, -1] + [1] * (dim - 2)


def _expand(v: Tensor, like: Tensor) -> Tensor:
    """Per-channel ``v`` ``[C]`` shaped to broadcast against ``like`` (:func:`_channel_shape`; ``v`` itself for 2-D)."""
    return v if like.dim() == 2 else v.reshape(_channel_shape(like.dim()))


#: Per-channel values: float64 numpy arrays for CPU input, tensors elsewhere (see "Per-channel arithmetic").
Values = Any

#: Device types whose per-channel values are computed in numpy (the others' stay tensors, on their device).
HOST_DEVICE_TYPES: tuple[str, ...] = ("cpu",)

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _values(t: Tensor) -> Values:
    """``t`` (per-channel, no gradient needed) as float64 values: a numpy copy on CPU, a float64 tensor elsewhere."""
    if t.device.type not in HOST_DEVICE_TYPES:
        return t.detach().to(torch.float64)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        return t.detach().to(torch.float64).numpy()
    return t.numpy(force=True).astype(np.float64)


def _tensor(values: Values, dtype: torch.dtype, shape: list[int] | None = None) -> Tensor:
    """``values`` as a tensor of ``dtype`` (a new one, not shared with other ranks), reshaped to ``shape`` if given."""
    if isinstance(values, np.ndarray):
        array = np.array(values, dtype=_NUMPY_DTYPES[dtype])
        return torch.from_numpy(array if shape is None else array.reshape(shape))
    t = values.to(dtype, copy=True)
    return t if shape is None else t.reshape(shape)


def _stack(gathered: list[Tensor]) -> Values:
    """The ranks' tensors stacked along a new first dimension, as float64 values (numpy for CPU tensors)."""
    if all(t.device.type in HOST_DEVICE_TYPES for t in gathered):
        return np.stack([t.numpy() for t in gathered]).astype(np.float64, copy=False)
    return torch.stack(gathered).to(torch.float64)


def combine_statistics(gathered: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s parallel combination of the ranks' ``[3, C]`` statistics ``(count, mean, M2)``.

    The ranks' rows are stacked into one ``[R, 3, C]`` tensor and reduced over ranks with a handful of
    tensor ops (no Python loop over ranks or channels); every rank computes the same values.

    Args:
        gathered: one float64 tensor ``[3, C]`` per rank: row 0 the count (the same in every column),
            row 1 the per-channel mean, row 2 the per-channel sum of squared deviations.

    Returns:
        ``(total, mean, M2)``: total count ``[]``, global mean ``[C]`` and global ``M2`` ``[C]``, float64.

    Raises:
        ValueError: at most one value per channel in all (``torch.nn.functional.batch_norm`` refuses it too).
    """
    return _combine_stacked(torch.stack(gathered))


def _combine_stacked(stats: Values, check: bool = True) -> tuple[Values, Values, Values]:
    """:func:`combine_statistics` of the stacked ``[R, 3, C]`` float64 statistics (numpy array or tensor).

    ``check=False`` skips the test for fewer than 2 values in all, for a caller that knows its own rank brought 2 or
    more (the total cannot be less): reading the total on a GPU waits for the device, once per layer and forward.
    """
    counts = stats[:, 0, :1]  # [R, 1]
    total = counts.sum()
    if check and float(total) < 2:
        raise ValueError(
            f"expected more than 1 value per channel when training, got {int(total)} across {len(stats)} rank(s)"
        )
    means = stats[:, 1]
    mean = (means * counts).sum(0) / total
    m2 = (stats[:, 2] + counts * (means - mean) ** 2).sum(0)
    return total, mean, m2


def _combine(gathered: list[Tensor], check: bool = True) -> tuple[Values, Values]:
    """``(total, [mean, biased var, unbiased var])`` of the ranks' statistics (:func:`combine_statistics`), float64;
    ``check``: as :func:`_combine_stacked`'s."""
    stacked = _stack(gathered)
    total, mean, m2 = _combine_stacked(stacked, check)
    moments = (np.stack if isinstance(stacked, np.ndarray) else torch.stack)([mean, m2 / total, m2 / (total - 1)])
    return total, moments


_combine_unchecked = partial(_combine, check=False)


def _meet(offers: list[_gathered.Offer], dtype: torch.dtype) -> tuple | None:
    """The forward rendezvous of CPU replica threads: the gathered layer (``(outputs, Gathered)``,
    :func:`~lightning_sparse_dp.syncbn._gathered.forward_all`) when it is small enough, else the ranks' statistics
    combined (``(total, moments)``, :func:`_combine`) when every rank brought them, else ``None`` (the ranks
    exchange their statistics at a second rendezvous)."""
    done = _gathered.forward_all(offers, dtype)
    if done is None and all(offer.stats is not None for offer in offers):
        return _combine([offer.stats for offer in offers])
    return done


def _sum_ranks(gathered: list[Tensor]) -> Values:
    """The ranks' ``[2, C]`` gradient sums added up over ranks (as ``SyncBatchNorm`` all-reduces them), float64."""
    return _stack(gathered).sum(0)


#: Rows of the first-row sample whose mean centers float32 input before its statistics (see :func:`_local_statistics`).
SHIFT_ROWS = 32

#: CPU float32 input is centered where a channel's ``mean^2 > CANCELLATION * variance`` (``|mean| > 8 std``): below
#: that the rounding of the mean, of the normalization's ``x * a + b`` and of the input gradient's ``a dy + b x + c``
#: costs at most some ``8 * 2^-24`` of a value's deviation, torch's own float32 batch norm's precision.
CANCELLATION = 64.0


def _center(x: Tensor) -> tuple[Tensor, Values]:
    """``(x - shift, shift)``: ``x`` centered on the mean of its first :data:`SHIFT_ROWS` rows (per channel), and that
    shift's float64 values."""
    shift = x[:SHIFT_ROWS].mean(dim=[d for d in range(x.dim()) if d != 1])
    return x - _expand(shift, x), _values(shift)


def _local_statistics(x: Tensor) -> tuple[Values | None, Tensor, Tensor]:
    """``(shift, centered, stats)``: this rank's statistics of ``x`` ``[N, C, *]`` (compute dtype), from a native kernel.

    ``stats`` is float64 ``[3, C]`` (count, mean, M2) for :func:`combine_statistics`, taken with torch's native
    batch-norm statistics kernel (``torch.batch_norm_update_stats``: the mean and the biased variance,
    fused, as ``torch.nn.functional.batch_norm`` computes them in training). That kernel accumulates in the
    compute dtype, which below float64 loses the mean's low digits when ``|mean| >> std``; so such input is
    first centered on a shift, the mean of its first :data:`SHIFT_ROWS` rows (``centered = x - shift``, the
    shifted-data algorithm: the kernel then sums small values), and the statistics are those of
    ``centered`` plus the shift. ``centered`` is what the layer normalizes and saves, so the centering is
    not a further copy of the features. Which input is centered: on the CPU, float32 input whose own statistics
    show a channel with ``mean^2 > CANCELLATION * variance`` (the statistics are then taken again, from the
    centered values; input that needs none, most of a network's, costs one pass); on other devices, where
    reading that test would wait for the device, all float32 input. float64 input is used as it is (``shift`` is
    ``None``; else the shift's float64 values).
    """
    count = x.numel() // x.shape[1]
    shift = None
    if count == 0:  # an empty rank contributes nothing
        return shift, x, torch.zeros(3, x.shape[1], dtype=torch.float64, device=x.device)
    host, below64 = x.device.type in HOST_DEVICE_TYPES, x.dtype != torch.float64
    if below64 and not host:
        x, shift = _center(x)
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)  # var: biased
    mean64, var64 = _values(mean), _values(var)
    if below64 and host and bool((mean64 * mean64 > CANCELLATION * var64).any()):
        x, shift = _center(x)
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        mean64, var64 = _values(mean), _values(var)
    if shift is not None:  # shift + mean(centered), added in float64: the mean's digits beyond float32
        mean64 = mean64 + shift
    m2 = var64 * count  # M2 = N * biased variance
    if isinstance(mean64, np.ndarray):
        stats = np.empty((3, mean64.shape[0]))
        stats[0], stats[1], stats[2] = count, mean64, m2
        return shift, x, torch.from_numpy(stats)
    return shift, x, torch.stack([torch.full_like(mean64, count), mean64, m2])


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over every rank's input (see the module docstring).

    ``apply(input, weight, bias, collective, eps, running)`` with ``input [N, C]`` or ``[N, C, *]``, ``weight`` /
    ``bias`` ``[C]`` or ``None``, ``running`` ``(running_mean, running_var, factor)`` on the rank that updates
    them (``running = (1 - factor) * running + factor * global``, the global mean and unbiased variance, as
    ``torch.nn.functional.batch_norm`` updates them with ``momentum=factor``) or ``None``; returns the output in
    the input's dtype and shape. Every rank must call it for the same layers in the same order, in forward
    and in backward (one rendezvous each; two in forward where a CPU replica thread's guess of the gathered path
    was wrong, see :func:`_meet`).

    Over a :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` of CPU replicas a small layer is computed
    once for all ranks (:mod:`lightning_sparse_dp.syncbn._gathered`); otherwise each rank computes its part.
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None, collective: Collective, eps: float,
                running: tuple[Tensor | None, Tensor | None, float] | None = None):
        start = time.perf_counter()
        cdt = compute_dtype(input.dtype)
        x = input if input.dtype == cdt else input.to(cdt)
        ctx.collective, ctx.gathered = collective, None
        ctx.dtypes = (input.dtype, None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        local = combined = None
        if is_fused(collective) and x.device.type in HOST_DEVICE_TYPES:
            if x.numel() * x.element_size() * collective.world_size > _gathered.GATHER_MAX_BYTES:
                local = _local_statistics(x)  # expected too large to gather: the statistics come along
            offer = _gathered.Offer(x, weight, bias, running, eps, None if local is None else local[2])
            kind = ("syncbn forward", tuple(x.shape[1:]), cdt)
            done = collective.all_gather_apply(offer, kind, partial(_meet, dtype=input.dtype))
            if done is not None and isinstance(done[1], _gathered.Gathered):
                outputs, ctx.gathered = done
                ctx.layer = _record(collective, None, time.perf_counter() - start)
                return outputs[collective.rank]
            combined = done
        shift, centered, stats = _local_statistics(x) if local is None else local
        # combined once per layer by one rank and shared: read here, never written
        if combined is None:  # the test for < 2 values in all only where this rank's own rows do not settle it
            few = x.shape[1] == 0 or x.numel() // x.shape[1] < 2
            total, moments = gather_reduce(collective, stats, _combine if few else _combine_unchecked)
        else:
            total, moments = combined
        mean64, var64 = moments[0], moments[1]
        # the global mean in the frame of `centered` (x - shift): small below float64, so the fused native
        # normalization centered * (w * invstd) + (b - mean * w * invstd) cancels nothing
        frame_mean = mean64 if shift is None else mean64 - shift
        frame_c, var_c = _tensor(frame_mean, cdt), _tensor(var64, cdt)
        weight_c, bias_c = _gathered.cast(weight, cdt), _gathered.cast(bias, cdt)
        output = torch.native_batch_norm(centered, weight_c, bias_c, frame_c, var_c, False, 0.0, eps)[0]
        invstd = (var64 + eps) ** -0.5
        scale = invstd if weight is None else invstd * _values(weight)
        ctx.save_for_backward(centered, frame_c, var_c)
        ctx.total, ctx.eps, ctx.invstd, ctx.scale = total, eps, invstd, scale
        ctx.frame_mean = frame_mean
        ctx.has_weight = weight is not None
        # any defined weight serves the backward's sums (their values do not enter them); detached: no graph through it
        ctx.weight_c = None if weight_c is None else weight_c.detach()
        if running is not None:
            _update_running(running, moments[0], moments[2])
        ctx.layer = _record(collective, None, time.perf_counter() - start)
        return output if output.dtype == input.dtype else output.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        start = time.perf_counter()
        if ctx.gathered is not None:
            collective = ctx.collective
            kind = ("syncbn backward", tuple(grad_output.shape[1:]))
            backward = partial(_gathered.backward_all, ctx.gathered, dtypes=ctx.dtypes)
            grads = collective.all_gather_apply(grad_output, kind, backward)
            grad_input, grad_weight, grad_bias = grads[collective.rank]
            _record(collective, ctx.layer, time.perf_counter() - start)
            return (grad_input if ctx.needs_input_grad[0] else None), grad_weight, grad_bias, None, None, None
        centered, frame_c, var_c = ctx.saved_tensors
        cdt = centered.dtype
        dy = grad_output if grad_output.dtype == cdt else grad_output.to(cdt)
        if centered.numel() > 0:
            # torch's native eval-mode backward: sum(dy) and sum(dy * (x - mean)) * invstd, one fused pass. What
            # the CPU kernel takes as None its CUDA twin does not (torch's Normalization.cu): the saved statistics
            # are given empty (asserted defined; empty means "use the running ones", here the frame), and a weight
            # (the layer's, or ones: without one it returns both sums empty), whose values the sums do not depend on.
            unsaved = frame_c.new_empty(0)
            weight_c = ctx.weight_c if ctx.weight_c is not None else torch.ones_like(frame_c)
            _, dot_invstd, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, centered, weight_c, frame_c, var_c, unsaved, unsaved, False, ctx.eps, [False, True, True],
            )
        else:
            dot_invstd = sum_dy = torch.zeros(centered.shape[1], dtype=cdt, device=centered.device)
        grad_input = grad_weight = grad_bias = None
        input_dtype, weight_dtype, bias_dtype = ctx.dtypes
        if ctx.needs_input_grad[0]:
            sums = torch.stack([sum_dy, dot_invstd])  # sum(dy), sum(dy * x_hat); the ranks' sum in float64
            total = gather_reduce(ctx.collective, sums, _sum_ranks)
            invstd, scale = ctx.invstd, ctx.scale
            # dx = (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean))) * invstd * w
            #    = scale * dy + b * centered + c, per channel, with sum(dy * (x - mean)) = sum(dy * x_hat) / invstd
            b = scale * invstd * total[1] / -ctx.total
            c = scale * total[0] / -ctx.total - b * ctx.frame_mean
            shape = _channel_shape(dy.dim())
            grad_input = torch.addcmul(_tensor(c, cdt, shape), centered, _tensor(b, cdt, shape))
            grad_input = grad_input.addcmul_(dy, _tensor(scale, cdt, shape))
            if grad_input.dtype != input_dtype:
                grad_input = grad_input.to(input_dtype)
        if ctx.has_weight and ctx.needs_input_grad[1]:
            grad_weight = _gathered.cast(dot_invstd, weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = _gathered.cast(sum_dy, bias_dtype)
        _record(ctx.collective, ctx.layer, time.perf_counter() - start)
        return grad_input, grad_weight, grad_bias, None, None, None


def _update_running(running: tuple[Tensor | None, Tensor | None, float], mean: Values, unbiased_var: Values) -> None:
    """``running_mean`` / ``running_var`` moved towards the global ``mean`` / ``unbiased_var`` by ``factor``, in
    place, as ``torch.nn.functional.batch_norm`` updates them (``momentum * value + (1 - momentum) * running``),
    computed in float64 (numpy for CPU buffers numpy can read) and copied into the buffer."""
    running_mean, running_var, factor = running
    with torch.no_grad():
        for buffer, value in ((running_mean, mean), (running_var, unbiased_var)):
            if buffer is None:
                continue
            if isinstance(value, np.ndarray) and buffer.dtype in _NUMPY_DTYPES and buffer.device.type == "cpu":
                buffer.copy_(torch.from_numpy(factor * value + (1 - factor) * buffer.numpy().astype(np.float64)))
            else:
                old = buffer.to(torch.float64)
                buffer.copy_(factor * _tensor(value, torch.float64).to(old.device) + (1 - factor) * old)


def _record(collective: Collective, layer: int | None, seconds: float) -> int | None:
    """Add ``seconds`` to ``layer``'s time (``None``: a new layer) where the collective keeps one
    (:meth:`~lightning_sparse_dp.syncbn.collective.ThreadGroup.record`); the layer's index, or ``None``."""
    return collective.record(seconds, layer) if is_fused(collective) else None


__all__ = [
    "HOST_DEVICE_TYPES",
    "SHIFT_ROWS",
    "SyncBatchNormFunction",
    "combine_statistics",
    "compute_dtype",
]
