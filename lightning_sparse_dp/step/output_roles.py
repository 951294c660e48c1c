"""Output roles: how each leaf of the replicas' step outputs is combined into the one output one device returns.

A role (:data:`OUTPUT_ROLES`) is named by the strategy's ``output_layout`` (:func:`output_role`) or read off the
leaf's values (:func:`guess_role`: a 0-dim float is a weighted mean, a 0-dim integer a sum, rows with the chunks' numbers
of samples or points are per-sample or per-point rows, other tensors are concatenated, equal non-tensors are one value),
with a warning, once, where the lengths cannot tell (the same length in every chunk, the chunks' own sample ids, rows
the step selected). :func:`per_sample_nodes` finds the lists and tuples with one entry per sample. The gather
(:mod:`~lightning_sparse_dp.step.gather`) merges each leaf by its role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lightning_sparse_dp.split import SplitPlan
from lightning_sparse_dp.split.leaves import key_of, layout_entry, path_name
from lightning_sparse_dp.split.merge import coordinates_back, point_sources, points_back

#: Roles for step outputs in ``output_layout`` (see :func:`gather_outputs`); ``"fixed"`` names a list /
#: tuple of fixed structure (e.g. ``(loss, logits)``) that is not one entry per sample; ``"first"`` the root replica's
#: value (a constant every replica returns).
OUTPUT_ROLES: tuple[str, ...] = ("samples", "points", "sum", "mean", "cat", "list", "fixed", "first")


def _alike(a: Any, b: Any) -> bool:
    """Two entries of one sequence that could be two samples' values: the same kind, recursively
    (tensors of the same dimensionality and dtype; sequences of the same length; dicts of the same keys)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Tensor):
        return a.dim() == b.dim() and a.dtype == b.dtype
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b))
    return True


def _is_sequence(x: Any) -> bool:
    return type(x) in (list, tuple)


def per_sample_nodes(
    outputs: Sequence[Any], plan: SplitPlan, output_layout: Mapping[Any, str] | None, warning_cache: WarningCache
) -> set[int]:
    """The ids of the lists / tuples in the replicas' outputs that hold one entry per sample.

    The rule, at every position of the outputs' common structure: a plain ``list`` or ``tuple`` (not a
    namedtuple) is per-sample when its length is its replica's number of samples in every replica
    and all its entries, in every replica, are alike (:func:`_alike`: a tuple ``(loss, logits)`` mixes a
    0-dim and a 2-dim tensor, so it is a fixed structure). When every chunk has the same number of samples,
    a sequence of alike entries could still be a fixed structure (``(logits_a, logits_b)`` in chunks of
    two samples): it is taken as per-sample and a warning (once) names the fix,
    ``output_layout={key: 'fixed'}`` (``'samples'`` silences it). ``output_layout`` decides first.

    Raises:
        ValueError: ``output_layout`` names a sequence ``'samples'`` whose lengths are not the chunks' samples.
    """
    marked: set[int] = set()

    def visit(values: list[Any], path: tuple[Any, ...]) -> None:
        first = values[0]
        if _is_sequence(first) and all(type(v) is type(first) for v in values):
            lengths = [len(v) for v in values]
            role = output_role(path, output_layout)
            entries = [x for v in values for x in v]
            if role == "samples" and lengths != plan.samples_per_chunk:
                raise ValueError(
                    f"output_layout gives step output {printed(path)} the role 'samples' but its lengths {lengths} "
                    f"are not the chunks' numbers of samples {plan.samples_per_chunk}."
                )
            present = [x for x in entries if x is not None]  # a sample with nothing to give (no detection): None
            per_sample = role == "samples" or (
                role not in OUTPUT_ROLES
                and lengths == plan.samples_per_chunk
                and bool(present) and all(_alike(present[0], x) for x in present[1:])
                # None beside values: per-sample where every replica's list holds two values or more, or where the
                # Nones sit at other places in different replicas; a fixed structure such as (logits, None) does neither
                and (len(present) == len(entries) or all(sum(x is not None for x in v) >= 2 for v in values)
                     or len({tuple(i for i, x in enumerate(v) if x is None) for v in values}) > 1)
            )
            if per_sample:
                if role != "samples" and plan.num_chunks > 1 and len(set(lengths)) == 1 and len(entries) > 1:
                    warning_cache.warn(
                        f"sparse_dp: step output {printed(path)} is a {type(first).__name__} of {lengths[0]} alike "
                        "entries in every chunk, which is also each chunk's number of samples: it is taken as one entry "
                        "per sample and the chunks' entries are concatenated in sample order. If it is a fixed "
                        f"structure (e.g. the outputs of two levels), say so: SparseDataParallelStrategy(output_layout="
                        f"{{{output_key(path)!r}: 'fixed'}}); name it 'samples' to silence this warning."
                    )
                marked.update(id(v) for v in values)
                return
            if len(set(lengths)) == 1:
                for k in range(lengths[0]):
                    visit([v[k] for v in values], (*path, pytree.SequenceKey(k)))
        elif isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
            for k in first:
                visit([v[k] for v in values], (*path, pytree.MappingKey(k)))
        elif isinstance(first, tuple) and hasattr(first, "_fields") and all(type(v) is type(first) for v in values):
            for k in first._fields:
                visit([getattr(v, k) for v in values], (*path, pytree.GetAttrKey(k)))

    visit(list(outputs), ())
    return marked


def lengths_of(values: list[Any]) -> list[int] | None:
    if all(isinstance(v, Tensor) and v.dim() > 0 for v in values):
        return [v.shape[0] for v in values]
    if all(isinstance(v, np.ndarray) and v.ndim > 0 or type(v) in (list, tuple) for v in values):
        return [len(v) for v in values]
    return None


def rows_of_chunks(values: list[Any], plan: SplitPlan) -> bool:
    """Whether ``values`` (one per chunk: tensors ``[m_i, ...]``, arrays, lists) are rows of their chunks: ``m_i`` each
    chunk's samples, or its points of one coordinate source; what a merge in batch order can put back as one device's."""
    lengths = lengths_of(values)
    return lengths is not None and (lengths == list(plan.samples_per_chunk) or bool(point_sources(plan, lengths)))


def guess_role(
    path: Sequence[Any], values: list[Any], plan: SplitPlan, warning_cache: WarningCache, say_lists: bool = True
) -> str:
    """The role of an output leaf that ``output_layout`` does not name, from its lengths; warns when unsure, and
    (``say_lists``) when differing values that are not tensors become the list of the replicas' values.

    ``path`` is the leaf's path: a warning prints it (``output['hist']``, :func:`printed`) and suggests its key for
    ``output_layout`` (:func:`output_key`), both made only when something is said.
    """
    first = values[0]
    if isinstance(first, Tensor) and first.dim() == 0:
        if any(v.is_floating_point() or v.is_complex() for v in values):  # not all integers (the loss): a mean
            return "mean"
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} is a 0-dim integer tensor from each replica: it is their sum, one device's "
            "value for a count over the batch (e.g. (pred == y).sum()), as self.log sums integers. If it is another "
            "integer (an index, a maximum), say how to combine it: SparseDataParallelStrategy(output_layout="
            f"{{{output_key(path)!r}: 'list'}}) gives the replicas' values (roles {', '.join(OUTPUT_ROLES)}); name it "
            "'sum' to silence this warning."
        )
        return "sum"
    lengths = lengths_of(values)
    if lengths is None:
        return _first_or_list(path, values, warning_cache, say_lists, plan)
    samples = lengths == plan.samples_per_chunk
    sets = point_sources(plan, lengths)
    points = bool(sets)
    same = plan.num_chunks > 1 and len(set(lengths)) == 1
    if len(sets) > 1 and not samples and points_back(values, plan, sets)[1] is values:  # features: no set told
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} has as many rows in every chunk as the points of several point sets "
            f"of the batch (its coordinate sources {', '.join(map(str, sets))}, in the order the split found them), which "
            f"put the chunks' rows back in different orders: it is merged as the points of source {sets[0]}, which is one "
            "device's only if it is theirs. Return it in an ME.SparseTensor of its set (whose coordinates tell the set), "
            "or return that set's coordinates (x.C) in its place."
        )
    if samples and _chunk_ids(values):
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} holds 0..b-1 in every chunk of b samples: the chunk's own sample ids "
            "(torch.unique(x.C[:, 0]), torch.arange(len(labels))), where one device's step gives the batch's 0..B-1. "
            "It is merged as per-sample rows as it is. Return the coordinates (x.C: they come back with the batch's "
            "sample ids) or per-sample values, and number the samples after the step (on_predict_batch_end, ...)."
        )
    if samples or points:
        role = "samples" if samples else "points"
        if same:
            warning_cache.warn(
                f"sparse_dp: step output {printed(path)} has the same length ({lengths[0]}) in every chunk, which is also each "
                f"chunk's number of {role}: it is taken as per-{role[:-1]} rows and merged in the original order. If it "
                f"is a value of fixed size (e.g. a histogram), say how to combine it: SparseDataParallelStrategy("
                f"output_layout={{{output_key(path)!r}: 'sum'}}) (roles {', '.join(OUTPUT_ROLES)}); name it "
                f"'{role}' to silence this warning."
            )
        return role
    if not isinstance(first, Tensor):
        return _first_or_list(path, values, warning_cache, say_lists, plan)
    integer = not (first.is_floating_point() or first.is_complex())
    if same:
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} has the same length ({lengths[0]}) in every chunk, matching neither the "
            "chunks' samples nor their points: it is concatenated in chunk order. If it is a value of fixed size (e.g. "
            f"a histogram), say how to combine it: SparseDataParallelStrategy(output_layout={{{output_key(path)!r}: 'sum'}}) "
            f"(roles {', '.join(OUTPUT_ROLES)}); name it 'cat' to silence this warning."
        )
    elif integer and coordinates_back(values, plan, "cat") is values:
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} is an integer tensor of other lengths than the chunks' samples or "
            "points: the replicas' are concatenated in chunk order, but integers read from a chunk are its own: row "
            "indices (torch.nonzero) count its rows, sample ids (x.C[mask][:, 0]) its samples, and a set (torch.unique) "
            "repeats what several chunks hold, where one device's step gives the batch's. Return per-point or "
            "per-sample values (a mask, the predictions: they come back in the batch's order) and select from them "
            f"after the step (on_predict_batch_end, ...), or name its role: SparseDataParallelStrategy(output_layout="
            f"{{{output_key(path)!r}: 'cat'}}) keeps the concatenation and silences this warning."
        )
    elif not integer and not in_sample_order(plan):
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} has other lengths than the chunks' samples or points (rows the step "
            "selected, e.g. o[mask], or a strided tensor's .F): the replicas' rows are concatenated in chunk order, "
            "and the balanced split put the batch's samples in the chunks out of their order (by points), so these "
            "rows come in another order than one device's. Return per-point or per-sample values and the mask (they "
            "come back in the batch's order) and select after the step (on_predict_batch_end, ...), or name its "
            f"role: SparseDataParallelStrategy(output_layout={{{output_key(path)!r}: 'cat'}}) keeps the chunk order "
            "and silences this warning."
        )
    return "cat"


def in_sample_order(plan: SplitPlan) -> bool:
    """Whether the chunks hold the batch's samples in its order (chunk ``i``'s sample ids all below chunk ``i + 1``'s;
    each chunk's ascend): rows concatenated in chunk order, each chunk's in its samples' order, are then in the
    batch's sample order."""
    chunks = plan.chunk_samples
    return all(int(a[-1]) < int(b[0]) for a, b in zip(chunks, chunks[1:]) if len(a) and len(b))


def _chunk_ids(values: list[Any]) -> bool:
    """Whether every chunk's value is the integer vector ``0..b_i-1`` (some chunk of two or more samples): the chunks'
    own sample ids."""
    return all(isinstance(v, Tensor) and v.dim() == 1 and not (v.is_floating_point() or v.is_complex()) for v in values) \
        and any(len(v) > 1 for v in values) \
        and all(torch.equal(v.long().cpu(), torch.arange(len(v))) for v in values)


def _first_or_list(path: Sequence[Any], values: list[Any], warning_cache: WarningCache, say: bool,
                   plan: SplitPlan | None = None) -> str:
    """``"first"`` for equal non-tensor values, else ``"list"``, said once (``say``): one device's step returns one
    value there, not one per chunk. Equal nonzero integers are said too (a count of each chunk's, ``int(mask.sum())``
    or ``len(y)`` over equal chunks, cannot be told from a constant): one device's count would be the batch's."""
    if comparable(values):
        value = values[0]
        several = plan is not None and plan.num_chunks > 1
        if say and several and type(value) is int and value != 0:  # a count of each chunk's, or a constant
            counted = plan.counts_each_chunk(value)  # type: ignore[union-attr]
            also = ", which is also each chunk's number of samples or points" if counted else ""
            warning_cache.warn(
                f"sparse_dp: step output {printed(path)} is {value} in every replica{also}: it is given as that one "
                "value, where one device's step counts the whole batch if it is a count (of the chunk's samples, "
                "points, hits: then 3 chunks of 1 hit each are 3). If it is, say so: "
                f"SparseDataParallelStrategy(output_layout={{{output_key(path)!r}: 'sum'}}); name it 'first' to "
                "silence this warning."
            )
        return "first"
    if say:  # the message names the output only, so that it is said once, whatever the values
        warning_cache.warn(
            f"sparse_dp: step output {printed(path)} ({type(values[0]).__name__}) differs between the replicas' chunks: it is "
            "given as the list of the replicas' values, in chunk order, where one device's step returns one value. "
            "Return it as a tensor (a 0-dim tensor is the batch's weighted mean, per-sample rows come back in sample "
            "order), or say how to combine it: SparseDataParallelStrategy(output_layout="
            f"{{{output_key(path)!r}: 'sum'}}) (roles {', '.join(OUTPUT_ROLES)}); name it 'list' to silence this warning."
        )
    return "list"


def comparable(values: list[Any]) -> bool:
    try:
        return all(bool(v == values[0]) for v in values[1:])
    except Exception:
        return False


def printed(path: Sequence[Any]) -> str:
    """An output leaf's path as messages print it (``output['hist']``), made only when something is said."""
    return path_name(path, root="output")


def output_key(path: Sequence[Any]) -> Any:
    """What to suggest for ``output_layout``: the innermost dict key / index of an output leaf, else its name."""
    key = key_of(path)
    return printed(path) if key is None else key


def output_role(path: Sequence[Any], output_layout: Mapping[Any, str] | None) -> str | None:
    entry = layout_entry(path, output_layout, root="output") if output_layout else None
    if entry is not None and entry[1] not in OUTPUT_ROLES:
        raise ValueError(f"output_layout[{entry[0]!r}] = {entry[1]!r}; use one of {OUTPUT_ROLES}.")
    return None if entry is None else entry[1]


__all__ = [
    "OUTPUT_ROLES", "comparable", "guess_role", "in_sample_order", "lengths_of", "output_key", "output_role",
    "per_sample_nodes", "printed", "rows_of_chunks",
]
