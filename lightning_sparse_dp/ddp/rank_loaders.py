"""Point-balanced DataLoaders for ``sparse_ddp``'s ranks: Lightning's injected ``DistributedSampler`` replaced by a
:class:`~lightning_sparse_dp.ddp.sampler.PointBalancedBatchSampler` (whole samples, even point counts, no padding, the
same number of steps on every rank), through Lightning's own DataLoader re-instantiation."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_sparse_dp.ddp.sampler import (
    PointBalancedBatchSampler,
    declared_point_counts,
    measure_point_counts,
)
from lightning_sparse_dp.runtime.compat import IndexBatchSamplerWrapper, inner_batch_sampler, reinstantiate_loader


def replace_batch_sampler(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """A copy of ``dataloader`` (same class, dataset, collate_fn, workers...) drawing batches from ``batch_sampler``.

    Uses Lightning's own DataLoader re-instantiation (``lightning.pytorch.utilities.data``), as its
    sampler injection does.
    """
    if isinstance(dataloader.batch_sampler, IndexBatchSamplerWrapper):
        # Lightning's predict wrapper cannot be re-instantiated: read the loader's arguments from a copy that
        # holds the BatchSampler it wraps (DataLoader forbids setting batch_sampler, hence __dict__)
        dataloader = copy.copy(dataloader)
        dataloader.__dict__["batch_sampler"] = inner_batch_sampler(dataloader.batch_sampler)
    return reinstantiate_loader(
        dataloader, sampler=None, shuffle=False, batch_sampler=batch_sampler, batch_size=1, drop_last=False
    )


def _in_dataset_order(sampler: Any) -> bool:
    """Lightning's predict sampler over the dataset in order (a DataLoader without ``shuffle``)."""
    wrapped = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    return type(sampler) is UnrepeatedDistributedSamplerWrapper and not sampler.shuffle and isinstance(wrapped, SequentialSampler)


def point_balanced_loader(
    dataloader: object,
    *,
    world_size: int,
    rank: int,
    split: str,
    counts_of: Callable[[Any], list[int]],
    use_distributed_sampler: bool = True,
    say: Callable[[str], Any] = print,
    predict_samplers: list[PointBalancedBatchSampler] | None = None,
) -> object:
    """``dataloader`` drawing its batches from a :class:`PointBalancedBatchSampler` instead of the
    ``DistributedSampler`` Lightning injected (``sparse_ddp``'s ``process_dataloader``).

    Only for map-style loaders whose sampler is a plain ``DistributedSampler`` batched by a plain ``BatchSampler``
    (Lightning's injection for training / validation / test), or, when predicting, Lightning's predict sampler over
    the dataset in order (its sampler is appended to ``predict_samplers``, so that predictions come back merged);
    other loaders (custom samplers, a shuffled predict loader, ``use_distributed_sampler=False``) are returned as
    they are. The global batch is the DataLoader's ``batch_size`` times ``world_size``, as with ``"ddp"``.

    Args:
        counts_of: points per sample of a dataset (``split="balanced"``; :func:`dataset_point_counts`).
        say: where the one line goes when the loader is kept (fewer samples than ranks, nothing to count).
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    inner = dataloader.batch_sampler  # for predict, Lightning wraps it to record each batch's indices
    predicting = isinstance(inner, IndexBatchSamplerWrapper)
    inner = inner_batch_sampler(inner) if predicting else inner
    sampler = getattr(inner, "sampler", None)
    if (
        type(inner) is not BatchSampler
        or not (_in_dataset_order(sampler) if predicting else type(sampler) is DistributedSampler)
        or not use_distributed_sampler
    ):
        return dataloader
    assert isinstance(sampler, DistributedSampler)
    size = len(dataloader.dataset)  # type: ignore[arg-type]
    if size < world_size:  # empty, or fewer samples than ranks: DDP's sampler pads, and Lightning warns / skips
        say(
            f"sparse_ddp: a DataLoader of {size} samples, fewer than the {world_size} ranks, keeps Lightning's "
            "DistributedSampler (which repeats samples to give every rank one)."
        )
        return dataloader
    try:
        counts = counts_of(dataloader.dataset) if split == "balanced" else None
    except TypeError as err:  # items with no tensor to count points of (e.g. a range of ints)
        say(
            f"sparse_ddp: {err} Until then this DataLoader keeps Lightning's DistributedSampler (samples dealt "
            "round-robin, the epoch padded with repeated samples)."
        )
        return dataloader
    batch_sampler = PointBalancedBatchSampler(
        counts,
        inner.batch_size * world_size,
        num_replicas=world_size,
        rank=rank,
        num_samples=size,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=inner.drop_last,
        split=split,
    )
    if predicting:
        if predict_samplers is not None:
            predict_samplers.append(batch_sampler)
        return replace_batch_sampler(dataloader, IndexBatchSamplerWrapper(batch_sampler))
    return replace_batch_sampler(dataloader, batch_sampler)


def dataset_point_counts(
    dataset: Any, cache: dict[int, tuple[Any, list[int]]], world_size: int, rank: int, count_points: Callable[..., int]
) -> list[int]:
    """Points per sample of ``dataset``: its ``point_counts`` attribute, else measured once, each rank reading
    ``1 / world_size`` of the samples and all-gathering (``cache``, keyed by the dataset, keeps the result).

    Raises:
        ValueError: ``point_counts`` of another length than the dataset.
        TypeError: samples with no tensor to count points of (:func:`~lightning_sparse_dp.ddp.sampler.measure_point_counts`).
    """
    cached = cache.get(id(dataset))
    if cached is not None and cached[0] is dataset:
        return cached[1]
    counts = declared_point_counts(dataset)
    if counts is None:
        size = len(dataset)
        rank_zero_info(
            f"sparse_ddp: measuring the points of {size} samples once (each rank reads 1/{world_size} of them); "
            "give the dataset a `point_counts` attribute to skip this."
        )
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            mine = measure_point_counts(dataset, range(rank, size, world_size), count_points)
            shares: list[Any] = [None] * world_size
            dist.all_gather_object(shares, mine)
            counts = [0] * size
            for r, share in enumerate(shares):
                counts[r::world_size] = share
        else:
            counts = measure_point_counts(dataset, range(size), count_points)
    if len(counts) != len(dataset):
        raise ValueError(f"the dataset declares {len(counts)} point_counts but has {len(dataset)} samples.")
    cache[id(dataset)] = (dataset, counts)
    return counts


__all__ = ["dataset_point_counts", "point_balanced_loader", "replace_batch_sampler"]
