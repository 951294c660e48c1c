"""Manual optimization on sparse_dp replicas (automatic_optimization = False): the step's manual_backward and
optimizer calls met once per step, against one device with the whole batch, float64, with sync batch norm."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from tests.support.clients import fresh_loader
from tests.support.exact import relative_difference, state_differences
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples
from tests.support.helpers import trainer as _trainer
from tests.support.step_forms import ManualOptimization
from tests.support.term_models import ScanNetSeg, seg_batch


class ManualSeg(ManualOptimization, ScanNetSeg):
    """ScanNetSeg (an ignore label) under manual optimization: zero_grad, manual_backward, clipping, step, a scheduler."""

    def before_step(self, opt):
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")

    def after_step(self, loss):
        self.lr_schedulers().step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class TwoOptimizers(ManualSeg):
    """GAN-style: two optimizers over two parts of the network, two losses, two manual_backward calls per step."""

    def training_step(self, batch, batch_idx):
        opt_net, opt_head = self.optimizers()
        logits = self.logits(batch)
        loss_a = self.criterion(logits, batch["labels"])
        opt_net.zero_grad()
        self.manual_backward(loss_a)
        opt_net.step()
        loss_b = torch.nn.functional.cross_entropy(self.logits(batch), batch["labels"], ignore_index=255, label_smoothing=0.1)
        opt_head.zero_grad()
        self.manual_backward(loss_b)
        opt_head.step()
        self.log("loss_b", loss_b)

    def configure_optimizers(self):
        net = list(self.net.parameters()) + list(self.up.parameters())
        return torch.optim.SGD(net, lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.2)


class ClipsItself(ManualSeg):
    """Reads and clips the gradients itself after manual_backward (torch's clip_grad_norm_ over self.parameters()) and
    logs their norm: each replica's parameters hold the reduced gradients (they had none: nothing was clipped)."""

    logged = "grad_norm"

    def before_step(self, opt):
        self.log("grad_norm", torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.05))


class Toggled(TwoOptimizers):
    """Lightning's GAN pattern: each optimizer's part trained between toggle_optimizer and untoggle_optimizer, its
    gradients cleared after its step, so the other part's gradients of a loss must never be made (they were, on the
    replicas, whose parameters kept requires_grad, and reached the other optimizer's step)."""

    def training_step(self, batch, batch_idx):
        opt_net, opt_head = self.optimizers()
        self.toggle_optimizer(opt_head)
        loss_b = torch.nn.functional.cross_entropy(self.logits(batch), batch["labels"], ignore_index=255)
        self.manual_backward(loss_b)
        opt_head.step()
        opt_head.zero_grad()
        self.untoggle_optimizer(opt_head)
        self.toggle_optimizer(opt_net)
        self.manual_backward(self.criterion(self.logits(batch), batch["labels"]))
        opt_net.step()
        opt_net.zero_grad()
        self.untoggle_optimizer(opt_net)
        self.log("loss_b", loss_b)


class WithClosure(ManualSeg):
    """Lightning's closure form: ``opt.step(closure=...)``, the closure zeroing the gradients and calling
    ``manual_backward`` (it hung: the replica that ran the optimizer's step waited in the closure for the others)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            opt.zero_grad()
            loss = self.loss(batch)
            self.manual_backward(loss)
            return loss

        loss = opt.step(closure=closure)
        return self.after_step(loss)


@pytest.mark.parametrize("model", [ManualSeg, TwoOptimizers, ClipsItself, Toggled, WithClosure])
def test_manual_optimization_on_replicas_is_the_one_device_step(model):
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.6)) for s in (111, 112)]
    torch.manual_seed(0)
    ours, reference = model(), model()
    reference.load_state_dict(ours.state_dict())
    t = trainer(
        strategy="sparse_dp",
        devices=3,
        max_steps=2 * (2 if issubclass(model, TwoOptimizers) else 1),  # an optimizer step each
        sync_batchnorm=True,
    )
    t.fit(ours, fresh_loader(batches))
    r = trainer(max_steps=t.max_steps)
    r.fit(reference, fresh_loader(batches))
    worst = max(state_differences(ours, reference).values())
    assert worst <= 1e-10, state_differences(ours, reference)
    name = getattr(model, "logged", "loss_b" if issubclass(model, TwoOptimizers) else "train_loss")
    assert relative_difference(t.logged_metrics[name], r.logged_metrics[name]) <= 1e-10
    assert t.global_step == r.global_step


def test_the_comparison_above_can_fail():
    """The same manual step with one weight per replica ("equal", as nn.DataParallel) is not exact here, and the
    parameters did move from their start."""
    from lightning_sparse_dp import SparseDataParallelStrategy

    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.6)) for s in (111, 112)]
    torch.manual_seed(0)
    ours, reference = ManualSeg(), ManualSeg()
    reference.load_state_dict(ours.state_dict())
    start = {k: v.clone() for k, v in ours.state_dict().items()}
    trainer(
        strategy=SparseDataParallelStrategy(loss_weighting="equal"), devices=3, max_steps=2, sync_batchnorm=True
    ).fit(ours, fresh_loader(batches))
    trainer(max_steps=2).fit(reference, fresh_loader(batches))
    assert max(state_differences(ours, reference).values()) > 1e-4
    assert any(not torch.equal(v, start[k]) for k, v in ours.state_dict().items() if v.is_floating_point())


class ManualSparseNet(ManualOptimization, SparseNet):
    """SparseNet (batch norm) under manual optimization: zero_grad, manual_backward, step."""

    def __init__(self):
        super().__init__(batch_norm=True)


def test_manual_backward_under_a_loss_scaler_is_scaled_like_lightnings():
    """16-mixed with a GradScaler: Lightning's manual_backward scales the loss and the optimizer step unscales the
    gradients; the replicas' manual_backward must scale too (without it the step is 2**10 times too small here).
    One step from equal parameters: the replicas' sums differ from the whole batch's by float32 rounding only (the
    automatic case, tests/step/test_backward.py, compares the same way)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    ours, reference = ManualSparseNet(), ManualSparseNet()
    reference.load_state_dict(ours.state_dict())
    start = {k: v.clone() for k, v in ours.state_dict().items()}
    batch = collate_dict(random_samples(7, seed=70))
    for model, strategy, devices in [(ours, "sparse_dp", 3), (reference, "auto", 1)]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        _trainer(strategy=strategy, devices=devices, max_steps=1, sync_batchnorm=devices > 1,
                 plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(model, loader(batch))
    ref, moved = reference.state_dict(), 0
    for name, value in ours.state_dict().items():
        if value.is_floating_point() and not torch.equal(ref[name], start[name]):
            step = (ref[name] - start[name]).abs().max()
            assert (value - ref[name]).abs().max() <= 1e-3 * step, name
            moved += 1
    assert moved >= 4  # the step moved the parameters, so the comparison says something


class WithLBFGS(WithClosure):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_an_optimizer_that_evaluates_the_closure_again_is_refused_naming_the_way():
    with pytest.raises(RuntimeError, match=r"LBFGS evaluates the closure several times.*strategy='sparse_ddp'"):
        trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(WithLBFGS(), fresh_loader([seg_batch(7, seed=113)]))


class ThroughTheTrainer(ManualSeg):
    """The optimizer reached through the trainer, not ``self.optimizers()``: every replica would step it."""

    def training_step(self, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()


def test_an_optimizer_stepped_outside_self_optimizers_is_refused_before_it_steps():
    """Each replica stepped the trainer's optimizer: three steps a batch on 3 replicas (0.94 relative off one device),
    silently. The first such step is refused now, naming self.optimizers()."""
    model = ThroughTheTrainer()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"step\(\) of a SGD it reached outside self.optimizers\(\)"):
        trainer(strategy="sparse_dp", devices=3, max_steps=1).fit(model, fresh_loader([seg_batch(7, seed=114)]))
    assert all(torch.equal(v, start[k]) for k, v in model.named_parameters())  # nothing stepped


class _ManualWithBackwardHooks(ManualOptimization, SparseNet):
    """Manual optimization with ``on_before_backward`` recording the loss and a ``backward`` of the module's own."""

    def __init__(self):
        super().__init__()
        self.before: list[float] = []

    def on_before_backward(self, loss):
        self.before.append(float(loss))

    def backward(self, loss, *args, **kwargs):
        (0.25 * loss).backward(*args, **kwargs)


def test_manual_backward_calls_on_before_backward_and_the_modules_backward(caplog):
    """manual_backward ran the replicas' backward passes itself: on_before_backward was never called, nor a backward
    the module overrides (0.18 off one device, silently). on_before_backward runs once with the whole batch's loss, and
    the module's backward runs on each replica's weighted loss, said once (exact where it is linear in the loss)."""
    import logging

    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "the module's own backward(loss)" in m})
    batches = [collate_dict(random_samples(7, seed=s)) for s in (65, 66, 67)]
    torch.manual_seed(0)
    ours = _ManualWithBackwardHooks()
    reference = _ManualWithBackwardHooks()
    reference.load_state_dict(ours.state_dict())
    with caplog.at_level(logging.INFO):
        trainer(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    assert sum("the module's own backward(loss) runs on each replica" in r.getMessage() for r in caplog.records) == 1
    trainer(max_steps=3).fit(reference, loader(*batches))
    assert len(ours.before) == len(reference.before) == 3
    assert ours.before == pytest.approx(reference.before, rel=1e-10)
    assert max(state_differences(ours, reference).values()) < 1e-10


class _KeepsHookValues(ManualOptimization, SparseNet):
    """Manual optimization whose ``on_before_backward`` / ``on_after_backward`` append to lists of the module, bump a
    counter tensor in place and update a plain object, as a one-device module keeps a history (dicts: below)."""

    def __init__(self):
        super().__init__()
        self.before: list[float] = []
        self.after: list[int] = []
        self.count = torch.zeros(())
        self.meter = types.SimpleNamespace(last=0.0)

    def on_before_backward(self, loss):
        self.before.append(float(loss))
        self.count.add_(1)
        self.meter.last = float(loss)

    def on_after_backward(self):
        self.after.append(len(self.before))


def _fit_three_steps(cls, names: tuple[str, ...]):
    """``cls`` fit three steps on 3 replicas and on one device from the same start: ``(ours, reference, lines)``, the
    lines the replicas' fit said holding one of ``names`` (said afresh: the process's said-once cache forgets them
    first)."""
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    def named(message: str) -> bool:
        return any(name in message for name in names)

    SAID_ONCE.difference_update({m for m in SAID_ONCE if named(m)})
    batches = [collate_dict(random_samples(7, seed=s)) for s in (91, 92, 93)]
    torch.manual_seed(0)
    ours, reference = cls(), cls()
    reference.load_state_dict(ours.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer(max_steps=3).fit(reference, loader(*batches))
    return ours, reference, [str(w.message) for w in caught if named(str(w.message))]


def test_the_modules_own_hooks_run_once_in_a_manual_step_change_it_as_one_devices_step_without_a_warning():
    """The hooks a manual step's manual_backward runs once on the module itself (on_before_backward with the whole
    batch's loss, on_after_backward) changed the module's lists, tensors and objects as one device's step does, yet
    each change got a false line ('changed in the step through the module itself', 'changed in place', 'was changed
    in the step'). They are one device's changes now, said by nothing; the values equal one device's."""
    ours, reference, said = _fit_three_steps(_KeepsHookValues, ("self.before", "self.count", "self.meter", "self.after"))
    assert said == [], said
    assert ours.before == pytest.approx(reference.before, rel=1e-10) and len(ours.before) == 3
    assert ours.after == reference.after == [1, 2, 3]
    assert float(ours.count) == float(reference.count) == 3.0
    assert ours.meter.last == pytest.approx(reference.meter.last, rel=1e-10)


class _HooksChangeDicts(ManualOptimization, SparseNet):
    """The hooks manual_backward runs once on the module change its dicts and nested containers without changing
    their sizes (a counter in a dict, one in a nested dict, an entry of a list in a list), replace a nested dict, add
    and remove keys, while the step sets another key of the same dict from the batch."""

    def __init__(self):
        super().__init__()
        self.counts = {"backward": 0, "gone": 1, "step": -1}
        self.nested = {"a": {"c": 0}, "b": {"e": 1}}
        self.rows = [[0], 5]

    def training_step(self, batch, batch_idx):
        self.counts["step"] = batch_idx
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        self.counts["backward"] += 1
        self.counts.pop("gone", None)
        self.counts["added"] = self.counts.get("added", 0) + 2
        self.nested["a"]["c"] += 1
        self.nested["b"] = {"e": self.nested["b"]["e"] + 1}
        self.rows[0][0] += 1
        self.rows[1] += 1


def test_what_the_modules_own_hooks_change_in_its_dicts_in_a_manual_step_is_kept_as_on_one_device():
    """A counter the hooks bumped in a dict (``self.counts["backward"] += 1``) or in a nested dict read 0 after three
    steps where one device's read 3, said by nothing: the replicas' copies, made before the hook ran, were merged over
    it. The merge now compares the copies with what they were made from, so the hooks' changes stand, beside the
    step's own change of the same dict, as one device's; nothing is said."""
    ours, reference, said = _fit_three_steps(_HooksChangeDicts, ("self.counts", "self.nested", "self.rows"))
    assert said == [], said
    assert reference.counts == {"backward": 3, "step": 2, "added": 6}
    assert (ours.counts, ours.nested, ours.rows) == (reference.counts, reference.nested, reference.rows)


class _HookAndStepSetOneKey(ManualOptimization, SparseNet):
    """The step and on_after_backward both set one key of a dict."""

    def __init__(self):
        super().__init__()
        self.last = {"where": "init"}

    def training_step(self, batch, batch_idx):
        self.last["where"] = "step"
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        self.last["where"] = "hook"


def test_a_dict_entry_both_the_hooks_and_the_replicas_set_is_said():
    from lightning_sparse_dp.runtime.process import SAID_ONCE

    SAID_ONCE.difference_update({m for m in SAID_ONCE if "self.last" in m})
    batches = [collate_dict(random_samples(7, seed=s)) for s in (91, 92)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(_HookAndStepSetOneKey(), loader(*batches))
    said = [str(w.message) for w in caught if "self.last['where']" in str(w.message)]
    assert len(said) == 1 and "changed both by the module's own hooks" in said[0], said


class _SegHookValues(ManualSeg):
    """ScanNetSeg's per-point loss (an ignore label) with on_before_backward recording the loss it gets."""

    def __init__(self):
        super().__init__()
        self.before: list[float] = []

    def on_before_backward(self, loss):
        self.before.append(float(loss))


class _TogglesTheHead(ManualSeg):
    """The head frozen on odd steps, by hand in the step (not toggle_optimizer)."""

    def training_step(self, batch, batch_idx):
        self.head.requires_grad_(batch_idx % 2 == 0)
        return super().training_step(batch, batch_idx)


class _LogsTheClippedNorm(ManualSeg):
    """The gradient norm logged after self.clip_gradients."""

    def before_step(self, opt):
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")  # below every step's norm
        self.log("clipped_norm", torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]).norm())


@pytest.mark.parametrize("cls", [_SegHookValues, _TogglesTheHead, _LogsTheClippedNorm])
def test_manual_steps_with_hook_values_and_frozen_layers_are_the_one_device_step(cls):
    """on_before_backward got the chunks' weighted mean where the loss is a per-point mean (3% off); a head frozen on
    every other step by hand trained unlike one device from the fifth step (0.16 off): the step's flags were given
    to the module and its replicas rebuilt, losing a parameter's gradients; a gradient norm logged after
    self.clip_gradients was 4x off (the root replica's gradients clipped, the others' copies not). The hook gets the
    whole batch's loss, flags a manual step sets stay the replicas' own, and every replica sees the clipped
    gradients."""
    batches = [seg_batch(7, seed=s, fractions=(0.0, 0.3, 0.6)) for s in (115, 116, 117, 118, 119, 120)]
    torch.manual_seed(0)
    ours, reference = cls(), cls()
    reference.load_state_dict(ours.state_dict())
    t = trainer(strategy="sparse_dp", devices=3, max_steps=6, sync_batchnorm=True)
    t.fit(ours, fresh_loader(batches))
    r = trainer(max_steps=6)
    r.fit(reference, fresh_loader(batches))
    assert max(state_differences(ours, reference).values()) < 1e-10
    if cls is _LogsTheClippedNorm:
        assert relative_difference(t.logged_metrics["clipped_norm"], r.logged_metrics["clipped_norm"]) <= 1e-10
    if cls is _SegHookValues:
        assert ours.before == pytest.approx(reference.before, rel=1e-10)


class _ScalesItsGradients(ManualOptimization, SparseNet):
    """A tensor hook on parameters of the module (``p.register_hook(lambda g: g * 10)``), under manual optimization."""

    def __init__(self):
        super().__init__()
        for p in self.net[-1].parameters():
            p.register_hook(lambda g: g * 10)


def test_a_parameters_own_hook_runs_on_the_batchs_gradient_in_a_manual_step():
    """manual_backward wrote the replicas' reduced gradients into the module's ``.grad`` directly, so a hook registered
    on a parameter never ran (0.34 off in a bias after 3 steps, silently; automatic optimization ran it). autograd
    accumulates them now, as one device's backward does: the hook runs once, on the batch's gradient."""
    ours, reference, _ = _fit_three_steps(_ScalesItsGradients, ())
    assert max(state_differences(ours, reference).values()) <= 1e-10


class _ClampsByRebinding(ManualOptimization, SparseNet):
    """Clamps the gradients between manual_backward and the optimizer's step by giving ``.grad`` a new tensor."""

    def before_step(self, opt):
        for p in self.parameters():
            if p.grad is not None:
                p.grad = p.grad.clamp(-0.01, 0.01)


def test_gradients_the_step_rebinds_before_the_optimizers_step_are_the_ones_it_steps_with():
    """``p.grad = p.grad.clamp(...)`` gave the replica's parameter a new tensor, which the module's optimizer never saw:
    it stepped with the unclamped gradients (6.8e-2 off in a bias, silently). The root replica's rebound gradients are
    the module's before the step now, as rank 0's optimizer steps with its own."""
    ours, reference, _ = _fit_three_steps(_ClampsByRebinding, ())
    assert max(state_differences(ours, reference).values()) <= 1e-10


class _ClipsOverTheGroups(ManualOptimization, SparseNet):
    """Clips the gradients of the optimizer's parameter groups itself and logs their norm."""

    def before_step(self, opt):
        params = [p for group in opt.param_groups for p in group["params"]]
        self.log("grad_norm", torch.nn.utils.clip_grad_norm_(params, max_norm=0.05))


def test_clipping_over_the_optimizers_param_groups_clips_each_replicas_own_gradients():
    """The groups' ``params`` were the module's parameters, so every replica clipped the module's gradients, one after
    another (the norm logged 0.085 where one device's is 0.131, the parameters 1.6e-2 off), silently. Each replica's
    copies of the groups hold its own parameters now, as a DDP rank's optimizer holds its own."""
    ours, reference, _ = _fit_three_steps(_ClipsOverTheGroups, ())
    assert max(state_differences(ours, reference).values()) <= 1e-10


class _DecaysByHand(ManualOptimization, SparseNet):
    """A weight decay by hand before the optimizer's step: ``p.mul_(0.95)`` over the module's parameters."""

    def before_step(self, opt):
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(0.95)


def test_parameters_a_manual_step_changes_in_place_are_said_on_cpu_replicas():
    """CPU replicas share the module's parameters (and their version counters), so a decay by hand in the step was made
    by every replica, 0.95**3 a step where one device's makes 0.95 (0.27 off after 3 steps), silently (manual steps
    have no exactness check). It is said now, naming the optimizer's weight_decay."""
    ours, reference, said = _fit_three_steps(_DecaysByHand, ("in place outside the optimizer's step",))
    assert len(said) == 1 and "weight_decay=" in said[0], said
    assert max(state_differences(ours, reference).values()) > 1e-3  # what the line is about
