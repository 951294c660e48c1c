"""Assign: which whole samples go to which chunk.

An assignment maps points per sample (int64 ``[B]``) and a number of chunks ``k`` to ``min(k, B)``
lists of sample ids. :func:`assign` checks what an assignment returns and derives what the cut needs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch
from torch import Tensor

from lightning_sparse_dp.split.records import BatchLayoutError

Assignment = Callable[[Tensor, int], list[Tensor]]


def check_num_chunks(num_chunks: int) -> None:
    """Raise ``ValueError`` unless ``num_chunks >= 1`` (chunks, replicas or ranks)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")


def _chunk_count(sample_sizes: Tensor, num_chunks: int) -> tuple[int, int]:
    """``(B, min(num_chunks, B))``, or a ValueError for ``num_chunks < 1`` or no samples."""
    check_num_chunks(num_chunks)
    num_samples = int(sample_sizes.numel())
    if num_samples < 1:
        raise ValueError("there are no samples to assign.")
    return num_samples, min(num_chunks, num_samples)


def contiguous_assignment(sample_sizes: Tensor, num_chunks: int) -> list[Tensor]:
    """Assign samples ``0..B-1`` to ``min(num_chunks, B)`` contiguous chunks of sizes differing by at most one.

    Same sizes as ``torch.tensor_split`` (the first ``B % k`` chunks get one sample more); the
    number of points is not looked at.

    Args:
        sample_sizes: int64 ``[B]``, points per sample (only its length is used).
        num_chunks: ``k``.

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids.

    Raises:
        ValueError: ``num_chunks < 1`` or no samples.
    """
    return [_ids(m) for m in _contiguous_members(sample_sizes, num_chunks)]


def _contiguous_members(sample_sizes: Tensor, num_chunks: int) -> list[list[int]]:
    """:func:`contiguous_assignment`'s chunks as lists of sample ids."""
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    size, extra = divmod(num_samples, k)
    bounds = [j * size + min(j, extra) for j in range(k + 1)]  # torch.tensor_split's: the first B % k one longer
    return [list(range(bounds[j], bounds[j + 1])) for j in range(k)]


def balanced_assignment(sample_sizes: Tensor, num_chunks: int, groups: Sequence[int] | None = None) -> list[Tensor]:
    """Assign whole samples to ``min(num_chunks, B)`` chunks so that their point counts are even.

    Greedy longest processing time first (R. L. Graham, "Bounds on multiprocessing timing
    anomalies", SIAM J. Appl. Math. 17(2), 1969; at most 4/3 - 1/(3k) times the optimal largest
    chunk): samples in decreasing size, each to the chunk with the fewest points so far (the lowest
    index on ties). Deterministic; sample ids ascend inside each chunk, so sample order is kept.

    With ``groups`` (chunks that share a resource, e.g. replicas pinned to one CPU core:
    :func:`~lightning_sparse_dp.runtime.threads.plan_cores`), the groups are balanced first and the chunks inside
    each group second: samples go to groups by the rule above (groups in place of chunks), then single
    moves and swaps between the most and the least loaded group narrow their gap while they can (the
    rule leaves up to the last sample's size), then each group's samples go to its chunks by the rule
    above. A group with fewer samples than chunks leaves chunks empty (dropped).

    Args:
        sample_sizes: int64 ``[B]``, points per sample.
        num_chunks: ``k``.
        groups: ``None``, or a group id per chunk (at least ``k``; the first ``k`` are used).

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids; every chunk has at least one sample.

    Raises:
        ValueError: ``num_chunks < 1``, no samples, or fewer groups than chunks.
    """
    return [_ids(m) for m in _balanced_members(sample_sizes, num_chunks, groups)]


def _balanced_members(sample_sizes: Tensor, num_chunks: int, groups: Sequence[int] | None = None) -> list[list[int]]:
    """:func:`balanced_assignment`'s chunks as ascending lists of sample ids."""
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    table = sample_sizes.detach().cpu().numpy()
    sizes = table.tolist()
    signed = table.astype(np.float64 if table.dtype.kind == "f" else np.int64, copy=False)  # negated below
    order = np.argsort(-signed, kind="stable").tolist()  # decreasing size, the lower id first on ties
    members = _grouped_assignment(sizes, order, k, groups) if groups is not None else _lpt(sizes, order, k)
    for m in members:
        m.sort()
    return members


def _ids(members: list[int]) -> Tensor:
    """Sample ids as an int64 tensor (through numpy: cheaper than ``torch.tensor`` of a list)."""
    return torch.from_numpy(np.array(members, dtype=np.int64))


def _lpt(sizes: list[int], order: list[int], bins: int) -> list[list[int]]:
    """Graham's rule: the samples of ``order`` (decreasing size), each to the bin with the fewest points so
    far (the lowest index on ties); the sample ids of each bin."""
    if bins == 1:
        return [list(order)]
    if bins == 2:  # the same rule without the heap (2 bins: pinned replicas' groups, 2 replicas): ties to bin 0
        loads2, first, second = [0, 0], [], []
        for i in order:
            if loads2[0] <= loads2[1]:
                loads2[0] += sizes[i]
                first.append(i)
            else:
                loads2[1] += sizes[i]
                second.append(i)
        return [first, second]
    loads = [(0, c) for c in range(bins)]  # a heap of (points so far, bin): the least loaded, lowest index first
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        load, j = loads[0]
        heapq.heapreplace(loads, (load + sizes[i], j))
        members[j].append(i)
    return members


def _grouped_assignment(sizes: list[int], order: list[int], k: int, groups: Sequence[int]) -> list[list[int]]:
    """:func:`balanced_assignment` with ``groups``: samples to groups (:func:`_lpt`, then :func:`_even_out`),
    then each group's samples to its chunks (:func:`_lpt`)."""
    if len(groups) < k:
        raise ValueError(f"groups must name a group for each of the {k} chunks, got {list(groups)}.")
    group_of = list(groups[:k])
    ids = sorted(set(group_of))
    chunks_of = {g: [c for c in range(k) if group_of[c] == g] for g in ids}
    in_group = dict(zip(ids, _lpt(sizes, order, len(ids))))
    loads = {g: sum(map(sizes.__getitem__, members)) for g, members in in_group.items()}
    _even_out(sizes, in_group, loads, {g: len(c) for g, c in chunks_of.items()})
    members: list[list[int]] = [[] for _ in range(k)]
    for g in ids:
        member = set(in_group[g])
        inside = [i for i in order if i in member]  # the group's samples in the rule's order (decreasing size)
        for c, chunk in zip(chunks_of[g], _lpt(sizes, inside, len(chunks_of[g]))):
            members[c] = chunk
    return members


def _even_out(sizes: list[int], in_group: dict[int, list[int]], loads: dict[int, int], keep: dict[int, int]) -> None:
    """Lower the gap between the most and the least loaded group, in place, while one move or swap can.

    Each round takes the best single move (a sample of the fuller group to the emptier one; the fuller keeps
    at least ``keep[g]`` samples) or swap (one sample each way; tried while the two groups hold at most 4096
    pairs) by the gap left, ``|gap - 2 d|`` for a transfer of ``d`` points; stops when none leaves a smaller
    gap, after at most 16 rounds (Graham's rule leaves a gap of at most the smallest sample's size; one or
    two rounds close it in practice, and the cap bounds the cost for large batches). Deterministic: strict
    improvements; among equal moves the lowest sample id, among equal swaps the lowest pair (out of the
    fuller group first), a swap only where it beats every move. The candidates of a round are scored as
    numpy arrays (the pairs as one broadcast ``[a, b]`` table), not in Python loops.
    """
    # a move or swap of d points narrows the gap only for 0 < d < gap: none exists for a gap of 1 (whole points)
    least = 1 if all(type(x) is int for x in loads.values()) else 0
    table = None
    for _ in range(16):
        high = max(loads, key=lambda g: (loads[g], -g))
        low = min(loads, key=lambda g: (loads[g], g))
        gap = loads[high] - loads[low]
        if gap <= least:  # nothing can leave a smaller gap (below): Graham's rule often leaves 0 or 1
            return
        table = np.asarray(sizes, dtype=np.int64) if table is None else table
        out_of_high = np.sort(np.asarray(in_group[high], dtype=np.int64))
        out_of_low = np.sort(np.asarray(in_group[low], dtype=np.int64))
        best: tuple[int, int, int | None] | None = None  # (gap left, sample out of high, sample out of low)
        if out_of_high.size > keep[high]:
            left = np.abs(gap - 2 * table[out_of_high])
            i = int(left.argmin())  # the first (lowest id) of the smallest
            if left[i] < gap:
                best = (int(left[i]), int(out_of_high[i]), None)
        if 0 < out_of_high.size * out_of_low.size <= 4096:
            left = np.abs(gap - 2 * (table[out_of_high][:, None] - table[out_of_low][None, :]))
            i, j = divmod(int(left.argmin()), out_of_low.size)  # row-major: the first pair in (high, low) order
            if left[i, j] < gap and (best is None or left[i, j] < best[0]):
                best = (int(left[i, j]), int(out_of_high[i]), int(out_of_low[j]))
        if best is None:
            return
        _, a, b = best
        in_group[high].remove(a)
        in_group[low].append(a)
        loads[high] -= sizes[a]
        loads[low] += sizes[a]
        if b is not None:
            in_group[low].remove(b)
            in_group[high].append(b)
            loads[low] -= sizes[b]
            loads[high] += sizes[b]


#: This module's assignments (a ``functools.partial`` of one too) and the functions that give their chunks as lists
#: of sample ids: :func:`assign` takes those, with nothing to convert or check, and makes its maps in Python (on a
#: cold cache after the replicas' backward pass, the tens of numpy calls over ``B`` ids took longer)
_OURS = {balanced_assignment: _balanced_members, contiguous_assignment: _contiguous_members}

#: The named assignments (``split_batch(assignment=...)``, the strategies' ``split=``).
ASSIGNMENTS: dict[str, Assignment] = {
    "contiguous": contiguous_assignment,
    "balanced": balanced_assignment,
}


def resolve_assignment(assignment: str | Assignment, argument: str = "assignment", callables: bool = True) -> Assignment:
    """The assignment function ``assignment`` names (or ``assignment`` itself, a callable).

    Args:
        argument: the name of the argument it came in, for the error (``"split"`` for the strategies
            and the sampler, which take names only: ``callables=False``).

    Raises:
        ValueError: a name not in :data:`ASSIGNMENTS`, or a callable where ``callables`` is False.
    """
    if callables and callable(assignment):
        return assignment
    if not isinstance(assignment, str) or assignment not in ASSIGNMENTS:
        raise ValueError(
            f"{argument}={assignment!r}; use one of {sorted(ASSIGNMENTS)}{' or a callable' if callables else ''}."
        )
    return ASSIGNMENTS[assignment]


def assign(sizes: Tensor, num_chunks: int, assignment: str | Assignment) -> tuple[list[Tensor], Tensor, Tensor]:
    """Chunks' sample ids, each sample's chunk ``[B]`` and its position inside the chunk ``[B]``.

    Empty chunks an assignment returns are dropped.

    Raises:
        ValueError: an unknown assignment name.
        BatchLayoutError: an assignment that puts a sample into two chunks or into none.
    """
    fn = resolve_assignment(assignment)
    num_samples = int(sizes.numel())
    base, args, keywords = (fn.func, fn.args, fn.keywords) if isinstance(fn, partial) else (fn, (), {})
    members_of = _OURS.get(base)
    if members_of is not None:  # ours (or a partial of ours, called as the partial would call it): every sample once
        return _maps([m for m in members_of(*args, sizes, num_chunks, **keywords) if m], num_samples)
    chunk_samples = [torch.as_tensor(c, dtype=torch.long).flatten().cpu() for c in fn(sizes, num_chunks)]
    chunk_samples = [c for c in chunk_samples if c.numel() > 0]
    # the checks and the derived maps in numpy: less overhead per call than torch ops on arrays this small
    lengths = np.array([c.numel() for c in chunk_samples], dtype=np.int64)
    ids = np.concatenate([c.numpy() for c in chunk_samples]) if chunk_samples else np.empty(0, dtype=np.int64)
    _check_assigned(ids, num_samples)
    sample_to_chunk = np.empty(num_samples, dtype=np.int64)
    index_in_chunk = np.empty(num_samples, dtype=np.int64)
    sample_to_chunk[ids] = np.repeat(np.arange(lengths.size), lengths)
    index_in_chunk[ids] = np.arange(num_samples) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return chunk_samples, torch.from_numpy(sample_to_chunk), torch.from_numpy(index_in_chunk)


def _maps(members: list[list[int]], num_samples: int) -> tuple[list[Tensor], Tensor, Tensor]:
    """:func:`assign`'s result from chunks given as lists of sample ids (each sample in one, ascending in each)."""
    chunk_of, position = [0] * num_samples, [0] * num_samples
    for j, chunk in enumerate(members):
        for p, i in enumerate(chunk):
            chunk_of[i] = j
            position[i] = p
    ids = [torch.from_numpy(np.array(m, dtype=np.int64)) for m in (*members, chunk_of, position)]  # as _ids makes them
    return ids[:-2], ids[-2], ids[-1]


def _check_assigned(ids: np.ndarray, num_samples: int) -> None:
    """A user's assignment's sample ids (all chunks', concatenated) name every sample ``0..num_samples-1`` once.

    Raises:
        BatchLayoutError: otherwise, saying how.
    """
    if ids.size > 0 and not 0 <= int(ids.min()) <= int(ids.max()) < num_samples:
        raise BatchLayoutError(f"the assignment names samples outside 0..{num_samples - 1}.")
    times_assigned = np.bincount(ids, minlength=num_samples)  # one pass over all chunks, no loop per chunk
    if ids.size > num_samples or bool((times_assigned > 1).any()):
        raise BatchLayoutError("the assignment puts a sample into more than one chunk.")
    if ids.size < num_samples:
        raise BatchLayoutError("the assignment leaves samples out of every chunk: every sample must go to one chunk.")


__all__ = [
    "ASSIGNMENTS",
    "Assignment",
    "assign",
    "balanced_assignment",
    "check_num_chunks",
    "contiguous_assignment",
    "resolve_assignment",
]
