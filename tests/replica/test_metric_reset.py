"""The replicas' metric copies: reset_metric leaves a metric as torchmetrics' reset does, merge_states merges as
merge_state does, and every copy a replica gets is empty."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, MinMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_sparse_dp.replica.metric_merge import merge_states
from lightning_sparse_dp.replica.metrics import ReplicaMetrics, reset_metric

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


def _updated(make):
    metric = make()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        if isinstance(metric, MulticlassAccuracy):
            metric.update(torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g))
        else:
            metric(torch.rand(5, generator=g))  # forward: _forward_cache and _computed set too
    metric.compute()
    return metric


def _state(metric: Metric) -> dict:
    out = {}
    for name, value in metric.__dict__.items():
        if name in ("update", "compute", "_update_signature") or isinstance(value, torch.nn.Module):
            continue
        out[name] = (
            [v.clone() for v in value]
            if isinstance(value, list)
            else value.clone()
            if isinstance(value, torch.Tensor)
            else value
        )
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) and x.dtype == y.dtype, name
        elif isinstance(x, list):
            assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)), name
        else:
            assert x == y, name


@pytest.mark.parametrize(
    "make",
    [lambda: MulticlassAccuracy(num_classes=4, average="micro"), MeanMetric, MaxMetric, CatMetric],
    ids=["accuracy", "mean", "max", "cat"],
)
def test_reset_metric_equals_torchmetrics_reset(make):
    ours, theirs = _updated(make), _updated(make)
    before = [id(ours.__dict__[n]) for n in ours._defaults]
    reset_metric(ours)
    theirs.reset()
    _same(_state(ours), _state(theirs))
    assert [id(ours.__dict__[n]) for n in ours._defaults] == before  # in place: the fast path ran
    # and the metric works on: the same results after one more update each
    for metric in (ours, theirs):
        metric.update(
            *(
                (torch.eye(4)[:3], torch.tensor([0, 1, 3]))
                if isinstance(metric, MulticlassAccuracy)
                else (torch.tensor([0.5, 2.0]),)
            )
        )
    assert torch.equal(torch.as_tensor(ours.compute()), torch.as_tensor(theirs.compute()))


def test_a_metric_with_its_own_reset_keeps_it():
    class Counting(MeanMetric):
        resets = 0

        def reset(self):
            type(self).resets += 1
            super().reset()

    metric = Counting()
    metric.update(torch.tensor([1.0]))
    reset_metric(metric)
    assert Counting.resets == 1 and metric._update_count == 0


def test_replica_metric_copies_start_every_step_empty_whether_or_not_the_last_step_used_them():
    # two metrics; each step updates one of them in some replicas: the root ends as one metric fed every batch
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = MeanMetric()
            self.b = MulticlassAccuracy(num_classes=4, average="micro")

    root = Holder()
    replicas = [Holder(), Holder(), Holder()]
    reference = Holder()
    g = torch.Generator().manual_seed(1)
    replica_metrics = ReplicaMetrics()
    for step, (name, used) in enumerate([("a", (0, 2)), ("b", (1,)), ("a", (1,)), ("b", (0, 1, 2)), ("a", (0,))]):
        with replica_metrics.step_copies(root, replicas, [torch.device("cpu")] * 3, structure=replicas) as copies:
            for index in range(len(replicas)):
                copies.install(index)
            merged = copies.merged
            for entry in merged:
                for copy in entry.replicas:  # every copy handed to a replica is empty
                    assert copy._update_count == 0 and copy._computed is None and copy._forward_cache is None
                    for state, default in copy._defaults.items():
                        value = getattr(copy, state)
                        assert torch.equal(value, default) if isinstance(default, torch.Tensor) else value == [], state
            for r in used:
                metric = getattr(replicas[r], name)
                if name == "a":
                    values = torch.rand(3 + r, generator=g)
                    metric.update(values)
                    reference.a.update(values)
                else:
                    preds, target = torch.randn(5, 4, generator=g), torch.randint(0, 4, (5,), generator=g)
                    if step == 3 and r == 2:
                        metric(preds, target)  # forward: the copy's _forward_cache is set too
                    else:
                        metric.update(preds, target)
                    reference.b.update(preds, target)
            if step == 1:
                replicas[0].a.compute()  # compute on an unused copy (a warning): it is reset all the same
    assert torch.equal(root.a.compute(), reference.a.compute())
    assert torch.equal(root.b.compute(), reference.b.compute())


class _FullState(MeanMetric):
    full_state_update = True


@pytest.mark.parametrize(
    "make",
    [
        lambda: MulticlassAccuracy(num_classes=4, average="micro"),  # int64 sums: fused
        lambda: MulticlassAccuracy(num_classes=4, average="none"),  # per-class [4] sums: fused
        lambda: MeanMetric(),  # float32 sums (value and weight): fused
        lambda: MeanMetric().double(),  # float64 sums: fused
        CatMetric,  # cat: merge_state
    ],
)
def test_merge_states_equals_torchmetrics_merge_state(make):
    g = torch.Generator().manual_seed(3)

    def fed(n: int):
        metric = make()
        for _ in range(n):
            if isinstance(metric, MulticlassAccuracy):
                metric.update(torch.randn(7, 4, generator=g), torch.randint(0, 4, (7,), generator=g))
            else:
                metric.update(torch.rand(5, generator=g, dtype=torch.float64) * 1e3)
        return metric

    root, copies = fed(2), [fed(1), fed(3), fed(1)]
    reference = make()
    reference.merge_state(root)
    ours = make()
    ours.merge_state(root)
    for m in copies:
        reference.merge_state(m)
    merge_states(ours, copies)
    for name in ours._defaults:
        a, b = getattr(ours, name), getattr(reference, name)
        if isinstance(a, list):
            # merge_state puts each incoming list first; one device appends: the root's entries, then each copy's
            b = [*getattr(root, name), *(x for m in copies for x in getattr(m, name))]
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), name
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name  # bit for bit
            assert all(a is not getattr(m, name) for m in copies)  # the copies' tensors are not taken over
    if not isinstance(ours, CatMetric):  # its compute() is the entries in their order
        torch.testing.assert_close(ours.compute(), reference.compute(), rtol=0, atol=0)


class _Level(Metric):
    """A state reduced by a mean (``dist_reduce_fx="mean"``) that every update sets: through ``forward`` torchmetrics
    keeps the running mean of it over the calls."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("level", torch.zeros((), dtype=torch.float64), dist_reduce_fx="mean")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, x):
        self.level = x.mean().to(torch.float64)
        self.count += 1

    def compute(self):
        return self.level


def test_merge_states_keeps_a_constant_mean_state():
    # PeakSignalNoiseRatio(data_range=1.0) keeps data_range as a state reduced by a mean, which no update changes:
    # merge_state weighted it by the target's update count, 0 in an empty root, and left 0 / 0 = nan
    from torchmetrics.image import PeakSignalNoiseRatio

    g = torch.Generator().manual_seed(5)
    preds, target = torch.rand(9, 4, generator=g), torch.rand(9, 4, generator=g)
    whole = PeakSignalNoiseRatio(data_range=1.0)
    whole.update(preds, target)
    copies = [PeakSignalNoiseRatio(data_range=1.0) for _ in range(3)]
    for i, m in enumerate(copies):
        m.update(preds[3 * i : 3 * i + 3], target[3 * i : 3 * i + 3])
    ours = PeakSignalNoiseRatio(data_range=1.0)
    merge_states(ours, copies)
    assert ours.data_range.item() == 1.0
    torch.testing.assert_close(ours.compute(), whole.compute())
    ours._update_count = 3  # as merge_into_root leaves it; a second step's merge keeps the constant too
    merge_states(ours, copies)
    assert ours.data_range.item() == 1.0


def test_merge_states_gives_a_mean_state_the_running_mean_over_every_forward_call():
    values = [torch.tensor([float(v), 2.0 * v]) for v in (3, 1, 4, 1, 5, 9, 2)]
    one = _Level()
    for v in values:
        one(v)  # forward, one call after another on one device
    copies = [_Level() for _ in range(3)]
    for i, v in enumerate(values):
        copies[i % 3](v)
    root = _Level()
    merge_states(root, copies[:1])
    root._update_count = copies[0]._update_count
    merge_states(root, copies[1:])  # into a root updated before: its count weighs its value
    assert root.level.item() == pytest.approx(one.level.item(), rel=1e-6)  # float32: forward makes it so (.float())
    assert root.count.item() == one.count.item() == len(values)


class _OwnReduction(MeanMetric):
    """``full_state_update=True`` and a state reduced by a function of its own: nothing tells how to merge it."""

    full_state_update = True

    def __init__(self):
        super().__init__()
        self._reductions["weight"] = lambda x: x.sum(0)


def test_merge_states_merges_a_metric_merge_state_refuses_by_its_states_reductions():
    # full_state_update=True (or unset): merge_state refuses; torchmetrics' sync across processes reduces the states
    # by their dist_reduce_fx all the same, and so does merge_states: the result of the same metric without the flag
    g = torch.Generator().manual_seed(4)
    data = [torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4)]
    for full, plain in ((_FullState, MeanMetric), (MaxMetric, MaxMetric), (MinMetric, MinMetric)):
        root, copies = full(), [full() for _ in data[1:]]
        root.update(data[0])
        for m, x in zip(copies, data[1:]):
            m.update(x)
        merge_states(root, copies)
        whole = plain()
        whole.update(torch.cat(data))
        torch.testing.assert_close(root.compute(), whole.compute(), rtol=1e-15, atol=0)


def test_merge_states_refuses_what_nothing_says_how_to_merge():
    root, copy = _OwnReduction(), _OwnReduction()
    copy.update(torch.ones(2))
    with pytest.raises(RuntimeError, match="full_state_update"):
        merge_states(root, [copy])


def test_reset_metric_of_inference_tensors_outside_inference_mode_makes_normal_ones():
    # a metric whose states were made in a validation step (Lightning's inference mode), reset in a training step
    with torch.inference_mode():
        ours = _updated(MeanMetric)
    theirs = _updated(MeanMetric)
    assert ours.mean_value.is_inference()
    reset_metric(ours)  # in place would raise: "Inplace update to inference tensor outside InferenceMode"
    theirs.reset()
    _same(_state(ours), _state(theirs))
    assert not any(ours.__dict__[n].is_inference() for n in ours._defaults)
    ours.update(torch.tensor([0.5, 2.0]))  # and the metric works on outside inference mode
    theirs.update(torch.tensor([0.5, 2.0]))
    assert torch.equal(ours.compute(), theirs.compute())


def test_a_metric_whose_dtype_is_set_after_the_first_step_gets_copies_of_that_dtype():
    """``MeanMetric.set_dtype(torch.float64)`` on the module after the replicas' copies were made (a hook, a callback,
    ``setup`` before a second fit) left the copies, kept for the run, in float32: each update rounded to float32 where
    one device's metric accumulated in float64 (the logged mean 1e-9 to 1e-8 relative off, silently). The copies follow
    the root's dtype now."""
    from tests.support.exact import trainer64
    from tests.support.helpers import SparseNet, collate_dict, loader, random_samples

    class Tracks(SparseNet):
        def __init__(self):
            super().__init__()
            self.loss_m, self.means = MeanMetric(), []

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:  # on the module, after the replicas' copies were made
                self.loss_m.set_dtype(torch.float64)

        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.loss_m(loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.means.append(self.loss_m.mean_value.clone())

    batches = [collate_dict(random_samples(7, seed=s)) for s in (0, 1, 2)]
    torch.manual_seed(0)
    ours, reference = Tracks(), Tracks()
    reference.load_state_dict(ours.state_dict())
    trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    assert reference.means[-1].dtype == ours.means[-1].dtype == torch.float64
    assert [float(m) for m in ours.means] == pytest.approx([float(m) for m in reference.means], rel=1e-12, abs=0)
