"""Log memory: what a strategy's steps showed of its logged names, kept for the run (:class:`LogMemory`), and the
``batch_size=`` the replicas (ranks) passed read as one constant for the whole batch or as each chunk's own count
(:func:`constant_batch_size`); the log reduction (:mod:`~lightning_sparse_dp.step.log`) reads both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LogMemory:
    """What a strategy's steps showed of its logged names, kept for the run: values that equal each other in every
    replica at one step by chance are read as earlier steps showed them.

    Attributes:
        counts: names logged as integers that differed between the replicas at some step (each chunk's count, summed),
            summed also where every replica counts the same (one correct prediction each), not taken as one value.
        own_sizes: names whose ``batch_size=`` differed between the replicas at some step (each chunk's count, summed),
            summed also where the replicas' counts are equal (10 labeled points each), not taken as one constant.
    """

    counts: set[str] = field(default_factory=set)
    own_sizes: set[str] = field(default_factory=set)

    def constant(self, name: str, sizes: Sequence[Any], replicas: Sequence[int], num_samples: int,
                 chunk_samples: Sequence[int] | None, chunk_points: Callable[[], Sequence[Sequence[int]]]) -> Any:
        """:func:`constant_batch_size`, where this name's sizes differed between the replicas before: ``None``
        (each chunk's count) unless the size is the whole batch's."""
        if len(sizes) > 1 and any(s != sizes[0] for s in sizes[1:]):
            self.own_sizes.add(name)
        constant = constant_batch_size(sizes, replicas, num_samples, chunk_samples, chunk_points)
        if constant is not None and name in self.own_sizes and constant != num_samples:
            return None
        return constant


def constant_batch_size(
    sizes: Sequence[Any], replicas: Sequence[int], num_samples: int, chunk_samples: Sequence[int] | None,
    chunk_points: Callable[[], Sequence[Sequence[int]]] = tuple,
) -> Any:
    """The ``batch_size=`` the replicas passed when it is one value for the whole batch, else ``None`` (each chunk's own
    count, to be summed): every replica passed the same value, and it is the whole batch's sample or point count or, for
    some replica, neither its chunk's sample count nor its chunk's point count of any point set (``chunk_points()``:
    per point set, per chunk) (``self.hparams.batch_size`` on every step, the epoch's last batch short: one device
    weighs that batch by the constant in epoch means, not by the replicas' sum of it). Equal point counts are each
    chunk's (fixed-size point clouds: ``batch_size=len(labels)``)."""
    if not sizes or any(s != sizes[0] for s in sizes[1:]):
        return None
    if sizes[0] == num_samples or any(sizes[0] == sum(c) for c in chunk_points()):  # the whole batch's samples or points
        return sizes[0]
    if chunk_samples is None or len(sizes) < 2:
        return None
    counts = [chunk_samples, *chunk_points()]
    own = any(all(i < len(c) and sizes[0] == c[i] for i in replicas) for c in counts)
    return None if own else sizes[0]


__all__ = ["LogMemory", "constant_batch_size"]
