"""Synchronized batch norm in sparse_dp steps: equal to one device with the whole batch, ME's own sync layers,
eval on running statistics, no replica waiting forever, and the swap that keeps the state dict.

The reference is one device with the whole batch under plain Lightning (strategy="auto"), in float64 unless a test
says otherwise: the pairs of tests/support/exact.py.
"""

from __future__ import annotations

import MinkowskiEngine as ME
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_sparse_dp import SparseDataParallelStrategy
from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm
from tests.support.exact import REL, assert_same_states, same_start, state_differences
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, run_isolated

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


# --- synchronized batch norm ------------------------------------------------------------------------

class WithMESync(SparseNet):
    """SparseNet with ME's own MinkowskiSyncBatchNorm (which in one process runs plain batch norm)."""

    def __init__(self):
        super().__init__(batch_norm=True)
        self.net[3] = ME.MinkowskiSyncBatchNorm(16)


def test_sync_batchnorm_step_equals_one_device_uneven_batch():
    batch = collate_dict(random_samples(7, seed=21))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)  # parameters and running mean / var / num_batches_tracked
    bn = ours.net[3].bn
    assert type(bn) is nn.BatchNorm1d  # reverted at teardown
    assert int(bn.num_batches_tracked) == 1


def test_without_sync_batchnorm_the_step_differs():  # the comparison above can fail
    batch = collate_dict(random_samples(7, seed=21))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert max(state_differences(ours, reference).values()) > 1e-4


def test_strategy_option_and_me_sync_batchnorm_layers():
    batch = collate_dict(random_samples(7, seed=22))
    ours, reference = same_start(WithMESync)
    trainer(strategy=SparseDataParallelStrategy(sync_batchnorm=True), devices=3).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)
    assert type(ours.net[3].bn) is nn.SyncBatchNorm


def test_me_sync_batchnorm_without_the_flag_warns():
    with pytest.warns(UserWarning, match="sync_batchnorm is off"):
        trainer(strategy="sparse_dp", devices=3).fit(WithMESync(), loader(collate_dict(random_samples(5))))


def test_sync_batchnorm_with_fewer_samples_than_devices():
    batch = collate_dict(random_samples(2, seed=23))
    ours, reference = same_start(batch_norm=True)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True).fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)


def test_eval_uses_running_statistics_without_sync():
    batches = [collate_dict(random_samples(7, seed=24)), collate_dict(random_samples(4, seed=25))]
    ours, reference = same_start(batch_norm=True)
    with torch.no_grad():  # non-trivial running statistics
        ours.net[3].bn.running_mean.uniform_(-1, 1)
        ours.net[3].bn.running_var.uniform_(0.5, 2)
    reference.load_state_dict(ours.state_dict())
    t = trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, limit_val_batches=1.0)
    t.validate(ours, loader(*batches), verbose=False)
    r = trainer(devices=1, limit_val_batches=1.0)
    r.validate(reference, loader(*batches), verbose=False)
    assert t.callback_metrics["val_loss"].item() == pytest.approx(r.callback_metrics["val_loss"].item(), rel=REL)
    assert_same_states(ours, reference, rel=0.0, trained=False)  # validation only: running statistics untouched


class _NoRunningStatistics(SparseNet):
    """A batch norm without running statistics, which normalizes with the batch's statistics in eval mode too."""

    def __init__(self):
        super().__init__()
        self.net[3] = ME.MinkowskiBatchNorm(16, track_running_stats=False)

    def predict_step(self, batch, batch_idx):
        return self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))


def test_batch_norm_without_running_statistics_is_synchronized_in_validate_and_predict(caplog):
    """``track_running_stats=False`` keeps the batch's statistics in eval mode: validate and predict normalized each
    chunk on its own (val_loss 1.5e-2, predictions 0.25 off), silently, with or without sync_batchnorm=True, whose
    swap ran when fitting only. The swap now runs for such layers in every stage; without it, it is said."""
    batches = [collate_dict(random_samples(7, seed=26)), collate_dict(random_samples(7, seed=27))]
    ours, reference = same_start(_NoRunningStatistics)
    t = trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, limit_val_batches=1.0)
    t.validate(ours, loader(*batches), verbose=False)
    r = trainer(devices=1, limit_val_batches=1.0)
    r.validate(reference, loader(*batches), verbose=False)
    assert t.callback_metrics["val_loss"].item() == pytest.approx(r.callback_metrics["val_loss"].item(), rel=REL)
    predicted = trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True).predict(ours, loader(*batches))
    expected = trainer(devices=1).predict(reference, loader(*batches))
    assert all(torch.allclose(a, b, rtol=REL, atol=0) for a, b in zip(predicted, expected))
    assert isinstance(ours.net[3].bn, nn.BatchNorm1d) and not isinstance(ours.net[3].bn, SyncBatchNorm)  # reverted
    with caplog.at_level("INFO"):
        trainer(strategy="sparse_dp", devices=3).validate(ours, loader(*batches), verbose=False)
    assert "1 batch-norm layer without running statistics (track_running_stats=False)" in caplog.text


class _TwoNorms(SparseNet):
    """Two batch norms; the replica whose chunk has ``odd`` samples misbehaves between them."""

    def __init__(self, odd: int, mode: str):
        super().__init__()
        self.norm1 = ME.MinkowskiBatchNorm(8)
        self.norm2 = ME.MinkowskiBatchNorm(8)
        self.odd, self.mode = odd, mode

    def loss(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        h = self.norm1(self.net[0](x))
        is_odd = batch["labels"].shape[0] == self.odd
        if is_odd and self.mode == "raise":
            raise RuntimeError("replica fails between batch norms")
        if not (is_odd and self.mode == "skip"):
            h = self.norm2(h)
        out = self.net[4:](self.net[2](self.net[1](h)))
        out = out.F[out.C[:, 0].argsort()]
        return nn.functional.cross_entropy(out, batch["labels"])


@pytest.mark.parametrize(
    "mode, error, message",
    [
        ("raise", RuntimeError, "replica fails between batch norms"),
        ("skip", RuntimeError, "different numbers of batch-norm calls"),
    ],
)
def test_replicas_never_wait_forever_in_batch_norm(mode, error, message, tmp_path):
    # in a child process killed after 120 s: replicas that wait for each other forever fail here
    run_isolated(
        f"""
        import pytest
        from lightning_sparse_dp import SparseDataParallelStrategy
        from tests.support.helpers import collate_dict, loader, random_samples
        from tests.syncbn.test_batchnorm_exactness import _TwoNorms, trainer
        model = _TwoNorms(odd=3, mode={mode!r})  # chunks of 3, 2, 2 samples: replica 0 misbehaves
        with pytest.raises({error.__name__}, match={message!r}):
            trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, sync_batchnorm=True).fit(
                model, loader(collate_dict(random_samples(7)))
            )
        """,
        tmp_path,
        timeout=120,
    )


def test_sync_batchnorm_swap_keeps_parameters_and_state_dict():
    model = SparseNet(batch_norm=True)
    from lightning_sparse_dp.syncbn.batchnorm import convert_sync_batchnorm, revert_sync_batchnorm

    before = {k: v for k, v in model.state_dict().items()}
    weight = model.net[3].bn.weight
    swaps = convert_sync_batchnorm(model)
    assert isinstance(model.net[3].bn, SyncBatchNorm) and model.net[3].bn.weight is weight
    assert list(model.state_dict()) == list(before)
    revert_sync_batchnorm(swaps)
    assert type(model.net[3].bn) is nn.BatchNorm1d and model.net[3].bn.weight is weight


class _RowsSeen(Callback):
    """Registers, in its ``setup`` (which Lightning calls before the strategy swaps batch norm), a forward hook on the
    module's batch-norm layer that counts the rows it normalizes."""

    def setup(self, trainer, pl_module, stage):
        self.rows = []
        pl_module.net[3].bn.register_forward_hook(lambda layer, args, out: self.rows.append(out.shape[0]))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_what_a_callback_set_on_a_batch_norm_layer_before_the_swap_reaches_the_layer_that_trains():
    """A forward hook and ModelPruning's masks, set on the batch-norm layer by callbacks in their ``setup`` (before the
    strategy's swap), apply to the synchronized layer that trains, as on one device: the hook sees every row of each
    step (it was never called), the pruned module trains as one device's (float32: 2e-2 relative off before, silently)."""
    from lightning.pytorch.callbacks import ModelPruning

    batches = [collate_dict(random_samples(7, seed=s)) for s in (91, 92, 93)]
    ours, reference = same_start(SparseNet, batch_norm=True)
    seen = []
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3, "sync_batchnorm": True}), (reference, {})):
        rows = _RowsSeen()
        prune = ModelPruning("l1_unstructured", amount=0.3, apply_pruning=lambda epoch: epoch >= 1, verbose=0)
        t = trainer(max_epochs=3, max_steps=-1, precision="32-true", callbacks=[rows, prune], **kwargs)
        t.fit(model, loader(*batches))
        seen.append(rows.rows)
    ours_rows, reference_rows = seen
    assert sum(ours_rows) == sum(reference_rows) > 0  # every row of every step, in each replica's chunk
    assert len(ours_rows) == 3 * len(reference_rows)
    assert set(ours.state_dict()) == set(reference.state_dict())
    assert (reference.net[3].bn.bias == 0).any() and torch.equal(ours.net[3].bn.bias == 0, reference.net[3].bn.bias == 0)
    worst = max(state_differences(ours, reference).values())
    assert worst < 1e-5, state_differences(ours, reference)  # float32 rounding only (pruning float64 fails on one device)


class _NoDecayOnNorms(SparseNet):
    """The usual recipe: batch norm found by ``isinstance(m, nn.BatchNorm1d)`` and left out of weight decay; its momentum
    changed in a hook (PointNet++'s decay)."""

    def __init__(self):
        super().__init__(batch_norm=True)

    def on_train_epoch_start(self):
        for m in self.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.momentum = 0.125

    def configure_optimizers(self):
        norms = {id(p) for m in self.modules() if isinstance(m, nn.BatchNorm1d) for p in m.parameters()}
        assert norms, "no batch norm found"
        decay = [p for p in self.parameters() if id(p) not in norms]
        return torch.optim.SGD([{"params": decay, "weight_decay": 0.1},
                                {"params": [p for p in self.parameters() if id(p) in norms], "weight_decay": 0.0}], lr=0.1)


def test_swapped_batch_norm_is_still_the_users_class_for_isinstance():
    """The swap made the layers a SyncBatchNorm that was no BatchNorm1d: code finding batch norm by its torch class
    found none (weight decay on batch norm: 3e-2 off after 3 steps; a frozen batch norm trained), and the exactness
    check said 'equals', comparing two swapped copies. The swapped layer is a BatchNorm1d too, and what the fit set on
    it (its momentum) is the user's layer's after the revert."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (34, 35, 36)]
    ours, reference = same_start(_NoDecayOnNorms)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=3).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=3).fit(reference, loader(*batches))
    assert_same_states(ours, reference)
    assert type(ours.net[3].bn) is nn.BatchNorm1d and ours.net[3].bn.momentum == 0.125


class _MomentumOnTheOriginals(SparseNet):
    """Batch norm layers kept in a list before the fit (the user's originals), their momentum set through it."""

    def __init__(self):
        super().__init__(batch_norm=True)
        self.norms = [m for m in self.modules() if isinstance(m, nn.BatchNorm1d)]

    def on_train_epoch_start(self):
        for m in self.norms:
            m.momentum = 0.3


def test_a_setting_made_on_the_users_own_layer_during_the_fit_stays_after_the_revert():
    """The revert gave every layer the swapped layer's momentum, overwriting what the user set on the original layer
    (held in a list made before the fit). Only what the fit changed through the swapped layer is given back now."""
    model = _MomentumOnTheOriginals()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=1).fit(
        model, loader(collate_dict(random_samples(7, seed=37))))
    assert model.net[3].bn is model.norms[0] and model.norms[0].momentum == 0.3


class _ScheduleThroughAList(SparseNet):
    """Batch norm kept in a plain list made in ``__init__`` (not a ModuleList) and changed through it during the fit:
    a per-batch momentum schedule, or the layers frozen (``.eval()``) at each epoch's start."""

    def __init__(self, how: str):
        super().__init__(batch_norm=True)
        self.norms, self.how = [m for m in self.modules() if isinstance(m, nn.BatchNorm1d)], how

    def on_train_epoch_start(self):
        if self.how == "eval":
            for m in self.norms:
                m.eval()

    def on_train_batch_start(self, batch, batch_idx):
        if self.how == "momentum":
            for m in self.norms:
                m.momentum = 0.6 / (batch_idx + 1)


@pytest.mark.parametrize("how", ["momentum", "eval"])
def test_batch_norm_changed_through_a_list_made_in_init_is_the_layer_that_trains(how):
    """The swap built new layers: a list of the user's layers made in ``__init__`` kept the old ones, and what the fit
    did through it (a momentum schedule: running statistics 2 to 4 off; ``.eval()``) reached no layer that trains,
    silently. The swap now changes each layer's class in place, so the list holds the layer that trains."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (40, 41, 42)]
    ours, reference = same_start(_ScheduleThroughAList, how)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=3).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=3).fit(reference, loader(*batches))
    assert ours.norms[0] is ours.net[3].bn and type(ours.norms[0]) is nn.BatchNorm1d
    assert_same_states(ours, reference)


def test_the_process_group_swap_is_in_place_too():
    """``sparse_ddp``'s plugin swaps the same way: the layer a list holds is the synchronized one, its collective taken
    off at the revert."""
    from lightning_sparse_dp.syncbn.process_group import ProcessGroupCollective, ProcessGroupSyncBatchNorm

    model, plugin = _ScheduleThroughAList("momentum"), ProcessGroupSyncBatchNorm()
    plugin.apply(model)
    assert model.norms[0] is model.net[3].bn and isinstance(model.norms[0], SyncBatchNorm)
    assert isinstance(model.norms[0].collective, ProcessGroupCollective)
    plugin.revert(model)
    assert type(model.norms[0]) is nn.BatchNorm1d and "collective" not in model.norms[0].__dict__


class _ScaledNorm(nn.BatchNorm1d):
    """A batch norm of the user's own class, with its own forward around torch's."""

    def forward(self, x):
        return super().forward(x * 2) + 1


class _OwnNormClass(SparseNet):
    def __init__(self):
        super().__init__(batch_norm=True)
        own = _ScaledNorm(16)
        own.load_state_dict(self.net[3].bn.state_dict())
        self.net[3].bn = own


def test_a_batch_norm_class_of_the_users_own_keeps_its_forward():
    """The swap gave a subclass of BatchNorm1d with a forward of its own the synchronized class, whose forward replaced
    the user's (parameters 0.83 off one device's; the check compared two swapped copies and said 'equals'). The layer
    now gets a class of both, the user's first: its forward runs, around the synchronized batch norm."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (43, 44, 45)]
    ours, reference = same_start(_OwnNormClass)
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=3).fit(ours, loader(*batches))
    trainer(devices=1, max_steps=3).fit(reference, loader(*batches))
    assert type(ours.net[3].bn) is _ScaledNorm
    assert_same_states(ours, reference)


def test_a_module_with_a_batch_norm_class_of_the_users_own_pickles_during_the_fit(tmp_path):
    """torch.save of the module during the fit failed ('not the same object as ...ScaledNorm'): the swapped layer's
    class was made for the swap under the user's class's name. It pickles as the user's class now."""
    saved = tmp_path / "module.pt"

    class Saves(Callback):
        def on_train_end(self, trainer, pl_module):
            torch.save(pl_module.net, saved)

    model = _OwnNormClass()
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, max_steps=1, callbacks=[Saves()]).fit(
        model, loader(collate_dict(random_samples(7, seed=46))))
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded[3].bn) is _ScaledNorm


class _BatchNormFromEpochOne(SparseNet):
    """A batch-norm block switched in at the second epoch (after setup, after the checked first step)."""

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            torch.manual_seed(5)
            layers = list(self.net)
            layers.insert(3, ME.MinkowskiBatchNorm(16).to(self.device, self.dtype))
            self.net = torch.nn.Sequential(*layers)


@pytest.mark.parametrize("sync", [True, False])
def test_a_batch_norm_layer_added_during_the_fit_is_synchronized_or_said(sync, caplog):
    """Setup swaps (or, without sync_batchnorm, names) the batch-norm layers it finds; one added in a hook of the fit ran
    per chunk, unsynchronized with sync_batchnorm=True and said by nothing (its running mean 0.29 off after two
    epochs). The replicas' rebuild swaps it now, or says it runs per chunk."""
    import logging

    batches = [collate_dict(random_samples(7, seed=400 + i)) for i in range(2)]
    ours, reference = same_start(_BatchNormFromEpochOne, seed=0)
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, sync_batchnorm=sync, max_steps=-1, max_epochs=2).fit(
            ours, loader(*batches))
    trainer(max_steps=-1, max_epochs=2).fit(reference, loader(*batches))
    said = [r.getMessage() for r in caplog.records if "1 batch-norm layer (e.g. ME.MinkowskiBatchNorm)" in r.getMessage()]
    if sync:
        assert said == [] and max(state_differences(ours, reference).values()) <= REL
    else:
        assert len(said) == 1 and "sync_batchnorm=True" in said[0]
