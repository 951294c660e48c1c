"""Sampler: every rank's share of each global batch, whole samples with even point counts.

Lightning's DDP installs ``torch.utils.data.DistributedSampler``: it deals indices round-robin to
ranks (``perm[rank::world_size]``), pads the epoch by repeating samples so every rank gets the same
number (or drops them with ``drop_last``), and ignores how many points each sample has, so the rank
with the biggest scenes sets the pace of every step.

:class:`PointBalancedBatchSampler` works on global batches instead. Every rank computes the same
epoch order (the permutation ``DistributedSampler`` would use with one replica: ``torch.randperm``
seeded with ``seed + epoch``), cuts it into global batches of ``global_batch_size`` samples, and
assigns the samples of each global batch to the ranks with the same assignment ``sparse_dp`` uses
for its replicas (:func:`lightning_sparse_dp.split.balanced_assignment`, greedy longest processing
time first, or :func:`~lightning_sparse_dp.split.contiguous_assignment`); rank ``r`` yields share
``r``. So, for every epoch:

- every sample is in exactly one rank's share of exactly one step: no padding, no repeats, no drops
  (unless ``drop_last=True`` asks for the last, incomplete global batch to be dropped);
- every rank takes the same number of steps (``len(sampler)``), and every share has >= 1 sample;
- a last global batch with fewer samples than ranks (``0 < remainder < world_size``) is appended to
  the global batch before it, so that one step is larger by up to ``world_size - 1`` samples; a
  dataset with fewer samples than ranks is refused with a ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils.data import DistributedSampler, Sampler

from lightning_sparse_dp.runtime.me import is_me_tensor
from lightning_sparse_dp.split import names_coordinates, resolve_assignment


def global_batches(order: Sequence[int], global_batch_size: int, world_size: int, drop_last: bool) -> list[list[int]]:
    """Cut one epoch's sample order into global batches (the module docstring gives the rules).

    Args:
        order: the epoch's sample ids, in order.
        global_batch_size: samples per global batch, ``>= world_size``.
        world_size: number of ranks.
        drop_last: drop the last global batch when it has fewer than ``global_batch_size`` samples.

    Returns:
        the global batches, each a list of sample ids with at least ``world_size`` of them.

    Raises:
        ValueError: ``global_batch_size < world_size``, or fewer samples than ranks.
    """
    if global_batch_size < world_size:
        raise ValueError(
            f"a global batch of {global_batch_size} samples cannot give each of {world_size} ranks a whole sample; "
            "use a DataLoader batch_size >= 1 per rank."
        )
    order = list(order)
    if len(order) < world_size:
        raise ValueError(
            f"the dataset has {len(order)} samples, fewer than the {world_size} ranks: some rank would have no sample "
            "to step on. Use fewer devices / nodes for this dataset, or a bigger dataset."
        )
    batches = [order[i : i + global_batch_size] for i in range(0, len(order), global_batch_size)]
    if len(batches[-1]) < global_batch_size:
        if drop_last:
            batches.pop()
        elif len(batches[-1]) < world_size:  # too few for one sample per rank: join the batch before
            tail = batches.pop()
            batches[-1].extend(tail)
    return batches


class PointBalancedBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding this rank's share of every global batch (see the module docstring).

    Used by :class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy` in place of Lightning's
    ``DistributedSampler``; usable on its own as ``DataLoader(dataset, batch_sampler=...)``.

    Args:
        point_counts: points per sample, int ``[len(dataset)]`` (may be None for ``split="contiguous"``).
        global_batch_size: samples per global batch (all ranks together), e.g. the DataLoader's
            per-rank ``batch_size * world_size`` as with Lightning's DDP.
        num_replicas: world size (ranks sharing each global batch).
        rank: this rank, ``0 <= rank < num_replicas``.
        num_samples: dataset length; needed only when ``point_counts`` is None.
        shuffle: a new permutation every epoch (``torch.randperm`` seeded with ``seed + epoch``, as
            ``DistributedSampler``); else dataset order.
        seed: the same on every rank.
        drop_last: drop the last incomplete global batch.
        split: ``"balanced"`` (even point counts; :func:`~lightning_sparse_dp.split.balanced_assignment`)
            or ``"contiguous"`` (consecutive samples, sizes differing by at most one, as a plain index
            split; :func:`~lightning_sparse_dp.split.contiguous_assignment`).

    ``set_epoch(epoch)`` (called by Lightning through :attr:`sampler`) selects the epoch's order.

    Raises:
        ValueError: a bad rank, split or batch size, negative point counts, ``point_counts`` missing for
            ``split="balanced"``, or fewer samples than ranks.
    """

    def __init__(
        self,
        point_counts: Sequence[int] | Tensor | None,
        global_batch_size: int,
        *,
        num_replicas: int,
        rank: int,
        num_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        split: str = "balanced",
    ) -> None:
        resolve_assignment(split, "split", callables=False)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is not in 0..{num_replicas - 1} (num_replicas={num_replicas}).")
        if point_counts is None:
            if split == "balanced":
                raise ValueError("split='balanced' needs point_counts (points per sample); pass them or use 'contiguous'.")
            if num_samples is None:
                raise ValueError("pass num_samples (the dataset length) when point_counts is None.")
            counts = torch.ones(num_samples, dtype=torch.long)
        else:
            counts = torch.as_tensor(point_counts, dtype=torch.long).flatten()
            if num_samples is not None and counts.numel() != num_samples:
                raise ValueError(f"point_counts has {counts.numel()} entries but the dataset has {num_samples} samples.")
            if bool((counts < 0).any()):
                raise ValueError("point_counts must be >= 0.")
        self.point_counts = counts
        self.global_batch_size = int(global_batch_size)
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last, self.split = drop_last, split
        # the epoch order: DistributedSampler's permutation, with one replica (no padding, no dropping)
        self.sampler = DistributedSampler(range(counts.numel()), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        global_batches(range(counts.numel()), self.global_batch_size, num_replicas, drop_last)  # checks early

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches (sample ids), the same on every rank."""
        return global_batches(list(self.sampler), self.global_batch_size, self.num_replicas, self.drop_last)

    def shares(self, batch: Sequence[int]) -> list[list[int]]:
        """Every rank's sample ids of one global batch, ascending positions of the global batch kept."""
        ids = torch.as_tensor(batch, dtype=torch.long)
        assignment = resolve_assignment(self.split, "split", callables=False)
        # a sample counted as 0 points still needs a rank: count it as 1, so every share has a sample
        sizes = self.point_counts[ids].clamp(min=1)
        return [ids[positions].tolist() for positions in assignment(sizes, self.num_replicas)]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            yield self.shares(batch)[self.rank]

    def __len__(self) -> int:
        return len(global_batches(range(self.point_counts.numel()), self.global_batch_size, self.num_replicas, self.drop_last))


def _first_length(item: Any) -> int:
    """Points in one dataset item: for a dict with keys that name coordinates (``coords0``, ``coords1``,
    ``target_coordinates``: :func:`~lightning_sparse_dp.split.names_coordinates`), the rows of all of them
    (every point set of the sample, as ``sparse_dp`` balances); else the rows of its first tensor (or of a
    SparseTensor's coordinates)."""
    if isinstance(item, Mapping):
        named = [v for k, v in item.items() if names_coordinates(k) and hasattr(v, "shape") and len(v.shape) >= 1]
        if named:
            return sum(int(v.shape[0]) for v in named)
    leaves = pytree.tree_leaves(item, is_leaf=is_me_tensor)
    for leaf in leaves:
        if is_me_tensor(leaf):
            return int(leaf.C.shape[0])
        if isinstance(leaf, Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
        if hasattr(leaf, "shape") and len(leaf.shape) >= 1:  # numpy arrays
            return int(leaf.shape[0])
    raise TypeError(
        f"cannot count the points of a dataset item of type {type(item).__name__}: it holds no tensor or array. Give "
        "the dataset a `point_counts` attribute (points per sample) or pass SparseDDPStrategy(count_points=fn), "
        "fn(item) -> its points."
    )


def declared_point_counts(dataset: Any) -> list[int] | None:
    """The dataset's own ``point_counts`` (a sequence, or a method returning one), or None."""
    counts = getattr(dataset, "point_counts", None)
    if counts is None:
        return None
    if callable(counts):
        counts = counts()
    return [int(c) for c in counts]


def measure_point_counts(
    dataset: Any, indices: Sequence[int], count_fn: Callable[[Any], int] | None = None
) -> list[int]:
    """Points of ``dataset[i]`` for ``i`` in ``indices``: ``count_fn(item)``, else the rows of the item's
    coordinate tensors when it is a dict with keys naming coordinates, else of its first tensor
    (``coordinates [n, D]`` of a ``(coordinates, features, label)`` sample, as ME's examples return).

    Raises:
        TypeError: an item holds no tensor or array to count.
    """
    fn = count_fn or _first_length
    return [int(fn(dataset[i])) for i in indices]


__all__ = [
    "PointBalancedBatchSampler",
    "declared_point_counts",
    "global_batches",
    "measure_point_counts",
]
