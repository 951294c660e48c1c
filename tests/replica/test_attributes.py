"""SubmoduleChanges: the attributes a step sets on the replicas' copies of the module's submodules."""

from __future__ import annotations

import torch
import torchmetrics

from lightning_sparse_dp.step.replicate import Replicas


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scale, self.cache = 1.0, None


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = _Layer()
        self.acc = torchmetrics.MeanMetric()


def _replicas():
    module = _Net()
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    replicas.refresh(3)
    return module, replicas


def test_changes_on_one_replicas_copies_are_found_there_only_after_a_clean_step():
    """Once a replica's copies were found clean (the one-pass comparison from then on), what its step sets, replaces,
    adds or removes on a copy is found, for that replica only; torch's own entries (``training``) and a metric's
    state are not followed."""
    module, replicas = _replicas()
    found = replicas.attributes
    index = found.names.index("layer")
    assert [found.changed(r) for r in range(3)] == [[], [], []]
    assert [found.changed(r) for r in range(3)] == [[], [], []]  # the one-pass comparison: still nothing
    copy = replicas._copies[1][index]
    copy.scale = 2.0
    copy.cache = torch.ones(3)
    copy.added = "x"
    del copy.__dict__["_forward_hooks"]  # torch's own: not followed
    copy.training = False
    replicas._copies[1][found.names.index("acc")].total = torch.ones(())  # a metric's state: the metrics' own merge
    assert sorted(found.changed(1)) == [(index, "added"), (index, "cache"), (index, "scale")]
    assert found.changed(0) == [] and found.changed(2) == []
    replicas._copies[2][index].__dict__.pop("scale")
    assert found.changed(2) == [(index, "scale")]
    assert found.name(index, "scale") == "self.layer.scale"


def test_a_refresh_gives_the_copies_the_modules_attributes_and_drops_those_it_lost():
    """After a refresh the copies hold their module's attributes again: nothing is found, and an attribute the module
    lost between steps (``del model.layer.cache``) is gone from the copies too, not taken for one a step added."""
    module, replicas = _replicas()
    found = replicas.attributes
    index = found.names.index("layer")
    assert found.changed(1) == []
    replicas._copies[1][index].scale = 5.0
    module.layer.extra = 3
    replicas.refresh_replica(1)
    assert found.changed(1) == [] and replicas._copies[1][index].scale == 1.0 and replicas._copies[1][index].extra == 3
    del module.layer.cache
    del module.layer.extra
    replicas.refresh_replica(1)
    assert found.changed(1) == []
    assert not hasattr(replicas._copies[1][index], "cache") and not hasattr(replicas._copies[1][index], "extra")


def test_the_submodules_lists_and_dicts_are_listed_as_they_are_now():
    """``containers()`` lists the followed list and dict attributes of the module's submodules as the module holds them
    at each call: one made a list, one added, one removed between calls (a key lost and another added keeps the
    number of entries: still seen), never a metric's or torch's own."""
    module, replicas = _replicas()
    found = replicas.attributes
    index = found.names.index("layer")
    assert found.containers() == []
    module.layer.cache = []
    assert found.containers() == [(index, "cache")]
    module.layer.table = {"a": 1}
    assert sorted(found.containers()) == [(index, "cache"), (index, "table")]
    del module.layer.scale
    module.layer.history = []  # as many entries as before
    assert sorted(found.containers()) == [(index, "cache"), (index, "history"), (index, "table")]
    module.layer.cache = None
    assert sorted(found.containers()) == [(index, "history"), (index, "table")]


def test_followed_modules_are_the_submodules_but_the_module_itself_and_metrics():
    """:func:`followed_modules`, read against the module's own ``named_modules()``: every submodule is followed but the
    module itself (its attributes are ModuleChanges's) and a torchmetrics metric with what is inside it (metrics merge)."""
    from lightning_sparse_dp.replica.attributes import followed_modules

    module = _Net()
    module.acc.inner = torch.nn.Linear(1, 1)  # inside a metric: the metric's own
    names, modules = zip(*module.named_modules())
    assert [names[i] for i in followed_modules(names, modules)] == ["layer", "layer.linear"]


class _Slotted(torch.nn.Module):
    """A layer that keeps a tensor in a slot, as a pruned ME convolution keeps its ``kernel``, and settings beside it."""

    __slots__ = ("kernel", "setting")

    def __init__(self):
        super().__init__()
        self.kernel, self.setting = torch.ones(2), 3


def test_a_tensor_a_step_sets_in_a_slot_is_found_and_a_refresh_gives_the_modules_back():
    """A slot of a submodule that held a tensor when the replicas were built (a pruned ME convolution's ``kernel``,
    which the pruning's forward pre-hook sets at every forward, on the replica's layer) is followed as ``__dict__``
    entries are: what a step sets there is found for that replica only (before, slots were never read, and the module's
    tensor stayed as pruning left it), read by ``value``, and a refresh gives the copies the module's value again, one
    the module got between steps included. Its other slots (settings) are not read."""
    module = torch.nn.Sequential(_Slotted())
    replicas = Replicas(module, [torch.device("cpu")] * 3)
    replicas.refresh(3)
    found = replicas.attributes
    index = found.names.index("0")
    copy = replicas._copies[1][index]
    assert copy.kernel is module[0].kernel and [found.changed(r) for r in range(3)] == [[], [], []]
    copy.kernel = torch.full((2,), 2.0)
    copy.setting = 4  # not a tensor when built: not followed
    assert found.changed(1) == [(index, "kernel")] and found.changed(0) == found.changed(2) == []
    assert found.value(copy, index, "kernel", None) is copy.kernel and found.value(copy, index, "scale", None) is None
    module[0].kernel = torch.zeros(2)  # between steps, on the module (a callback)
    replicas.refresh_replica(1)
    assert copy.kernel is module[0].kernel and found.changed(1) == []
    del module[0].kernel
    replicas.refresh_replica(1)
    assert found.value(copy, index, "kernel", None) is None and found.changed(1) == []
