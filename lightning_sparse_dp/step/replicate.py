"""Replicate: one copy of the module per device, built once per run and refreshed every step.

:class:`Replicas` builds the copies the way ``torch.nn.parallel.replicate`` does (every submodule
copied with ``Module._replicate_for_data_parallel``), with three differences:

- Parameters. Each replica holds its own leaf ``nn.Parameter`` per trainable parameter of the
  module, so each replica's backward (run in its own thread) accumulates into its own ``.grad`` and
  :meth:`Replicas.reduce_gradients` adds them up in replica order (bit-for-bit repeatable, as
  ``torch.nn.parallel.comm.reduce_add_coalesced`` for ``nn.DataParallel``). On CPU, and for the replica on
  the root device, the replicas' parameters share the module's parameter storage, so the optimizer's in-place update
  is seen at once; on other CUDA devices they are copies, refreshed before every step with
  ``torch.nn.parallel.comm.broadcast_coalesced`` (no autograd). Parameters that need no gradient are the
  module's own (on other GPUs: copies, refreshed with the others, as ``nn.DataParallel`` broadcasts every
  parameter every step), except those a step changes in place (an EMA teacher's ``t.mul_(m).add_(s, alpha=1 - m)``):
  replicas after the root one sharing the module's storage would each apply the update to the one tensor (and race
  with each other's saved tensors), so once :meth:`Replicas.written_frozen` has seen a step do it, the replicas are
  rebuilt with copies of their own for those (``own_frozen``), refreshed every step, and the module keeps the root
  replica's update, as DDP's rank 0 keeps its own. Replica parameters are real ``Parameter`` objects, so
  ``replica.layer.parameters()`` works in the step.
- Buffers follow ``nn.DataParallel``: the root replica shares the module's buffers (its in-place
  updates, e.g. batch-norm running statistics, persist); the other replicas hold copies, refreshed
  from the module's before every step (:class:`~lightning_sparse_dp.step.copies.BufferMirror`).
- ME layers: the attributes they keep in ``__slots__``, which ``Module._replicate_for_data_parallel`` does not copy,
  are carried over (:func:`~lightning_sparse_dp.step.copies.copy_slots`).

Every step, :meth:`Replicas.refresh` copies each module's attributes (``training``, hooks, plain
attributes, everything in ``__dict__`` but its parameters, buffers and children) onto its copies, so
a replica behaves as a fresh ``_replicate_for_data_parallel`` copy would. :meth:`Replicas.matches`
tells when the replicas must be rebuilt instead: a submodule, parameter or buffer was added,
removed or replaced, a parameter's ``requires_grad`` changed (fine-tuning that freezes layers), or
its storage moved (``module.to(...)``, ``configure_model``, a precision plugin's conversion); the strategy takes that
check while the replicas' threads make their chunks (:class:`~lightning_sparse_dp.step.check.DeferredCheck`).

Also here: :func:`make_replicas`, one-off replicas. A module with lazy layers not yet built is refused
(:func:`~lightning_sparse_dp.step.copies.refuse_uninitialized`); whether it has batch norm, which the replicas note
when they are built, is :func:`~lightning_sparse_dp.syncbn.layer_sync.has_batch_norm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import comm  # torch.cuda.comm is this, but no module of torch imports it: an attribute error

from lightning_sparse_dp.replica.attributes import SubmoduleChanges
from lightning_sparse_dp.replica.optimizers import RankOptimizers
from lightning_sparse_dp.replica.snapshot import equal_tensors, tensor_mark
from lightning_sparse_dp.runtime.devices import check_devices
from lightning_sparse_dp.split.records import SplitPlan
from lightning_sparse_dp.step.copies import BufferHandOff, BufferMirror, copy_slots, refuse_uninitialized
from lightning_sparse_dp.syncbn.layer_sync import has_batch_norm


class Replicas:
    """Persistent replicas of ``module`` for ``devices`` (all CPU or all CUDA, the root device first).

    Args:
        module: the root module, on ``devices[0]``.
        devices: one device per replica.
        own_frozen: qualified names of parameters that need no gradient of which the replicas after the root one get
            copies of their own where they would share the module's storage (parameters a step changes in place).

    Attributes:
        modules: the replicas, ``modules[i]`` on ``devices[i]``.
        trainable: the module's parameters that require a gradient, in ``module.parameters()`` order.
        frozen: the module's other parameters, in the same order.
        parameters: ``parameters[i][j]`` is replica ``i``'s parameter for ``trainable[j]``.
        batch_norm: whether the module had a batch-norm layer (``torch.nn.modules.batchnorm._BatchNorm``) when built.
        attributes: what a step sets on the replicas' copies of the module's submodules
            (:class:`~lightning_sparse_dp.replica.attributes.SubmoduleChanges`).
        frozen_written: names of frozen parameters that replicas share and a step changed in place
            (:meth:`written_frozen`): the next build owns them.

    Raises:
        MisconfigurationException: no devices, CPU and CUDA devices mixed, or a CUDA device the
            machine does not have (:func:`~lightning_sparse_dp.runtime.devices.check_devices`).
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], own_frozen: Iterable[str] = ()) -> None:
        check_devices(devices)
        self.own_frozen = frozenset(own_frozen)
        self.frozen_written: set[str] = set()
        #: a step changed what the replicas were built from through them (``requires_grad_()`` on a replica's
        #: parameters, given to the module's): the next step builds new ones
        self.stale = False
        # Built outside inference mode even in a validation / predict step (Lightning runs them in
        # torch.inference_mode): tensors made there are inference tensors, which the training steps that
        # later refresh the same replicas could not update in place.
        with torch.inference_mode(False):
            self._build(module, devices)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A deep copy (of a Trainer, e.g. by a callback) holds no replicas: its strategy builds its own at its next
        step (replicas hold ME layers' autograd functions in ``__slots__``, which do not copy)."""
        return None

    def _build(self, module: nn.Module, devices: Sequence[torch.device]) -> None:
        refuse_uninitialized(module)
        self.root = module
        self.devices = list(devices)
        named = list(module.named_modules())
        self._sources = [m for _, m in named]
        # the module's buffers outside batch norm (whose running statistics follow their own rules), by module index
        # and key, with their qualified names: what a step may update in place (diverged_buffers)
        self._watched = [
            (i, key, f"{name}.{key}" if name else key)
            for i, (name, m) in enumerate(named)
            if not isinstance(m, _BatchNorm)
            for key, b in m._buffers.items()
            if b is not None
        ]
        self._diverged: set[str] = set()  # the buffers diverged_buffers has named (each once for these replicas)
        self._source_dicts = [m.__dict__ for m in self._sources]
        self._structure = _structure_key(self._source_dicts)
        self.batch_norm = has_batch_norm(self._sources)
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        frozen_named = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self.frozen = [p for _, p in frozen_named]
        owned = [(n, p) for n, p in frozen_named if n in self.own_frozen]
        index = {id(m): i for i, m in enumerate(self._sources)}
        self.modules: list[nn.Module] = []
        self.parameters: list[list[Tensor]] = []
        self._frozen_copies: list[list[Tensor]] = []  # per replica: its copies of `frozen` (none where storage is shared)
        self._owned_copies: list[list[tuple[Tensor, Tensor]]] = []  # per replica: (module's, its copy) of own_frozen
        shared_by_others = any(d.type == "cpu" or d == self.devices[0] for d in self.devices[1:])
        self._shared_frozen = [(n, p) for n, p in frozen_named if n not in self.own_frozen] if shared_by_others else []
        self._copies: list[list[nn.Module]] = []
        buffer_slots: list[list[tuple[dict[str, Tensor | None], str]]] = []  # per replica > 0
        root_device = self.devices[0]
        for r, device in enumerate(self.devices):
            shares_storage = device.type == "cpu" or device == root_device
            slots = []  # replica r > 0: where its copy of each of the module's buffers goes, in `buffer_sources` order
            copy_of = {}
            for p in self.trainable:
                data = p.detach() if shares_storage else torch.empty_like(p, device=device)
                copy_of[id(p)] = nn.Parameter(data, requires_grad=True)
            if not shares_storage:  # frozen parameters: copies on the replica's device, refreshed every step as well
                for p in module.parameters():
                    if not p.requires_grad:
                        copy_of[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=False)
            elif r > 0:  # frozen parameters a step changes in place: copies here too, refreshed every step
                for _, p in owned:
                    copy_of[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=False)
            copies = [m._replicate_for_data_parallel() for m in self._sources]
            for m, c in zip(self._sources, copies):
                c._parameters = {k: (None if p is None else copy_of.get(id(p), p)) for k, p in m._parameters.items()}
                if r == 0:
                    c._buffers = m._buffers  # DataParallel: the root replica's buffers are the module's
                else:
                    c._buffers = dict(m._buffers)  # filled in by the mirror below
                    slots.extend((c._buffers, k) for k, b in m._buffers.items() if b is not None)
                c._modules = {k: (None if child is None else copies[index[id(child)]]) for k, child in m._modules.items()}
            copy_slots(module, copies[0])
            if hasattr(copies[0], "_device"):  # Lightning's DeviceDtypeModuleMixin: `self.device` in the replica
                copies[0]._device = device
            self.modules.append(copies[0])
            self.parameters.append([copy_of[id(p)] for p in self.trainable])
            self._frozen_copies.append([] if shares_storage else [copy_of[id(p)] for p in self.frozen])
            self._owned_copies.append([(p, copy_of[id(p)]) for _, p in owned] if shares_storage and r > 0 else [])
            self._copies.append(copies)
            if r > 0:
                buffer_slots.append(slots)
        buffer_sources = [b for m in self._sources for b in m._buffers.values() if b is not None]
        self._buffer_mirror = BufferMirror(buffer_sources, self.devices[1:])
        self.attributes = SubmoduleChanges([name for name, _ in named], self._sources, self._copies)
        for r, slots in enumerate(buffer_slots):
            for (buffers, key), copy in zip(slots, self._buffer_mirror.copies[r], strict=True):
                buffers[key] = copy
        self._dicts = [
            (c.__dict__, m.__dict__, {"_parameters": c._parameters, "_buffers": c._buffers, "_modules": c._modules})
            for copies in self._copies
            for m, c in zip(self._sources, copies)
        ]
        # each replica: its own copies of the optimizers' param groups for a step, as each DDP rank has its own optimizer
        # (replica/optimizers.py: the root's written back after the step); kept through every refresh, emptied by it
        self.rank_optimizers = [RankOptimizers(module) if hasattr(module, "optimizers") else None
                                for _ in range(len(self.devices))]
        for r, view in enumerate(self.rank_optimizers):
            if view is not None:
                self._dicts[r * len(self._sources)][2]["optimizers"] = view
                view.params = {id(source): own for source, own in zip(self.trainable, self.parameters[r])}
        # the first replica whose parameters a refresh copies (frozen ones it owns, or all on another GPU), else the
        # replica count: a refresh of the replicas before it has no parameter to copy (refresh_tensors)
        self._copied_from = next(
            (r for r in range(1, len(self.devices)) if self._owned_copies[r] or (
                self.devices[r] != root_device and self.devices[r].type == "cuda" and (self.trainable or self.frozen))),
            len(self.devices),
        )
        self._copy_parameters()

    def buffer_marks(self) -> list[tuple[int, str, str, Tensor | None, int | Tensor | None, Tensor | None]]:
        """The module's buffers outside batch norm as a step finds them: ``(module index, key, name, buffer, mark,
        value)`` each (:func:`~lightning_sparse_dp.replica.snapshot.tensor_mark`; ``value``: a 0-dim buffer's copy, a
        counter's value before the step), for :meth:`diverged_buffers` after the step (none in most networks: nothing
        to look at)."""
        marks = []
        for i, key, name in self._watched:
            b = self._sources[i]._buffers.get(key)
            value = b.detach().clone() if b is not None and b.dim() == 0 and not b.is_inference() else None
            marks.append((i, key, name, b, -1 if b is None else tensor_mark(b), value))
        return marks

    def diverged_buffers(
        self, marks: list[tuple[int, str, str, Tensor | None, int | Tensor | None, Tensor | None]], count: int,
        plan: SplitPlan | None = None, counted: list[tuple[str, float]] | None = None,
    ) -> list[str]:
        """The names of the buffers of ``marks`` that the step's root replica (the module itself) changed, in place or
        by assignment, where one of the other ``count - 1`` replicas holds another value after its step: an update
        computed from each replica's chunk (a histogram of its labels), of which the module keeps the root replica's,
        as ``nn.DataParallel`` (and DDP's buffer broadcast from rank 0) keep the first device's. Replicas that all
        made one update (a step counter) agree and are not named; each buffer is named once for these replicas. A
        buffer the root replica left as it was is named too where another replica changed it (an update in a branch
        that the root replica's chunk did not take), whose change the module does not keep. ``counted`` gets the
        0-dim buffers every replica changed by one number ``d`` that is each chunk's count in the step's ``plan`` (its
        samples, its points: ``self.seen += len(labels)`` over equal chunks, :meth:`SplitPlan.counts_each_chunk`),
        ``(name, d)``, each once."""
        out = []
        for i, key, name, _, _, value in marks:
            now = self._sources[i]._buffers.get(key)
            if name in self._diverged or now is None:
                continue  # named already, or none
            for r in range(1, count):
                theirs = self._copies[r][i]._buffers.get(key)
                if not equal_tensors(theirs, now):
                    out.append(name)
                    self._diverged.add(name)
                    break
            else:
                if counted is not None and value is not None and now.dim() == 0 and now.dtype != torch.bool:
                    d = float(now) - float(value)
                    if d != 0 and plan is not None and plan.counts_each_chunk(d):
                        counted.append((name, d))
                        self._diverged.add(name)
        return out

    def matches(self, module: nn.Module, devices: Sequence[torch.device]) -> bool:
        """Whether these replicas still fit ``module`` on ``devices`` (else build new ones): :meth:`serve` and
        :meth:`unchanged`."""
        return self.serve(module, devices) and self.unchanged()

    def serve(self, module: nn.Module, devices: Sequence[torch.device]) -> bool:
        """Whether these are ``module``'s replicas and ``devices`` the first of theirs (no walk of the module), no
        step changed in place a frozen parameter they share (:meth:`written_frozen`: then they are rebuilt), and none
        made them :attr:`stale`."""
        return (
            module is self.root and not self.frozen_written and not self.stale and len(devices) <= len(self.devices)
            and list(devices) == self.devices[: len(devices)]
        )

    def frozen_marks(self) -> list[tuple[str, Tensor, int]]:
        """Before a step: ``(name, parameter, version)`` of the module's frozen parameters that replicas after the root
        one share (for :meth:`written_frozen`)."""
        return [(n, p, p._version) for n, p in self._shared_frozen]

    def written_frozen(self, marks: list[tuple[str, Tensor, int]]) -> list[str]:
        """After a step: the names of ``marks``' parameters the step changed in place (their version moved), each
        once; noted in :attr:`frozen_written`, so that the next step's replicas are built owning them."""
        out = [n for n, p, version in marks if p._version != version and n not in self.frozen_written]
        self.frozen_written.update(out)
        return out

    def unchanged(self) -> bool:
        """Whether the module's structure, parameters and buffers are as the replicas were built from (the module's
        fingerprint: every submodule's, parameter's and buffer's identity, ``requires_grad``, storage and dtype: a
        walk of the whole module, on the cold cache a step starts on, so the strategy takes it while the replicas'
        threads cut and place their chunks: :class:`~lightning_sparse_dp.step.check.DeferredCheck`)."""
        return _structure_key(self._source_dicts) == self._structure

    def refresh(self, count: int | None = None) -> list[nn.Module]:
        """Bring the first ``count`` replicas (default all) up to date with the module; returns them.

        Copies every module's ``__dict__`` entries but its own parameters / buffers / children onto its
        copies, refreshes the buffer copies and, on CUDA, the parameter copies (no autograd).
        """
        count = len(self.modules) if count is None else count
        self.refresh_tensors(count)
        for r in range(count):
            self.refresh_replica(r)
        return self.modules[:count]

    def refresh_tensors(self, count: int, buffers: bool = True) -> None:
        """The first ``count`` replicas' buffer copies and, on CUDA, parameter copies brought up to date: one fused
        copy (broadcast) for all of them, so on the calling thread. Without ``buffers`` the buffer copies are left to
        the replicas' threads (:meth:`buffer_hand_off`)."""
        if buffers:
            self._buffer_mirror.refresh(count - 1)
        if count > self._copied_from:  # decided when built: CPU replicas owning no frozen parameter copy none
            self._copy_parameters(count)

    @property
    def buffers_in_threads(self) -> bool:
        """Whether the replicas' threads may refresh their own buffer copies (:meth:`buffer_hand_off`): every copy is
        on the module's buffer's device (CPU replicas, replicas sharing one GPU); replicas on other GPUs are refreshed
        by the calling thread, fused."""
        return self._buffer_mirror.per_replica

    def buffer_hand_off(self, count: int) -> BufferHandOff | None:
        """The first ``count`` replicas' buffer refresh in their own threads (:class:`BufferHandOff`), or ``None``
        where :attr:`buffers_in_threads` is false or the module has no buffer to copy (nothing for the replicas' threads
        to do or wait for; decided when the replicas were built)."""
        mirror = self._buffer_mirror
        return BufferHandOff(mirror, count) if mirror.per_replica and not mirror.empty else None

    def refresh_replica(self, r: int) -> None:
        """Replica ``r``'s modules given their module's ``__dict__`` entries but their own parameters / buffers /
        children, and their module's slot values (:meth:`~lightning_sparse_dp.replica.attributes.SubmoduleChanges.refresh_slots`:
        a pruned ME convolution's ``kernel``): touches replica ``r`` only, so each replica's thread can run its own
        (the strategy's prologue)."""
        per_replica = len(self._sources)
        for d, source, own in self._dicts[r * per_replica : (r + 1) * per_replica]:  # (copy's __dict__, module's, own)
            d.update(source)
            d.update(own)
        if self.rank_optimizers[r] is not None:  # a new step: its param groups copied again at their first read
            self.rank_optimizers[r].copies.clear()
        self.attributes.prune(r)
        self.attributes.refresh_slots(r)
        if "_device" in self.root.__dict__:  # Lightning's DeviceDtypeModuleMixin: a plain attribute
            self.modules[r].__dict__["_device"] = self.devices[r]

    def _copy_parameters(self, count: int | None = None) -> None:
        """The replicas' copies of the module's frozen parameters a step changes in place (``own_frozen``), and on
        CUDA the module's parameters, frozen ones too (an EMA teacher or a callback may change them in place, as
        ``nn.DataParallel`` broadcasts every parameter every step), into the replicas on other devices (no
        autograd)."""
        count = len(self.modules) if count is None else count
        owned = [pair for r in range(1, count) for pair in self._owned_copies[r]]
        if owned:  # frozen parameters a step changes in place, in the replicas that share the module's storage
            with torch.no_grad():
                torch._foreach_copy_([copy.data for _, copy in owned], [p.detach() for p, _ in owned])
        others = [r for r in range(1, count) if self.devices[r] != self.devices[0] and self.devices[r].type == "cuda"]
        if not others or not (self.trainable or self.frozen):
            return
        targets = list(dict.fromkeys(self.devices[r] for r in others))  # each GPU once (replicas_per_device > 1)
        with torch.no_grad():  # the source device comes first; its "copies" are the parameters themselves
            sources = [p.detach() for p in chain(self.trainable, self.frozen)]
            copies = dict(zip(targets, comm.broadcast_coalesced(sources, [self.devices[0], *targets])[1:]))
            for r in others:
                params = [param.data for param in chain(self.parameters[r], self._frozen_copies[r])]
                torch._foreach_copy_(params, list(copies[self.devices[r]]))

    def reduce_gradients(self, count: int | None = None) -> list[Tensor | None]:
        """The replicas' gradients, per trainable parameter, added in replica order on the root device.

        The replicas' ``.grad`` are reset to ``None``. Entry ``j`` is ``None`` when no replica got a
        gradient for ``trainable[j]``.
        """
        count = len(self.modules) if count is None else count
        root = self.devices[0]
        grads = []
        for params in self.parameters[:count]:
            grads.append([param.grad for param in params])
            for param in params:
                param.grad = None
        if all(g is not None and g.layout == torch.strided for per_replica in grads for g in per_replica):
            # every replica has every gradient: one fused add per replica, in place into replica 0's gradients
            # (owned by nobody else now), in replica order as below
            reduced = [g.to(root) for g in grads[0]]
            for per_replica in grads[1:]:
                torch._foreach_add_(reduced, [g.to(root) for g in per_replica])
            return list(reduced)
        out: list[Tensor | None] = []
        for j in range(len(self.trainable)):
            total = None
            for per_replica in grads:
                g = per_replica[j]
                if g is not None:
                    g = g.to(root)
                    total = g if total is None else total + g
            out.append(total)
        return out


def _structure_key(dicts: list[dict[str, Any]]) -> tuple:
    """What must not change for replicas to stay valid (identity of children, parameters, buffers and storage).

    ``dicts``: the modules' ``__dict__``. Built with C-level iteration (``map``, ``itertools.chain``; this runs
    every step, mostly on a cold cache after the previous step's backward pass): per module the sizes of its three
    dicts, then every child's, parameter's and buffer's identity, and each parameter's ``requires_grad``, storage
    address and dtype and each buffer's storage address. A conversion (``module.to(torch.float64)``, a precision
    plugin's) gives every non-empty tensor new storage at a new address: the replicas' parameters and
    :class:`BufferMirror`'s views (buffers) keep the old storage alive, so the address is not reused.
    """
    children = list(map(_MODULES, dicts))
    parameters = list(map(_PARAMETERS, dicts))
    buffers = list(map(_BUFFERS, dicts))
    params = list(chain.from_iterable(map(dict.values, parameters)))
    bufs = list(chain.from_iterable(map(dict.values, buffers)))
    return (
        list(map(len, children)),
        list(map(len, parameters)),
        list(map(len, buffers)),
        list(map(id, chain.from_iterable(map(dict.values, children)))),
        list(map(id, params)),
        list(map(id, bufs)),
        [None if p is None else (p.requires_grad, p.data_ptr(), p.dtype) for p in params],
        [None if b is None else b.data_ptr() for b in bufs],
    )


_MODULES, _PARAMETERS, _BUFFERS = itemgetter("_modules"), itemgetter("_parameters"), itemgetter("_buffers")


def make_replicas(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One-off replicas of ``module`` for ``devices``: ``Replicas(module, devices).modules``.

    Not ``torch.nn.parallel.replicate``'s contract: gradients do not flow back to ``module``; they stay
    on the replicas' own leaf parameters. Keep the :class:`Replicas` object and call
    :meth:`Replicas.reduce_gradients` to add them up.
    """
    return Replicas(module, devices).modules


__all__ = ["Replicas", "make_replicas"]
