"""Manual optimization on replicas: ``manual_backward`` and the optimizer's calls of a step, met by every replica.

With ``automatic_optimization = False`` the step itself calls ``opt.zero_grad()``, ``self.manual_backward(loss)``
and ``opt.step()`` (a GAN's two optimizers, a step that backpropagates twice). Each replica runs the step on its
chunk, in its own thread, so each of those calls is made once per replica. :func:`installed` puts stand-ins on
every replica for the step; at each such call the replicas meet (a call of the step's
:class:`~lightning_sparse_dp.syncbn.collective.ThreadGroup`, ``all_gather_apply``: the replica that completes it
does the work once, the others wait):

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

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_sparse_dp.loss.step import StepTerms
from lightning_sparse_dp.loss.weights import zeroed
from lightning_sparse_dp.replica.optimizers import rank_view
from lightning_sparse_dp.runtime.compat import call_after_backward, call_before_backward, trainer_of
from lightning_sparse_dp.runtime.process import SAID_ONCE as _OVERRIDE_SAID
from lightning_sparse_dp.step.replicate import Replicas
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
        optimizer's step inside it is the replicas' one step (:func:`_refuse_direct_step` lets it through)."""

        def run(_: Any) -> Any:
            _once.inside = True
            try:
                return fn()
            finally:
                _once.inside = False

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
_once = threading.local()


def _refuse_direct_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    """An optimizer's step pre-hook for a manual step on replicas: a step that is not the replicas' one step (through
    ``self.optimizers()``) is one each replica makes, so it is refused before it changes anything."""
    if not getattr(_once, "inside", False):
        raise RuntimeError(
            f"sparse_dp: the step called step() of a {type(optimizer).__name__} it reached outside self.optimizers() "
            "(self.trainer.optimizers[0], an optimizer kept on the module): every replica runs the step, so every "
            "replica would step it. Reach it through self.optimizers(), whose calls the strategy makes once for the "
            "replicas, or train with strategy='sparse_ddp', where each rank steps its own."
        )


class _Once:
    """Stands in for an optimizer or scheduler in a replica: ``step`` / ``zero_grad`` run once per step's replicas."""

    def __init__(self, manual: ManualStep, rank: int, target: Any, name: str) -> None:
        self._manual, self._rank, self._target, self._name = manual, rank, target, name

    def step(self, *args: Any, **kwargs: Any) -> Any:
        closure = kwargs.pop("closure", None) if "closure" in kwargs else args[0] if args and callable(args[0]) else None
        if closure is not None:
            return self._closure_step(closure, args[1:] if args and args[0] is closure else args, kwargs)

        def run() -> Any:
            if self._name.startswith("optimizer"):
                self._manual.write_back()
            out = self._target.step(*args, **kwargs)
            if self._name.startswith("optimizer"):
                self._manual.stepped()
            return out

        return self._manual.once(self._rank, f"{self._name}.step", run)

    def _closure_step(self, closure: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``opt.step(closure)``: every replica runs its own closure in its thread first (its ``zero_grad`` and
        ``manual_backward`` meet the others', as outside a closure), then the optimizer steps once with the reduced
        gradients, handed a closure that gives the loss already computed (Lightning's wrapper around it runs the
        ``on_before_optimizer_step`` hooks and the clipping once). Each replica gets its own loss back, as each DDP rank
        does. An optimizer that evaluates the closure several times per step (``torch.optim.LBFGS``: a line search at
        new parameters) is refused: the replicas cannot follow those evaluations."""
        optimizer = getattr(self._target, "optimizer", self._target)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise RuntimeError(
                "sparse_dp: opt.step(closure) with torch.optim.LBFGS evaluates the closure several times per step, at "
                "parameters its line search picks, which the replicas cannot follow together. Train an LBFGS module "
                "with strategy='sparse_ddp' (each rank runs its own closure) or on one device."
            )
        with torch.enable_grad():  # as the optimizer calls it
            loss = closure()

        def run() -> Any:
            self._manual.write_back()
            self._target.step(lambda: loss, *args, **kwargs)  # the gradients are the replicas' reduced ones already
            self._manual.stepped()

        self._manual.once(self._rank, f"{self._name}.step", run)
        return loss

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """An optimizer's groups as this replica's own copies (:class:`~lightning_sparse_dp.replica.optimizers.RankOptimizer`),
        as each DDP rank changes its own optimizer's; a scheduler's target's groups as they are."""
        return (rank_view(self._target) if self._name.startswith("optimizer") else self._target).param_groups

    @property
    def optimizer(self) -> Any:
        """An optimizer's torch optimizer, or a scheduler's optimizer, as this replica's view
        (:func:`~lightning_sparse_dp.replica.optimizers.rank_view`): its param groups the replica's own copies."""
        return rank_view(self._target.optimizer)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        def run() -> None:
            self._target.zero_grad(*args, **kwargs)
            if self._name.startswith("optimizer"):
                self._manual.expose()  # the replicas' .grad as the module's now are

        self._manual.once(self._rank, f"{self._name}.zero_grad", run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextmanager
def installed(manual: ManualStep, replicas: Sequence[nn.Module]) -> Iterator[None]:
    """For the ``with`` body (the replicas' step), each replica's ``manual_backward``, ``optimizers()``,
    ``lr_schedulers()``, ``clip_gradients``, ``toggle_optimizer`` and ``untoggle_optimizer`` are :class:`ManualStep`'s
    stand-ins (instance attributes, removed after, with the gradients the replicas were shown)."""
    module = manual.module
    for rank, replica in enumerate(replicas):
        replica.manual_backward = _bound(manual.manual_backward, rank)
        replica.optimizers = _optimizers(manual, rank, module)
        replica.lr_schedulers = _schedulers(manual, rank, module)
        replica.clip_gradients = _clip(manual, rank, module)
        replica.toggle_optimizer = _toggle(manual, rank, module, "toggle_optimizer")
        replica.untoggle_optimizer = _toggle(manual, rank, module, "untoggle_optimizer")
    try:
        yield
    finally:
        manual.hide()
        for replica in replicas:
            for name in _STAND_INS:
                replica.__dict__.pop(name, None)


_STAND_INS = ("manual_backward", "optimizers", "lr_schedulers", "clip_gradients", "toggle_optimizer", "untoggle_optimizer")


def _bound(fn: Callable[..., Any], rank: int) -> Callable[..., Any]:
    def bound(*args: Any, **kwargs: Any) -> Any:
        return fn(rank, *args, **kwargs)

    return bound


def _optimizers(manual: ManualStep, rank: int, module: Any) -> Callable[..., Any]:
    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = type(module).optimizers(module, use_pl_optimizer)
        if isinstance(found, list):
            return [_Once(manual, rank, o, f"optimizer{i}") for i, o in enumerate(found)]
        return _Once(manual, rank, found, "optimizer0")

    return optimizers


def _schedulers(manual: ManualStep, rank: int, module: Any) -> Callable[[], Any]:
    def lr_schedulers() -> Any:
        found = type(module).lr_schedulers(module)
        if found is None:
            return None
        if isinstance(found, list):
            return [_Once(manual, rank, s, f"scheduler{i}") for i, s in enumerate(found)]
        return _Once(manual, rank, found, "scheduler0")

    return lr_schedulers


def _clip(manual: ManualStep, rank: int, module: Any) -> Callable[..., None]:
    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        target = optimizer._target if isinstance(optimizer, _Once) else optimizer

        def clip() -> None:
            type(module).clip_gradients(module, target, *args, **kwargs)
            manual.expose()  # every replica's .grad the clipped gradients, as each DDP rank's after its clipping

        manual.once(rank, "clip_gradients", clip)

    return clip_gradients


def _toggle(manual: ManualStep, rank: int, module: Any, name: str) -> Callable[[Any], None]:
    def toggle(optimizer: Any) -> None:
        target = optimizer._target if isinstance(optimizer, _Once) else optimizer
        manual.once(rank, name, lambda: manual.toggled(lambda: getattr(type(module), name)(module, target)))

    return toggle


@contextmanager
def manual_step(
    module: nn.Module, replicas: Replicas, step_replicas: Sequence[nn.Module], group: ThreadGroup | None,
    weights: Sequence[float], terms: StepTerms | None, on_module: Callable[[Callable[[], Any]], Any],
) -> Iterator[ThreadGroup]:
    """A ``sparse_dp`` step under manual optimization: a :class:`ManualStep` installed on the step's replicas
    (:func:`installed`), with the step's thread group (a new one when no batch norm is synchronized) and the chunks'
    ``weights``, needed inside the step, so computed before it; yields the group. ``on_module(fn)`` runs the module's
    own hooks the step calls once (:meth:`~lightning_sparse_dp.replica.changes.ModuleChanges.once_on_module`)."""
    group = group if group is not None else ThreadGroup(len(step_replicas))
    trainer = trainer_of(module)
    hooks = [o.register_step_pre_hook(_refuse_direct_step) for o in getattr(trainer, "optimizers", None) or ()]
    try:
        with installed(ManualStep(module, replicas, len(step_replicas), group, weights, terms, on_module), step_replicas):
            yield group
    finally:
        for hook in hooks:
            hook.remove()


__all__ = ["ManualStep", "installed", "manual_step"]
