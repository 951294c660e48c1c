"""Copies: what the replicas carry beyond ``Module._replicate_for_data_parallel``: ME layers' slots, buffer copies.

ME layers: ``Module._replicate_for_data_parallel`` copies only ``__dict__``, but ME's convolution, channel-wise
convolution and pooling layers keep ``dimension``, ``kernel_generator``, ``conv``, ``use_mm``, ... in ``__slots__``
(upstream MinkowskiEngine issues #264, #366, #618); :func:`copy_slots` carries them over to the replicas' layers
(shared, not copied).

Buffers: the replicas after the root one hold copies of the module's buffers, refreshed from the module's before every
step as ``nn.DataParallel`` broadcasts them: on the calling thread with one fused copy per dtype
(:class:`BufferMirror`), or, where every copy is on the module buffer's device (CPU replicas, replicas sharing one GPU),
by each replica's own thread before its step, replica 0, whose step updates the module's buffers in place, waiting until
every other replica has its copies (:class:`BufferHandOff`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import chain

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_sparse_dp.replica.attributes import slots_of


def copy_slots(source: nn.Module, replica: nn.Module) -> None:
    """Copy every ``__slots__`` attribute of every submodule of ``source`` to the matching one of ``replica``.

    Both module trees must have the same structure (``replica`` made from ``source``); values are
    shared, not copied (ME's kernel generators and functions hold no per-call state).
    """
    for src, dst in zip(source.modules(), replica.modules(), strict=True):
        for name, _ in slots_of(type(src)):
            try:
                value = object.__getattribute__(src, name)
            except AttributeError:
                continue
            object.__setattr__(dst, name, value)


class BufferMirror:
    """Copies of the module's buffers for the replicas after the root one, refreshed with one fused copy per dtype.

    ``nn.DataParallel`` broadcasts the module's buffers to its replicas every step (``Broadcast.apply`` on the
    buffers in ``torch.nn.parallel.replicate``); so does this, coalesced the way ``broadcast_coalesced`` is:
    each replica's copies of the module's contiguous buffers that need no gradient share the storage of one flat
    tensor per (dtype, device) of the replica's (each copy with a version counter of its own, as
    ``broadcast_coalesced``'s outputs), and a refresh concatenates the module's buffers (flat views of
    them, made once) into the first replica's flat tensor with ``torch.cat(..., out=...)`` and copies that
    into the others': a few calls per dtype instead of one ``copy_`` per buffer, which costs more
    (docs/benchmarks.md, "Costs of the step's parts"). Other buffers (not contiguous, another layout, needing a
    gradient) are copied one by one.

    The flat views keep the module's buffer storage alive, so a buffer given new storage (``module.to(...)``,
    a precision conversion) never gets its old address back:
    :meth:`~lightning_sparse_dp.step.replicate.Replicas.matches` sees the change.

    Args:
        sources: the module's buffers (no ``None``), any shapes and dtypes.
        devices: one device per replica after the root one (none: nothing to mirror).

    Attributes:
        copies: ``copies[r][k]``: replica ``r + 1``'s copy of ``sources[k]`` (its shape and dtype), on ``devices[r]``.
        empty: nothing to mirror (no buffers, or no replica after the root one): a refresh copies nothing.
    """

    def __init__(self, sources: Sequence[Tensor], devices: Sequence[torch.device]) -> None:
        self.copies: list[list[Tensor]] = [[] for _ in devices]
        self._groups: list[tuple[list[Tensor], Tensor | None, list[Tensor]]] = []  # (flat sources, staging, flats)
        self._loose: list[tuple[Tensor, list[Tensor]]] = []  # (source, its copy per replica)
        self.per_replica = True
        self.empty = not devices or not sources
        if not devices:
            return
        slots: list[list[Tensor | None]] = [[None] * len(sources) for _ in devices]
        grouped: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for k, b in enumerate(sources):
            if b.layout == torch.strided and b.is_contiguous() and not b.requires_grad:
                grouped.setdefault((b.dtype, b.device), []).append(k)
            else:
                copies = [b.detach().to(device, copy=True) for device in devices]
                for r, copy in enumerate(copies):
                    slots[r][k] = copy
                self._loose.append((b, copies))
        for (dtype, device), indices in grouped.items():
            views = [sources[k].detach().view(-1) for k in indices]
            total = sum(v.numel() for v in views)
            flats = [torch.empty(total, dtype=dtype, device=d) for d in devices]
            for r, flat in enumerate(flats):
                for k, piece in zip(indices, flat.split([v.numel() for v in views])):
                    # .data: the flat's storage with a version counter of its own, as torch's broadcast_coalesced gives
                    # (NOTE [ Version Counter in comm.*_coalesced ]): a step that saves one buffer for its backward
                    # and updates another in place must not see the first as modified
                    slots[r][k] = piece.view(sources[k].shape).data
            staging = None if flats[0].device == device else torch.empty(total, dtype=dtype, device=device)
            self._groups.append((views, staging, flats))
        self.copies = [list(s) for s in slots]  # type: ignore[arg-type]  # every slot is filled above
        # whether refresh_one may refresh each replica on its own: every copy on its source's device (CPU replicas,
        # replicas sharing the module's GPU), not only the first replica's (replicas_per_device > 1 on several GPUs)
        self.per_replica = all(flat.device == views[0].device for views, _, flats in self._groups for flat in flats) and all(
            copy.device == source.device for source, copies in self._loose for copy in copies
        )
        self.refresh(len(devices))

    def refresh(self, count: int) -> None:
        """Copy the module's buffers into the first ``count`` replicas after the root one (``count <= 0``: none)."""
        if count <= 0:
            return
        for views, staging, flats in self._groups:
            first = flats[0] if staging is None else staging
            torch.cat(views, out=first)  # the buffers need no gradient: nothing is recorded
            for flat in flats[:count]:
                if flat is not first:
                    flat.copy_(first)
        if self._loose:
            with torch.no_grad():
                for source, copies in self._loose:
                    for copy in copies[:count]:
                        copy.copy_(source)

    def refresh_one(self, r: int) -> None:
        """Copy the module's buffers into replica ``r + 1``'s copies only (where ``per_replica``; any thread: it reads
        the module's buffers and writes that replica's)."""
        for views, _, flats in self._groups:
            torch.cat(views, out=flats[r])
        if self._loose:
            with torch.no_grad():
                for source, copies in self._loose:
                    copies[r].copy_(source)


class BufferHandOff:
    """One step's buffer refresh in the replicas' own threads (CPU replicas preparing in their threads).

    Replica ``r >= 1`` copies the module's buffers into its own first thing in its preparation (:meth:`copy`); replica
    0, whose step updates the module's buffers in place (its buffers are the module's, as in ``nn.DataParallel``:
    batch norm's running statistics), waits before its step until every other replica has its copy (:meth:`wait`).
    So every replica starts from the module's buffers as they were before the step, as ``nn.DataParallel``'s
    broadcast before the step (and :meth:`BufferMirror.refresh` on the calling thread) gives.

    Args:
        mirror: the replicas' :class:`BufferMirror` (one whose ``per_replica`` is true).
        count: the step's replicas, the root one included.
        timeout: seconds replica 0 waits at most.
    """

    def __init__(self, mirror: BufferMirror, count: int, timeout: float = 300.0) -> None:
        self._mirror, self._timeout = mirror, timeout
        self._pending = count - 1
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self._pending <= 0:
            self._done.set()

    def copy(self, r: int) -> None:
        """Replica ``r``'s copies (``r >= 1``; counted as done even when the copy raises, which then fails the step)."""
        try:
            self._mirror.refresh_one(r - 1)
        finally:
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._done.set()

    def wait(self) -> None:
        """Until every replica after the root one has its copies.

        Raises:
            RuntimeError: they do not within ``timeout`` seconds (a replica thread that never started its step).
        """
        if not self._done.wait(self._timeout):
            raise RuntimeError(
                f"sparse_dp: the replicas' buffer copies were not made within {self._timeout:.0f} s (a replica thread "
                "did not start its step); pass prepare_in_threads=False to refresh them on the calling thread."
            )


def refuse_uninitialized(module: nn.Module) -> None:
    """Refuse a module with parameters or buffers of a lazy module (``nn.LazyLinear``) not yet built: replicas are
    copies of its tensors, which it does not have before its first forward (torch's ``DistributedDataParallel``
    refuses such a module too).

    Raises:
        MisconfigurationException: naming the tensors and the fix.
    """
    lazy = [name for name, t in chain(module.named_parameters(), module.named_buffers())
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise MisconfigurationException(
            f"sparse_dp: the module has uninitialized parameters or buffers ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}: a lazy module such as nn.LazyLinear, built at its first forward), "
            "which replicas cannot copy, as DDP cannot. Build them before the fit: run one forward of a small batch in "
            "the module's __init__ or configure_model(), or give the layer its input size (nn.Linear)."
        )


__all__ = ["BufferHandOff", "BufferMirror", "copy_slots", "refuse_uninitialized"]
