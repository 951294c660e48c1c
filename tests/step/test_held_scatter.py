"""The scatter stage's held layouts (split/held.py) in a fit: derived once while the batches keep their structure,
derived again where it changes mid-fit, and every step as the full derivation gives it."""

from __future__ import annotations

import torch

import lightning_sparse_dp.split as split
from lightning_sparse_dp.split.held import HeldLayouts
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer, unchecked


def _batches(structures):
    batches = []
    for i, form in enumerate(structures):
        batch = collate_dict(random_samples(6, seed=i))
        if form == "names":
            batch["names"] = [f"scene{j}" for j in range(6)]
        elif form == "point_weights":
            batch["weights"] = torch.ones(batch["coordinates"].shape[0])
        batches.append(batch)
    return batches


def _fit(batches, monkeypatch=None, held=True):
    if not held:  # every batch derived in full, as split_batch does
        monkeypatch.setattr(HeldLayouts, "read", lambda self, *args: None)
    torch.manual_seed(0)
    model = SparseNet()
    strategy = unchecked()
    trainer(strategy=strategy, devices=3, max_steps=len(batches)).fit(model, loader(*batches))
    return model, strategy


def test_a_steady_fit_derives_the_layout_once(monkeypatch):
    calls = []
    original = split.resolve_roles
    monkeypatch.setattr(split, "resolve_roles", lambda *a, **k: calls.append(1) or original(*a, **k))
    _, strategy = _fit(_batches(["plain"] * 4))
    assert strategy._held_layouts.derived == 1
    assert len(calls) == 1


def test_a_structure_changing_mid_fit_steps_as_the_full_derivation(monkeypatch):
    structures = ["plain", "plain", "names", "names", "point_weights", "plain"]
    held, strategy = _fit(_batches(structures))
    assert strategy._held_layouts.derived == 3  # plain, names, point_weights; plain again held
    with monkeypatch.context() as m:
        full, _ = _fit(_batches(structures), m, held=False)
    for (name, a), b in zip(held.named_parameters(), full.parameters()):
        assert torch.equal(a, b), name
