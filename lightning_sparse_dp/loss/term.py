"""Term: one captured call of a mean- or sum-reduced loss in a replica's step (:class:`Term`), and the value handed
back to the step in its place (:func:`scaled_value`), whose factor scales the gradient that reaches the call once the
replicas' denominators are known (:mod:`~lightning_sparse_dp.loss.capture` makes them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparse_dp.loss.classes import one_class
from lightning_sparse_dp.loss.sites import CallSite


class Term:
    """One captured call: ``name`` (``"F.cross_entropy"``), denominator ``D`` and value ``L`` (0 where ``D = 0``).

    ``denominator`` is ``None`` for a ``reduction="sum"`` call (its value counts once per replica). ``site``
    (:func:`~lightning_sparse_dp.loss.sites.call_site`'s key) names the place in the user's code that called it, the
    same in every process (``where``: ``file.py:line``), and ``in_loop`` whether that call ran inside a loop of the
    user's code; ``rows`` is the number of rows its input has (``input.shape[0]``; 1 for an unbatched or 0-dim input),
    which tells a loss over one sample's points from one over a decoder level's voxels; ``statistic`` whether its
    input (or a target or weight it was given) is a statistic of the chunk
    (:func:`~lightning_sparse_dp.loss.sites.reduces_rows`: ``out.F.mean(0)``), not rows of the chunk; ``shared`` the
    call's arguments that apply to all its rows alike (a class weight:
    :func:`~lightning_sparse_dp.loss.denominators.shared_arguments`), which every replica must have been given alike;
    ``bounds`` a mean-reduced cross entropy's target classes in a loop (:meth:`target_class`), else ``None``.
    A full ``torch.sum`` / ``torch.mean`` of a tensor is named ``"torch.sum"`` / ``"torch.mean"`` (no loss of torch's
    is named ``torch.*``: :func:`~lightning_sparse_dp.loss.denominators.loss_name`).

    The value handed to the step is ``L * s`` with ``s`` a 0-dim tensor of 1: :attr:`scale` sets ``s``
    after the step, without a version bump, so the multiplication's backward (which reads ``s``
    then) scales the gradient that reaches the call. A plain multiplication's backward costs less than a
    Python autograd function's (docs/benchmarks.md, "Costs of the step's parts").
    """

    __slots__ = (
        "name", "denominator", "value", "site", "where", "in_loop", "rows", "statistic", "shared", "checkpointed",
        "unrecorded", "bounds", "_scale", "_factor", "_numbers", "_class",
    )

    def __init__(
        self, name: str, denominator: float | Tensor | None, factor: Tensor, site: CallSite | None = None, rows: int = 1,
        statistic: bool = False, shared: tuple[Tensor, ...] = (), bounds: Tensor | None = None,
    ) -> None:
        self.name, self.denominator, self._factor = name, denominator, factor
        self.shared = tuple(t.detach() for t in shared)
        site = site or CallSite(0, "?", False)
        self.site, self.where, self.in_loop, self.rows = site.key, site.where, site.in_loop, rows
        self.statistic = statistic
        self.bounds = bounds
        self._class: int | None = None  # read with the numbers (TermCapture.read_numbers)
        self.checkpointed = False  # called inside torch.utils.checkpoint: recomputed in backward, unscaled there
        #: called where autograd records nothing in a step that records (a custom Function's forward, torch.no_grad):
        #: the gradient that reaches it comes from elsewhere (a hand-written backward), past the term's factor
        self.unrecorded = False
        self.value: Tensor | None = None
        self._scale = 1.0
        self._numbers: tuple[float, float] | None = None  # (D, L) once read (TermCapture.read_numbers)

    @property
    def is_sum(self) -> bool:
        """Whether the call reduced by ``"sum"``: each replica's value counts once, no denominator."""
        return self.denominator is None

    @property
    def scale(self) -> float:
        """What multiplies the gradient that reaches the call's value (1 until the strategy sets it)."""
        return self._scale

    @scale.setter
    def scale(self, scale: float) -> None:
        self._scale = scale
        self._factor.data.fill_(scale)  # .data: no version bump, or backward would refuse the saved factor

    def numbers(self) -> tuple[float, float]:
        """``(D, L)`` as Python floats (``D`` is 1 for a ``"sum"`` call), read once
        (:meth:`~lightning_sparse_dp.loss.capture.TermCapture.read_numbers`)."""
        if self._numbers is None:
            d = self.denominator
            self._numbers = (1.0 if d is None else float(d), float(self.value))  # type: ignore[arg-type]
            if self.bounds is not None:
                self._class = one_class(float(self.bounds[0]), float(self.bounds[1]))
        return self._numbers

    def target_class(self) -> int | None:
        """The one class of all the call's targets (a per-class loss in a loop: :mod:`~lightning_sparse_dp.loss.classes`),
        else ``None``: several classes or none, or targets not read (``bounds``:
        :func:`~lightning_sparse_dp.loss.denominators.class_bounds`)."""
        self.numbers()
        return self._class

def scaled_value(value: Tensor, keep: Tensor | bool, factor: Tensor) -> Tensor:
    """``value * factor``; 0 where ``keep`` is false (a mean over nothing), still in the graph, with gradient 0."""
    if keep is True:
        return value * factor
    if keep is False:
        return value.nan_to_num(0.0, 0.0, 0.0) * 0.0
    return torch.where(keep, value, torch.zeros_like(value)) * factor


__all__ = ["Term", "scaled_value"]
