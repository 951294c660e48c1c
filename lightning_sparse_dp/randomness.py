"""Randomness: replicas that share one torch generator take its random numbers in an order the threads decide.

torch keeps one default generator per device (the CPU's, each GPU's), not one per thread. CPU replicas, or several
replicas on one GPU (``replicas_per_device``), share it: a step that draws random numbers (``F.dropout``,
``ME.MinkowskiDropout``, a random augmentation in the step) takes them in whatever order its replicas' threads reach
their draws, so two runs from the same seed differ even with ``Trainer(deterministic=True)``, while one device's run
repeats. ``nn.DataParallel``'s replicas, one per GPU, each draw from their own GPU's generator, as replicas on
distinct GPUs do here. :class:`SharedDraws` compares the shared generators' states around the first training
forward passes (grad mode on) while torch's deterministic algorithms are on, and says once when a step drew.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

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


class SharedDraws:
    """Says once (a warning) when a step's replicas drew random numbers from a generator they share while torch's
    deterministic algorithms are on (``Trainer(deterministic=True)``): such runs do not repeat (module docstring).

    :meth:`before` and :meth:`after` go around one call of the replicas; only the first :data:`CHECKED_PASSES` calls
    in grad mode with shared generators are looked at (a state copy and comparison per shared generator each).
    """

    def __init__(self) -> None:
        self.passes = 0
        self.said = False

    def before(self, devices: Sequence[torch.device]) -> list[tuple[torch.device, Tensor]] | None:
        """The shared generators' states, when this call is one to look at; else ``None``."""
        if self.said or self.passes >= CHECKED_PASSES or len(devices) < 2 or not torch.is_grad_enabled():
            return None
        if not torch.are_deterministic_algorithms_enabled():
            return None
        shared = shared_generators(devices)
        if not shared:
            self.passes = CHECKED_PASSES  # the same devices every step: nothing to look at
            return None
        self.passes += 1
        return [(d, _state(d)) for d in shared]

    def after(self, before: list[tuple[torch.device, Tensor]] | None) -> None:
        """Warn once if a generator's state moved since :meth:`before`."""
        if before is None or self.said:
            return
        drew = [str(d) for d, state in before if not torch.equal(state, _state(d))]
        if drew:
            self.said = True
            rank_zero_warn(
                f"sparse_dp: the step draws random numbers (dropout, a random augmentation) from torch's generator of "
                f"{', '.join(drew)}, which its replicas share (torch has one per device, not per thread): the replicas "
                "take them in the order their threads reach the draws, so runs from the same seed differ despite "
                "deterministic=True (one device's draws differ from any split's as well). For repeatable runs use one "
                "replica per GPU, or sparse_ddp (a process per replica), or no random ops in the step."
            )


__all__ = ["CHECKED_PASSES", "SharedDraws", "shared_generators"]
