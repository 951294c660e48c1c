"""What a sparse_dp step leaves on the module and its submodules is one device's (lightning_sparse_dp/replica/changes.py,
attributes.py): attributes set, lists and dicts changed in place, and what no merge can undo said; each fit against
one device with the whole batch."""

from __future__ import annotations

import collections
import warnings

import MinkowskiEngine as ME
import pytest
import torch

from tests.support.exact import assert_same_states, epoch_pair, same_start
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples, trainer, unchecked

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


def test_state_a_step_leaves_on_the_module_is_one_devices():
    """Lightning 2's pattern: self.validation_step_outputs.append(loss) then a mean in on_validation_epoch_end, plus
    a flag, a counter and the last loss set on self in the step: one entry per step and one device's values
    (float64, 3 replicas, uneven chunks), not one entry per replica or nothing."""

    class Leaves(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.validation_step_outputs, self.epoch_means = [], []
            self.flag, self.steps, self.last = False, 0, None

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.flag, self.steps, self.last = True, self.steps + 1, loss.detach()
            return loss

        def validation_step(self, batch, batch_idx):
            self.validation_step_outputs.append(self.loss(batch))

        def on_validation_epoch_end(self):
            self.epoch_means.append(torch.stack(self.validation_step_outputs).mean())
            self.validation_step_outputs.clear()

    ours, reference = epoch_pair(Leaves, (51, 52))
    assert ours.flag is True and ours.steps == reference.steps == 2
    assert len(ours.epoch_means) == len(reference.epoch_means) == 1
    assert float(ours.epoch_means[0]) == pytest.approx(float(reference.epoch_means[0]), rel=1e-10)
    assert float(ours.last) == pytest.approx(float(reference.last), rel=1e-10)


def test_counts_and_fixed_size_tensors_a_step_leaves_are_one_devices_or_rank_zeros():
    """The usual hand-made accuracy (``self.correct.append((pred == y).sum())``, also returned from the step) is one
    device's: the replicas' 0-dim integer counts are summed (they were merged as a weighted mean, a fraction, without a
    word). A Python int appended (a chunk's sample count) and a fixed-size tensor set on ``self`` each step (a confusion
    matrix, concatenated to 3x its rows before, which broke the next step) keep the root replica's, as Lightning's DDP
    keeps rank 0's, and are said."""

    class Counts(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.correct, self.returned, self.seen, self.ratios = [], [], [], []
            self.confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long)

        def training_step(self, batch, batch_idx):
            labels = batch["labels"]
            pairs = torch.bincount(labels * NUM_CLASSES + labels, minlength=NUM_CLASSES**2)
            self.confusion = self.confusion + pairs.view(NUM_CLASSES, NUM_CLASSES)
            self.seen.append(int(labels.shape[0]))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            correct = (self(x).argmax(1) == batch["labels"]).sum()
            self.correct.append(correct)
            self.ratios.append({"ratio": correct / batch["labels"].shape[0]})  # a hand-made ratio: said, not one device's
            return {"correct": correct}

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            self.returned.append(outputs["correct"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, reference = epoch_pair(Counts, (63, 64))
    said = " ".join(str(w.message) for w in caught)
    assert [int(c) for c in ours.correct] == [int(c) for c in reference.correct]
    assert [int(c) for c in ours.returned] == [int(c) for c in reference.returned] == [int(c) for c in reference.correct]
    assert all(not c.is_floating_point() for c in ours.correct + ours.returned)
    assert "the entry appended to self.correct is a 0-dim integer tensor" in said
    assert "step output output['correct'] is a 0-dim integer tensor" in said
    assert reference.seen == [7, 7] and len(ours.seen) == 2 and all(0 < n < 7 for n in ours.seen)
    assert "the entry appended to self.seen was set to different values" in said
    assert ours.confusion.shape == reference.confusion.shape
    assert 0 < int(ours.confusion.sum()) < int(reference.confusion.sum()) == 14
    assert "self.confusion was set to different values by the replicas' steps" in said
    assert len(ours.ratios) == 2 and "output['ratio'] differs between the replicas and is not a combination" in said


def test_dicts_and_nested_lists_a_step_changes_in_place_are_one_devices():
    """Dicts and lists inside the module's attributes that the step changes in place (a dict of per-stage output lists,
    a counter in a defaultdict, a list per dataloader, a running value in a dict): one entry per step and one device's
    values (float64, 3 replicas, uneven chunks). The replicas shared the module's dicts and inner lists before, so each
    step appended one entry per replica, in the order their threads ran, and counted each step once per replica."""

    class Nested(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.outputs = {"train": [], "val": []}
            self.counts = collections.defaultdict(int)
            self.per_loader = [[]]
            self.running = {"last": None, "ids": []}

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.outputs["train"].append(loss.detach())
            self.counts["train_steps"] += 1
            self.running["last"] = loss.detach()
            return loss

        def validation_step(self, batch, batch_idx):
            loss = self.loss(batch)
            logits = self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))
            self.outputs["val"].append({"loss": loss, "preds": logits.argmax(1)})
            self.per_loader[0].append(batch["labels"] * 10)
            self.counts["val_steps"] += 1

    ours, reference = epoch_pair(Nested, (61, 62))
    assert dict(ours.counts) == dict(reference.counts) == {"train_steps": 2, "val_steps": 2}
    assert type(ours.counts) is collections.defaultdict and ours.counts.default_factory is int
    assert len(ours.outputs["train"]) == len(reference.outputs["train"]) == 2
    for a, b in zip(ours.outputs["train"], reference.outputs["train"]):
        assert float(a) == pytest.approx(float(b), rel=1e-10)
    assert float(ours.running["last"]) == pytest.approx(float(reference.running["last"]), rel=1e-10)
    assert len(ours.outputs["val"]) == len(reference.outputs["val"]) == 2
    for a, b in zip(ours.outputs["val"], reference.outputs["val"]):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-10)
        assert torch.equal(a["preds"], b["preds"])  # per-sample rows, in sample order
    assert len(ours.per_loader) == 1 and [t.tolist() for t in ours.per_loader[0]] == [
        t.tolist() for t in reference.per_loader[0]
    ]


def test_dict_entries_the_replicas_change_merge_as_attributes_and_per_sample_keys_are_theirs():
    """ModuleChanges on a dict attribute: a key every replica sets merges as an attribute does, a key each replica adds
    for its own samples (a per-sample cache) is theirs, a key all remove goes, one changed by some replicas only is
    said; the module keeps its own dict (a defaultdict stays one); a dict of more than 16 entries is shared."""
    from lightning.pytorch.utilities.rank_zero import WarningCache

    from lightning_sparse_dp.replica.changes import ModuleChanges

    module = torch.nn.Module()
    module.stats = collections.defaultdict(list, {"sum": 0, "gone": 1, "flag": False, "per_stage": {"val": []}})
    module.big = {i: i for i in range(17)}
    stats, big = module.stats, module.big
    replicas = [torch.nn.Module() for _ in range(3)]
    for r in replicas:
        r.__dict__.update(module.__dict__)
    state = ModuleChanges(module, replicas)
    for i, r in enumerate(replicas):
        assert r.stats is not stats and r.stats["per_stage"] is not stats["per_stage"] and r.big is big
        r.stats["sum"] += 10.0 * (i + 1)  # every replica: merged as an attribute (combine: numbers, tensors)
        r.stats[f"sample{i}"] = i  # each its own sample's key
        del r.stats["gone"]
        r.stats["per_stage"]["val"].append(float(i))  # a value the step computed: merged (combine)
        r.big[100 + i] = i  # shared: in place, once per replica (each its own key)
    replicas[2].stats["flag"] = True  # some replicas only
    cache = WarningCache()
    merged = []
    state.merge(lambda values: merged.append(values) or (sum(values), True), cache)
    assert module.stats is stats and type(stats) is collections.defaultdict and stats.default_factory is list
    assert {k: v for k, v in stats.items() if k != "per_stage"} == {
        "sum": 60.0, "flag": True, "sample0": 0, "sample1": 1, "sample2": 2
    }
    assert stats["per_stage"] == {"val": [3.0]} and merged == [[10.0, 20.0, 30.0], [0.0, 1.0, 2.0]]
    assert module.big is big and len(big) == 20
    assert any("self.stats['flag'] was set or removed by some replicas' steps only" in m for m in cache)
    assert not any("sample" in m or "'sum'" in m for m in cache)
    assert all(r.stats is stats for r in replicas)  # what runs after the step changes the module's
    module.tmp, module.scratch, module.partial = 1, [0], 5
    for r in replicas:
        r.__dict__.update(module.__dict__)
    state = ModuleChanges(module, replicas)
    for r in replicas:
        del r.tmp, r.scratch  # removed by every replica's step: gone, as on one device
    del replicas[1].partial  # by one only: said
    state.merge(lambda values: (values[0], True), cache)
    assert not any(hasattr(module, k) for k in ("tmp", "scratch", "partial"))  # partial: what replica 1 did, said
    assert any("self.partial was set (or removed) by some replicas' steps only" in m for m in cache)


class _Probe(torch.nn.Module):
    """A layer that notes what passes through it on itself, as attention maps or feature-transform matrices are kept for
    a loss term or a plot: a call counter, the last input's per-sample rows, and a flag it removes."""

    def __init__(self):
        super().__init__()
        self.calls, self.last_rows, self.scratch, self.pending = 0, None, True, []

    def forward(self, x):
        self.calls += 1
        self.last_rows = x.F.detach()  # after global pooling: one row per sample
        if hasattr(self, "scratch"):
            del self.scratch
        if hasattr(self, "pending"):  # a list of the layer (each replica's own copy) removed as a flag is
            del self.pending
        return x


def test_attributes_a_step_sets_on_a_submodule_are_one_devices():
    """What a step sets on a submodule of the module (``self.encoder.last_attention = ...``, a counter, a removed flag)
    lands on the module's submodule as on one device (float64, 3 replicas, uneven chunks: per-sample rows in sample
    order, a counter counted once per step). Before, it stayed on the replicas' copies of the submodule and the
    module's never changed: ``calls`` stayed 0 and ``last_rows`` ``None``."""

    class Noted(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.net.insert(len(self.net) - 1, _Probe())  # before the head: global pooling's per-sample rows

    ours, reference = epoch_pair(Noted, (71, 72))
    mine, theirs = ours.net[-2], reference.net[-2]
    assert theirs.calls == 4 and mine.calls == theirs.calls  # 2 training + 2 validation steps
    assert mine.last_rows.shape == theirs.last_rows.shape == (7, 16)
    torch.testing.assert_close(mine.last_rows, theirs.last_rows, rtol=1e-10, atol=0)
    assert not hasattr(theirs, "scratch") and not hasattr(mine, "scratch")
    assert not hasattr(theirs, "pending") and not hasattr(mine, "pending")


def test_lists_and_dicts_of_a_submodule_a_step_changes_in_place_are_one_devices():
    """A layer that appends what passes through it to its own list (``self.history.append(x)``) and counts in its own
    dict: one entry and one count per step, per-sample rows in sample order (float64, 3 replicas, uneven chunks).
    Before, the replicas' copies of the layer shared its list and dict: 3 entries per step, in thread order, and 12
    counts after 4 steps where one device counts 4."""

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.history, self.counts = [], {"calls": 0}

        def forward(self, x):
            self.history.append(x.F.detach())
            self.counts["calls"] += 1
            return x

    class Recorded(SparseNet):
        def __init__(self):
            super().__init__(lr=0.1)
            self.net.insert(len(self.net) - 1, Recorder())

    ours, reference = epoch_pair(Recorded, (75, 76))
    mine, theirs = ours.net[-2], reference.net[-2]
    assert theirs.counts == {"calls": 4} and mine.counts == theirs.counts
    assert len(theirs.history) == 4 and len(mine.history) == len(theirs.history)
    for a, b in zip(mine.history, theirs.history):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)


def test_a_submodule_attribute_some_replicas_set_is_said():
    """A submodule attribute set by some replicas' steps only (a branch on the chunk) is said once, naming it; the module
    gets the first setter's value."""

    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.F.shape[0] > 2:  # the chunk's samples (after pooling): 3, 2 and 2 of 7
                self.big = x.F.shape[0]
            return x

    class Branches(SparseNet):
        def __init__(self):
            super().__init__()
            self.net.insert(len(self.net) - 1, Branchy())

    model = Branches()
    with pytest.warns(UserWarning, match=r"self\.net\.5\.big was set \(or removed\) by some replicas' steps only"):
        trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(model, loader(collate_dict(random_samples(7, seed=73))))
    assert model.net[5].big == 3


def test_a_list_of_the_module_a_hook_holding_the_module_fills_is_said():
    """A forward hook registered with the module itself in its closure (``layer.register_forward_hook(lambda m, i, o:
    self.features.append(o))``) runs in every replica's step and appends to the module's own list, not the replica's
    copy: one entry per replica per step, in thread order, where one device's list gets one per step. No merge can
    tell the replicas' entries apart there, so it is said, naming the list; a list the step fills through ``self``
    (the replica) is merged and not named."""

    class Hooked(SparseNet):
        def __init__(self):
            super().__init__()
            self.features, self.losses = [], []
            self.net[-1].register_forward_hook(lambda m, i, o: self.features.append(o.F.detach()))

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach())
            return loss

    batches = [collate_dict(random_samples(7, seed=95 + i)) for i in range(2)]
    ours, reference = Hooked(), Hooked()
    with pytest.warns(UserWarning, match=r"self\.features \(a list of the module\) changed in the step") as record:
        trainer(strategy=unchecked(), devices=3, max_steps=2).fit(ours, loader(*batches))  # counts the hook's calls
    trainer(max_steps=2).fit(reference, loader(*batches))
    assert len(reference.features) == 2 and len(ours.features) == 6  # what the warning is about
    assert len(ours.losses) == len(reference.losses) == 2
    assert not any("self.losses" in str(w.message) for w in record)


def test_a_tensor_of_the_module_changed_in_place_in_the_step_is_said():
    """A tensor attribute (or one in a dict attribute) that the step changes in place is the replicas' shared object:
    a decay is applied once per replica (3 steps of 3 replicas: 1 - 0.5**9 where one device reads 1 - 0.5**3). No merge
    can undo that, so it is said, naming it; a tensor the step replaces (not in place) is merged and not named."""

    class Decays(SparseNet):
        def __init__(self):
            super().__init__()
            self.ema, self.stats, self.replaced = torch.zeros(()), {"ema": torch.zeros(())}, torch.zeros(())

        def training_step(self, batch, batch_idx):
            self.ema.mul_(0.5).add_(0.5)
            self.stats["ema"].mul_(0.5).add_(0.5)
            self.replaced = self.replaced * 0.5 + 0.5
            return super().training_step(batch, batch_idx)

    batches = [collate_dict(random_samples(7, seed=90 + i)) for i in range(3)]
    ours, reference = Decays(), Decays()
    with pytest.warns(UserWarning, match=r"self\.ema \(a tensor of the module\) was changed in place") as record:
        trainer(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer(max_steps=3).fit(reference, loader(*batches))
    said = [str(w.message) for w in record if "(a tensor of the module) was changed in place" in str(w.message)]
    assert len(said) == 2 and any("self.stats['ema']" in m for m in said)  # each named once
    checked = [str(w.message) for w in record if "exactness check of training step 0" in str(w.message)]
    assert len(checked) == 1 and "attribute 'ema'" in checked[0]  # the check measures it too
    assert float(reference.ema) == 1 - 0.5**3 and float(ours.ema) != pytest.approx(1 - 0.5**3)
    assert float(ours.replaced) == float(reference.replaced) == 1 - 0.5**3  # replaced, merged: one device's


class AverageMeter:
    """The running-average helper of many training scripts (ME's examples among them): a plain object, not a metric."""

    def __init__(self):
        self.val, self.sum, self.count, self.history = 0.0, 0.0, 0, []

    def update(self, val, n=1):
        self.val, self.sum, self.count = val, self.sum + val * n, self.count + n
        self.history.append(val)


def test_a_simple_namespace_of_the_module_the_step_changes_is_said():
    """``self.stats = types.SimpleNamespace(seen=0)`` updated in the step (``self.stats.seen += n``) was changed by each
    replica with its chunk, silently: 3 times one device's count over 3 replicas, since a SimpleNamespace (module
    ``types``) was not taken for a plain object. It is said now, as an AverageMeter is."""
    import types

    class Counts(SparseNet):
        def __init__(self):
            super().__init__()
            self.stats = types.SimpleNamespace(seen=0)

        def training_step(self, batch, batch_idx):
            self.stats.seen += 10
            return super().training_step(batch, batch_idx)

    batches = [collate_dict(random_samples(7, seed=97 + i)) for i in range(2)]
    with pytest.warns(UserWarning, match=r"self\.stats \(a SimpleNamespace\) was changed in the step \(seen\)"):
        trainer(strategy="sparse_dp", devices=3, max_steps=2, precision="64-true").fit(ours := Counts(), loader(*batches))
    assert ours.stats.seen == 60  # what is said: each replica's step added its 10


def test_a_plain_object_of_the_module_the_step_changes_is_said():
    """An object of the module that is neither a tensor, a module, a metric nor a container (an AverageMeter) is the
    replicas' shared object: each replica's step updates it with its chunk, so its last value is the last replica's
    and its history gets an entry per replica (against one device's, float64). No merge can tell a sum from a last
    value, so it is said once, naming it and what changed; an object the step only reads (a config) is not named."""

    class Config:
        def __init__(self):
            self.scale = 1.0

    class Metered(SparseNet):
        def __init__(self):
            super().__init__()
            self.meter, self.config = AverageMeter(), Config()

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx) * self.config.scale
            self.meter.update(loss.item(), len(batch["labels"]))
            return loss

    batches = [collate_dict(random_samples(7, seed=95 + i)) for i in range(2)]
    ours, reference = same_start(Metered)
    said_as = r"self\.meter \(a AverageMeter\) was changed in the step \(count, history, sum, val\)"
    with pytest.warns(UserWarning, match=said_as) as record:
        trainer(strategy="sparse_dp", devices=3, max_steps=2, precision="64-true").fit(ours, loader(*batches))
    trainer(max_steps=2, precision="64-true").fit(reference, loader(*batches))
    said = [str(w.message) for w in record if "was changed in the step" in str(w.message)]
    assert len(said) == 1 and "self.config" not in said[0]
    # what it is about: the count adds up, the last value and the history are the replicas', not one device's
    assert ours.meter.count == reference.meter.count == 14
    assert len(reference.meter.history) == 2 and len(ours.meter.history) == 6
    assert ours.meter.val != pytest.approx(reference.meter.val, rel=1e-10)



def test_a_metric_kept_in_a_plain_dict_and_updated_in_the_step_is_said():
    """A MeanMetric in a plain dict (no submodule) is shared by the replicas, each updating it with its chunk's loss: 9
    updates in 3 steps where one device makes 3, the epoch mean 6e-3 off, silently. It is said now, naming the fix;
    the same metric in an nn.ModuleDict is one device's, and one updated in a hook on the module is not said."""
    from torchmetrics import MeanMetric

    from lightning_sparse_dp.runtime.process import SAID_ONCE

    class Meters(SparseNet):
        def __init__(self, plain: bool):
            super().__init__()
            self.meters = {"loss": MeanMetric()} if plain else torch.nn.ModuleDict({"loss": MeanMetric()})
            self.seen = {"batches": MeanMetric()}  # updated in a hook, on the module: one device's

        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.meters["loss"].update(loss.detach())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.seen["batches"].update(1.0)

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "self.meters" in m or "self.seen" in m})
    batches = [collate_dict(random_samples(7, seed=90 + i)) for i in range(3)]
    counts = {}
    for plain in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = Meters(plain)
            trainer(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
        said = [str(w.message) for w in caught if "in a plain list or dict of the module" in str(w.message)]
        counts[plain] = int(ours.meters["loss"].weight)  # one per update of a scalar
        assert len(said) == (1 if plain else 0) and all("self.meters['loss']" in m for m in said), said
    assert counts == {True: 9, False: 3}  # the plain dict's metric: one update per replica, as the line says


def _pruned(model):
    """What :func:`test_a_pruned_layers_masked_weight_is_one_devices` prunes: both ME convolutions' ``kernel`` (a slot of
    the layer once pruned) and the head's ``weight`` (a ``__dict__`` entry once pruned)."""
    return [(model.net[0], "kernel"), (model.net[2], "kernel"), (model.net[-1].linear, "weight")]


@pytest.mark.parametrize("lottery", [True, False], ids=["lottery-reset", "no-reset"])
def test_a_pruned_layers_masked_weight_is_one_devices(lottery):
    """Lightning's ``ModelPruning`` each epoch (``l1_unstructured``, 20 %): torch's pruning keeps the masked weight
    (``kernel_orig * kernel_mask``) as a plain tensor on the layer, which its forward pre-hook sets again at every
    forward, on the replica's layer in a step, and the next pruning scores. Float64, 3 replicas, 4 epochs of 2 batches,
    with and without the lottery-ticket reset: the module's masked weights, masks and parameters are one device's. Before,
    an ME convolution's ``kernel`` (a slot) kept the value of the last pruning, so the next pruning scored stale weights
    and chose other masks (1.4e-3 relative off one device's parameters with the reset, other entries masked without)."""
    from lightning.pytorch.callbacks import ModelPruning

    batches = [collate_dict(random_samples(9, seed=s)) for s in (1, 2)]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    models = same_start(SparseNet)
    for model, kwargs in zip(models, ({"strategy": "sparse_dp", "devices": 3}, {})):
        model.double()
        pruning = ModelPruning("l1_unstructured", amount=0.2, use_lottery_ticket_hypothesis=lottery,
                               parameters_to_prune=_pruned(model), make_pruning_permanent=False, verbose=0)
        trainer(precision="64-true", max_steps=-1, max_epochs=4, callbacks=[pruning], **kwargs).fit(model, loader(*batches))
    ours, reference = models
    assert_same_states(ours, reference, trained=False)  # pruned: kernel_orig, which same_start did not note
    assert not torch.equal(ours.net[-1].linear.bias, ours._starting_parameters["net.5.linear.bias"])  # it trained
    for (mine, name), (theirs, _) in zip(_pruned(ours), _pruned(reference)):
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name).detach(), rtol=1e-10, atol=0)


class _SlottedLayer(torch.nn.Module):
    """A layer that keeps a plain tensor in a slot, set at every forward from its parameter, as torch's pruning sets a
    pruned ME convolution's ``kernel``."""

    __slots__ = ("kernel",)

    def __init__(self):
        super().__init__()
        self.kernel_orig = torch.nn.Parameter(torch.arange(4.0))
        self.kernel = self.kernel_orig.detach() * 2


def test_a_tensor_the_step_sets_in_a_layers_slot_is_the_root_replicas_detached_or_said():
    """ModuleChanges on a submodule's slot (replica/attributes.py follows it): tensors every replica's step set there
    from its parameters, equal, give the module the root replica's value detached from the replica's graph (before:
    nothing reached the module, whose tensor kept what pruning last set); tensors that differ between the replicas (a
    value of each chunk) keep the root replica's, said as for any attribute set to different values; either way a
    refresh gives the copies the module's value."""
    from lightning.pytorch.utilities.rank_zero import WarningCache

    from lightning_sparse_dp.replica.changes import ModuleChanges
    from lightning_sparse_dp.step.replicate import Replicas

    module = torch.nn.Sequential(_SlottedLayer())
    replicas = Replicas(module, [torch.device("cpu")] * 3)

    def fixed_size(values):  # as combine_values treats tensors that are not rows of the chunks
        raise ValueError("fixed size")

    for scale in (None, [1.0, 2.0, 3.0]):
        copies = replicas.refresh(3)
        state = ModuleChanges(module, copies, attributes=replicas.attributes)
        for r, copy in enumerate(copies):
            copy[0].kernel = copy[0].kernel_orig * (3.0 if scale is None else scale[r])  # the replica's own graph
        cache = WarningCache()
        with warnings.catch_warnings(record=True):  # counted in the cache below
            state.merge(fixed_size, cache)
        kernel = module[0].kernel
        root = 3.0 if scale is None else scale[0]
        assert kernel.grad_fn is None and torch.equal(kernel, torch.arange(4.0) * root)  # the root replica's value
        said = [m for m in cache if "self.0.kernel was set to different values by the replicas' steps" in m]
        assert len(said) == (0 if scale is None else 1)
        replicas.refresh_replica(1)
        assert replicas.modules[1][0].kernel is kernel
