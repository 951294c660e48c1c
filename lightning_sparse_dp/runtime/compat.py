"""Compat: every private name of Lightning and torchmetrics the package uses, named and reached here only.

Lightning and torchmetrics promise nothing about names that start with ``_``; the strategies need a few of them to do
what Lightning's own strategies do from inside (run a hook as the Trainer runs it, read what a step logged) and to
merge metric states across replicas. Each use is one entry below, with the versions it was checked at:
``tests/runtime/test_compat.py`` exercises every entry on real objects, and ``scripts/min_versions.sh`` runs it at the
lowest versions ``pyproject.toml`` admits (Lightning 2.4, torchmetrics 1.6) as well as the suite's current ones. A
release that renames one breaks that test, not a user's fit.

Lightning (``lightning.pytorch``, and the ``pytorch_lightning`` mirror the same objects come from):

- :func:`trainer_of`, :func:`set_trainer`: ``LightningModule._trainer`` (the public ``.trainer`` raises when none is
  attached; its setter reaches into the Trainer);
- :func:`results_of`: ``Trainer._results``, the active loop's ``_ResultCollection`` (what ``self.log`` writes);
- :func:`synced_reduction`, :func:`inferred_batch_size`, :func:`shadow_result_updates`: a ``_ResultMetric``'s
  ``meta`` (reduction, ``sync_dist``, ``rank_zero_only``) and ``is_tensor``, the collection's ``batch_size`` (what
  Lightning inferred for the step) and its ``update_metrics(key, value, batch_size)``;
- :func:`current_hook`, :func:`set_current_hook`: ``LightningModule._current_fx_name`` (which hook runs: ``self.log``
  refuses some);
- :func:`apply_batch_transfer`, :func:`call_batch_hook`, :data:`LOOPS_CALL_BEFORE_TRANSFER`:
  ``LightningModule._apply_batch_transfer_handler`` and ``._call_batch_hook`` (a batch hook run as the Trainer runs
  it: the datamodule's first, the profiler's action);
- :func:`call_after_backward`: ``trainer.call._call_callback_hooks`` / ``._call_lightning_module_hook``;
- :func:`uses_distributed_sampler`: ``Trainer._accelerator_connector.use_distributed_sampler``;
- :data:`IndexBatchSamplerWrapper`, :func:`inner_batch_sampler`, :func:`reinstantiate_loader`: the predict loop's
  batch-sampler wrapper and Lightning's DataLoader re-instantiation (``_get_dataloader_init_args_and_kwargs``,
  ``_reinstantiate_wrapped_cls``), as its sampler injection uses them.

torchmetrics (``Metric``):

- :func:`update_count`, :func:`forward_cache`, :func:`computed`: ``_update_count``, ``_forward_cache``, ``_computed``;
- :func:`set_step_results`: the same three written as ``Metric.forward`` / ``compute`` leave them;
- :data:`RESET_ATTRIBUTES`: what ``Metric.reset`` sets besides the states (with ``_cache`` and ``_is_synced``);
- :func:`state_defaults`, :func:`state_reduction`: ``_defaults`` (the states and their initial values) and
  ``_reductions`` (each state's ``dist_reduce_fx``);
- :func:`reduce_states`, :func:`own_reduce_states`: ``Metric._reduce_states`` (how ``forward`` adds a batch's states
  to the accumulated ones) and whether a metric class overrides it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.pytorch import LightningModule
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torchmetrics import Metric

# --- Lightning ------------------------------------------------------------------------------------------------------


def trainer_of(module: Any) -> Any:
    """The Trainer ``module`` is attached to, else ``None`` (``LightningModule._trainer``)."""
    return getattr(module, "_trainer", None)


def set_trainer(module: Any, trainer: Any) -> None:
    """Attach ``trainer`` to ``module`` (a replica or a copy: a view of the Trainer) past ``LightningModule``'s setter."""
    module.__dict__["_trainer"] = trainer


def results_of(trainer: Any) -> Any:
    """What ``self.log`` writes to in the running loop (``Trainer._results``, a ``_ResultCollection``), else ``None``."""
    return getattr(trainer, "_results", None)


def synced_reduction(result: Any) -> str | None:
    """How a logged result (a ``_ResultMetric``) synchronized across processes (a tensor logged with
    ``sync_dist=True``, not ``rank_zero_only``) is reduced: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``
    (``reduce_fx``); ``None`` for one that is not synchronized, or reduced by a function of the user's."""
    meta = result.meta
    if not (result.is_tensor and meta.sync.should and not meta.sync.rank_zero_only):
        return None
    kinds = (("mean", meta.is_mean_reduction), ("sum", meta.is_sum_reduction), ("max", meta.is_max_reduction),
             ("min", meta.is_min_reduction))
    return next((kind for kind, found in kinds if found), None)


def inferred_batch_size(results: Any) -> int | None:
    """The batch size Lightning inferred for the step's logs (``_ResultCollection.batch_size``), ``None`` before any."""
    return results.batch_size


@contextmanager
def shadow_result_updates(results: Any, update: Callable[[Callable[..., None], str, Any, int], None]) -> Iterator[None]:
    """In the block, ``results.update_metrics(key, value, batch_size)`` (which ``self.log`` calls) runs
    ``update(original, key, value, batch_size)`` instead; on this instance only, given back on exit."""
    original = results.update_metrics
    results.update_metrics = lambda key, value, batch_size: update(original, key, value, batch_size)
    try:
        yield
    finally:
        vars(results).pop("update_metrics", None)


def current_hook(module: Any) -> str | None:
    """The hook Lightning is running on ``module`` (``LightningModule._current_fx_name``), else ``None``."""
    return getattr(module, "_current_fx_name", None)


def set_current_hook(module: Any, name: str | None) -> None:
    """Mark ``module`` as running hook ``name``, as Lightning's hook call does (``self.log`` reads it)."""
    module._current_fx_name = name


def has_hook_name(module: Any) -> bool:
    """Whether ``module`` carries Lightning's running-hook name (a ``LightningModule``)."""
    return hasattr(module, "_current_fx_name")


def apply_batch_transfer(module: Any, batch: Any, device: Any, dataloader_idx: int) -> Any:
    """``transfer_batch_to_device`` and ``on_after_batch_transfer`` run as the Trainer runs them
    (``LightningModule._apply_batch_transfer_handler``: the datamodule's first, the profiler's action)."""
    return module._apply_batch_transfer_handler(batch, device, dataloader_idx)


def call_batch_hook(module: Any, hook: str, *args: Any) -> Any:
    """A batch hook run as the Trainer runs it (``LightningModule._call_batch_hook``)."""
    return module._call_batch_hook(hook, *args)


def _loops_call_before_transfer() -> bool:
    try:
        return "on_before_batch_transfer" not in inspect.getsource(LightningModule._apply_batch_transfer_handler)
    except (OSError, TypeError):  # no source at hand: the current Lightning's behaviour
        return True


#: Whether Lightning's loops call ``on_before_batch_transfer`` before ``Strategy.batch_to_device`` (2.6), rather than
#: ``batch_to_device`` calling it through ``LightningModule._apply_batch_transfer_handler`` (earlier 2.x).
LOOPS_CALL_BEFORE_TRANSFER = _loops_call_before_transfer()


def call_before_backward(trainer: Any, loss: Any) -> None:
    """The callbacks' and the module's ``on_before_backward(loss)``, as Lightning's strategy calls them before a
    backward (``Strategy.pre_backward`` -> ``precision_plugin.pre_backward``)."""
    from lightning.pytorch.trainer import call

    call._call_callback_hooks(trainer, "on_before_backward", loss)
    call._call_lightning_module_hook(trainer, "on_before_backward", loss)


def call_after_backward(trainer: Any) -> None:
    """The callbacks' and the module's ``on_after_backward``, as Lightning's automatic optimization calls them."""
    from lightning.pytorch.trainer import call

    call._call_callback_hooks(trainer, "on_after_backward")
    call._call_lightning_module_hook(trainer, "on_after_backward")


def uses_distributed_sampler(trainer: Any) -> bool:
    """``Trainer(use_distributed_sampler=...)`` as the Trainer resolved it (``_accelerator_connector``); ``True``
    without a Trainer."""
    return trainer is None or bool(trainer._accelerator_connector.use_distributed_sampler)


#: The batch-sampler wrapper Lightning's predict loop puts around a DataLoader's (it records the indices).
IndexBatchSamplerWrapper = _IndexBatchSamplerWrapper


def inner_batch_sampler(wrapper: Any) -> Any:
    """The batch sampler an :data:`IndexBatchSamplerWrapper` wraps."""
    return wrapper._batch_sampler


def reinstantiate_loader(dataloader: Any, **changes: Any) -> Any:
    """A new DataLoader of ``dataloader``'s class and arguments with ``changes``, as Lightning's sampler injection makes
    it (``_get_dataloader_init_args_and_kwargs`` and ``_reinstantiate_wrapped_cls``)."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler)
    kwargs.update(changes)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


# --- torchmetrics ---------------------------------------------------------------------------------------------------

#: what ``Metric.reset`` sets besides the states (torchmetrics 1.x); tests/replica/test_metric_reset.py checks that
#: :func:`~lightning_sparse_dp.replica.metrics.reset_metric` leaves a metric as ``reset`` does
RESET_ATTRIBUTES = {"_update_count": 0, "_forward_cache": None, "_computed": None, "_cache": None, "_is_synced": False}


def update_count(metric: Metric) -> int:
    """How many times ``update`` ran since the last reset (``Metric._update_count``)."""
    return metric._update_count


def forward_cache(metric: Metric) -> Any:
    """What the last ``forward`` returned (``Metric._forward_cache``), else ``None``."""
    return metric._forward_cache


def computed(metric: Metric) -> Any:
    """``compute()``'s cached result (``Metric._computed``), else ``None``."""
    return metric._computed


def set_step_results(metric: Metric, count: int | None = None, forward: Any = ..., result: Any = ...) -> None:
    """Write ``_update_count`` (``count``), ``_forward_cache`` (``forward``) and ``_computed`` (``result``), each when
    given, into the instance's ``__dict__`` (past ``Metric.__setattr__``'s checks), as ``forward`` / ``compute`` leave
    them."""
    if count is not None:
        metric.__dict__["_update_count"] = count
    if forward is not ...:
        metric.__dict__["_forward_cache"] = forward
    if result is not ...:
        metric.__dict__["_computed"] = result


def state_defaults(metric: Metric) -> dict[str, Any]:
    """The metric's states and their initial values, in ``add_state`` order (``Metric._defaults``)."""
    return metric._defaults


def state_reduction(metric: Metric, name: str) -> Any:
    """State ``name``'s ``dist_reduce_fx`` as torchmetrics resolved it (``Metric._reductions``)."""
    return metric._reductions[name]


def reduce_states(target: Metric, source: dict[str, Any]) -> None:
    """Add ``source``'s states into ``target``'s as ``forward`` adds a batch's (``Metric._reduce_states``)."""
    target._reduce_states(source)


def own_reduce_states(metric: Metric) -> bool:
    """Whether the metric's class overrides ``Metric._reduce_states``."""
    return type(metric)._reduce_states is not Metric._reduce_states


__all__ = [
    "IndexBatchSamplerWrapper",
    "LOOPS_CALL_BEFORE_TRANSFER",
    "RESET_ATTRIBUTES",
    "apply_batch_transfer",
    "call_after_backward",
    "call_batch_hook",
    "computed",
    "current_hook",
    "forward_cache",
    "has_hook_name",
    "inferred_batch_size",
    "inner_batch_sampler",
    "own_reduce_states",
    "reduce_states",
    "reinstantiate_loader",
    "results_of",
    "set_trainer",
    "set_current_hook",
    "set_step_results",
    "shadow_result_updates",
    "synced_reduction",
    "state_defaults",
    "state_reduction",
    "trainer_of",
    "update_count",
    "uses_distributed_sampler",
]
