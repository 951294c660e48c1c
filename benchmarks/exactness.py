"""Print how far a sparse_dp step on 3 CPU replicas is from the one-device step with the whole batch.

    .venv/bin/python benchmarks/exactness.py            # float64 (precision="64-true"): the standard
    .venv/bin/python benchmarks/exactness.py --float32  # float32 smoke run (rounding reaches ~1e-4)

Exactness is judged in float64: float32 rounding, amplified by cancellation in batch-norm gradient
sums, reaches 1e-4 relative and can hide a real difference or fake one. For each case, over every floating-point tensor
of the state dict (parameters, running mean / var)
after the same steps, sparse_dp (devices=3) vs strategy="auto": the largest absolute difference, and
the largest relative one, taken per tensor as max |difference| / max |reference value|.
"""

from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

import lightning_sparse_dp  # noqa: E402,F401
from lightning_sparse_dp import SparseDataParallelStrategy  # noqa: E402
from tests.support.clients import CLIENTS, fresh_loader  # noqa: E402
from tests.support.helpers import SegNet, SparseNet, collate_dict, field_batch, loader, random_samples, trainer  # noqa: E402


def differences(ours, reference):
    ref = reference.state_dict()
    abs_diff, rel_diff = 0.0, 0.0
    for name, value in ours.state_dict().items():
        if not value.is_floating_point():
            continue
        d = (value.double() - ref[name].double()).abs()
        abs_diff = max(abs_diff, d.max().item())
        rel_diff = max(rel_diff, d.max().item() / max(ref[name].double().abs().max().item(), 1e-12))
    return abs_diff, rel_diff


def _case(name, make, batches, strategy, steps=1, make_loader=lambda batches: loader(*batches), **kwargs):
    ours, reference = make(), make()
    reference.load_state_dict(ours.state_dict())
    trainer(strategy=strategy, devices=3, max_steps=steps, **kwargs).fit(ours, make_loader(batches))
    trainer(devices=1, max_steps=steps, **{k: v for k, v in kwargs.items() if k != "sync_batchnorm"}).fit(
        reference, make_loader(batches)
    )
    a, r = differences(ours, reference)
    print(f"{name:<58} max abs {a:.2e}  max rel {r:.2e}")


def main():
    torch.manual_seed(0)
    precision = "32-true" if "--float32" in sys.argv else "64-true"
    uneven = [collate_dict(random_samples(7, seed=s)) for s in range(5)]
    fields = [field_batch(7, seed=s, dtype=torch.float64 if precision == "64-true" else torch.float32) for s in range(5)]
    print(f"sparse_dp devices=3 vs one device, batches of 7 samples, balanced split (the default), precision={precision}")
    case = partial(_case, precision=precision)
    case("no batch norm, 1 step", lambda: SparseNet(), uneven[:1], "sparse_dp")
    case("no batch norm, 5 steps", lambda: SparseNet(), uneven, "sparse_dp", steps=5)
    case("batch norm, sync_batchnorm=True, 1 step", lambda: SparseNet(batch_norm=True), uneven[:1], "sparse_dp",
         sync_batchnorm=True)
    case("batch norm, sync_batchnorm=True, 5 steps", lambda: SparseNet(batch_norm=True), uneven, "sparse_dp", steps=5,
         sync_batchnorm=True)
    case("batch norm, no sync (per-replica statistics), 1 step", lambda: SparseNet(batch_norm=True), uneven[:1],
         "sparse_dp")
    case("segmentation, points weighting + sync BN, 5 steps", lambda: SegNet(), fields,
         SparseDataParallelStrategy(loss_weighting="points", sync_batchnorm=True), steps=5)
    case("segmentation, samples weighting + sync BN, 5 steps", lambda: SegNet(), fields,
         SparseDataParallelStrategy(loss_weighting="samples", sync_batchnorm=True), steps=5)
    for name, (cls, make) in sorted(CLIENTS.items()):  # ME-example-style modules, default options + sync BN
        batches = [make(range(7 * s, 7 * s + 7)) for s in range(2)]
        case(f"client {name}, sync BN, 2 steps", cls, batches, "sparse_dp", steps=2, sync_batchnorm=True,
             make_loader=fresh_loader)  # clients edit their batch in place: a copy per fetch


if __name__ == "__main__":
    main()
