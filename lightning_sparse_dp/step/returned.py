"""Returned entries: batch entries a step returns, merged back by the role the split cut them by.

A step may return an entry of its batch (``{"logits": ..., "inverse_map": batch["inverse_map"]}``, for
``on_predict_batch_end`` to map voxel predictions back to the original points), as it got it or changed in place
(labels remapped, ``y[y == 3] = -100``), or a new tensor put at its place (``batch["features"] = ...``). Each
replica returns its chunk's piece of that entry, cut by the entry's role in the split (per point, per sample, row
indices re-based to the chunk's rows, coordinates with the chunk's batch index). Merging such pieces by their lengths
alone would keep what the cut renumbered (an inverse map's chunk rows); one device's step returns the batch's entry.
So an output leaf that is, in every replica, the tensor its chunk holds at one place of the batch (after the step:
what the step put there counts) is merged by that place's role (:data:`~lightning_sparse_dp.split.merge.MERGES`, the
inverse of the cut): the pieces as the replicas returned them, in the batch's order, with the cut's renumbering
undone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_sparse_dp.split.leaves import flatten
from lightning_sparse_dp.split.merge import MERGES
from lightning_sparse_dp.split.records import BatchLayoutError, Role, SplitPlan

#: per replica, ``id(tensor) -> its leaf's position`` in its chunk (the split's flattening, ``plan.roles``' order)
Places = list[dict[int, int]]


def returned_entries(inputs: Sequence[Any] | None, plan: SplitPlan, layout: Mapping[Any, str] | None) -> Places | None:
    """Per replica, where each tensor of the chunk its step got (``inputs``: the step's chunks, made) sits among the
    split's leaves; ``None`` when a chunk is not made or does not flatten to the plan's leaves."""
    if not inputs or any(callable(chunk) and not isinstance(chunk, (Mapping, Sequence)) for chunk in inputs):
        return None
    try:
        flats = [flatten(chunk, layout)[0] for chunk in inputs]
    except BatchLayoutError:
        return None
    if any(len(flat) != len(plan.roles) for flat in flats):
        return None
    return [{id(leaf.value): i for i, leaf in enumerate(flat) if isinstance(leaf.value, Tensor)} for flat in flats]


def merged_entry(values: Sequence[Any], places: Places, plan: SplitPlan) -> Tensor | None:
    """The replicas' ``values`` merged by the role of the batch entry each is (the same place in every chunk, its piece's
    length the cut's), else ``None`` (an entry every chunk holds whole, or not an entry: the gather's rules)."""
    if len(values) != len(places) or not all(isinstance(v, Tensor) for v in values):
        return None
    i = places[0].get(id(values[0]))
    if i is None or any(p.get(id(v)) != i for p, v in zip(places[1:], values[1:])):
        return None
    role = Role(plan.roles[i])
    if role is Role.REPLICATE:
        return None
    if role is Role.INDICES:
        lengths = [len(r) for r in plan.index_rows[i]]
    elif role is Role.SAMPLES:
        lengths = plan.samples_per_chunk
    else:
        lengths = [len(r) for r in plan.point_rows[plan.leaf_sources[i]]]
    if [v.shape[0] if v.dim() else -1 for v in values] != lengths:
        return None
    return MERGES[role](list(values), i, plan)


__all__ = ["Places", "merged_entry", "returned_entries"]
