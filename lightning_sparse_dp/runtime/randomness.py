"""Randomness: replicas that share one torch generator take its random numbers in an order the threads decide.

torch keeps one default generator per device (the CPU's, each GPU's), not one per thread. CPU replicas, or several
replicas on one GPU (``replicas_per_device``), share it: a step that draws random numbers (``F.dropout``,
``ME.MinkowskiDropout``, a random augmentation in the step) takes them in whatever order its replicas' threads reach
their draws, so two runs from the same seed differ even with ``Trainer(deterministic=True)``, while one device's run
repeats. ``nn.DataParallel``'s replicas, one per GPU, each draw from their own GPU's generator, as replicas on
distinct GPUs do here. NumPy's global generator (``np.random.rand``) and Python's ``random`` are one per process: every
replica shares them, on GPUs too. :class:`SharedDraws` compares the shared generators' states around the first
forward passes of training (grad mode on) and of evaluation while torch's deterministic algorithms are on, and says
once when a step drew.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

#: training forward passes (grad mode on) looked at before the check stops: a step that draws does so every time
CHECKED_PASSES = 4


def shared_generators(devices: Sequence[torch.device]) -> list[torch.device]:
    """The devices whose default generator two or more of ``devices`` draw from (the CPU for CPU replicas, a GPU
    with several replicas), in order of first appearance."""
    def generator_of(d: torch.device) -> torch.device:
        if d.type == "cuda":
            return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
        return torch.device(d.type)

    counts = Counter(generator_of(d) for d in devices)
    return [d for d, n in counts.items() if n > 1]


def _state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


#: the generators of the process, which every replica shares: (name, state getter)
HOST_GENERATORS: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("NumPy's global generator (np.random)", np.random.get_state),
    ("Python's random module", random.getstate),
)


def _equal(a: Any, b: Any) -> bool:
    """Two generator states alike: tensors, NumPy's state tuple (with its key array), Python's tuple of ints."""
    if isinstance(a, Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


class SharedDraws:
    """Says once (a warning) when a step's replicas drew random numbers from a generator they share while torch's
    deterministic algorithms are on (``Trainer(deterministic=True)``): such runs do not repeat (module docstring).

    :meth:`before` and :meth:`after` go around one call of the replicas; only the first :data:`CHECKED_PASSES` calls
    in each grad mode with shared generators are looked at (a state copy and comparison per shared generator each).
    """

    def __init__(self) -> None:
        self.passes = {True: 0, False: 0}  # calls looked at, by grad mode: training passes, evaluation passes
        self.said = False
        #: whether a later call may still be looked at (not said, fewer than CHECKED_PASSES looked at in a grad mode):
        #: the executor calls :meth:`before` only then
        self.looking = True

    def before(self, devices: Sequence[torch.device]) -> list[tuple[str, Callable[[], Any], Any]] | None:
        """The shared generators' ``(name, state getter, state)``, when this call is one to look at; else ``None``.
        Training passes and evaluation passes (a validation step's bootstrap draws) are counted apart, so that the
        sanity check's validation passes leave the training passes looked at."""
        mode = torch.is_grad_enabled()
        if not self.looking or len(devices) < 2 or self.passes[mode] >= CHECKED_PASSES:
            return None
        if not torch.are_deterministic_algorithms_enabled():
            return None
        self.passes[mode] += 1
        self.looking = min(self.passes.values()) < CHECKED_PASSES
        getters = [(f"torch's generator of {d}", partial(_state, d)) for d in shared_generators(devices)]
        return [(name, get, get()) for name, get in [*getters, *HOST_GENERATORS]]

    def after(self, before: list[tuple[str, Callable[[], Any], Any]]) -> None:
        """Warn once if a generator's state moved since :meth:`before`, whose states ``before`` are (called only for a
        call :meth:`before` looked at: it returned states, not ``None``)."""
        if self.said:
            return
        drew = [name for name, get, state in before if not _equal(state, get())]
        if drew:
            self.said, self.looking = True, False
            rank_zero_warn(
                f"sparse_dp: the step draws random numbers (dropout, a random augmentation) from {', '.join(drew)}, "
                "which its replicas share (torch has one generator per device, NumPy and Python one per process, not "
                "one per thread): the replicas "
                "take them in the order their threads reach the draws, so runs from the same seed differ despite "
                "deterministic=True (one device's draws differ from any split's as well). For repeatable runs draw "
                "with torch on one replica per GPU, or use sparse_ddp (a process per replica), or draw no random "
                "numbers in the step (augment in the dataset, whose DataLoader workers seed their own generators)."
            )


__all__ = ["CHECKED_PASSES", "HOST_GENERATORS", "SharedDraws", "shared_generators"]
