"""Optimizers: what each replica reaches as ``self.optimizers()`` in a step, as each DDP rank has its own optimizer.

The replicas run the step in threads of one process and share the trainer's optimizers. A step that changes an
optimizer's hyperparameters in place (``for g in self.optimizers().param_groups: g["lr"] *= 0.5``, a warm-up
written in ``training_step``) would change them once per replica, where one device changes them once and each of
Lightning's DDP ranks changes its own optimizer. So each replica gets, as its ``optimizers``, a
:class:`RankOptimizers`: the module's optimizers, each behind a :class:`RankOptimizer` whose ``param_groups`` are the
replica's own copies of the groups for the step (dicts copied from the trainer's at their first read in the step,
their ``params`` lists shared), which no other replica sees. After the step the root replica's copies are written
back into the trainer's optimizers (:meth:`RankOptimizers.write_back`), as rank 0's optimizer is the one that
checkpoints keep; the others' are dropped when their replica is refreshed for the next step
(:meth:`~lightning_sparse_dp.step.replicate.Replicas.refresh_replica`). The replica's trainer view shows the same
views as ``self.trainer.optimizers`` (:mod:`~lightning_sparse_dp.replica.effects`). Under manual optimization the
step's own stand-ins (:mod:`~lightning_sparse_dp.step.manual`) take their place for the step, with the same copies as
their ``param_groups``; the root replica's are written back before each optimizer step, which then uses them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_sparse_dp.runtime.process import STEP_EFFECTS as _current

#: ``id(group) -> (the trainer's group, the replica's copy, the group's entries when copied)``
Copies = dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]


class RankOptimizer:
    """An optimizer (a ``LightningOptimizer`` or torch's) as a replica sees it in a step: ``param_groups`` its own copies
    (``copies``, shared by the replica's views), the rest the optimizer's."""

    def __init__(self, optimizer: Any, copies: Copies, params: dict[int, Any] | None = None) -> None:
        self._optimizer, self._copies, self._params = optimizer, copies, params or {}

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(view, torch.optim.SGD) holds, as for the optimizer itself
        return type(self._optimizer)

    @property
    def optimizer(self) -> Any:
        """A ``LightningOptimizer``'s torch optimizer, as the same replica's view (its groups the same copies)."""
        return RankOptimizer(self._optimizer.optimizer, self._copies, self._params)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        copies, out = self._copies, []
        for group in self._optimizer.param_groups:
            entry = copies.get(id(group))
            if entry is None:
                mine = dict(group)  # its parameters the replica's own (their .grad the replica's), as a DDP rank's are
                mine["params"] = [self._params.get(id(p), p) for p in group["params"]]
                entry = copies[id(group)] = (group, mine, dict(group))
            out.append(entry[1])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class RankOptimizers:
    """A replica's ``optimizers`` (``LightningModule.optimizers``'s signature): ``module``'s optimizers, each a
    :class:`RankOptimizer` over :attr:`copies`, the replica's group copies for the step (emptied by its refresh)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.copies: Copies = {}
        #: ``id(module's parameter) -> the replica's``: the params of the replica's group copies (set by the replicas)
        self.params: dict[int, Any] = {}

    def __call__(self, use_pl_optimizer: bool = True) -> Any:
        found = type(self.module).optimizers(self.module, use_pl_optimizer)  # type: ignore[attr-defined]
        if isinstance(found, list):
            return [RankOptimizer(o, self.copies, self.params) for o in found]
        return RankOptimizer(found, self.copies, self.params)

    def write_back(self) -> None:
        """The hyperparameters the replica changed in its copies (entries but ``params`` that differ from the group's
        when copied) into the trainer's groups; the copies dropped. What changed the trainer's groups meanwhile (a
        scheduler stepped in the step) stays where the replica left an entry as it found it."""
        for group, copy, found in self.copies.values():
            group.update((k, v) for k, v in copy.items() if k != "params" and (k not in found or found[k] is not v))
        self.copies.clear()


def rank_view(optimizer: Any) -> Any:
    """``optimizer`` as the calling replica's step sees it: a :class:`RankOptimizer` over the replica's copies, in a
    step of several replicas (``self.lr_schedulers().optimizer``, ``self.trainer.strategy.optimizers``, a manual
    step's ``opt.optimizer``); ``optimizer`` itself elsewhere, or when it is a view already."""
    effects = getattr(_current, "effects", None)
    views = None if effects is None else effects.rank_optimizers
    if not views or type(optimizer) is RankOptimizer or optimizer is None:
        return optimizer
    index = _current.index
    view = views[index] if index < len(views) else None
    return optimizer if view is None else RankOptimizer(optimizer, view.copies, view.params)


__all__ = ["RankOptimizer", "RankOptimizers", "rank_view"]
