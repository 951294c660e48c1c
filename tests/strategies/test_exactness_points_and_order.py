"""Exact data parallelism: per-point weighting of per-point losses, and predictions in the batch's order.

The reference of every test: plain Lightning on one device with the whole batch, from the same start, in float64
(tests/support/exact.py says how the two are compared).
"""

from __future__ import annotations

import MinkowskiEngine as ME
import pytest
import torch

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from tests.support.exact import assert_same_states, same_start, state_differences
from tests.support.exact import trainer64 as trainer
from tests.support.helpers import SegNet, SparseNet, collate_dict, field_batch, loader, random_samples

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


# --- per-point losses ------------------------------------------------------------------------------

def test_points_weighting_is_exact_for_per_point_losses_with_sync_batchnorm():
    batch = field_batch(7, seed=26, dtype=torch.float64)
    ours, reference = same_start(SegNet)
    strategy = SparseDataParallelStrategy(loss_weighting="points", sync_batchnorm=True)
    t = trainer(strategy=strategy, devices=3)
    t.fit(ours, loader(batch))
    trainer(devices=1).fit(reference, loader(batch))
    assert_same_states(ours, reference)


def test_samples_weighting_is_not_exact_for_per_point_losses():  # the comparison above can fail
    batch = field_batch(7, seed=26, dtype=torch.float64)
    ours, reference = same_start(SegNet)
    trainer(strategy=SparseDataParallelStrategy(loss_weighting="samples", sync_batchnorm=True), devices=3).fit(
        ours, loader(batch)
    )
    trainer(devices=1).fit(reference, loader(batch))
    assert max(state_differences(ours, reference).values()) > 1e-5


# --- ordered outputs -------------------------------------------------------------------------------

def _reversed_split(batch, num_chunks):
    """Chunks of samples in reverse order, so gathering must reorder."""
    def assignment(sizes, k):
        ids = torch.arange(sizes.numel()).flip(0)
        return list(ids.tensor_split(min(k, sizes.numel())))

    return split_batch(batch, num_chunks, assignment=assignment)


def test_predict_returns_per_point_outputs_in_the_original_order():
    batches = [field_batch(7, seed=30, dtype=torch.float64), field_batch(4, seed=31, dtype=torch.float64)]
    ours, reference = same_start(SegNet)
    ours.eval(), reference.eval()
    got = trainer(strategy=SparseDataParallelStrategy(split_fn=_reversed_split), devices=3).predict(ours, loader(*batches))
    want = trainer(devices=1).predict(reference, loader(*batches))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_predict_returns_per_sample_outputs_in_the_original_order():
    class Classify(SparseNet):
        def predict_step(self, batch, batch_idx):
            x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
            return {"logits": self(x), "labels": batch["labels"]}

    batch = collate_dict(random_samples(7, seed=32))
    ours, reference = same_start(Classify)
    got = trainer(strategy=SparseDataParallelStrategy(split_fn=_reversed_split), devices=3).predict(ours, loader(batch))
    want = trainer(devices=1).predict(reference, loader(batch))
    assert torch.equal(got[0]["labels"], batch["labels"])
    torch.testing.assert_close(got[0]["logits"], want[0]["logits"], rtol=1e-5, atol=1e-6)
