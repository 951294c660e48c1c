"""Weigh: each replica's loss and its weight in the whole batch's, so that the gather's weighted sum is one device's loss.

After the apply stage: each replica's loss as its step returned it (:func:`~lightning_sparse_dp.loss.values.loss_of`),
its chunk's weight (:meth:`~lightning_sparse_dp.loss.weights.HeldWeighting.step_weights`, for the strategy's
``loss_weighting``) and, with ``loss_weighting="terms"``, every captured mean-reduced loss term weighted by its own share
(:meth:`~lightning_sparse_dp.loss.step.StepTerms.weigh`); after the backward stage, the losses shifted so that the weighted
sum is the whole batch's loss (:func:`exact_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.loss.weights import HeldWeighting

if TYPE_CHECKING:
    from lightning_sparse_dp.step.context import StepContext


def weigh(step: StepContext, loss_weighting: Any, held: HeldWeighting) -> tuple[list[Any], list[float]]:
    """``(losses, weights)``: each replica's own loss (a logged loss is reduced as the loss) and its weight (``step.weights``
    where a manual step needed them before it; else from ``loss_weighting``, checked and resolved once by the strategy's
    ``held`` while it holds: :class:`~lightning_sparse_dp.loss.weights.HeldWeighting`); with ``step.terms``, each term
    weighted by its own share (gradient scales set) or ``"auto"`` said once. Stage ``weigh``."""
    assert step.plan is not None
    with step.call.timer.stage("weigh"):
        losses = [loss_of(o) for o in step.outputs]
        try:
            weights = step.weights if step.weights is not None else held.step_weights(
                step.plan, step.inputs, loss_weighting, step.call.warnings
            )
        except Exception as err:  # a callable written for labelled chunks, on a predict batch without labels
            if step.call.name != "predict_step" or not callable(loss_weighting):
                raise
            step.call.warnings.info(
                f"sparse_dp: the loss_weighting callable failed on a predict step's chunk ({type(err).__name__}: "
                f"{err}); predict has no loss, so its outputs' means are weighted by the chunks' samples."
            )
            weights = held.step_weights(step.plan, step.inputs, "samples", step.call.warnings)
        if step.terms is not None:
            step.terms.weigh(losses, weights)
    return losses, weights


def exact_outputs(step: StepContext) -> list[Any]:
    """``step.outputs`` with the losses shifted so that the gather's weighted sum is the whole batch's loss
    (``loss_weighting="terms"``: :meth:`~lightning_sparse_dp.loss.step.StepTerms.exact_outputs`); as they are otherwise.
    Stage ``weigh``."""
    if step.terms is None:
        return step.outputs
    assert step.weights is not None
    with step.call.timer.stage("weigh"):
        return step.terms.exact_outputs(step.outputs, step.weights)


__all__ = ["exact_outputs", "weigh"]
