"""Skipped chunks: a step that returns ``None`` in some replicas' chunks and an output in others.

On one device Lightning runs the step once on the whole batch: a ``training_step`` that returns ``None`` skips the
optimization step (``lightning.pytorch.loops.optimization.automatic``: no loss, no backward), an evaluation step's
return value goes only to ``on_validation_batch_end`` / ``on_test_batch_end`` (the module's and the callbacks'), and a
``predict_step``'s is the batch's prediction. With replicas, each step sees its chunk only, so a condition the step
tests (``if not moving.any(): return None``) can hold in one chunk and not in the whole batch. What one device would
have done is then known only where the output is never read:

- every replica returns ``None``: the step returns ``None``, as one device would for the same decision;
- a validation or test step whose output no hook reads (the module does not override ``on_<stage>_batch_end`` and
  only Lightning's own callbacks, which ignore the output, implement it) and whose ``None`` chunks logged the same
  names as the others (so their samples are in every logged value): what one device's step leaves is reproduced, so
  ``None`` is returned and the logged values are reduced over every chunk as usual;
- otherwise (a training step, whose ``None`` chunks' samples would have counted in the whole batch's loss; a
  prediction; an evaluation output a hook reads; ``None`` chunks that logged less than the others, whose samples
  would be missing from the logged values): refused by :func:`check_skipped`, naming the step, the replicas
  and their samples, and what to do.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_sparse_dp.runtime.compat import trainer_of

if TYPE_CHECKING:
    from lightning_sparse_dp.step.context import StepContext

#: what to do when some chunks' steps return ``None``
SKIPPED_STEP_HELP = (
    "Decide on the whole batch rather than on a chunk: let the collate function put a flag in the batch (a Python "
    "bool or str, which every chunk gets whole, e.g. batch['skip'] = not labels.any()) and return None when it is "
    "set, so every replica returns None; or return an output from every chunk (for a training chunk with nothing to "
    "learn from, a loss that is still in the graph and counts nothing, e.g. 0 * logits.sum(), with "
    "SparseDataParallelStrategy(loss_weighting=fn) giving such chunks weight 0)."
)

_EVALUATION_HOOKS = {"validation_step": "on_validation_batch_end", "test_step": "on_test_batch_end"}


def output_readers(step_name: str, module: Any) -> list[str]:
    """Who reads ``step_name``'s return value on one device, as names for a message: the training loop (the loss) or
    the predict loop (the predictions) for a training / predict step, else the module and the non-Lightning callbacks
    that implement the step's batch-end hook (Lightning's own callbacks, progress bars and checkpoints among them,
    never read it); ``[]`` when nothing does."""
    hook = _EVALUATION_HOOKS.get(step_name)
    if hook is None:
        return ["the training loop (the loss)" if step_name == "training_step" else "the predict loop (the predictions)"]
    readers = [f"{type(module).__name__}.{hook}"] if is_overridden(hook, module) else []
    trainer = trainer_of(module)
    for callback in getattr(trainer, "callbacks", None) or ():
        if _implements(callback, hook):
            readers.append(f"{type(callback).__name__}.{hook}")
    return readers


def _implements(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class, or a base of it below Lightning's own classes, defines ``hook`` (a subclass of
    Lightning's progress bar that does not is not a reader)."""
    for cls in type(callback).__mro__:
        if cls.__module__.startswith(("lightning.", "pytorch_lightning.")):
            return False
        if hook in cls.__dict__:
            return True
    return False


def check_skipped(
    outputs: Sequence[Any], step_name: str, module: Any, chunk_samples: Sequence[Any],
    logged: Sequence[Collection[str]] = (),
) -> list[Any]:
    """The replicas' outputs to gather: as they are, unless some are ``None`` (then see the module docstring).

    Args:
        outputs: the replicas' step outputs, replica order.
        step_name: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
        module: the LightningModule (its batch-end hooks and its trainer's callbacks are read).
        chunk_samples: the split's sample ids per chunk (``SplitPlan.chunk_samples``), for the message.
        logged: the names each replica's step logged (``self.log``), replica order; empty: none logged.

    Returns:
        ``outputs``, or ``[None] * len(outputs)`` for an evaluation step whose output nothing reads.

    Raises:
        ValueError: some replicas returned ``None`` and others an output that someone reads; the message names the
            step, both groups of replicas with their samples, the readers and the fix (:data:`SKIPPED_STEP_HELP`).
    """
    nones = [i for i, o in enumerate(outputs) if o is None]
    if not nones or len(nones) == len(outputs):
        return list(outputs)
    others = [i for i in range(len(outputs)) if i not in nones]
    readers = output_readers(step_name, module)
    names = [set(n) for n in logged] or [set() for _ in outputs]
    missing = sorted(set().union(*(names[i] for i in others)) - set.intersection(*(names[i] for i in nones)))
    if not readers and not missing:  # nothing reads an evaluation step's output, and every chunk's samples were logged
        return [None] * len(outputs)
    if missing:
        readers = [*readers, f"the logged value(s) {missing}, which the None chunks did not log"]

    def samples(replicas: list[int]) -> str:
        ids = sorted(int(s) for i in replicas for s in chunk_samples[i].tolist())
        return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")

    raise ValueError(
        f"sparse_dp: {step_name} returned None in replica(s) {nones} (the batch's samples {samples(nones)}) and an "
        f"output in replica(s) {others} (samples {samples(others)}). On one device the step runs once on the whole "
        f"batch, so its result for this batch is not known (the None chunks' samples would have counted in it), and "
        f"it is needed by: {'; '.join(readers)}. {SKIPPED_STEP_HELP}"
    )


def skipped_outputs(step: StepContext) -> list[Any]:
    """The step's outputs where some chunks' steps returned ``None`` (the hub enters this stage only then; otherwise
    ``step.outputs`` are the outputs as they are): :func:`check_skipped`'s verdict on them, from the names each replica
    logged (``step.replica_state.recorders``).

    Raises:
        ValueError: as :func:`check_skipped`, where one device's result is not known.
    """
    assert step.replica_state is not None and step.plan is not None
    recorded = [r.calls if r is not None else {} for r in step.replica_state.recorders]
    return check_skipped(step.outputs, step.call.name, step.call.module, step.plan.chunk_samples, recorded)


__all__ = ["skipped_outputs", "SKIPPED_STEP_HELP", "check_skipped", "output_readers"]
