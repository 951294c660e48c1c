"""Probe: the float64 copies and the batch the exactness check runs on, apart from everything the user has.

The check (:mod:`~lightning_sparse_dp.exactness.check`) runs the first training step twice, on one device and on the
replicas, and must leave no trace: each run gets its own :func:`float64_copy` of the module (its trainer a view whose
loggers run nothing, :func:`~lightning_sparse_dp.replica.effects.trainer_view`), the batch converted as Lightning's
``precision="64-true"`` converts it (:func:`float64_batch`), and the process's random generators set to one state
before each run and given back after (:class:`RandomStates`). What both runs leave out (:func:`held_out`: batch norm
in eval mode where it is not synchronized, dropout) and the modules whose own hooks the copies would call
(:func:`hooked_modules`) are said with the outcome.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_sparse_dp.replica.effects import trainer_view
from lightning_sparse_dp.runtime.compat import set_trainer
from lightning_sparse_dp.runtime.me import ME
from lightning_sparse_dp.split import SparseSpec
from lightning_sparse_dp.split.cut import sparse_kwargs
from lightning_sparse_dp.step.scatter import SharedManagers
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm


def float64_copy(module: nn.Module, trainer: Any, batch_norm_eval: bool, one_device: bool = False) -> nn.Module:
    """A deep copy of ``module`` in float64 (``module.double()``, as ``precision="64-true"`` converts it), attached to a
    view of ``trainer`` (its state shared, its loggers' calls run nowhere while the check runs).

    Dropout layers (``torch.nn`` ``Dropout*``, so ME's ``MinkowskiDropout`` too) are put in eval mode: one device and
    the replicas then draw nothing there and can be compared. ``batch_norm_eval``: batch norm in eval mode too (used
    for batch norm that is not synchronized across replicas: each replica normalizes its own chunk, which the strategy
    said at setup; the check then compares the rest of the step). ``one_device``: the copy for one device's run, its
    synchronized batch norm (:class:`~lightning_sparse_dp.syncbn.batchnorm.SyncBatchNorm`) given no collective, so
    that it is plain batch norm. The trainer, datasets, DataLoaders and batch-norm collectives the module refers to are
    shared, not copied.

    Raises:
        Exception: what ``copy.deepcopy`` raises for a module that cannot be copied (the check says it and trains on).
    """
    memo: dict[int, Any] = {}
    if trainer is not None:
        memo[id(trainer)] = trainer
    for m in module.modules():
        for name, value in vars(m).items():
            if isinstance(value, (Dataset, DataLoader)) or (isinstance(m, SyncBatchNorm) and name == "collective"):
                memo[id(value)] = value
    twin = copy.deepcopy(module, memo)
    twin.double()
    set_trainer(twin, trainer_view(trainer))
    for m in twin.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()
        elif batch_norm_eval and isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
        if one_device and isinstance(m, SyncBatchNorm):
            m.collective = None
    return twin


def _double(x: Tensor) -> Tensor:
    """A copy of ``x`` (a step may change its batch in place), floating ones in float64."""
    return x.to(torch.float64, copy=True) if x.is_floating_point() else x.clone()


def _double_me(x: Any) -> SparseSpec:
    """An ``ME.SparseTensor`` / ``ME.TensorField`` as a spec with float64 features, to build on its device as the
    scatter builds a chunk's (:class:`~lightning_sparse_dp.step.scatter.SharedManagers`)."""
    return SparseSpec(type(x), _double(x.F), x.C.clone(), sparse_kwargs(x), manager=id(x.coordinate_manager))


def float64_batch(batch: Any) -> Any:
    """A copy of ``batch`` (every tensor copied: a step may change its batch in place) with its floating tensors in
    float64, as Lightning's ``precision="64-true"`` converts it, ME tensors (whose features Lightning does not reach;
    rebuilt on coordinate managers of their own, those that shared one on one) and the chunks of a split batch
    (:class:`~lightning_sparse_dp.split.SparseSpec` features) included."""
    build = SharedManagers()  # a split batch's own specs stay specs: only the batch's ME tensors are built here
    batch = apply_to_collection(batch, (ME.SparseTensor, ME.TensorField), lambda x: build(_double_me(x)))
    return apply_to_collection(batch, Tensor, _double)


class RandomStates:
    """The states of torch's generators (CPU, and every GPU's once CUDA is initialized), NumPy's global generator and
    Python's ``random``: taken once, set again before each run, compared after one, given back at the end."""

    def __init__(self) -> None:
        self.saved = _collect()

    def restore(self) -> None:
        torch.set_rng_state(self.saved["torch"])
        if "cuda" in self.saved:
            torch.cuda.set_rng_state_all(self.saved["cuda"])
        np.random.set_state(self.saved["numpy"])
        random.setstate(self.saved["python"])

    def drawn(self) -> list[str]:
        """The generators that moved since :meth:`restore` (a run drew random numbers from them)."""
        now = _collect()
        moved = [name for name in ("torch", "cuda") if name in now and not _same(now[name], self.saved.get(name))]
        if not _same_numpy(now["numpy"], self.saved["numpy"]):
            moved.append("numpy")
        if now["python"] != self.saved["python"]:
            moved.append("python")
        return moved


def _collect() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return isinstance(b, Tensor) and bool(torch.equal(a, b))


def _same_numpy(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and bool(np.array_equal(a[1], b[1])) and tuple(a[2:]) == tuple(b[2:])


class OptimizerGroups:
    """The hyperparameters of the trainer's optimizers (each param group's entries but its ``params``) and the states of
    its learning-rate schedulers (``state_dict()``): taken once, set again before each run and given back at the end, so
    that a step that changes them (a warm-up written in ``training_step``: ``g["lr"] *= 0.5``,
    ``self.lr_schedulers().step()``) changes them in the fit, not in the check's runs of its copies, which reach the
    trainer's optimizers and schedulers through ``self.optimizers()`` and ``self.lr_schedulers()``."""

    def __init__(self, trainer: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", None) or ())
        self.saved = [(g, {k: v for k, v in g.items() if k != "params"}) for o in optimizers for g in o.param_groups]
        schedulers = [c.scheduler for c in getattr(trainer, "lr_scheduler_configs", None) or ()]
        self.schedulers = [(s, copy.deepcopy(s.state_dict())) for s in schedulers if hasattr(s, "state_dict")]

    def restore(self) -> None:
        for group, values in self.saved:
            group.update(values)
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(copy.deepcopy(state))


@contextmanager
def given_back(states: RandomStates, groups: OptimizerGroups | None = None) -> Iterator[RandomStates]:
    """``states`` (and ``groups``) set before the block and given back after it, whatever the block drew or raised."""
    states.restore()
    try:
        yield states
    finally:
        states.restore()
        if groups is not None:
            groups.restore()


@contextmanager
def kept_stop(trainer: Any) -> Iterator[None]:
    """``trainer.should_stop`` as it was before the block (the check's runs of the step may set it)."""
    stop = getattr(trainer, "should_stop", None)
    try:
        yield
    finally:
        if stop is not None:
            trainer.should_stop = stop


def hooked_modules(module: nn.Module, shown: int = 3) -> list[str]:
    """The modules of ``module`` with forward or backward hooks of their own (``register_forward_hook``, ...; torch's
    global module hooks as ``"global"``), the first ``shown`` of them named and the rest counted: the check's deep
    copies would call those hooks, whose calls reach what they hold (a callback's list), where the fit without the
    check does not call them (the check leaves no trace)."""
    found = [name or "the module itself" for name, m in module.named_modules() if any(
        _users(getattr(m, hooks, None)) for hooks in _HOOKS)]
    if any(_users(getattr(torch.nn.modules.module, hooks, None)) for hooks in _GLOBAL_HOOKS):
        found.insert(0, "global")
    return found[:shown] + ([f"{len(found) - shown} more"] if len(found) > shown else [])


def _users(hooks: Any) -> bool:
    """Whether a hook dict holds a hook that is not torch's own (``spectral_norm``'s and legacy ``weight_norm``'s, which
    compute a weight from the copy's own parameters, as ``torch.nn.utils.prune``'s do): one that may reach what it
    holds."""
    return bool(hooks) and any(not (getattr(h, "__module__", None) or "").startswith("torch.") for h in hooks.values())


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def held_out(module: nn.Module, batch_norm_eval: bool) -> list[str]:
    """What both of the check's runs leave out of the step (:func:`~lightning_sparse_dp.exactness.probe.float64_copy`),
    in words for its line (``{who}``: replica or rank): training's batch norm when it is not synchronized, and dropout;
    so that "equals one device's" never claims them."""
    held = []
    if batch_norm_eval:
        held.append("batch norm in eval mode (not synchronized, training normalizes each {who}'s chunk by itself, "
                    "not the whole batch as one device does; sync_batchnorm=True makes it one device's)")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules()):
        held.append("dropout off (in training each {who} draws its own masks, as DDP ranks do)")
    return held


__all__ = [
    "OptimizerGroups", "RandomStates", "float64_batch", "float64_copy", "given_back", "held_out", "hooked_modules",
    "kept_stop",
]
