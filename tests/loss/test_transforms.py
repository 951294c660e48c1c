"""``torch.func`` transforms in the step (issue 65 item 4), against plain Lightning on one device in float64: a loss
evaluated inside ``vmap`` / ``grad`` (per-sample gradients) is the transform's function, left alone by the capture
(it crashed there reading a batched value); the step's own loss stays exact, and so does a loss built from the
transform's result by a mean over the samples (a gradient penalty: a term of its own)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.support.exact import REL, relative_difference, same_start, state_differences, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import GradientPenalty, PerSampleGradients, PooledNet


def _fit_both(cls, devices):
    batches = [collate_dict(random_samples(8, seed=s)) for s in (3, 4)]
    ours, reference = same_start(cls, seed=0)
    t = trainer64(strategy="sparse_dp", devices=devices, max_steps=2)
    t.fit(ours, loader(*batches))
    r = trainer64(max_steps=2)
    r.fit(reference, loader(*batches))
    return max(state_differences(ours, reference).values()), t, r


@pytest.mark.parametrize("devices", [2, 3])
def test_per_sample_gradients_in_the_step_train_and_log_as_on_one_device(devices, caplog):
    with caplog.at_level(logging.INFO):
        worst, t, r = _fit_both(PerSampleGradients, devices)
    assert worst <= REL
    assert relative_difference(t.logged_metrics["grad_norm"], r.logged_metrics["grad_norm"]) <= REL
    assert "cannot weight" not in caplog.text


@pytest.mark.parametrize("devices", [2, 3])
def test_a_gradient_penalty_from_per_sample_gradients_is_exact(devices, caplog):
    """The penalty is the mean over the chunk's samples of their gradients' norms: a full mean, so a term of its own."""
    with caplog.at_level(logging.INFO):
        worst, t, r = _fit_both(GradientPenalty, devices)
    assert worst <= REL
    assert "cannot weight" not in caplog.text


class CompiledLoss(PooledNet):
    """An L1 loss, a ``torch.compile``-d helper made lazily on the module (in its ``__dict__``, not a submodule)."""

    def training_step(self, batch, batch_idx):
        if "_l1" not in self.__dict__:
            self.__dict__["_l1"] = torch.compile(lambda a, b: (a - b).abs().mean())
        logits = self.head(self.features(batch))
        target = F.one_hot(batch["labels"], logits.shape[1]).to(logits.dtype)
        loss = self.__dict__["_l1"](logits, target)
        assert loss.dim() == 0  # the compiled helper's value is one value inside a step too (issue 65 item 3)
        return loss


def test_a_compiled_loss_helper_trains_as_on_one_device_or_is_said(caplog):
    with caplog.at_level(logging.INFO):
        worst, _, _ = _fit_both(CompiledLoss, 2)
    said = {r.getMessage() for r in caplog.records if "cannot weight the step's loss term by term" in r.getMessage()}
    assert worst <= REL and len(said) <= 1  # its mean runs inside compiled code: said once, weighted by samples: exact


class CompiledSubmodule(PooledNet):
    def __init__(self):
        super().__init__()
        self.chead = torch.compile(self.head)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.chead(self.features(batch)), batch["labels"])


def test_a_compiled_submodule_is_refused_at_setup_and_the_module_left_as_it_was():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    module = CompiledSubmodule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(MisconfigurationException, match="chead is a torch.compile-d submodule"):
        trainer64(strategy="sparse_dp", devices=2, max_steps=1).fit(module, loader(collate_dict(random_samples(8))))
    assert set(module.head._parameters) == {"weight", "bias"}  # torch's replica copy used to empty it
    assert all(relative_difference(module.state_dict()[k], v) == 0 for k, v in before.items())


class ScriptedHead(PooledNet):
    def __init__(self):
        super().__init__()
        self.head = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))


def test_a_scripted_submodule_is_refused_at_setup_naming_it_and_the_fixes():
    """A TorchScript submodule crashed the first step (its _parameters is TorchScript's wrapper, not a dict) after the
    exactness check had failed on it: refused at setup, naming the outermost scripted submodule."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"sparse_dp: head is a TorchScript module .*sparse_ddp"):
        trainer64(strategy="sparse_dp", devices=2, max_steps=1).fit(ScriptedHead(), loader(collate_dict(random_samples(8))))
    trainer64(max_steps=1).fit(ScriptedHead(), loader(collate_dict(random_samples(8))))  # one device trains it


class CompiledBody(PooledNet):
    """A compiled function in the network's path (made lazily on the module), a class-weighted cross-entropy after it."""

    def training_step(self, batch, batch_idx):
        if "_body" not in self.__dict__:
            self.__dict__["_body"] = torch.compile(lambda h: torch.relu(h) * 2)
        logits = self.head(self.__dict__["_body"](self.features(batch)))
        weight = torch.linspace(0.5, 1.5, logits.shape[1], dtype=logits.dtype)
        return F.cross_entropy(logits, batch["labels"], weight=weight)


@pytest.mark.parametrize("devices", [2, 3])
def test_compiled_code_in_the_step_leaves_the_loss_exact_and_its_reading_stable(devices, caplog):
    """Call sites are keyed by their place in the source (not bytecode offsets, which compiled frames move): two fits
    read the loss alike, exactly."""
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            worst, _, _ = _fit_both(CompiledBody, devices)
        assert worst <= REL
        assert "cannot weight" not in caplog.text
