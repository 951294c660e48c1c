"""State: what a step leaves on the LightningModule, from its replicas, as one device's step leaves it.

Replicas are copies of the module (:mod:`lightning_sparse_dp.step.replicate`), so what a step sets on ``self``
(``self.flag = True``, ``self.last_loss = loss.detach()``) lands on a replica and is lost, and what it
appends to a list of the module (``self.validation_step_outputs.append(...)``, the pattern Lightning 2
recommends since ``validation_epoch_end`` was removed) is appended once per replica, and so is what it appends to a
list in a dict (``self.outputs["val"].append(...)``) or counts in one (``self.counts["steps"] += 1``). :class:`ModuleChanges`
gives each replica its own copy of the module's list attributes and dict attributes of at most 16 entries before the
step (the lists and dicts in those copied too, to 8 levels: :func:`~.snapshot.copy_nested`; a longer dict, such as
a per-sample cache that the replicas fill with their own samples' keys, is shared as before) and, after it:

- an attribute the replicas set to one value (``==``, or equal tensors) gets that value on the module;
  tensors they set to different values get them merged as the step's outputs are
  (:func:`~lightning_sparse_dp.step.gather.gather_outputs`: a combination of the losses, or a mean the step computed
  with ``torch.mean`` / ``.mean()``, its whole-batch value, other 0-dim tensors the mean weighted by the replicas'
  shares of the batch, per-sample rows in sample order); any other value they set
  differently (an object made lazily in the step, a count) keeps the root replica's, as Lightning's DDP keeps rank
  0's, never a list of the replicas' values; a one-time warning names what was not one device's for certain;
- the ``j``-th entry every replica appended to a list is merged the same way into one entry appended to
  the module's list: one entry per step, as on one device;
- a dict's entries are merged as attributes are (set or removed by every replica; a key some replicas added, such
  as a per-sample key, gets their value; one changed by some replicas only is said), and the lists and dicts in it,
  and in a list of at most 16 entries (one per dataloader), likewise, in place, so the module keeps its own objects
  (a ``defaultdict`` stays one).

A tensor of the module changed in place in the step (``self.ema.mul_(0.9).add_(...)``) is said once: the replicas
share it, so each applies its chunk's change (a decay once per replica), which no merge can undo. So is an object
of the user's own class (an ``AverageMeter``: :func:`~lightning_sparse_dp.replica.snapshot.is_plain_object`) whose public
attributes the step changed, and a list or dict
of the module (one the replicas got copies of) that changed during the step: only code holding the module itself, not
the replica, reaches it (a forward hook whose closure holds ``self``), once per replica, in thread order; its copies
are not merged then. The module's own hooks that a manual step runs once on the module itself
(:meth:`ModuleChanges.once_on_module`) change it as one device's step does: the merge compares the replicas' copies with
what they were made from, so the hooks' changes stand (an entry the hooks and the replicas both changed is said). The
lists' and dicts' merges are in :mod:`~lightning_sparse_dp.replica.container_merge`.

Plain attributes of the module object itself are followed (not Lightning's and torch's own), and, with ``attributes``
(:class:`~lightning_sparse_dp.replica.attributes.SubmoduleChanges`), those a step sets, replaces or removes on its
replica's copies of the module's submodules (``self.calls += 1`` in a layer), merged into the module's submodules by the same
rules, the submodules' lists and short dicts copied for each replica and merged as the module's are
(``self.history.append(x)`` in a layer). The entries of a longer list (one added each step) are not copied, so a step
that changes an earlier entry in place changes the module's, once per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor, nn

from lightning_sparse_dp.replica import snapshot
from lightning_sparse_dp.replica.attributes import SubmoduleChanges, remove_attribute
from lightning_sparse_dp.replica.container_merge import ContainerMerge
from lightning_sparse_dp.replica.watch import MISSING as _MISSING
from lightning_sparse_dp.replica.watch import container_marks, list_entries, untouched_copies
from lightning_sparse_dp.runtime.compat import update_count


class ModuleChanges(ContainerMerge):
    """The module's attributes around one step of ``replicas`` (copies of ``module``; the module itself, when it is
    among them, keeps what it sets, as one device does).

    Args:
        module: the LightningModule.
        replicas: this step's replicas, in replica order.
        deferred: each replica's part (:meth:`enter`) is left to the caller, to run in the replica's own thread.
        attributes: the replicas' copies of the module's submodules (the persistent replicas'
            :attr:`~lightning_sparse_dp.step.replicate.Replicas.attributes`): what the step set on them is merged into the
            module's submodules too; ``None``: the module's own attributes only.
    """

    def __init__(
        self, module: nn.Module, replicas: Sequence[nn.Module], deferred: bool = False,
        attributes: SubmoduleChanges | None = None, plan: Any = None,
    ) -> None:
        self.module = module
        self.plan = plan  # the step's SplitPlan (each chunk's samples and points tell a count of the chunk), if known
        self.replicas = list(replicas)
        self.active = module not in self.replicas and len(self.replicas) > 1
        self.attributes = attributes if self.active else None
        self.before: dict[str, Any] = {}
        self.containers: list[str] = []
        self.entered: list[dict[str, Any]] = [{} for _ in self.replicas]  # each replica's attributes as its step found them
        self.sub_containers: list[tuple[int, str]] = []  # (module index, key): the submodules' lists and short dicts
        self.sub_given: list[dict[tuple[int, str], Any]] = [{} for _ in self.replicas]  # each replica's copies of them
        # the module's lists and dicts as the replicas' copies were made from them, kept where the module's own hooks
        # ran during the step (once_on_module): id -> (container, its shallow copy), what the merge compares the
        # replicas' copies with, so that the hooks' own changes stand
        self.bases: dict[int, tuple[Any, Any]] = {}
        self.metrics: list[tuple[str, Any, int]] = []
        if not self.active:
            return
        # what the step follows of the module's entries: held by the persistent replicas while the module's __dict__
        # holds the same keys and objects (watch.py), else listed anew
        entries = module.__dict__
        listing = self.attributes.watch.listed(entries) if self.attributes is not None else list_entries(entries)
        self.before, self.containers, self._objects = listing.before, listing.containers, listing.objects
        # each replica gets its own copies of the containers, which the module's own containers must not see change:
        # only code holding the module itself (a hook's closure) reaches them during the step (said in merge); the
        # replicas share the module's tensors: one changed in place was changed by each replica (said in merge)
        self.sizes, self.versions, self._flat = container_marks(listing) if listing.marked else ({}, [], set())
        if self.attributes is not None:  # the submodules' lists and dicts, copied and merged likewise
            found = self.attributes
            self.sub_containers = [(j, k) for j, k in found.containers() if snapshot.is_copied(found.sources[j].__dict__[k])]
            self.sizes.update(
                {found.name(j, k): list(snapshot.nested_sizes(found.sources[j].__dict__[k])) for j, k in self.sub_containers}
            )
        # and its plain objects (an AverageMeter): one the step changed was changed by each replica (said in merge)
        self.objects = [(k, self.before[k], snapshot.public_state(self.before[k])) for k in self._objects]
        # and the torchmetrics metrics in its lists and dicts: shared too, one the step updated was updated by each
        # replica (said in merge)
        self.metrics = [(name, m, update_count(m)) for name, m in snapshot.container_metrics(self.before, self.containers)]
        if not deferred:
            for i in range(len(self.replicas)):
                self.enter(i)

    def enter(self, i: int) -> None:
        """Replica ``i`` given its own copies of the module's lists and dicts (:func:`~.snapshot.copy_nested`; a flat
        list or dict: its ``copy()``), its attributes noted, before its step (``deferred``: in replica ``i``'s thread
        after its refresh; else at construction)."""
        if not self.active:
            return
        replica, flat = self.replicas[i], self._flat
        for key in self.containers:  # each replica appends to (or changes) its own
            value = self.before[key]
            replica.__dict__[key] = value.copy() if key in flat else snapshot.copy_nested(value)
        self.entered[i] = dict(replica.__dict__)
        if self.sub_containers:
            found, given = self.attributes, self.sub_given[i]
            for j, key in self.sub_containers:  # after the replica's refresh (which gave it the module's objects)
                copied = snapshot.copy_nested(found.sources[j].__dict__[key])
                given[(j, key)] = found.copies[i][j].__dict__[key] = copied  # type: ignore[union-attr]

    def once_on_module(self, fn: Callable[[], Any]) -> Any:
        """``fn()``: code the strategy runs once on the module itself during the step, as one device's step runs it
        (under manual optimization, Lightning's ``on_before_backward`` / ``on_after_backward`` hooks). What it changes
        in the module's tensors (in place), plain objects, lists and dicts is one device's change, not a replica's: the
        marks still as the step found them before ``fn`` move with it, so :meth:`merge` says only what the replicas'
        steps changed there (a mark a replica moved already stays, and is said), and the lists and dicts are kept as
        the replicas' copies were made from them (:attr:`bases`), so the merge sets only what the replicas changed in
        their copies and keeps what ``fn`` set, appended or removed (an entry both changed is said)."""
        if not self.active or not (self.sizes or self.versions or self.objects or self.metrics):
            return fn()
        held = {name for name, marks in self.sizes.items() if all(len(c) == n for c, n in marks)}
        for name in held:
            for c, _ in self.sizes[name]:
                self.bases.setdefault(id(c), (c, dict(c) if isinstance(c, dict) else list(c)))
        versions = [not snapshot.changed_in_place(t, mark) for _, t, mark in self.versions]
        states = [snapshot.public_state(obj) for _, obj, _ in self.objects]
        counts = [update_count(m) == n for _, m, n in self.metrics]
        try:
            return fn()
        finally:
            self.metrics = [(name, m, update_count(m) if held_count else n)
                            for (name, m, n), held_count in zip(self.metrics, counts)]
            for name in held:
                self.sizes[name] = [(c, len(c)) for c, _ in self.sizes[name]]
            self.versions = [(n, t, snapshot.tensor_mark(t) if ok else mark)
                             for (n, t, mark), ok in zip(self.versions, versions)]
            self.objects = [(k, obj, snapshot.public_state(obj) if not snapshot.changed_keys(state, now) else state)
                            for (k, obj, state), now in zip(self.objects, states)]

    def merge(self, combine: Callable[[list[Any]], tuple[Any, bool]], warning_cache: WarningCache) -> None:
        """After the step: set on the module what the replicas left (see the module docstring).

        ``combine(values)``: the replicas' values of one output leaf merged as the step's outputs are, and whether
        that is one device's value for certain (a combination of the step's captured losses).
        """
        if not self.active:
            return
        reached = (  # what no merge can undo, said
            snapshot.say_shared_changes(self.versions, self.objects, self.sizes, warning_cache, self.metrics)
            if self.versions or self.objects or self.sizes or self.metrics else set()
        )
        skip = {k for k in self.containers if f"self.{k}" in reached}  # not merged: the module's object holds the step's
        keys = [k for k in self.containers if k not in skip]  # what the step set (or may have changed: its copies)
        kept = untouched_copies(self.before, keys, self.replicas, self.entered) if keys else set()  # nothing to merge
        keys = [k for k in keys if k not in kept]
        for replica, entered in zip(self.replicas, self.entered):
            keys.extend(  # the identity test first: most attributes are the objects the step found
                k for k, v in replica.__dict__.items()
                if entered.get(k, _MISSING) is not v and k not in keys and k not in skip and snapshot.is_followed(k, v)
            )
            keys.extend(k for k in self.before if k not in replica.__dict__ and k not in keys)  # removed by the step
            for key in (*skip, *kept):  # the replicas hold the module's objects again
                replica.__dict__[key] = self.before[key]
        dicts = [r.__dict__ for r in self.replicas]
        for key in keys:
            copies = [e.get(key, _MISSING) for e in self.entered]
            if key in self.containers:
                self._merge_copied(self.module, key, f"self.{key}", self.before[key], dicts, copies, combine, warning_cache)
            else:
                values = [d.get(key, _MISSING) for d in dicts]
                self._merge_attribute(self.module, key, f"self.{key}", values, copies, combine, warning_cache)
        found = self.attributes  # what the replicas' steps set on their copies of the submodules (in C while none)
        changes = [found.changed(r) for r in range(len(self.replicas))] if found is not None else []
        if self.sub_containers or any(changes):
            self._merge_submodules(changes, combine, warning_cache, reached)

    def _merge_copied(
        self, target: nn.Module, key: str, name: str, before: Any, dicts: list[dict[str, Any]], given: list[Any],
        combine: Callable[[list[Any]], tuple[Any, bool]], warning_cache: WarningCache,
    ) -> None:
        """``target.<key>``, the list or dict ``before`` of which each replica was given its own copy (``given``;
        ``dicts``: the replicas' ``__dict__`` holding it): removed when every replica's step removed it, as one
        device's step does; a list, or copies changed in place, merged into ``before`` (replaced lists said), after
        which the replicas hold ``before`` again (what runs after the step, a backward hook, changes it); else
        (replaced by every replica) an attribute (:meth:`_merge_attribute`)."""
        values = [d.get(key, _MISSING) for d in dicts]
        if all(v is _MISSING for v in values):
            target.__dict__.pop(key, None)
            return
        if type(before) is list or all(v is g for v, g in zip(values, given)):
            self._merge_container(name, before, values, combine, warning_cache, 0)
            for d in dicts:
                d[key] = before
            return
        self._merge_attribute(target, key, name, values, given, combine, warning_cache)

    def _merge_attribute(
        self, target: nn.Module, key: str, name: str, values: list[Any], copies: list[Any],
        combine: Callable[[list[Any]], tuple[Any, bool]], warning_cache: WarningCache,
    ) -> None:
        """``target.<key>`` from the replicas' ``values`` (``_MISSING``: removed), which their steps found as
        ``copies``:
        one value when every replica set it (merged, :meth:`_combined`), removed when every replica removed it, the
        first setter's when some did (said once)."""
        changed = [v is not c for v, c in zip(values, copies)]
        if not any(changed):
            return
        if all(v is _MISSING for v in values):
            remove_attribute(target, key)
            return
        if not all(changed) or any(v is _MISSING for v in values):
            warning_cache.warn(
                f"sparse_dp: {name} was set (or removed) by some replicas' steps only (a branch on the chunk): "
                "the module gets what the first did. Set it in every replica's step, from the whole batch's values."
            )
            value = next(v for v, c in zip(values, changed) if c)
            if value is _MISSING:
                remove_attribute(target, key)
            else:
                setattr(target, key, self._to_root(value))
            return
        self._say_chunk_count(name, values, copies, warning_cache)
        setattr(target, key, self._combined(name, values, combine, warning_cache))

    def _chunk_count(self, values: list[Any], copies: list[Any]) -> int | None:
        """``d`` when every replica's Python int in ``values`` differs from its ``copies`` entry by one nonzero number
        ``d`` that is each chunk's number of samples or points (a count of the chunk over equal chunks, which the
        replicas agree on), else ``None``."""
        plan = self.plan
        if plan is None or len(values) < 2 or not all(type(v) is int and type(c) is int for v, c in zip(values, copies)):
            return None
        deltas = {v - c for v, c in zip(values, copies)}
        if len(deltas) != 1 or 0 in deltas:
            return None
        d = deltas.pop()
        return d if plan.counts_each_chunk(d) else None

    def _say_chunk_count(self, name: str, values: list[Any], copies: list[Any], warning_cache: WarningCache) -> None:
        """Said once: a Python int every replica's step grew by one number ``d`` that is each chunk's number of samples
        or points (``self.seen += len(labels)`` over equal chunks, :meth:`_chunk_count`), which the replicas agree on,
        so the module keeps it, where one device's step grows it by the batch's count."""
        d = self._chunk_count(values, copies)
        if d is not None:
            warning_cache.warn(
                f"sparse_dp: {name} grew by {d} in every replica's step, which is also each chunk's number of samples or "
                "points: the replicas agree, so the module keeps that change, as DDP keeps rank 0's, where one device's "
                "step, if it counts the batch, grows it by the whole batch's count. Count from the whole batch in "
                "on_train_batch_end (or keep the count in a torchmetrics SumMetric, merged across the replicas)."
            )

    def _merge_submodules(
        self, changes: list[list[tuple[int, str]]], combine: Callable[[list[Any]], tuple[Any, bool]],
        warning_cache: WarningCache, reached: set[str],
    ) -> None:
        """What the replicas' steps set on their copies of the module's submodules (``changes``, replica by replica:
        :meth:`~lightning_sparse_dp.replica.attributes.SubmoduleChanges.changed`), and what they changed in their copies
        of the submodules' lists and dicts, merged into the module's submodules as the module's own attributes and
        containers are (``reached``: the names of containers the step changed through the module)."""
        found = self.attributes
        assert found is not None
        count = len(self.replicas)
        for j, key in self.sub_containers:
            target, name = found.sources[j], found.name(j, key)
            dicts = [found.copies[r][j].__dict__ for r in range(count)]
            if name in reached:  # said above; the module's object holds what the step did, the copies hold it again
                for d in dicts:
                    d[key] = target.__dict__[key]
                continue
            given = [self.sub_given[r].get((j, key), _MISSING) for r in range(count)]
            self._merge_copied(target, key, name, target.__dict__[key], dicts, given, combine, warning_cache)
        handled = set(self.sub_containers)
        for i, key in dict.fromkeys(k for replica in changes for k in replica):
            if (i, key) in handled:
                continue
            target = found.sources[i]
            before = found.value(target, i, key, _MISSING)
            values = [found.value(found.copies[r][i], i, key, _MISSING) for r in range(count)]
            self._merge_attribute(target, key, found.name(i, key), values, [before] * len(values), combine, warning_cache)
            now = found.value(target, i, key, _MISSING)
            if isinstance(now, Tensor) and now.grad_fn is not None and any(now is v for v in values):
                # a replica's tensor of its own graph (a pruned weight the forward pre-hook set, kernel_orig * mask):
                # its value, detached, on the module's device, as DDP's rank 0 keeps its own; the graph is the replica's
                setattr(target, key, self._to_root(now.detach()))

    def _combined(
        self, name: str, values: list[Any], combine: Callable[[list[Any]], tuple[Any, bool]], warning_cache: WarningCache,
        appended: bool = False,
    ) -> Any:
        """The replicas' values of one attribute or container entry as one value: 0-dim integer tensors the replicas
        ``appended`` to a list (``(pred == y).sum()``) their sum, a count over the batch, as ``self.log`` sums integers
        (said once); appended tensors of the chunks' rows the batch's rows, equal or not; theirs when they agree;
        appended dicts, lists and tuples merged leaf by leaf as step outputs are (the merge saying what is not one
        device's); a combination of the step's losses (or its ``.item()``) by its whole-batch
        value; other floating-point values, and tensors of the chunks' rows, merged as step outputs are (said once when
        that is not one device's value for certain); anything else (an object the step made, a Python int, a 0-dim
        integer tensor kept on ``self``, a tensor of fixed size) the root replica's value, as Lightning's DDP
        keeps rank 0's (the one it checkpoints), said once."""
        if appended and all(isinstance(v, Tensor) and snapshot.is_integer(v) for v in values):
            warning_cache.warn(
                f"sparse_dp: {name} is a 0-dim integer tensor from each replica's step (each ran on its chunk of the "
                "batch): the module's list gets their sum, one device's value for a count over the batch (e.g. "
                "(pred == y).sum()), as self.log sums integers. For any other integer (an index, a maximum), append it "
                "from the whole batch in on_*_batch_end, which gets the gathered outputs."
            )
            moved = [self._to_root(v) for v in values]
            return sum(moved[1:], moved[0])
        if appended and len(values) > 1 and all(isinstance(v, Tensor) and v.dim() > 0 for v in values):
            try:  # rows of the chunks appended (self.outs.append(batch["labels"])): the batch's rows, even where every
                return combine(values)[0]  # replica's are equal (labels of one class); a fixed size raises: below
            except ValueError:
                pass
        if snapshot.all_same(values):
            return values[0]
        if appended and all(isinstance(v, (Mapping, list, tuple)) for v in values):
            try:  # entries of several values (a dict of the step's loss and predictions): merged leaf by leaf as step
                return combine(values)[0]  # outputs are, the merge saying what is not one device's
            except Exception:  # noqa: BLE001  (entries the output merge cannot read): the root replica's, said below
                pass
        if all(isinstance(v, float) or (isinstance(v, Tensor) and not snapshot.is_integer(v)) for v in values):
            try:
                value, exact = combine(values)
            except Exception:  # noqa: BLE001  (values the output merge cannot read)
                value, exact = None, False
            if exact:
                return value
            if value is not None and all(isinstance(v, Tensor) for v in values):
                warning_cache.warn(
                    f"sparse_dp: {name} was set to different tensors by the replicas' steps: the module gets them "
                    "merged as step outputs are (0-dim tensors: the mean weighted by each replica's share of the batch, "
                    "its samples or points; per-sample rows: in sample order), one device's value only for a mean "
                    "over those. Compute it with torch.mean / .mean() (counted), log it, or return it from the step, "
                    "to get one device's value."
                )
                return value
        warning_cache.warn(
            f"sparse_dp: {name} was set to different values by the replicas' steps (each ran on its chunk of the "
            "batch): the module keeps the root replica's (replica 0's), as Lightning's DDP keeps rank 0's. Set it from "
            "the whole batch (in on_*_batch_end, which gets the gathered outputs) for one device's value."
        )
        return self._to_root(values[0])

    def _to_root(self, value: Any) -> Any:
        """``value`` with its tensors moved to the module's device (a replica's on another GPU would stay there)."""
        device = getattr(self.module, "device", None)
        return value if not isinstance(device, torch.device) else move_data_to_device(value, device)


__all__ = ["ModuleChanges"]
