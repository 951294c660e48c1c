"""Memory: what earlier steps of a run told of each loss call site, kept so that a later step whose chunks cannot tell
reads the site as before (:class:`SiteMemory`; the strategy keeps one for its training steps and one for its
evaluation steps, :meth:`~lightning_sparse_dp.strategies.base.SparseStrategyMixin._memory_for`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sparse_dp.loss.readings import Reading


#: decisions kept per memory (the step's loss, its logged values and outputs; a few batch structures), oldest dropped
RECALLED = 16


class SiteMemory(dict):
    """Per call site (its key), how it was read where the step left no doubt: ``("samples", "mean" | "sum" |
    None)`` or ``("matched", None)``; kept by the strategy for the run, so that a later step of equal chunks reads
    the site as before. Every rank of ``sparse_ddp`` builds the same memory from the same summaries.

    ``loops``: per call site inside a loop of the user's code whose calls are matched by position, how many times each
    replica's step called it (``-1`` once that changed from step to step: a loop over what the chunk holds).
    ``sums``: per site of ``reduction="sum"`` calls, ``"divided"`` (by their inputs' rows), ``"counted"`` (a
    ``torch.sum`` divided by different numbers at some step, or any site whose coefficients differed between the
    replicas at some step: a count of the chunk, said at every step after) or
    ``"constant"`` (one coefficient), where a step of unequal chunks told which (:mod:`~lightning_sparse_dp.loss.readings`).
    ``classes``: per site of per-class losses (:mod:`~lightning_sparse_dp.loss.classes`), ``"mean"`` or ``"sum"``
    where a step told which their coefficients are.
    ``recalled``: per :func:`~lightning_sparse_dp.loss.decide.structure` key, the readings of its sites and the notes
    of their decision (at most :data:`RECALLED`, the oldest dropped first). ``last_sites``: the call sites of
    ``sparse_ddp``'s last decision on a step's loss (:attr:`~lightning_sparse_dp.loss.decide.Decision.sites`, set by
    :func:`~lightning_sparse_dp.loss.step.rank_scale`; its exactness check reads them), ``None`` once read.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loops: dict[int, int] = {}
        self.sums: dict[int, str] = {}
        self.classes: dict[int, str] = {}
        self.recalled: dict[tuple, tuple[list[Reading], list[str]]] = {}
        self.last_sites: frozenset | None = None

    def recall(self, key: tuple, readings: list[Reading], notes: list[str]) -> None:
        """Keep the ``readings`` and ``notes`` of a decision of structure ``key`` (read without the values)."""
        if len(self.recalled) >= RECALLED:
            del self.recalled[next(iter(self.recalled))]
        self.recalled[key] = (readings, list(notes))


__all__ = ["RECALLED", "SiteMemory"]
