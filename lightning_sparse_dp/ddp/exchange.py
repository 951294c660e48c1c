"""What ``sparse_ddp``'s ranks exchange over ``torch.distributed``: summaries in one fixed-size all-gather
(:func:`gather_objects`), each rank's count ``n_r`` and split of its batch (:func:`count_and_plan`), predictions
merged in the global batch's order (:func:`gather_step_outputs`), and the process group's end
(:func:`destroy_process_group_at_exit`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler
from lightning_sparse_dp.loss.weights import chunk_counts, chunk_weights, say_auto_choice
from lightning_sparse_dp.split import SplitPlan, split_batch
from lightning_sparse_dp.split.records import ChunkRows
from lightning_sparse_dp.step.gather import gather_outputs

#: bytes of a pickled summary that travel in the one fixed-size all-gather of :func:`gather_objects`
GATHER_BYTES = 4096


def gather_objects(obj: Any, device: torch.device, size: int = GATHER_BYTES) -> list[Any]:
    """Every rank's ``obj`` in rank order, in one ``all_gather`` of ``size + 8`` bytes per rank where every
    pickle fits (``all_gather_object`` costs two collectives: a length, then the data), else a second round
    through ``all_gather_object`` (every rank sees every length, so all take the same path)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = torch.zeros(size + 8, dtype=torch.uint8)
    buffer[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if len(data) <= size:
        buffer[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    out = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(out, buffer)
    rows = [r.tobytes() for r in torch.stack(out).cpu().numpy()]  # one copy to the host (a GPU wait), not one per rank
    lengths = [int.from_bytes(r[:8], "little") for r in rows]
    if max(lengths) > size:
        gathered: list[Any] = [None] * len(rows)
        dist.all_gather_object(gathered, obj)
        return gathered
    return [pickle.loads(r[8 : 8 + n]) for r, n in zip(rows, lengths)]


def local_count(
    batch: Any, loss_weighting: Any, layout: Mapping[Any, str] | None = None, warning_cache: WarningCache | None = None
) -> float:
    """``n_r``: what this rank's step loss is a mean over, in ``batch`` (this rank's share).

    :func:`~lightning_sparse_dp.loss.weights.chunk_counts` of the batch read as one chunk by
    :func:`~lightning_sparse_dp.split.split_batch`, so ranks count exactly as ``sparse_dp`` replicas do:
    ``"samples"``, ``"points"`` (points of the first coordinate source), ``"equal"`` (1), ``"auto"``
    (see :func:`~lightning_sparse_dp.loss.weights.resolve_auto`; said once through ``warning_cache`` when given) or
    a callable ``fn(batch) -> number``.

    Raises:
        ValueError: an unknown ``loss_weighting``.
        BatchLayoutError: a batch the split cannot read (see :func:`~lightning_sparse_dp.split.split_batch`).
    """
    return count_and_plan(batch, loss_weighting, layout, warning_cache)[0]


def count_and_plan(
    batch: Any, loss_weighting: Any, layout: Mapping[Any, str] | None = None, warning_cache: WarningCache | None = None
) -> tuple[float, SplitPlan | None]:
    """:func:`local_count` and the batch's split as one chunk (``None`` for ``"equal"``, which reads nothing), so that
    a step splits its batch once for both the count and the terms (a split reads every entry of the batch)."""
    if loss_weighting == "equal":
        return 1.0, None
    chunks, plan = split_batch(batch, 1, layout=layout)
    count = float(chunk_counts(plan, chunks, loss_weighting)[0])
    if warning_cache is not None:
        say_auto_choice(plan, loss_weighting, warning_cache, strategy="sparse_ddp")
    return count, plan


class _SaidBySparseDDP(WarningCache):
    """The merge's lines (:func:`~lightning_sparse_dp.step.gather.gather_outputs`, written for ``sparse_dp``) as
    ``sparse_ddp`` says them: its name, and its class where a line names the option to pass."""

    @staticmethod
    def _renamed(message: str) -> str:
        return message.replace("sparse_dp:", "sparse_ddp:", 1).replace("SparseDataParallelStrategy(", "SparseDDPStrategy(")

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        super().warn(self._renamed(message), stacklevel, **kwargs)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        super().info(self._renamed(message), stacklevel, **kwargs)


_said = _SaidBySparseDDP()


def gather_step_outputs(
    output: Any, sampler: PointBalancedBatchSampler, batch_idx: int, device: torch.device, batch: Any = None,
    layout: Mapping[Any, str] | None = None, output_layout: Mapping[Any, str] | None = None,
) -> Any:
    """Every rank's output of global batch ``batch_idx`` as one output, in the global batch's sample order.

    ``all_gather_object`` of each rank's output (tensors on the CPU) and of its share's points per sample
    (:func:`share_points` of ``batch``, this rank's share, read with ``layout``), merged by
    :func:`~lightning_sparse_dp.step.gather.gather_outputs` with the shares ``sampler`` dealt
    (:func:`global_plan`): per-sample lists and rows, and per-point rows, in the global batch's order, as one device
    returns them. Every rank must call it, for the same batch.
    """
    ids = sampler.global_batches()[batch_idx]
    position = {sample: p for p, sample in enumerate(ids)}
    shares = [torch.tensor([position[i] for i in share], dtype=torch.long) for share in sampler.shares(ids)]
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = (apply_to_collection(output, Tensor, lambda t: t.detach().cpu()), share_points(batch, layout))
    dist.all_gather_object(gathered, mine)
    plan = global_plan(len(ids), shares, [points for _, points in gathered])
    return gather_outputs([out for out, _ in gathered], plan, chunk_weights(plan, "samples"), device, output_layout, _said,
                          value_of=_no_whole_value)  # a 0-dim value that differs between the ranks is said


def _no_whole_value(values: list[Tensor]) -> None:
    """The ranks' 0-dim predict outputs have no whole-batch value here (a predict step's means are not captured across
    ranks): :func:`~lightning_sparse_dp.step.gather.gather_outputs` then says the weighted mean it gives is one device's
    only for a mean over the samples."""
    return None


def share_points(batch: Any, layout: Mapping[Any, str] | None = None) -> tuple[list[list[int]], list[int]] | None:
    """A rank's share ``batch`` read as the split reads a batch (:func:`~lightning_sparse_dp.split.split_batch`, one
    chunk): per coordinate source, the points of each of its samples in the share's order, and the sources' coordinate
    columns; ``None`` for no batch or one the split cannot read (its per-point outputs are then merged in rank order)."""
    if batch is None:
        return None
    try:
        _, plan = split_batch(batch, 1, layout=layout)
    except Exception:  # noqa: BLE001  (a batch of the user's own form: its per-sample outputs still merge)
        return None
    return [p.tolist() for p in plan.sample_points], list(plan.coordinate_columns)


def global_plan(num_samples: int, shares: list[Tensor], points: list[Any]) -> SplitPlan:
    """The global batch's :class:`~lightning_sparse_dp.split.SplitPlan` over the ranks' ``shares`` (per rank, int64
    ascending positions of its samples in the global batch, as the sampler deals them) and their :func:`share_points`:
    per coordinate source, each sample's points and each rank's rows of the batch one device collates (samples in
    position order, each sample's points together, as ME's ``sparse_collate`` puts them), as the split keeps a chunk's
    rows (:class:`~lightning_sparse_dp.split.records.ChunkRows`). Without every rank's points (or with sources that
    differ), the plan knows samples only."""
    plan = SplitPlan(num_samples=num_samples, chunk_samples=tuple(shares))
    if any(p is None for p in points) or len({(len(p[0]), tuple(p[1])) for p in points}) != 1:
        return plan
    rank_of_sample = np.zeros(num_samples, dtype=np.int64)
    for rank, share in enumerate(shares):
        rank_of_sample[share.numpy()] = rank
    sample_points = []
    for source in range(len(points[0][0])):
        counts = torch.zeros(num_samples, dtype=torch.long)
        for share, (per_source, _) in zip(shares, points):
            counts[share] = torch.tensor(per_source[source], dtype=torch.long)
        sample_points.append(counts)
    point_rows = tuple(ChunkRows(np.repeat(rank_of_sample, counts.numpy()), len(shares)) for counts in sample_points)
    return SplitPlan(num_samples=num_samples, chunk_samples=tuple(shares), point_rows=point_rows,
                     sample_points=tuple(sample_points), coordinate_columns=tuple(points[0][1]))


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group, if one is still up, while the interpreter is alive.

    A process that exits with a gloo process group alive can abort during interpreter shutdown
    ("terminate called without an active exception", exit code -6: gloo's worker threads are
    destroyed unjoined; pytorch/pytorch issue #190489). Lightning's ``DDPStrategy`` leaves the group
    up after ``fit`` (a later ``validate`` / ``test`` reuses it), so :class:`SparseDDPStrategy` registers
    this with ``atexit`` when it sets the group up.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "GATHER_BYTES",
    "count_and_plan",
    "destroy_process_group_at_exit",
    "gather_objects",
    "gather_step_outputs",
    "global_plan",
    "local_count",
    "share_points",
]
