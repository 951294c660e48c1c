"""The exactness pairs of the tests: one module trained from the same start by sparse_dp (or sparse_ddp) on CPU
replicas and by plain Lightning (strategy="auto") on one device with the whole batch, in float64, compared tensor by
tensor at ``REL`` relative (:func:`relative_difference`).

Exactness tests: tests/strategies/test_exactness_metrics.py, test_exactness_buffers.py and
test_exactness_points_and_order.py; batch norm: tests/syncbn/test_batchnorm_exactness.py; the rest of the Trainer:
tests/strategies/test_trainer_features.py.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import torch

from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer

#: Exactness is judged in float64: float32 rounding, amplified by cancellation in batch-norm gradient sums,
#: reaches 1e-4 relative and can hide a real difference. ``trainer64`` is :func:`trainer` running "64-true" unless
#: told otherwise; ``REL`` the relative difference per tensor a float64 comparison allows.
trainer64 = partial(trainer, precision="64-true")
REL = 1e-10


def fit_float64(model, batch, strategy="auto", devices=1, **kwargs) -> L.Trainer:
    """Fit ``model`` on the one ``batch`` in float64 (``precision="64-true"``) with :func:`trainer`; the trainer."""
    t = trainer(strategy=strategy, devices=devices, precision="64-true", **kwargs)
    t.fit(model, loader(batch))
    return t


def same_start(cls=SparseNet, *args, seed: int | None = None, **kwargs):
    """Two modules ``cls(*args, **kwargs)`` with the same parameters and buffers (ME modules cannot be deep-copied).

    ``seed``: ``torch.manual_seed(seed)`` first, for modules whose construction draws more than parameters.
    The first keeps a copy of its starting parameters, for :func:`assert_same_states` to check that it trained.
    """
    if seed is not None:
        torch.manual_seed(seed)
    a, b = cls(*args, **kwargs), cls(*args, **kwargs)
    b.load_state_dict(a.state_dict())
    a._starting_parameters = {name: p.detach().clone() for name, p in a.named_parameters()}
    return a, b


def relative_difference(a, b) -> float:
    """The exactness measure: max |a - b| / max |b| per tensor (the absolute difference where b is all 0; 0 when empty)."""
    a, b = torch.as_tensor(a).detach().double().cpu(), torch.as_tensor(b).detach().double().cpu()
    if b.numel() == 0:
        return 0.0
    scale, diff = b.abs().max().item(), (a - b).abs().max().item()
    return diff / scale if scale else diff


def state_differences(ours, reference) -> dict[str, float]:
    """:func:`relative_difference` of every state-dict tensor (parameters and buffers) of two modules."""
    ref = reference.state_dict()
    return {name: relative_difference(value, ref[name]) for name, value in ours.state_dict().items()}


def assert_same_states(ours, reference, rel: float = 1e-10, trained: bool = True) -> None:
    """Every state-dict tensor of ``ours`` within ``rel`` of ``reference`` (:func:`relative_difference`).

    ``trained``: also that a parameter of ``ours`` moved from where :func:`same_start` started it (two
    equal untrained states would otherwise pass).
    """
    worse = {name: d for name, d in state_differences(ours, reference).items() if not d <= rel}
    assert not worse, f"state tensors further than {rel:g} from the reference: {worse}"
    if trained:
        start = getattr(ours, "_starting_parameters", None)
        assert start is not None, "trained=True needs `ours` from same_start (it keeps the starting parameters)"
        moved = [n for n, p in ours.named_parameters() if not torch.equal(p.detach().cpu(), start[n].to(p.dtype).cpu())]
        assert moved, "no parameter of `ours` moved from its start: the comparison says nothing about training"


def fit_pair(ours, reference, batches, max_steps: int, strategy="sparse_dp", devices: int = 3):
    """``ours`` fit under ``strategy`` on ``devices`` CPU replicas and ``reference`` on one device, in float64, on the
    same ``batches``; the two trainers."""
    t = trainer64(strategy=strategy, devices=devices, max_steps=max_steps)
    t.fit(ours, loader(*batches))
    r = trainer64(max_steps=max_steps)
    r.fit(reference, loader(*batches))
    return t, r


def epoch_pair(cls, seeds):
    """One epoch of two float64 batches (7 samples each, one per seed), validated on them too: ``cls`` under sparse_dp
    on 3 CPU replicas and on one device, from the same start."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in seeds]
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    models = same_start(cls)
    for model, kwargs in zip(models, ({"strategy": "sparse_dp", "devices": 3}, {})):
        model.double()
        t = L.Trainer(accelerator="cpu", precision="64-true", max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
        data = torch.utils.data.DataLoader(batches, batch_size=None)
        t.fit(model, data, data)
    return models
