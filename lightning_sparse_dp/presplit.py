"""Pre-split: do the split in DataLoader worker processes instead of on the step's critical path.

:class:`PreSplitCollate` wraps a collate function: in each worker it collates the samples, then
splits the batch (:func:`~lightning_sparse_dp.split.split_batch`: batch indices, sample and point
rows, renumbering, the balanced assignment) and hands the main process a :class:`PreSplitBatch`,
so the main process only places the chunks on their devices. The ``sparse_dp`` strategy installs it
on DataLoaders with ``num_workers > 0`` by itself (``presplit=True``); it can be used directly too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from torch.utils.data import default_collate

from lightning_sparse_dp.split import SparseSpec, SplitPlan, check_num_chunks, split_batch


@dataclass
class PreSplitBatch:
    """A batch split in a worker: the chunks (SparseTensor / TensorField as SparseSpec) and the plan."""

    chunks: list[Any]
    plan: SplitPlan


class PreSplitCollate:
    """``collate_fn`` for a DataLoader: collate with ``collate_fn``, then split into ``num_chunks``.

    Args:
        collate_fn: the collate function to wrap (default ``torch.utils.data.default_collate``),
            e.g. one that calls ``ME.utils.sparse_collate``.
        num_chunks: the number of devices.
        layout, assignment, min_points: as for :func:`~lightning_sparse_dp.split.split_batch`.

    Picklable when ``collate_fn`` is, so it runs in worker processes.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_chunks: int,
        layout: Mapping[Any, str] | None = None,
        assignment: str = "balanced",
        min_points: int = 1,
    ) -> None:
        check_num_chunks(num_chunks)
        self.collate_fn = collate_fn or default_collate
        self.num_chunks = num_chunks
        self.layout = dict(layout) if layout else None
        self.assignment = assignment
        self.min_points = min_points

    def __call__(self, samples: list[Any]) -> PreSplitBatch:
        chunks, plan = split_batch(
            self.collate_fn(samples),
            self.num_chunks,
            layout=self.layout,
            assignment=self.assignment,
            min_points=self.min_points,
        )
        for chunk in chunks:  # a whole-batch chunk's source tensor cannot cross processes; it is rebuilt
            for spec in _specs(chunk):
                spec.source = None
        return PreSplitBatch(chunks, plan)


def _specs(chunk: Any) -> list[SparseSpec]:
    leaves = pytree.tree_leaves(chunk, is_leaf=lambda x: isinstance(x, SparseSpec))
    return [x for x in leaves if isinstance(x, SparseSpec)]


__all__ = ["PreSplitBatch", "PreSplitCollate"]
