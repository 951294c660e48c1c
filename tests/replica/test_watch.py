"""The replicas' watch list (lightning_sparse_dp/replica/watch.py): what a step's state follows of the module, the
replicas' trainer views and recorders, held from step to step while their premise holds and derived anew when it
fails, always equal to the derivation of every step."""

from __future__ import annotations

import collections

import MinkowskiEngine as ME
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.utilities.rank_zero import WarningCache
from torchmetrics import MeanMetric

from lightning_sparse_dp.replica import effects, recorder, snapshot, watch
from lightning_sparse_dp.replica.changes import ModuleChanges
from lightning_sparse_dp.step.replicate import Replicas
from tests.support.exact import same_start
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples, trainer, unchecked


class _Meter:
    def __init__(self) -> None:
        self.total = 0


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.history: list = []
        self.counts = {"a": 0}
        self.ema = torch.zeros(2)
        self.flag = False


def _today(module: torch.nn.Module) -> tuple:
    """The derivation of every step before the watch list (the reference)."""
    before = snapshot.followed(module.__dict__)
    containers = [k for k, v in before.items() if snapshot.is_copied(v)]
    sizes = {f"self.{k}": list(snapshot.nested_sizes(before[k])) for k in containers}
    versions = [(n, t, t._version) for k, v in before.items() for n, t in snapshot.nested_tensors(v, f"self.{k}")]
    objects = [(k, v, snapshot.public_state(v)) for k, v in before.items() if snapshot.is_plain_object(v)]
    return before, containers, sizes, versions, objects


def _held(state: ModuleChanges) -> tuple:
    return state.before, state.containers, state.sizes, state.versions, state.objects


def _step(module: torch.nn.Module, replicas: Replicas) -> ModuleChanges:
    """One step's state on the replicas, entered for each and merged (nothing set by the replicas)."""
    replicas.refresh(3)
    state = ModuleChanges(module, replicas.modules, attributes=replicas.attributes)
    assert _held(state) == _today(module)
    cache = WarningCache()
    state.merge(lambda values: (values[0], True), cache)
    assert not list(cache)
    return state


def _counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _add(m):
    m.added = [1]


def _remove(m):
    m.__dict__.pop("flag", None)


def _replace_list(m):
    m.history = [torch.ones(1)]


def _grow_dict(m):  # in place, past the length of a copied dict: shared from then on
    m.counts.update({i: i for i in range(20)})


def _shrink_dict(m):
    m.counts = {"a": 1}


def _nest(m):  # a nested list in the module's list, in place: the list is no longer flat
    m.history.append([2])


def _replace_tensor(m):
    m.ema = torch.ones(2)


def _object(m):
    m.meter = _Meter()


def _library(m):  # a value under a library key changes (training): the listing holds
    m.training = not m.training


OPERATIONS = [_add, _remove, _replace_list, _grow_dict, _shrink_dict, _nest, _replace_tensor, _object, _library]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(OPERATIONS), max_size=6))
def test_the_listing_each_step_is_the_derivation_of_every_step(operations):
    """Whatever a hook did to the module between steps (an attribute added or removed, a container or a tensor
    replaced, a dict grown past the copied length in place, a list given a nested list, a plain object added), the
    step's followed entries, containers, sizes, tensors and objects are those the derivation of every step gives."""
    module = _Net()
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    _step(module, replicas)
    for operation in operations:
        operation(module)
        _step(module, replicas)


def test_the_listing_is_reused_while_it_holds_and_listed_again_when_an_entry_changes(monkeypatch):
    module = _Net()
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    listed = _counting(monkeypatch, watch, "list_entries")
    _step(module, replicas)
    assert listed[0] == 1
    for _ in range(3):
        module.history.append(torch.ones(1))  # contents change between steps: the listing holds (sizes read again)
        module.counts["a"] += 1
        _library(module)
        _step(module, replicas)
    assert listed[0] == 1
    for operation, relisted in ((_add, 2), (_replace_list, 3), (_grow_dict, 4), (_object, 5), (_remove, 6)):
        operation(module)
        _step(module, replicas)
        assert listed[0] == relisted, operation.__name__
        _step(module, replicas)
        assert listed[0] == relisted, operation.__name__  # and held again
    fresh = Replicas(module, [torch.device("cpu")] * 3)  # replicas rebuilt (the module changed): a new watch
    _step(module, fresh)
    assert listed[0] == 7


def test_copies_no_replica_changed_are_not_merged_and_the_module_keeps_its_objects(monkeypatch):
    """A list and a short dict no replica's step touched: no merge runs, the replicas hold the module's objects again;
    one a replica appended to is merged as before (one entry per step)."""
    module = _Net()
    module.counts = collections.defaultdict(int, {"a": 0})
    history, counts = module.history, module.counts
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    merged = _counting(monkeypatch, ModuleChanges, "_merge_copied")
    state = _step(module, replicas)
    assert merged[0] == 0 and all(r.history is history and r.counts is counts for r in replicas.modules)
    assert state.sizes == {"self.history": [(history, 0)], "self.counts": [(counts, 1)]}
    replicas.refresh(3)
    state = ModuleChanges(module, replicas.modules, attributes=replicas.attributes)
    for i, r in enumerate(replicas.modules):
        assert r.history is not history and r.counts is not counts and type(r.counts) is collections.defaultdict
        r.history.append(float(i))
    state.merge(lambda values: (sum(values), True), WarningCache())
    assert merged[0] == 1 and module.history is history and history == [3.0] and counts == {"a": 0}


def test_a_trainer_view_is_kept_per_replica_and_trainer():
    class Trainerish:
        logger = property(lambda self: None, None)
        loggers = property(lambda self: [], None)

    first, second = Trainerish(), Trainerish()
    replica = torch.nn.Module()
    views: list = [None, None]
    replica._trainer = first
    effects.give_view(replica, views, 1)
    view = replica._trainer
    assert view is not first and view.__dict__ is first.__dict__ and isinstance(view, Trainerish)
    replica._trainer = first  # the next refresh gives the trainer back
    effects.give_view(replica, views, 1)
    assert replica._trainer is view and views[0] is None
    replica._trainer = second  # a new trainer: a new view
    effects.give_view(replica, views, 1)
    assert replica._trainer is not view and replica._trainer.__dict__ is second.__dict__


class _Grows(SparseNet):
    """A step that appends to a list a hook adds between steps (and replaces later), and updates a metric a hook adds
    mid-fit."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if hasattr(self, "history"):
            self.history.append(1)  # one entry per step, as on one device
        if hasattr(self, "labels_mean"):
            self.labels_mean.update(batch["labels"].float())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.history = []
        if batch_idx == 3:
            self.labels_mean = MeanMetric()
        if batch_idx == 4:
            self.old_history, self.history = self.history, [-1]  # replaced: the replicas' copies are of the new list


@pytest.mark.usefixtures("both_preparations")
def test_attributes_containers_and_metrics_a_hook_adds_mid_fit_are_followed(monkeypatch):
    made = _counting(monkeypatch, recorder.LogRecorder, "__init__")
    views = _counting(monkeypatch, effects, "trainer_view")
    listed = _counting(monkeypatch, watch, "list_entries")
    batches = [collate_dict(random_samples(6, seed=s)) for s in range(6)]
    model = _Grows()
    trainer(strategy=unchecked(), devices=3, max_steps=6).fit(model, loader(*batches))
    assert model.old_history == [1, 1, 1] and model.history == [-1, 1, 1]  # one entry per step, in the list it had
    labels = torch.cat([b["labels"].float() for b in batches[3:]])
    assert torch.allclose(model.labels_mean.compute(), labels.mean())
    # recorders: one per replica while the module has no metric (steps 0-2: kept from step to step), then one per
    # replica and step with the metric's copies; trainer views: one per replica and build of the replicas (rebuilt
    # for the metric)
    assert made[0] == 3 + 3 * 3
    assert views[0] == 3 * 2
    # the module's entries listed at the first step, when the hook added a list, for the rebuilt replicas and when the
    # hook replaced the list: not at the other steps
    assert listed[0] == 4


class ValidationCounts(SparseNet):
    """A validation confusion count kept in a tensor the validation hooks make, so under Lightning's inference mode
    (an inference tensor, with no version counter): rebuilt in ``on_validation_epoch_start``, added to in place in each
    validation step, and a running decay changed in place there too (applied once per replica: said)."""

    def on_validation_epoch_start(self):
        self.counts = torch.zeros(NUM_CLASSES, dtype=torch.long)
        self.decay = torch.ones(())

    def validation_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        self.counts += torch.bincount(self(x).argmax(1), minlength=NUM_CLASSES)
        self.decay.mul_(0.5)
        return super().validation_step(batch, batch_idx)


def test_tensors_a_validation_hook_makes_are_followed_as_one_devices():
    """Tensors made under inference mode (in a validation hook) have no version counter: the step's watch reads their
    values instead (it crashed reading the version). An in-place sum adds up to one device's count; an in-place decay,
    applied once per replica, is said."""
    batches = [collate_dict(random_samples(7, seed=70 + i)) for i in range(2)]
    ours, reference = same_start(ValidationCounts)
    with pytest.warns(UserWarning, match=r"self\.decay \(a tensor of the module\) was changed in place"):
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(ours, loader(*batches))
    trainer(limit_val_batches=None).validate(reference, loader(*batches))
    assert ours.counts.is_inference() and torch.equal(ours.counts, reference.counts)
    assert int(reference.counts.sum()) == 14
    assert float(reference.decay) == 0.5**2 and float(ours.decay) == 0.5**6


def test_an_inference_tensor_is_copied_for_its_mark_under_inference_mode_only():
    """A validation step (inference mode) marks a tensor its hooks made by a copy of its values; a training step copies
    none (it may be large, kept from the validation epoch), since torch refuses to change it in place there."""
    with torch.inference_mode():
        kept = torch.zeros(1000)
        mark = snapshot.tensor_mark(kept)
        assert isinstance(mark, torch.Tensor) and not snapshot.changed_in_place(kept, mark)
        kept.add_(1)
        assert snapshot.changed_in_place(kept, mark)
        kept[0] = float("nan")  # a NaN that stays is no change; one that comes is
        mark = snapshot.tensor_mark(kept)
        assert not snapshot.changed_in_place(kept, mark)
        kept[1] = float("nan")
        assert snapshot.changed_in_place(kept, mark)
    assert snapshot.tensor_mark(kept) is None and not snapshot.changed_in_place(kept, None)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        kept.add_(1)  # why no copy is needed outside inference mode
