"""How a loss's terms are read across replicas (``loss/readings.py``), against plain Lightning on one device in float64:
a ``reduction="sum"`` loss whose input is a batch of one holding the chunk's rows in another dimension."""

from __future__ import annotations

import torch.nn.functional as F

from tests.support.exact import REL, same_start, state_differences, trainer64
from tests.support.helpers import collate_dict, loader, random_samples
from tests.support.step_forms import PooledNet


class SummedOverOneBatch(PooledNet):
    """The cross-entropy's K-dimensional layout, ``[1, C, B]``: rows in the last dimension, ``reduction="sum"``."""

    def training_step(self, batch, batch_idx):
        logits = self.head(self.features(batch))
        return F.cross_entropy(logits.T[None], batch["labels"][None], reduction="sum")


def test_a_sum_over_a_batch_of_one_is_the_chunks_sum():
    """Its input has one row in every replica, so its coefficient (1) times its rows (1) was read as ``sum / len(y)``:
    the whole batch's sum divided by the replicas' rows, 3 on 3 replicas (the loss and gradients 1 - 1/3 off one
    device's, the parameters 1.27 after 3 steps), with an info line promising a later batch would settle it."""
    batches = [collate_dict(random_samples(n, seed=s)) for n, s in ((7, 11), (8, 12), (5, 13))]
    ours, reference = same_start(SummedOverOneBatch, seed=0)
    trainer64(strategy="sparse_dp", devices=3, max_steps=3).fit(ours, loader(*batches))
    trainer64(max_steps=3).fit(reference, loader(*batches))
    assert max(state_differences(ours, reference).values()) <= REL
