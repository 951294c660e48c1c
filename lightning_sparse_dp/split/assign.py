"""Assign: which whole samples go to which chunk.

An assignment maps points per sample (int64 ``[B]``) and a number of chunks ``k`` to ``min(k, B)``
lists of sample ids. :func:`assign` checks what an assignment returns and derives what the cut needs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

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
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    return list(torch.arange(num_samples).tensor_split(k))


def balanced_assignment(sample_sizes: Tensor, num_chunks: int) -> list[Tensor]:
    """Assign whole samples to ``min(num_chunks, B)`` chunks so that their point counts are even.

    Greedy longest processing time first (R. L. Graham, "Bounds on multiprocessing timing
    anomalies", SIAM J. Appl. Math. 17(2), 1969; at most 4/3 - 1/(3k) times the optimal largest
    chunk): samples in decreasing size, each to the chunk with the fewest points so far (the lowest
    index on ties). Deterministic; sample ids ascend inside each chunk, so sample order is kept.

    Args:
        sample_sizes: int64 ``[B]``, points per sample.
        num_chunks: ``k``.

    Returns:
        per chunk, int64 ``[b_i]`` ascending sample ids; every chunk has at least one sample.

    Raises:
        ValueError: ``num_chunks < 1`` or no samples.
    """
    num_samples, k = _chunk_count(sample_sizes, num_chunks)
    sizes = sample_sizes.tolist()
    order = sorted(range(num_samples), key=lambda i: (-sizes[i], i))
    loads = [(0, c) for c in range(k)]  # a heap of (points so far, chunk): the least loaded, lowest index first
    members: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, j = loads[0]
        heapq.heapreplace(loads, (load + sizes[i], j))
        members[j].append(i)
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members]


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
    chunk_samples = [torch.as_tensor(c, dtype=torch.long).flatten() for c in fn(sizes, num_chunks)]
    chunk_samples = [c for c in chunk_samples if c.numel() > 0]
    lengths = [c.numel() for c in chunk_samples]
    ids = torch.cat(chunk_samples) if chunk_samples else torch.empty(0, dtype=torch.long)
    if ids.numel() > 0 and not 0 <= int(ids.min()) <= int(ids.max()) < num_samples:
        raise BatchLayoutError(f"the assignment names samples outside 0..{num_samples - 1}.")
    times_assigned = torch.bincount(ids, minlength=num_samples)  # one pass over all chunks, no loop per chunk
    if ids.numel() > num_samples or bool((times_assigned > 1).any()):
        raise BatchLayoutError("the assignment puts a sample into more than one chunk.")
    if ids.numel() < num_samples:
        raise BatchLayoutError("the assignment leaves samples out of every chunk: every sample must go to one chunk.")
    counts = torch.tensor(lengths)
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    sample_to_chunk = torch.empty(num_samples, dtype=torch.long)
    index_in_chunk = torch.empty(num_samples, dtype=torch.long)
    sample_to_chunk[ids] = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    index_in_chunk[ids] = torch.arange(num_samples) - starts
    return chunk_samples, sample_to_chunk, index_in_chunk


__all__ = [
    "ASSIGNMENTS",
    "assign",
    "balanced_assignment",
    "check_num_chunks",
    "contiguous_assignment",
    "resolve_assignment",
]
