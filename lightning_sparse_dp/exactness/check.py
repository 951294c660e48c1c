"""Check: the first training step of a fit run on one device and on the replicas, compared, the outcome said.

The strategy's promise is one device's step over the whole batch. How the loss is weighted is read from the step's
code (:mod:`~lightning_sparse_dp.loss`), which is right for every form it was shown; this check measures instead. At
the first training step of every fit (and every ``check_exactness_every_n_steps`` steps, when set), before the step
itself, :meth:`ExactnessCheck.run`:

1. runs the module's own ``training_step`` and its backward on one device (the root device) over the whole batch,
   on a float64 copy of the module (:func:`~lightning_sparse_dp.exactness.probe.float64_copy`; the batch converted as
   ``precision="64-true"`` converts it; tensors the step makes without a dtype float64, in the check's threads only:
   :mod:`~lightning_sparse_dp.runtime.defaults`), as plain Lightning does: the step, then the gradients cleared (Lightning's
   ``zero_grad`` comes between the step and its backward), then ``LightningModule.backward``;
2. runs the strategy's step (its stages on its replicas) and backward the same way, on a second float64 copy, over
   the same batch;
3. compares (:mod:`~lightning_sparse_dp.exactness.compare`) the loss, every parameter's gradient, the module's
   parameters and buffers after the step, its metrics' states and every value the step logged, each by its max-norm
   relative difference, against :data:`TOLERANCE`.

Equal: one info line. Different: one warning (``check_exactness="error"``: an :class:`ExactnessError`) naming the worst
tensors, how the strategy weighted the loss, and the fixes. Nothing the user has sees the check: the copies and their
trainer view (loggers' calls run nowhere), the random generators set to one state before each run and given back
(dropout layers are off in both copies; a step that still draws random numbers cannot be compared, which is said), no
optimizer step, no hook or callback called. A check that cannot run (a module that cannot be deep-copied, a step that
fails in float64) says why, once, and training goes on. Cost: one extra forward and backward of the batch on one
device and one on the replicas, and two float64 copies of the module, per check.

Batch norm that is not synchronized (``sync_batchnorm=False``) normalizes each replica's chunk by itself, which the
strategy says at setup: both copies run it in eval mode (running statistics), so that the check compares the rest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor, nn

from lightning_sparse_dp.exactness.compare import StepRecord, differences, record_step
from lightning_sparse_dp.exactness.probe import (
    OptimizerGroups,
    RandomStates,
    float64_copy,
    given_back,
    held_out,
    hooked_modules,
    kept_stop,
)
from lightning_sparse_dp.loss.values import loss_of
from lightning_sparse_dp.replica.effects import StepEffects
from lightning_sparse_dp.replica.recorder import install_recorder
from lightning_sparse_dp.runtime.defaults import float64_defaults

_log = logging.getLogger(__name__)

#: relative difference (max-norm, per tensor) above which a tensor differs: float64 rounding of the same math stays
#: below 1e-11 in the project's tests (batch-norm gradients included); inexact steps differ by 1e-4 and more
TOLERANCE = 1e-8
#: the tensors named in a warning
WORST_SHOWN = 5

#: a step's run on a float64 copy: ``run(copy) -> (loss, logged values, how the loss was weighted or None)``; an
#: evaluation step's logged values hold its output under :data:`OUTPUT_KEY`
Run = Callable[[nn.Module], tuple[Tensor | None, dict[str, Any], str | None]]


#: the key of an evaluation step's output among a run's logged values (compared as returned tensors)
OUTPUT_KEY = "\0output"


class ExactnessError(RuntimeError):
    """Raised by the exactness check under ``check_exactness="error"`` when the strategy's step differs from one
    device's; the message names the tensors, how the loss was weighted and the fixes."""


def resolve_mode(value: bool | str) -> str | None:
    """``check_exactness``: ``True`` / ``"warn"`` -> ``"warn"``, ``"error"`` -> ``"error"``, ``False`` -> ``None``.

    Raises:
        ValueError: any other value.
    """
    if value is True or value == "warn":
        return "warn"
    if value == "error":
        return "error"
    if value is False:
        return None
    raise ValueError(f"check_exactness={value!r}; give True (or 'warn'), 'error' or False.")


@dataclass
class Outcome:
    """What one check found: ``worst`` (``(what, relative difference)``, largest first), ``compared`` (the number of
    tensors compared), ``reading`` (how the strategy weighted the loss), ``skipped`` (why nothing was compared),
    ``failure`` (the error the strategy's step raised where one device's ran)."""

    worst: list[tuple[str, float]]
    compared: int = 0
    reading: str | None = None
    skipped: str | None = None
    failure: str | None = None

    @property
    def exact(self) -> bool:
        return self.skipped is None and self.failure is None and (not self.worst or self.worst[0][1] <= TOLERANCE)


def one_device_step(module: nn.Module, batch: Any, args: tuple, kwargs: dict) -> tuple[Tensor | None, dict[str, Any], None]:
    """The module's own ``training_step`` on ``batch`` and its backward, as plain Lightning runs them on one device:
    ``self.log`` recorded (:class:`~lightning_sparse_dp.replica.recorder.LogRecorder`, Lightning's checks), ``print``
    and the loggers' calls run nowhere, the gradients cleared after the step, then ``module.backward(loss)``."""
    output, logged = quiet_step(module, lambda: module.training_step(batch, *args, **kwargs))  # type: ignore[operator]
    loss = loss_of(output)
    backward(module, loss)
    return loss, logged, None


def quiet_step(module: nn.Module, step: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``step()`` (a step of the check's copy ``module``) with nothing said or logged outside it: ``self.log`` recorded
    (:func:`~lightning_sparse_dp.replica.recorder.install_recorder`, Lightning's checks), ``print`` a no-op (as a
    replica's after the first), the loggers' calls run nowhere (:class:`~lightning_sparse_dp.replica.effects.StepEffects`
    ``run_none``). Returns the step's output and ``name -> value`` of what it logged."""
    recorder = install_recorder(module, 1)
    output = StepEffects("training_step", 1, run_none=True).watch(0, step)
    return output, {name: call.value for name, call in recorder.calls.items()}


def backward(module: nn.Module, loss: Tensor | None) -> None:
    """Lightning's automatic optimization after a step: ``zero_grad`` (every parameter's ``.grad`` to ``None``), then the
    module's own ``backward`` (:meth:`LightningModule.backward`) on ``loss``, autograd's device threads off."""
    for p in module.parameters():
        p.grad = None
    if loss is not None and loss.requires_grad:
        with torch.autograd.set_multithreading_enabled(False):
            module.backward(loss)  # type: ignore[operator]


def eval_key(hook: str, dataloader_idx: int = 0) -> str:
    """What :attr:`ExactnessCheck.evaluated` notes of an evaluation step: its hook, and its dataloader after the first
    (a second validation loader's values are checked at its own first step)."""
    return hook if not dataloader_idx else f"{hook}[{dataloader_idx}]"


class ExactnessCheck:
    """When to check, and the check itself, for one strategy.

    Args:
        mode: ``"warn"``, ``"error"`` or ``None`` (off), from :func:`resolve_mode`.
        every_n_steps: also check when ``trainer.global_step`` advanced this many optimizer steps since the last check
            (0: the first training step of each fit only).
        strategy: the strategy's name, in what is said.

    Raises:
        ValueError: ``every_n_steps`` not an int >= 0.
    """

    def __init__(self, mode: str | None, every_n_steps: int, strategy: str) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0:
            raise ValueError(f"check_exactness_every_n_steps={every_n_steps!r}; give an int >= 0 (0: the first step only).")
        self.mode = mode
        self.every_n_steps = every_n_steps
        self.strategy = strategy
        #: compare the loss's value, the logged values and the metrics' states too (``sparse_dp``: the gathered loss,
        #: the reduced calls, the states merged into the root's); ``sparse_ddp``'s ranks keep their own until Lightning
        #: reduces them, so there the gradients and the module's state after the step are compared
        self.compare_values = strategy == "sparse_dp"
        self._last: int | None = None  # global_step of the fit's last check
        #: whether no training step of this fit will be checked any more: off, or checked once with
        #: ``every_n_steps=0`` (the strategies then skip the check's step machinery); an attribute, read every step
        self.done = mode is None
        #: names of the module's frozen parameters the checked step changed in place on one device (an EMA teacher):
        #: the strategy's replicas own copies of them (:class:`~lightning_sparse_dp.step.replicate.Replicas`)
        self.frozen_written: set[str] = set()
        #: names of the module's parameters that require grad and that the checked step changed in place (said)
        self.trainable_written: list[str] = []
        #: the evaluation hooks (``"validation_step"``, ...) whose first step of the run was checked
        self.evaluated: set[str] = set()
        #: the loss call sites of the training steps checked in this fit (each with whether a call entered the value
        #: and how many times it was called): a step that calls another, or a checked one otherwise (a loss term that
        #: starts after a warm-up, from 0 or from none; objectives that alternate), is checked too (:meth:`again`)
        self.sites: frozenset = frozenset()
        #: the sets of sites the training steps checked in this fit called (a step calling a set none called is checked
        #: too: :meth:`new_sites`)
        self.site_sets: set[frozenset] = set()

    def new_sites(self, sites: frozenset) -> bool:
        """Whether a training step whose loss call sites are ``sites`` (:attr:`~lightning_sparse_dp.loss.decide.Decision.sites`)
        calls a site, or a set of sites, that no step seen in this fit called (a term that starts after a warm-up, or
        one dropped under a condition on the batch, ``if (y == k).sum() >= n``, which each chunk meets otherwise than
        the whole batch): then it is checked too. Notes them."""
        if sites in self.site_sets:
            return False
        self.site_sets.add(sites)
        self.sites |= sites
        return True

    def reset(self, count: int = 1, warnings: WarningCache | None = None) -> None:
        """A new fit: its first training step is checked. With the check off and ``count`` (replicas or ranks of the
        fit) of two or more, said once in ``warnings``: the loss's weighting is then read from the step's code only
        (:mod:`~lightning_sparse_dp.loss`), which cannot see samples that meet before the loss (features centered on
        the batch's mean inside ``forward``, a contrastive loss across samples)."""
        self._last = None
        self.done = self.mode is None
        self.evaluated = set()
        self.sites = frozenset()
        self.site_sets = set()
        if self.mode is not None or count < 2 or warnings is None:
            return
        strategy, who = self.strategy, "replica" if self.strategy == "sparse_dp" else "rank"
        warnings.info(
            f"{strategy}: exactness check off (check_exactness=False): how each {who}'s loss is weighted is read from "
            "the step's code only, which cannot see a step coupling the batch's samples before its loss (features "
            "centered on the batch's mean or scaled by its std inside forward, a contrastive loss between samples): "
            f"such a step trains unlike one device and nothing says so. check_exactness=True (the default) runs the "
            f"first training step on one device and on the {who}s and says whether they differ."
        )

    def due(self, global_step: int) -> bool:
        """Whether the training step at ``global_step`` is checked (noted as checked when it is)."""
        if self.mode is None:
            return False
        last = self._last
        if last is not None and (self.every_n_steps == 0 or global_step - last < self.every_n_steps):
            return False
        self._last = global_step
        self.done = self.every_n_steps == 0
        return True

    def again(self, global_step: int) -> None:
        """The training step at ``global_step`` is checked (again), whatever :meth:`due` says: it calls a loss call
        site no checked step called."""
        self._last = global_step

    def eval_due(self, hook: str, dataloader_idx: int = 0) -> bool:
        """Whether this step of the evaluation hook ``hook`` (``"validation_step"``, ``"test_step"``,
        ``"predict_step"``) is checked: the first of each hook and dataloader in a run (fit, validate, test, predict;
        noted as checked: :func:`eval_key`)."""
        key = eval_key(hook, dataloader_idx)
        if self.mode is None or key in self.evaluated:
            return False
        self.evaluated.add(key)
        return True

    def run(
        self, module: nn.Module, trainer: Any, one_device: Run, replicas: Run, count: int, samples: Callable[[], Any],
        batch_norm_eval: bool, warnings: WarningCache, evaluation: tuple[Any, ...] | None = None,
    ) -> Outcome:
        """Run both steps on float64 copies of ``module``, compare, say the outcome (see the module docstring).

        Args:
            one_device: the module's own step and backward on a copy (:func:`one_device_step` over the whole batch).
            replicas: the strategy's step and backward on a copy, over the same batch.
            count: the replicas (ranks) the step runs on; ``samples()``: the batch's samples, once the runs ran; both
                named in what is said.
            batch_norm_eval: batch norm in eval mode in both copies (not synchronized across replicas).
            warnings: where what is said once goes.
            evaluation: ``(hook, batch_idx, dataloader_idx)`` of an evaluation step (``("validation_step", 0, 0)``):
                its logged values, metrics' states and returned tensors compared, no backward; ``None``: a training step.

        Raises:
            ExactnessError: under ``mode="error"``, when the steps differ.
        """
        hooked = hooked_modules(module)
        try:
            if hooked:  # the copies would carry the hooks, whose calls reach what they hold (a callback's state)
                outcome = Outcome([], skipped=f"the module has hooks ({', '.join(hooked)}), which its copies would call "
                                              "on the checked batch, where the fit without the check does not")
            else:
                outcome = self._compare(module, trainer, one_device, replicas, batch_norm_eval)
        except Exception as err:  # the check is an observer: training goes on without it
            _log.debug("exactness check failed", exc_info=True)
            hint = ("; a tensor the module keeps from a step with its graph (self.x = logits) cannot be copied: keep "
                    "it detached (self.x = logits.detach())") if "deepcopy protocol" in str(err) else ""
            outcome = Outcome([], skipped=f"it failed on its float64 copies ({type(err).__name__}: {err}){hint}")
        self._say(outcome, count, samples(), warnings, held_out(module, batch_norm_eval), evaluation)
        on_cpu = any(p.device.type == "cpu" for p in module.parameters())  # CPU replicas share the module's storage
        if self.trainable_written and self.strategy == "sparse_dp" and on_cpu:  # DDP's ranks own their parameters
            names = ", ".join(self.trainable_written[:3]) + (", ..." if len(self.trainable_written) > 3 else "")
            warnings.warn(
                f"sparse_dp: the training step changed parameters that require grad in place ({names}: an EMA "
                "teacher's update_parameters, t.mul_(m).add_(s, alpha=1 - m)): CPU replicas share the module's "
                "parameters, so each replica applies the change, once per replica, which the checked step may not "
                "show (a first update that copies). Freeze them (teacher.requires_grad_(False)): the replicas then own "
                "copies, one device's; or update them in on_train_batch_end."
            )
        return outcome

    def _compare(self, module: nn.Module, trainer: Any, one_device: Run, replicas: Run, batch_norm_eval: bool) -> Outcome:
        states, groups = RandomStates(), OptimizerGroups(trainer)
        records: list[StepRecord] = []
        reading = None
        # float64 defaults in this thread and the replicas' only, not set_default_dtype; a step that stops the fit
        # stops it once, itself, not in the check
        with given_back(states, groups), float64_defaults(), kept_stop(trainer):
            for run in (one_device, replicas):
                states.restore()
                groups.restore()
                twin = float64_copy(module, trainer, batch_norm_eval, one_device=run is one_device)
                versions = {n: (p._version, p.requires_grad) for n, p in twin.named_parameters()}
                try:
                    loss, logged, how = run(twin)
                except Exception as err:
                    if run is one_device:
                        raise
                    _log.debug("the exactness check's run on the replicas failed", exc_info=True)
                    return Outcome([], failure=f"{type(err).__name__}: {str(err).strip().splitlines()[0]}")
                reading = how or reading
                if run is one_device:  # what the step changes in place (before the replicas' run builds its replicas)
                    written = {n for n, p in twin.named_parameters() if n in versions and p._version != versions[n][0]}
                    self.frozen_written = {n for n in written if not versions[n][1]}
                    self.trainable_written = sorted(n for n in written if versions[n][1])
                values = self.compare_values
                output = logged.pop(OUTPUT_KEY, None)
                records.append(record_step(twin, loss if values else None, logged if values else {}, metrics=values,
                                           output=output))
                drawn = states.drawn() if run is one_device else []
                if drawn:
                    return Outcome([], skipped=f"the step draws random numbers ({', '.join(drawn)}'s generator) beyond "
                                               "dropout layers, which one device and the replicas draw differently")
                del twin, loss, logged
        found = sorted(differences(records[1], records[0]), key=lambda d: -d[1])
        return Outcome(found, compared=len(found), reading=reading)

    def _say(self, outcome: Outcome, count: int, samples: Any, warnings: WarningCache, held: list[str],
             evaluation: tuple[Any, ...] | None = None) -> None:
        strategy = self.strategy
        who = "replicas" if strategy == "sparse_dp" else "ranks"
        what = f"training step {self._last}" if evaluation is None else (
            f"{evaluation[0].removesuffix('_step')} step {evaluation[1]}"
            + (f" of dataloader {evaluation[2]}" if len(evaluation) > 2 and evaluation[2] else ""))
        left_out = f", with {' and '.join(held)} in both runs".replace("{who}", who[:-1]) if held else ""
        if outcome.skipped is not None:
            goes_on = "Training goes on" if evaluation is None else "The run goes on"
            warnings.info(f"{strategy}: exactness check of {what} on {count} {who}: not compared, "
                          f"because {outcome.skipped}. {goes_on} unchecked; check_exactness=False turns the "
                          "check off.")
            return
        if outcome.failure is not None:
            message = (f"{strategy}: exactness check of {what} on {count} {who}: fails on the {who} "
                       f"where one device's step runs ({outcome.failure}). The step does something the strategy cannot "
                       "run on replicas or ranks (docs/exactness.md lists the constructs and what to write instead); "
                       "check_exactness=False turns the check off.")
            if self.mode == "error":
                raise ExactnessError(message)
            warnings.warn(message)
            return
        worst = outcome.worst[0][1] if outcome.worst else 0.0
        if outcome.exact:
            warnings.info(f"{strategy}: exactness check of {what} on {count} {who}: equals one "
                          f"device's on the same {samples} samples (float64, {outcome.compared} tensors compared, max "
                          f"relative difference {worst:.1e}){left_out}.")
            return
        shown = [f"{name} {_figure(d)}" for name, d in outcome.worst[:WORST_SHOWN] if d > TOLERANCE]
        more = sum(d > TOLERANCE for _, d in outcome.worst) - len(shown)
        found = (f"{strategy}: exactness check of {what} on {count} {who}: differs from one device's on the same "
                 f"{samples} samples (float64, relative): {'; '.join(shown)}{f' and {more} more' if more else ''}. ")
        if evaluation is None:
            message = found + (
                f"{outcome.reading + '. ' if outcome.reading else ''}"
                "The step does something the strategy does not split exactly (a loss that is not a mean over samples "
                "or points, a loss coupling the batch's samples, state changed in place in the step, a backward inside "
                "the step, ...). Fixes: loss_weighting=<callable counting what the loss is a mean over>, layout= for "
                "batch entries the split cannot tell apart, or the patterns in docs/exactness.md; "
                "check_exactness='error' makes this an error, False turns the check off."
            )
        else:
            end = f"on_{evaluation[0].removesuffix('_step')}_batch_end"
            message = found + (
                f"What each {who[:-1]}'s step logs or returns is its chunk's: a value that couples the batch's samples "
                "(a contrastive loss or a similarity between samples, a nearest neighbour or a rank in the batch, a "
                "softmax or a statistic over the batch), that is not a mean over samples or points, or that draws "
                "random numbers in the step is not the whole batch's, nor is what a step keeps on the module from its "
                "chunk (self.preds = ...); rows returned in another order (a strided tensor's .C / .F, said apart) "
                "differ too. Fixes: return what it needs per sample and "
                f"compute it over the whole batch in {end}(outputs, batch, batch_idx), which gets the gathered outputs "
                "and the whole batch, or the "
                "patterns in docs/exactness.md; check_exactness='error' makes this an error, False turns the check off."
            )
        if self.mode == "error":
            raise ExactnessError(message)
        warnings.warn(message)


def _figure(d: float) -> str:
    return "inf (missing, NaN or of another shape in one run)" if math.isinf(d) else f"{d:.1e}"


__all__ = [
    "OUTPUT_KEY", "ExactnessCheck", "ExactnessError", "Outcome", "TOLERANCE", "backward", "eval_key", "one_device_step",
    "quiet_step", "resolve_mode",
]
