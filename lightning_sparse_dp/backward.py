"""Backward: every replica runs its own backward pass in its own thread, as each DDP process does.

Autograd runs the backward of CPU tensors in the thread that calls ``backward()``, so one backward of
the gathered loss ``sum_i w_i * loss_i`` would run every CPU replica's backward one after the other.
Instead, the loss handed to Lightning is :class:`_SplitLoss`: its value is the gathered loss, and its
autograd node, when the backward pass reaches it with the gradient ``g`` of whatever Lightning (or
the user) computed from it (``loss / accumulate_grad_batches``, a precision plugin's loss scaling,
a ``LightningModule.backward`` override), runs ``loss_i.backward(g * w_i)`` in replica ``i``'s thread
for every ``i`` at once, then adds the replicas' parameter gradients in replica order
(:meth:`~lightning_sparse_dp.replicate.Replicas.reduce_gradients`) and hands the sums to autograd as
the gradients of the module's parameters, which accumulate them into ``.grad`` as usual (hooks,
gradient accumulation and clipping, ``on_after_backward`` all see the usual ``.grad``).

Synchronized batch norm exchanges its gradient terms between the replicas' concurrent backward
passes through the step's :class:`~lightning_sparse_dp.collective.ThreadGroup` (a new phase of it).

Limits: the backward of the gathered loss can run once (``retain_graph=True`` cannot re-run the
replicas' passes, whose graphs are freed) and not with ``create_graph=True``; both raise a clear error.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lightning_sparse_dp.apply import ReplicaExecutor
from lightning_sparse_dp.collective import ThreadGroup
from lightning_sparse_dp.replicate import Replicas
from lightning_sparse_dp.timing import StepTimer


class ReplicaBackward:
    """The backward stage of one step: the replicas' losses, their weights and where to run their passes.

    Args:
        losses: ``loss_i`` of each replica (replica order), with their graphs.
        weights: ``w_i``, as the gather weighted the losses.
        replicas: the replicas (their first ``len(losses)`` ran the step).
        executor: the replica threads.
        group: the step's batch-norm group, or ``None`` when nothing is synchronized.
        times: where to record ``backward<i>`` (each replica's pass) and ``reduce``.
    """

    def __init__(
        self,
        losses: Sequence[Tensor],
        weights: Sequence[float],
        replicas: Replicas,
        executor: ReplicaExecutor,
        group: ThreadGroup | None,
        times: StepTimer,
    ) -> None:
        self.losses: list[Tensor] | None = list(losses)
        self.weights = list(weights)
        self.replicas = replicas
        self.executor = executor
        self.group = group
        self.times = times

    def run(self, grad: Tensor) -> list[Tensor | None]:
        """Run every replica's backward with ``grad * w_i``, at once; the reduced parameter gradients.

        Raises:
            RuntimeError: a second call (the replicas' graphs are gone).
            Exception: what a replica's backward raised (see :meth:`ReplicaExecutor.run`).
        """
        losses, self.losses = self.losses, None
        if losses is None:
            raise RuntimeError(
                "sparse_dp: backward ran twice through the same step's loss. Each replica's backward pass runs once "
                "(its graph is freed), so retain_graph=True cannot run it again; compute everything that needs the "
                "gradient in one backward call."
            )
        count = len(losses)
        devices = self.replicas.devices[:count]
        fns = []
        for rank, (loss, weight, device) in enumerate(zip(losses, self.weights, devices)):
            fn = partial(_backward, loss, (grad * weight).to(device=device, dtype=loss.dtype))
            if self.group is not None:
                fn = partial(self.group.run, rank, fn)
            fns.append(self.times.timed(f"backward{rank}", fn))
        self.executor.run(fns, devices)
        with self.times.stage("reduce"):
            return self.replicas.reduce_gradients(count)


def _backward(loss: Tensor, grad: Tensor) -> None:
    if loss.requires_grad:
        torch.autograd.backward(loss, grad)


class _SplitLoss(torch.autograd.Function):
    """``apply(stage, value, *params)``: ``value`` (the gathered loss, detached) whose backward is ``stage.run``.

    ``params`` are the module's trainable parameters: the node's backward returns their reduced gradients.
    """

    @staticmethod
    def forward(ctx: Any, stage: ReplicaBackward, value: Tensor, *params: Tensor) -> Tensor:
        ctx.stage = stage
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "sparse_dp: backward(create_graph=True) is not supported: each replica runs its own first-order "
                "backward pass. Use strategy='auto' (one device) for higher-order gradients."
            )
        return (None, None, *ctx.stage.run(grad))


def loss_of(output: Any) -> Tensor | None:
    """The loss Lightning takes from a ``training_step`` output: the tensor itself, or ``output["loss"]``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def split_backward(output: Any, replica_outputs: Sequence[Any], stage_args: dict[str, Any]) -> Any:
    """``output`` (the gathered step output) with its loss replaced by one whose backward runs per replica.

    Args:
        output: the gathered ``training_step`` output (a loss tensor, or a mapping with ``"loss"``).
        replica_outputs: the replicas' own outputs, replica order.
        stage_args: the other arguments of :class:`ReplicaBackward` (``weights``, ``replicas``,
            ``executor``, ``group``, ``times``).

    Returns:
        ``output`` unchanged when it has no loss that requires a gradient (nothing to run backward on).
    """
    loss = loss_of(output)
    if loss is None or not loss.requires_grad:
        return output
    losses = [loss_of(o) for o in replica_outputs]
    if any(part is None for part in losses):
        return output  # gather already refused outputs of different structure; nothing more to split
    stage = ReplicaBackward(losses, **stage_args)
    split = _SplitLoss.apply(stage, loss.detach(), *stage.replicas.trainable)
    if isinstance(output, Tensor):
        return split
    output = copy.copy(output)
    output["loss"] = split
    return output


__all__ = ["ReplicaBackward", "loss_of", "split_backward"]
