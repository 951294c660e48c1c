"""Stand-ins: what a replica's manual step reaches in place of ``self.optimizers()``, ``self.lr_schedulers()``,
``self.manual_backward``, ``self.clip_gradients`` and ``self.toggle_optimizer`` / ``untoggle_optimizer``.

Each replica runs the step on its chunk, so each would make those calls. :func:`installed` puts stand-ins on every
replica for the step: their calls meet the other replicas' at the step's
:class:`~lightning_sparse_dp.step.manual.ManualStep`, which makes each once (an optimizer's ``step`` and
``zero_grad``, a scheduler's ``step``: :class:`Once`). An optimizer stepped some other way (reached through
``self.trainer.optimizers``) is refused before it changes anything (:func:`refuse_direct_step`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_sparse_dp.replica.optimizers import rank_view

if TYPE_CHECKING:
    from lightning_sparse_dp.step.manual import ManualStep


#: whether the calling thread is inside the replicas' one optimizer step
#: (:meth:`~lightning_sparse_dp.step.manual.ManualStep.once`)
ONCE = threading.local()


def refuse_direct_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    """An optimizer's step pre-hook for a manual step on replicas: a step that is not the replicas' one step (through
    ``self.optimizers()``) is one each replica makes, so it is refused before it changes anything."""
    if not getattr(ONCE, "inside", False):
        raise RuntimeError(
            f"sparse_dp: the step called step() of a {type(optimizer).__name__} it reached outside self.optimizers() "
            "(self.trainer.optimizers[0], an optimizer kept on the module): every replica runs the step, so every "
            "replica would step it. Reach it through self.optimizers(), whose calls the strategy makes once for the "
            "replicas, or train with strategy='sparse_ddp', where each rank steps its own."
        )


class Once:
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
    ``lr_schedulers()``, ``clip_gradients``, ``toggle_optimizer`` and ``untoggle_optimizer`` are
    :class:`~lightning_sparse_dp.step.manual.ManualStep`'s stand-ins (instance attributes, removed after, with the
    gradients the replicas were shown)."""
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
            return [Once(manual, rank, o, f"optimizer{i}") for i, o in enumerate(found)]
        return Once(manual, rank, found, "optimizer0")

    return optimizers


def _schedulers(manual: ManualStep, rank: int, module: Any) -> Callable[[], Any]:
    def lr_schedulers() -> Any:
        found = type(module).lr_schedulers(module)
        if found is None:
            return None
        if isinstance(found, list):
            return [Once(manual, rank, s, f"scheduler{i}") for i, s in enumerate(found)]
        return Once(manual, rank, found, "scheduler0")

    return lr_schedulers


def _clip(manual: ManualStep, rank: int, module: Any) -> Callable[..., None]:
    def clip_gradients(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        target = optimizer._target if isinstance(optimizer, Once) else optimizer

        def clip() -> None:
            type(module).clip_gradients(module, target, *args, **kwargs)
            manual.expose()  # every replica's .grad the clipped gradients, as each DDP rank's after its clipping

        manual.once(rank, "clip_gradients", clip)

    return clip_gradients


def _toggle(manual: ManualStep, rank: int, module: Any, name: str) -> Callable[[Any], None]:
    def toggle(optimizer: Any) -> None:
        target = optimizer._target if isinstance(optimizer, Once) else optimizer
        manual.once(rank, name, lambda: manual.toggled(lambda: getattr(type(module), name)(module, target)))

    return toggle


__all__ = ["ONCE", "Once", "installed", "refuse_direct_step"]
