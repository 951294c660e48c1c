"""Logged means of a ``sparse_ddp`` step, held back until every rank's are known, then logged as the global batch's.

Lightning accumulates a mean logged with ``on_epoch=True`` as ``sum(value * batch_size)`` per rank and, at the
epoch's end, divides the ranks' summed products by their summed batch sizes (``_ResultMetric.update`` /
``.compute`` in ``lightning.pytorch.trainer.connectors.logger_connector.result``). That is one device's epoch mean
only when each rank's value is a mean over exactly what its ``batch_size`` counts; a loss with an ignore label,
or a mean over samples logged with the points Lightning infers from the coordinates, is off wherever the ranks'
shares differ. Here a mean-reduced tensor logged with ``sync_dist=True`` in a training / validation / test step
(:class:`HeldMeans`) reaches Lightning's results only after the step, and then as the global batch's value ``V``
(the strategy's reading of every rank's value, gathered once for all such names: :func:`settle`) and one device's
batch size ``B``, the same on every rank. Every rank then accumulates one device's ``sum_b V_b B_b`` and
``sum_b B_b``, so the epoch mean, and its on-step value, are one device's.

``B`` is what one device's ``self.log`` would weigh the batch by: the sum of the ranks' ``batch_size`` (each rank's
count: Lightning's inference from its share, e.g. its points, or an explicit per-rank count), or the one value every
rank passed where it is not each rank's own sample count (a constant such as ``self.hparams.batch_size``:
:func:`~lightning_sparse_dp.step.log.constant_batch_size`, as ``sparse_dp`` reads its replicas').

As with Lightning's DDP, a name logged with ``sync_dist=True`` must be logged by every rank in the step (the gather is
a collective); a name some ranks leave out in a step is the value of those that logged it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor

from lightning_sparse_dp.loss.decide import decide
from lightning_sparse_dp.loss.means import count_of
from lightning_sparse_dp.loss.step import log_fallback_message, refusal
from lightning_sparse_dp.runtime.compat import inferred_batch_size, shadow_result_updates, synced_reduction
from lightning_sparse_dp.step.log_memory import constant_batch_size

#: one rank's reading of a logged value: (its summary where it is a combination of the step's captured losses, else
#: ``None``; its values as floats; the element count of a mean the step computed, else ``None``; ``n_r``)
Row = tuple[Any, list[float], Any, float]


@dataclass
class HeldCall:
    """One held ``self.log`` of a step: the value (0-dim tensor, Lightning's copy of what was logged), what the
    strategy tells the other ranks of it (``row``, read while the step runs: its losses and means are known then),
    its ``batch_size`` as Lightning resolved it, and whether the step passed it (else Lightning inferred it)."""

    value: Tensor
    row: Any
    batch_size: int
    explicit: bool
    reduction: str = "mean"


class HeldMeans:
    """For one step of one rank: Lightning's results (``trainer._results``, a ``_ResultCollection``) take the step's
    held values (the tensors logged with ``sync_dist=True``: :func:`~lightning_sparse_dp.runtime.compat.synced_reduction`;
    reduced by a sum, maximum or minimum only where the strategy reads the batch's value, a combination of the losses
    or a mean the step computed: the global value, a sum's share ``1 / world_size`` of it, which Lightning's reduction
    across ranks gives back) into :attr:`calls` instead of accumulating them;
    :meth:`release`, after the block, accumulates the settled values. Entered around the step in the rank's own thread;
    the results object's ``update_metrics`` is shadowed on that instance only, and given back on exit
    (:func:`~lightning_sparse_dp.runtime.compat.shadow_result_updates`). ``row(value)`` is what the rank tells the others of a
    held value. A name logged twice in a step keeps its last value, as Lightning's on-step value does.
    """

    def __init__(self, results: Any, row: Callable[[Tensor], Any], all_ranks: Callable[[bool], bool] | None = None) -> None:
        self.results = results
        self.row = row
        #: ``all_ranks(flag)``: whether ``flag`` holds on every rank (a collective): a summed, maximal or minimal value
        #: is held only where every rank holds it, so that the ranks' collectives stay in step (one rank holding a value
        #: for the step's gather while another lets Lightning reduce it at once deadlocked both)
        self.all_ranks = all_ranks
        self.calls: dict[str, HeldCall] = {}
        self._shadow = shadow_result_updates(results, self._hold)

    def _hold(self, update: Callable[[str, Any, int], None], key: str, value: Any, batch_size: int) -> None:
        reduction = synced_reduction(self.results[key])
        if reduction is None:
            update(key, value, batch_size)
            return
        value = value.detach()
        row = self.row(value)
        if reduction != "mean":  # the ranks' own sum / max / min (a count, logits.max()), which Lightning's reduction
            # across ranks makes one device's, unless every rank reads it as a loss or a mean of the step (read off its
            # value, which may match on one rank only: an accuracy of 1.0 and a count of 1)
            held = row[0] is not None or row[2] is not None
            if self.all_ranks is not None:
                held = self.all_ranks(held)
            if not held:
                update(key, value, batch_size)
                return
        inferred = inferred_batch_size(self.results)
        explicit = inferred is None or batch_size != inferred
        self.calls[key] = HeldCall(value, row, int(batch_size), explicit, reduction)

    def __enter__(self) -> HeldMeans:
        self._shadow.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shadow.__exit__(*exc)

    def release(self, settled: dict[str, tuple[Tensor, int]]) -> None:
        """After the block: accumulate each held name's settled ``(value, batch_size)`` in Lightning's results, as its
        ``self.log`` would have (the same order)."""
        for key in self.calls:
            value, size = settled[key]
            self.results.update_metrics(key, value, size)
        self.calls = {}


def rank_row(tensor: Tensor, capture: Any, summary_of: Callable[[Tensor], Any], n: float) -> Row:
    """What a rank tells the others of a logged value (a :data:`Row`, which :func:`whole_value` reads): its summary
    where it is a combination of the step's captured losses (``capture``: the rank's
    :class:`~lightning_sparse_dp.loss.capture.TermCapture`, ``None`` without ``loss_weighting="terms"``;
    ``summary_of(value)``: the rank's :class:`~lightning_sparse_dp.loss.decide.Summary` of it), its values as floats,
    the element count of a mean the step computed (:func:`~lightning_sparse_dp.loss.means.count_of`), and ``n``
    (the rank's ``n_r``)."""
    x = tensor.detach()
    one = x.numel() == 1  # a logged float is a tensor on the rank's device by now (Lightning's self.log)
    summary = None
    if capture is not None:
        target = tensor if id(tensor) in capture.forms else capture.tensor_of(float(x)) if one else None
        if target is not None:
            summary = summary_of(target)
    count = count_of(tensor)
    if count is None and one:
        count = count_of(float(x))
    return (summary, x.to(torch.float64).cpu().reshape(-1).tolist(), count, n)


def whole_value(
    rows: Sequence[Row], like: Tensor, memory: Any, name: str | None = None, warnings: WarningCache | None = None,
) -> Tensor:
    """The global batch's value of a logged value from the ranks' rows: the loss's own where every row is a
    combination of captured losses (:func:`~lightning_sparse_dp.loss.decide.decide`, with the strategy's site memory
    ``memory``), an integer (a count over the rank's rows, ``mask.sum()``) the ranks' sum, as ``sparse_dp`` sums its
    replicas', else the values weighted by the means' element counts where every rank has one, else by ``n_r``;
    shaped, typed and placed like ``like``. The last, for values that differ between the ranks, is one device's only
    for a mean over what ``n_r`` counts (a hand-made ``correct / labeled`` is not): said once per ``name`` in
    ``warnings`` (rank 0 says it; every rank reads the same rows), as ``sparse_dp`` says it of its replicas; where every
    row is a combination of captured losses that the decision refuses (ranks that called a loss different numbers of
    times), its reason is said instead (:func:`~lightning_sparse_dp.loss.step.log_fallback_message`)."""
    said = False
    if all(r[0] is not None for r in rows):
        decision = decide([r[0] for r in rows], memory, "rank")
        if warnings is not None:
            for note in decision.notes:  # an ambiguous reading said, as the training step's decision says its own
                warnings.info(note.replace("sparse_dp:", "sparse_ddp:", 1))
        if decision.value is not None:
            return torch.tensor(decision.value, dtype=like.dtype, device=like.device).reshape(like.shape)
        reason = refusal(decision)  # losses the ranks called otherwise than one device (a loop stopped early): said
        if reason is not None and warnings is not None:
            warnings.info(log_fallback_message("sparse_ddp", name or "<name>", reason))
            said = True
    if not (like.is_floating_point() or like.is_complex()):  # a count over the rank's rows (mask.sum()): the batch's
        total = torch.tensor([r[1] for r in rows], dtype=torch.float64).sum(0)  # is their sum, as sparse_dp sums them
        return total.reshape(like.shape).to(device=like.device, dtype=like.dtype)
    counted = all(r[2] is not None for r in rows)
    if not counted and not said and warnings is not None and any(r[1] != rows[0][1] for r in rows[1:]):
        warnings.info(
            f"sparse_ddp: self.log({name or '<name>'!r}, ..., sync_dist=True) differs between ranks and is not a mean the "
            "step computed with torch.mean / .mean() (e.g. a hand-made sum / count): it is reduced as a mean weighted "
            "by each rank's share of the loss weighting (samples or points), the whole batch's value only for a mean "
            "over those. For the whole batch's value log value.mean() of the per-element values (e.g. "
            "(pred[m] == y[m]).double().mean()) or pass batch_size= the count it is a mean over; a torchmetrics metric "
            "logged instead gives the whole epoch's value (on step, the rank's own, as under DDP)."
        )
    weights = [float(r[2]) for r in rows] if counted else [r[3] for r in rows]
    total = sum(weights)
    values = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    share = torch.tensor([w / total if total > 0 else 1.0 / len(rows) for w in weights], dtype=torch.float64)
    return (values * share[:, None]).sum(0).reshape(like.shape).to(device=like.device, dtype=like.dtype)


def settle(
    ranks: Sequence[tuple[int, dict[str, tuple[Any, int, bool]]]],
    value_of: Callable[[list[Any], Tensor, str], Tensor],
    mine: dict[str, HeldCall],
    constants: dict[str, bool] | None = None,
    warnings: WarningCache | None = None,
) -> dict[str, tuple[Tensor, int]]:
    """Every held name's global value and one device's batch size, read alike on every rank.

    Args:
        ranks: every rank's ``(samples in its share, {name: (row, batch_size, explicit)}, points of its share per
            point set)``, in rank order; ``row`` is what ``value_of`` reads (the strategy's summary of the value); the
            points tell a ``batch_size=`` that is each share's point count (fixed-size point clouds) from a constant.
        value_of: ``value_of(rows of the ranks that logged the name, this rank's value, name=the name) -> value``: the
            global batch's value, shaped and typed like this rank's (the strategy's :func:`whole_value`).
        mine: this rank's held calls (the names it settles).
        constants: per name logged with one ``batch_size=`` on every rank, whether it was read as one constant at some
            step (``True``; else each share's count) (the strategy's, kept for the run): one equal to every share's
            samples at a later step (the loader's per-rank ``batch_size``, passed as ``self.hparams.batch_size``) is that
            constant still, not each share's count. A name first read as each share's count and then found constant
            is said once (``warnings``): the epoch's mean weighed those earlier steps by the ranks' sum.
        warnings: where that is said.

    Returns:
        ``{name: (value, batch_size)}`` for the names in ``mine``.
    """
    samples = [rank[0] for rank in ranks]
    sets = min((len(rank[2]) for rank in ranks), default=0) if all(len(rank) > 2 for rank in ranks) else 0
    points = [[rank[2][s] for rank in ranks] for s in range(sets)]  # per point set, per rank
    out: dict[str, tuple[Tensor, int]] = {}
    for key, call in mine.items():
        present = [r for r, rank in enumerate(ranks) if key in rank[1]]
        sizes = [ranks[r][1][key][1] for r in present]
        constant = None
        if all(ranks[r][1][key][2] for r in present):  # explicit everywhere: a count per rank, or one constant
            constant = constant_batch_size(sizes, present, sum(samples), samples, lambda: points)
            alike = all(size == sizes[0] for size in sizes)
            if constants is not None and alike:
                if constant is None and constants.get(key):
                    constant = sizes[0]
                elif constant is not None and constant != sum(samples):  # neither the batch's count nor the shares'
                    if constants.get(key) is False and warnings is not None:
                        warnings.info(
                            f"sparse_ddp: self.log({key.split('.', 1)[-1]!r}, ..., batch_size={constant}) is one "
                            f"constant: it was read as each rank's own count at earlier steps where every rank's share "
                            f"had {constant} samples, which weighed those steps by the ranks' sum in the epoch's mean; it "
                            "is read as the constant from now on. Pass batch_size=len(...) of the step's own samples, or "
                            "the global batch's size, to be read alike at every step."
                        )
                    constants[key] = True
                elif constant is None:
                    constants.setdefault(key, False)
        name = key.split(".", 1)[-1]  # Lightning's results key: "<hook>.<name>"
        value = value_of([ranks[r][1][key][0] for r in present], call.value, name=name)
        if call.reduction == "sum":  # Lightning sums it over the ranks: each accumulates its part of the batch's value
            value = value / len(ranks)
        out[key] = (value, constant if constant is not None else sum(sizes))
    return out


__all__ = ["HeldCall", "HeldMeans", "Row", "rank_row", "settle", "whole_value"]
