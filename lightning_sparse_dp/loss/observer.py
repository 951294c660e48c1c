"""Observer: the torch function mode every replica's step (a rank's) runs under, and what it notes of the step's calls.

:class:`StepObserver` is the thread's ``torch.overrides.TorchFunctionMode`` (modes are per thread, so each replica
thread enters its own and no other thread sees anything): it counts the step's one-value means
(:mod:`~lightning_sparse_dp.loss.means`), notes the collectives the user's code calls
(:mod:`~lightning_sparse_dp.loss.collectives`) and says, once, what no split of the batch computes as one device does
and only the calls show (a ``torch.Generator`` of the step's own, ``SparseTensor.dense()`` sizing its grid by the
chunk). Nothing of torch is replaced. With ``loss_weighting="terms"`` the observer is a
:class:`~lightning_sparse_dp.loss.capture.TermCapture`, which :data:`KINDS` tells what to do with each call.
:func:`outside_capture` runs a call (a metric's update) with the observer out of the way.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_sparse_dp.loss.collectives import COLLECTIVE_FUNCTIONS, note_collective
from lightning_sparse_dp.loss.denominators import CAPTURED, UNCAPTURED
from lightning_sparse_dp.loss.means import MEAN_FUNCTIONS, PASSING_FUNCTIONS, counting, note_mean, pass_mean
from lightning_sparse_dp.replica.derived import note_derived
from lightning_sparse_dp.runtime.process import REPLICA_CALL as _replica_call
from lightning_sparse_dp.runtime.process import SAID_ONCE as _said
from lightning_sparse_dp.runtime.process import STEP_OBSERVER as _local

T = TypeVar("T")

CAPTURED_KIND, UNCAPTURED_KIND, MEAN_KIND, COLLECTIVE_KIND = "captured", "uncaptured", "mean", "collective"

SUM_KIND, PASS_KIND = "sum", "pass"

#: torch's sums whose one-value results over rows of the chunk are terms too (``x.sum()``, ``torch.sum(x)``)
SUM_FUNCTIONS = frozenset({torch.sum, torch.Tensor.sum})

#: what ``__torch_function__`` does first with a function it is handed; anything else passes straight through
KINDS: dict[Any, str] = {
    **{f: CAPTURED_KIND for f in CAPTURED}, **{f: UNCAPTURED_KIND for f in UNCAPTURED},
    **{f: MEAN_KIND for f in MEAN_FUNCTIONS}, **{f: COLLECTIVE_KIND for f in COLLECTIVE_FUNCTIONS},
    **{f: SUM_KIND for f in SUM_FUNCTIONS}, **{f: PASS_KIND for f in PASSING_FUNCTIONS},
}

class StepObserver(TorchFunctionMode):
    """The torch function mode of one step's thread: counts its one-value means (:func:`~lightning_sparse_dp.loss.means.
    note_mean`) and, where ``collectives`` is a list, notes the ``torch.distributed`` collectives the user's code calls
    (:func:`~lightning_sparse_dp.loss.collectives.note_collective`). Enter it with :meth:`run`, in the step's thread.

    Every torch call of the step passes through :meth:`__torch_function__` (a dict lookup, then the call), which is
    what observing per thread costs; torch's own functions are never replaced (that would be seen by every thread).
    """

    def __init__(self, collectives: list[str] | None = None) -> None:
        super().__init__()
        self.collectives = collectives
        #: ``id(mean) -> (mean, element count)`` of the one-value means the last :meth:`run` computed (its outputs')
        self.means: dict[int, tuple[Tensor, int]] = {}
        #: ``id -> (tensor, how)`` of the values the step's metrics returned and of what the step computed from them
        #: (:func:`~lightning_sparse_dp.replica.derived.note_derived`), while :meth:`run` runs
        self.derived: dict[int, tuple[Tensor, Any]] = {}

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` with this observer as the calling thread's innermost torch function mode, and the thread counting
        its means (:func:`~lightning_sparse_dp.loss.means.counting`, kept as :attr:`means`)."""
        self.recording = torch.is_grad_enabled()  # whether the step records gradients (TermCapture's terms read it)
        previous = getattr(_local, "active", None)
        _local.active = self
        self.derived = {}
        try:
            with counting() as self.means, self:
                return fn()
        finally:
            _local.active = previous
            self.derived = {}

    def _observe(self, kind: str | None, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if kind is MEAN_KIND:
            note_mean(args, kwargs, out)
        elif kind is PASS_KIND:
            pass_mean(args, out)
        elif kind is COLLECTIVE_KIND and self.collectives is not None:
            note_collective(func, self.collectives)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if kwargs and isinstance(kwargs.get("generator"), torch.Generator) and getattr(_replica_call, "replicas", 1) > 1:
            say_own_generator()
        if func is TENSOR_MAX:
            say_if_chunk_grid()
        out = func(*args, **kwargs)
        if self.derived:  # after a replica metric's forward / compute: what the step computes from its value
            note_derived(self.derived, func, args, kwargs, out)
        try:
            kind = KINDS.get(func)
        except TypeError:  # an unhashable callable: nothing to observe
            return out
        if kind is not None:
            self._observe(kind, func, args, kwargs, out)
        return out

def say_own_generator() -> None:
    """Once per process: a replica's step drew random numbers from a ``torch.Generator`` it was given
    (``torch.randn(..., generator=g)``)."""
    _said.warn(
        "sparse_dp: the step draws random numbers from a torch.Generator of its own (torch.randn(..., generator=g)): "
        "a generator made and seeded in the step starts the same stream in every replica, so each chunk gets the "
        "stream's first rows where one device's batch gets rows 0..B-1 (and one kept on the module is drawn from by "
        "the replicas in thread order). Draw for the whole batch in on_before_batch_transfer and put the draws in the "
        "batch (per-sample rows are cut with their samples), or train with sparse_ddp."
    )

#: ``torch.Tensor.max``: what ME's ``SparseTensor.dense()`` sizes its grid with when it is given no ``shape``
TENSOR_MAX = torch.Tensor.max

def say_if_chunk_grid() -> None:
    """Once per process: ``SparseTensor.dense()`` without ``shape`` in a step of several replicas, or of a
    ``sparse_ddp`` rank of several (the caller of this ``Tensor.max`` is ME's ``dense``, which calls it only to size
    the grid by the tensor's own coordinates)."""
    code = sys._getframe(2).f_code
    if code.co_name != "dense" or not code.co_filename.endswith("MinkowskiSparseTensor.py"):
        return
    if getattr(_replica_call, "replicas", 1) > 1:
        strategy, who, part = "sparse_dp", "replica", "chunk"
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        strategy, who, part = "sparse_ddp", "rank", "share"
    else:
        return
    _said.info(
        f"{strategy}: SparseTensor.dense() without shape= sizes each {who}'s grid by its {part}'s largest "
        "coordinates, where one device's grid is sized by the whole batch's: a sample's cells are the same, but a "
        "mean over the grid (F.mse_loss(dense, target), dense.mean(), an average over the spatial dimensions) "
        "averages over a different number of cells than one device's. Pass a grid fixed for the dataset: "
        f"x.dense(shape=torch.Size([samples, channels, *size])), samples the {part}'s (len(batch['labels']))."
    )


def outside_capture(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` that runs with its thread's :class:`StepObserver` out of the way (for a metric's ``update`` / ``forward``).

    What a torchmetrics metric computes in a step is its own state (merged across replicas by
    :mod:`~lightning_sparse_dp.replica.metrics`), never a term of the loss, so the capture has nothing to follow in
    it, while every torch call made under the mode costs a Python ``__torch_function__`` call (a metric's
    update makes many small torch calls: docs/benchmarks.md, "Costs of the step's parts"). The wrapped call runs with the
    observer popped from the thread's torch function mode stack when it is the innermost mode (else, a
    mode the step entered after it is on top, the call runs under both). Without an observer in the thread it
    calls ``fn`` directly.
    """

    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> T:
        active = getattr(_local, "active", None)
        if active is None:
            return fn(*args, **kwargs)
        depth = torch._C._len_torch_function_stack()
        if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not active:
            return fn(*args, **kwargs)
        active.__exit__(None, None, None)
        try:
            return fn(*args, **kwargs)
        finally:
            active.__enter__()

    return outside


__all__ = [
    "CAPTURED_KIND", "COLLECTIVE_KIND", "KINDS", "MEAN_KIND", "PASS_KIND", "SUM_FUNCTIONS", "SUM_KIND", "TENSOR_MAX",
    "UNCAPTURED_KIND", "StepObserver", "outside_capture", "say_if_chunk_grid", "say_own_generator",
]
