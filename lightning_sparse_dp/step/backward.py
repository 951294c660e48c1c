"""Backward: every replica runs its own backward pass in its own thread, as each DDP process does.

Autograd runs the backward of CPU tensors in the thread that calls ``backward()``, so one backward of
the gathered loss ``sum_i w_i * loss_i`` would run every CPU replica's backward one after the other.
Instead, before the gather, :func:`parallel_backward` hands each replica's loss on as an output of one
autograd node, :class:`_ParallelBackward`, whose values are the replicas' losses. The gather (the
strategy's, or an override of it) computes the step's loss from them with ordinary autograd; when the
backward pass reaches the node with the gradient ``g_i`` of every replica's loss (``w_i`` times whatever
Lightning or the user did to the gathered loss: ``loss / accumulate_grad_batches``, a precision
plugin's loss scaling, a ``LightningModule.backward`` override, a ``gather`` override), it runs
``loss_i.backward(g_i)`` in replica ``i``'s thread for every ``i`` at once (with autograd's device threads off there,
so on a GPU as on CPU: :mod:`~lightning_sparse_dp.runtime.executor`), then adds the replicas'
parameter gradients in replica order (:meth:`~lightning_sparse_dp.step.replicate.Replicas.reduce_gradients`)
and hands the sums to autograd as the gradients of the module's parameters, which accumulate them into
``.grad`` as usual (hooks, gradient accumulation and clipping, ``on_after_backward`` all see the usual
``.grad``).

Synchronized batch norm exchanges its gradient terms between the replicas' concurrent backward
passes through the step's :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup` (a new phase of it).

Limits: the backward of the step's loss can run once (``retain_graph=True`` cannot re-run the
replicas' passes, whose graphs are freed) and not with ``create_graph=True``; both raise a clear error.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.runtime.compat import trainer_of
from lightning_sparse_dp.runtime.executor import ReplicaExecutor
from lightning_sparse_dp.runtime.timing import StepTimer
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.syncbn.collective import ThreadGroup

if TYPE_CHECKING:
    from lightning_sparse_dp.step.context import StepContext


class ReplicaBackward:
    """The backward stage of one step: the replicas' losses and where to run their passes.

    Args:
        losses: ``loss_i`` of each replica (replica order), with their graphs.
        replicas: the replicas (their first ``len(losses)`` ran the step).
        executor: the replica threads.
        group: the step's batch-norm group, or ``None`` when nothing is synchronized.
        times: where to record ``backward<i>`` (each replica's pass) and ``reduce``.
    """

    def __init__(
        self,
        losses: Sequence[Tensor],
        replicas: Replicas,
        executor: ReplicaExecutor,
        group: ThreadGroup | None,
        times: StepTimer,
    ) -> None:
        self.losses: list[Tensor] | None = list(losses)
        self.replicas = replicas
        self.executor = executor
        self.group = group
        self.times = times

    def run(self, grads: Sequence[Tensor]) -> list[Tensor | None]:
        """Run replica ``i``'s backward with ``grads[i]`` for every ``i``, at once; the reduced parameter gradients.

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
        for rank, (loss, grad, device) in enumerate(zip(losses, grads, devices)):
            fn = partial(_backward, loss, grad.to(device=device, dtype=loss.dtype))
            if self.group is not None:
                fn = partial(self.group.run, rank, fn)
            fns.append(self.times.timed(f"backward{rank}", fn))
        try:  # each in its replica's thread, autograd's device threads off there (runtime/executor.py)
            self.executor.run(fns, devices)
        except RuntimeError as err:
            if _IN_PLACE in str(err) and len(fns) > 1:
                err.add_note(IN_PLACE_NOTE)
            raise
        if self.group is not None:
            self.times.record(self.group.times.timings())  # each synchronized layer's share of the step
        with self.times.stage("reduce"):
            return self.replicas.reduce_gradients(count)


_IN_PLACE = "modified by an inplace operation"  # autograd's message for a saved tensor changed since
#: the note a replica's backward that failed on a tensor changed in place gets
IN_PLACE_NOTE = (
    "sparse_dp: a tensor a replica saved for its backward was changed in place meanwhile, most likely by another "
    "replica's step: replicas on one device share the module's frozen parameters, so a step that changes one in "
    "place (an EMA teacher's t.mul_(m).add_(s, alpha=1 - m)) changes it under the others. With check_exactness on "
    "(the default) the replicas own copies of such parameters from the first step; without it, from the step after "
    "the one that was said to change them. Or update the teacher in on_train_batch_end."
)


def _backward(loss: Tensor, grad: Tensor) -> None:
    if loss.requires_grad:
        torch.autograd.backward(loss, grad)


class _ParallelBackward(torch.autograd.Function):
    """``apply(stage, k, *values, *params)``: the ``k`` replica losses (detached) whose backward is ``stage.run``.

    ``params`` are the module's trainable parameters: the node's backward returns their reduced gradients.
    """

    @staticmethod
    def forward(ctx: Any, stage: ReplicaBackward, count: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.stage, ctx.count = stage, count
        return tuple(v.clone() for v in inputs[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "sparse_dp: backward(create_graph=True) is not supported: each replica runs its own first-order "
                "backward pass. Use strategy='auto' (one device) for higher-order gradients."
            )
        return (None, None, *([None] * ctx.count), *ctx.stage.run(grads))


def parallel_backward(
    outputs: Sequence[Any], replicas: Replicas, losses: Sequence[Any] | None = None, **stage_args: Any
) -> list[Any]:
    """The replicas' ``training_step`` outputs, their losses replaced by ones whose backward runs per replica.

    Args:
        outputs: the replicas' own outputs (loss tensors, or mappings with ``"loss"``), replica order.
        replicas: the replicas (:class:`~lightning_sparse_dp.step.replicate.Replicas`).
        losses: ``loss_of(outputs[i])`` for each ``i`` where the caller read them already (the weigh stage's
            ``step.losses``); ``None``: read here.
        **stage_args: the other arguments of :class:`ReplicaBackward` (``executor``, ``group``, ``times``).

    Returns:
        ``outputs`` unchanged when a replica has no loss or none needs a gradient (nothing to split).
    """
    losses = [loss_of(o) for o in outputs] if losses is None else list(losses)
    if any(loss is None for loss in losses) or not any(loss.requires_grad for loss in losses):
        return list(outputs)  # gather refuses outputs of different structure; nothing to run backward on
    stage = ReplicaBackward(losses, replicas, **stage_args)
    values = [loss.detach() for loss in losses]
    joined = _ParallelBackward.apply(stage, len(values), *values, *replicas.trainable)
    result = []
    for output, loss in zip(outputs, joined):
        if isinstance(output, Tensor):
            result.append(loss)
        else:
            output = copy.copy(output)
            output["loss"] = loss
            result.append(output)
    return result


def zero_grad_due(module: Any, batch_idx: Any) -> bool:
    """Whether Lightning's automatic optimization clears the gradients between this training step and its backward
    (``loops/optimization/automatic.py``, ``_make_zero_grad_fn``: at the first batch of each accumulation window)."""
    trainer = trainer_of(module)
    every = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
    return not isinstance(batch_idx, int) or batch_idx % max(int(every), 1) == 0


def clear_replica_gradients(step: StepContext, replicas: Replicas | None) -> None:
    """Where Lightning's ``zero_grad`` clears the module's gradients after a training step (:func:`zero_grad_due`), the
    replicas' gradients that a backward inside the step left (``aux.backward()``, Lightning's ``measure_flops``) are
    cleared too, so that the step's backward reduces only its own, as one device's ``.grad`` holds only its own. Inside
    an accumulation window, where one device's ``.grad`` keeps them, the replicas' are their chunks' gradients, which no
    weight makes the whole batch's: said once (they stay, and are reduced with the step's). The replicas' parameters are
    the persistent replicas' parameters (not the module's, which Lightning clears).

    A steady step has none to clear: the previous backward took every replica's gradient and left ``None``
    (:meth:`~lightning_sparse_dp.step.replicate.Replicas.reduce_gradients`), so Lightning's schedule
    (:func:`zero_grad_due`) is read only where a backward inside this step left some."""
    if replicas is None or len(step.replicas) < 2 or step.call.manual or not torch.is_grad_enabled():
        return
    params = replicas.parameters[: len(step.replicas)]
    if all(param.grad is None for per_replica in params for param in per_replica):
        return
    if zero_grad_due(step.call.module, step.call.args[0] if step.call.args else step.call.kwargs.get("batch_idx")):
        for per_replica in params:
            for param in per_replica:
                param.grad = None
    else:
        step.call.warnings.warn(
            "sparse_dp: a backward inside training_step (e.g. aux.backward(), measure_flops) left gradients in an "
            "accumulation window (accumulate_grad_batches > 1), where one device keeps them in .grad: each replica's "
            "are its chunk's, added up, not the whole batch's. Add the auxiliary term to the loss the step returns, or "
            "train with accumulate_grad_batches=1."
        )


def backward_in_replicas(step: StepContext, replicas: Replicas | None, executor: ReplicaExecutor) -> list[Any]:
    """A training step's outputs with each replica's loss tied to its own backward, run in the replica's thread (on
    ``executor``) when Lightning calls backward on the gathered loss (:func:`parallel_backward`, with the losses the
    weigh stage read from the same outputs, ``step.losses``); as they are for one replica or without gradients."""
    if len(step.replicas) < 2 or not torch.is_grad_enabled():
        return step.outputs
    assert replicas is not None
    return parallel_backward(step.outputs, replicas, step.losses, executor=executor, group=step.group, times=step.call.timer)


__all__ = ["backward_in_replicas", "clear_replica_gradients", "ReplicaBackward", "parallel_backward", "zero_grad_due"]
