"""Manual optimization on replicas: ``manual_backward`` and the optimizer's calls of a step, met by every replica.

With ``automatic_optimization = False`` the step itself calls ``opt.zero_grad()``, ``self.manual_backward(loss)``
and ``opt.step()`` (a GAN's two optimizers, a step that backpropagates twice). Each replica runs the step on its
chunk, in its own thread, so each of those calls is made once per replica.
:func:`~lightning_sparse_dp.step.stand_ins.installed` puts stand-ins on every replica for the step; at each such
call the replicas meet (a call of the step's :class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup`,
``all_gather_apply``: the replica that completes it does the work once, the others wait):

- ``manual_backward(loss)``: the whole batch's weights of the replicas' losses are decided once, from every
  replica's loss (``loss_weighting="terms"``: each captured loss's own share, as after an automatic step,
  :mod:`~lightning_sparse_dp.loss.decide`; else the chunks' weights); then each replica runs its own backward in
  its own thread with its weight, and once all are done their gradients are added in replica order into the
  module's ``.grad`` (:meth:`~lightning_sparse_dp.step.replicate.Replicas.reduce_gradients`), then
  ``on_after_backward`` runs once;
- after it, each replica's parameters hold the reduced gradients in ``.grad``, as each DDP rank's hold the
  all-reduced ones, so that the step reads them and clips them as one device's step does
  (``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)``, a gradient norm logged): the root replica's are the
  module's own gradient tensors (what it does to them is what the optimizer steps with), every other replica's a copy
  of them (made before any replica goes on; what it does to its copy reaches nothing); they are cleared before each
  replica's next backward and when the step ends;
- ``opt.step()``, ``opt.zero_grad()``, ``lr_schedulers().step()``, ``self.clip_gradients(...)`` and
  ``self.toggle_optimizer(opt)`` / ``self.untoggle_optimizer(opt)`` run once, on the module (CUDA replicas on other
  devices then get the stepped parameters); a toggle's ``requires_grad`` is then given to the replicas' parameters, so
  that their backward leaves the other optimizers' parameters without gradients, as one device's does.

So a manual step on N replicas is the step on one device with the whole batch (``tests/step/test_manual.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_sparse_dp.loss.step import StepTerms
from lightning_sparse_dp.loss.weights import zeroed
from lightning_sparse_dp.runtime.compat import call_after_backward, call_before_backward, trainer_of
from lightning_sparse_dp.runtime.process import SAID_ONCE as _OVERRIDE_SAID
from lightning_sparse_dp.step.replicate import Replicas
from lightning_sparse_dp.step.stand_ins import ONCE, installed, refuse_direct_step
from lightning_sparse_dp.syncbn.collective import ThreadGroup

#: ``LightningModule.backward`` as Lightning defines it (``loss.backward()``): a module that overrides it gets its own
_DEFAULT_BACKWARD = LightningModule.backward

class ManualStep:
    """What the replicas of one manual-optimization step share.

    Args:
        module: the LightningModule.
        replicas: the persistent replicas (their first ``count`` run the step).
        count: replicas in the step.
        group: the step's thread group (the batch-norm group when there is one, so that every rendezvous of a
            replica, batch norm's and these, is numbered in one sequence).
        weights: the chunks' weights (``"auto"``'s or the given ``loss_weighting``'s).
        terms: the step's term captures under ``loss_weighting="terms"`` (made with the step's plan), else ``None``.
    """

    def __init__(
        self, module: nn.Module, replicas: Replicas, count: int, group: ThreadGroup, weights: Sequence[float],
        terms: StepTerms | None, on_module: Callable[[Callable[[], Any]], Any],
    ) -> None:
        self.module, self.replicas, self.count, self.group = module, replicas, count, group
        self.weights, self.terms = list(weights), terms
        # the module's own hooks, run once: what they change on it is one device's (ModuleChanges.once_on_module)
        self.on_module = on_module
        self._versions = self._marks()  # the module's parameters as the step (or its last optimizer step) left them

    # --- the stand-ins, called in replica threads ------------------------------------------------
    def manual_backward(self, rank: int, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if args or kwargs.get("retain_graph") or kwargs.get("create_graph"):
            raise RuntimeError(
                "sparse_dp: manual_backward(loss, ...) takes no backward arguments on replicas (each replica's graph "
                "runs once, first order). Call it once per loss."
            )
        weight = self.group.all_gather_apply(rank, loss, ("manual_backward",), self._decide)[rank]
        for param in self.replicas.parameters[rank]:  # the reduced gradients an earlier backward exposed: not its own
            param.grad = None
        if loss.requires_grad:
            backward = type(self.module).backward
            if backward is _DEFAULT_BACKWARD:
                torch.autograd.backward(loss if weight != 0 else zeroed(loss), torch.full_like(loss, weight))
            else:  # the module's own backward (LightningModule.backward overridden), on the replica's weighted loss
                if rank == 0:
                    _OVERRIDE_SAID.info(
                        "sparse_dp: the module's own backward(loss) runs on each replica's weighted loss under manual "
                        "optimization (weight * the chunk's loss): the whole batch's gradient where it is linear in the "
                        "loss ((0.25 * loss).backward()), not where it is not (loss.pow(2).backward()); write such a "
                        "transform in the step, on the loss given to manual_backward."
                    )
                backward(self.replicas.modules[rank], (loss if weight != 0 else zeroed(loss)) * weight)
        self.group.all_gather_apply(rank, None, ("reduce",), lambda _: self._reduce())

    def once(self, rank: int, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` run once for the step's replicas (by the replica that arrives last), its result to every one; an
        optimizer's step inside it is the replicas' one step
        (:func:`~lightning_sparse_dp.step.stand_ins.refuse_direct_step` lets it through)."""

        def run(_: Any) -> Any:
            ONCE.inside = True
            try:
                return fn()
            finally:
                ONCE.inside = False

        return self.group.all_gather_apply(rank, None, (name,), run)

    # --- run once, by the replica that completes the rendezvous ------------------------------------
    def _decide(self, losses: list[Tensor]) -> list[float]:
        decision = self.terms.scale_terms(losses, self.weights) if self.terms is not None else None
        trainer = trainer_of(self.module)
        if trainer is not None:  # on_before_backward once, with the whole batch's loss (its value), as one device's
            root = self.replicas.devices[0]
            if decision is not None and decision.value is not None:  # the terms' whole-batch value
                whole = torch.tensor(decision.value, dtype=losses[0].dtype, device=root)
            else:
                whole = sum(float(w) * loss.detach().to(root) for w, loss in zip(self.weights, losses))
            self.on_module(partial(call_before_backward, trainer, whole))
        scale = self._loss_scale()
        return [w * scale for w in self.weights]

    def _loss_scale(self) -> float:
        """The precision plugin's loss scale (16-mixed's ``GradScaler``), else 1: Lightning's ``manual_backward``
        scales the loss (``precision_plugin.pre_backward``) and the optimizer step unscales the gradients, so each
        replica's backward must start from the scaled weight too. Scaling a root-device tensor also makes the scaler
        set up its scale there, where the step's ``unscale_`` looks for it."""
        trainer = trainer_of(self.module)
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.scale(torch.ones((), device=self.replicas.devices[0])).item())

    def _reduce(self) -> None:
        grads = self.replicas.reduce_gradients(self.count)
        leaves, sums = [], []  # accumulated by autograd, as one device's backward does: the parameters' own hooks
        for parameter, grad in zip(self.replicas.trainable, grads):  # (p.register_hook) run on the batch's gradient
            if grad is None:
                continue
            grad = grad.to(parameter.device)
            if parameter.requires_grad:
                leaves.append(parameter)
                sums.append(grad)
            else:  # a parameter frozen since the replicas were built (toggle_optimizer): as the replicas gave it
                parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        if leaves:
            with torch.autograd.set_multithreading_enabled(False):
                torch.autograd.backward(leaves, sums)
        self.expose()
        trainer = trainer_of(self.module)
        if trainer is not None:
            self.on_module(partial(call_after_backward, trainer))

    def expose(self) -> None:
        """The module's gradients as the replicas' ``.grad``: the root replica's the module's own tensors (on the root
        device), the others' copies; run once, while every replica waits (so no replica reads what another changes)."""
        for rank, params in enumerate(self.replicas.parameters[: self.count]):
            for param, source in zip(params, self.replicas.trainable):
                grad = source.grad
                if grad is not None and (rank > 0 or grad.device != param.device):
                    grad = grad.to(param.device, copy=True)
                param.grad = grad

    def hide(self) -> None:
        """The replicas' ``.grad`` cleared (when the step ends); parameters the step changed in place after its last
        optimizer step (an update by hand, without an optimizer) said."""
        self._say_changed_in_place()
        for params in self.replicas.parameters[: self.count]:
            for param in params:
                param.grad = None

    def toggled(self, toggle: Callable[[], Any]) -> Any:
        """``toggle()`` (the module's ``toggle_optimizer`` / ``untoggle_optimizer``), then each replica's parameters
        given their module parameter's ``requires_grad``; run once."""
        out = toggle()
        for params in self.replicas.parameters[: self.count]:
            for param, source in zip(params, self.replicas.trainable):
                param.requires_grad_(source.requires_grad)
        return out

    def _marks(self) -> list[int]:
        return [p._version for p in self.replicas.trainable]

    def _say_changed_in_place(self) -> None:
        """Said once, before an optimizer's step: the step changed the module's trainable parameters in place since the
        step began (or since the last optimizer step): CPU replicas share them (their version counters too), so every
        replica made the change, where one device's step makes it once."""
        if self.count < 2 or self.replicas.devices[0].type != "cpu":
            return
        changed = [p for p, before, now in zip(self.replicas.trainable, self._versions, self._marks()) if before != now]
        if changed:
            names = {id(p): n for n, p in self.module.named_parameters()}
            shown = ", ".join(names.get(id(p), "?") for p in changed[:3]) + (", ..." if len(changed) > 3 else "")
            _OVERRIDE_SAID.warn(
                f"sparse_dp: the manual step changed the module's parameters in place outside the optimizer's step "
                f"({shown}: a decay or update by hand, p.mul_(0.95)): CPU replicas share them, so every replica made "
                "the change, once per replica, where one device's step makes it once. Make it through the optimizer "
                "(weight_decay=), or once per step in on_train_batch_end or an optimizer_step override."
            )

    def write_back(self) -> None:
        """Before an optimizer's step: the param groups the root replica changed in the step (its copies) into the
        trainer's optimizers, as rank 0's optimizer steps with its own groups, and the gradients the root replica's step
        gave its parameters in place of those it was given (``p.grad = p.grad.clamp(-c, c)``) into the module's, as
        rank 0's optimizer steps with its own gradients (run once, while every replica waits)."""
        self._say_changed_in_place()
        root = self.replicas.rank_optimizers[0] if self.replicas.rank_optimizers else None
        if root is not None and root.copies:
            root.write_back()
        if self.replicas.parameters:  # the root replica was given the module's own gradient tensors (expose)
            for param, source in zip(self.replicas.parameters[0], self.replicas.trainable):
                grad = param.grad
                if grad is not None and grad is not source.grad and grad.device == source.device:
                    source.grad = grad

    def stepped(self) -> None:
        """After an optimizer step: CUDA replicas on other devices get the module's new parameters."""
        self.replicas._copy_parameters(self.count)
        self._versions = self._marks()


#: ``inside``: whether the calling thread runs a call the replicas make once (:meth:`ManualStep.once`)
@contextmanager
def manual_step(
    module: nn.Module, replicas: Replicas, step_replicas: Sequence[nn.Module], group: ThreadGroup | None,
    weights: Sequence[float], terms: StepTerms | None, on_module: Callable[[Callable[[], Any]], Any],
) -> Iterator[ThreadGroup]:
    """A ``sparse_dp`` step under manual optimization: a :class:`ManualStep` installed on the step's replicas
    (:func:`~lightning_sparse_dp.step.stand_ins.installed`), with the step's thread group (a new one when no batch
    norm is synchronized) and the chunks' ``weights``, needed inside the step, so computed before it; yields the
    group. ``on_module(fn)`` runs the module's own hooks the step calls once
    (:meth:`~lightning_sparse_dp.replica.changes.ModuleChanges.once_on_module`)."""
    group = group if group is not None else ThreadGroup(len(step_replicas))
    trainer = trainer_of(module)
    hooks = [o.register_step_pre_hook(refuse_direct_step) for o in getattr(trainer, "optimizers", None) or ()]
    try:
        with installed(ManualStep(module, replicas, len(step_replicas), group, weights, terms, on_module), step_replicas):
            yield group
    finally:
        for hook in hooks:
            hook.remove()


__all__ = ["ManualStep", "manual_step"]
