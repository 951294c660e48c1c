"""What the state stage merges of what a step keeps on ``self`` (lightning_sparse_dp/step/state.py, ``combine_values``):
values the step computed as a combination of its losses or as a counted mean get the whole batch's value, against one
device with the whole batch (float64, 3 CPU replicas)."""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import pytest
import torch

from tests.support.exact import epoch_pair
from tests.support.helpers import SparseNet

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)


class MeansOnSelf(SparseNet):
    """A loss of a mean over samples and one over points, and a mean over points, kept on ``self`` three ways: none is
    weighted as the replicas' shares of the batch, so the merge must read them (the loss's terms, the counted mean)."""

    def __init__(self):
        super().__init__(lr=0.1)
        self.history, self.stats, self.frac = [], {}, None

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        h = self.net[0](x).F  # per point
        loss = torch.nn.functional.cross_entropy(self(x), batch["labels"]) + 0.1 * (h**2).mean()
        frac = (h[:, 0] > 0).double().mean()
        self.frac, self.stats["frac"] = frac.detach(), frac.detach()
        self.history.append({"loss": loss.detach(), "frac": frac.detach()})  # Lightning 2's outputs list, as a dict
        return loss


def test_means_and_losses_a_step_keeps_on_self_are_the_whole_batchs():
    """A mean computed with .mean() set on self, in a dict of self or appended, and the loss appended under "loss",
    are the whole batch's values as on one device, unsaid (the appended "loss" and a bare mean were weighted by the
    replicas' shares, silently or said as "weighted like the loss": 5e-2 relative off)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, reference = epoch_pair(MeansOnSelf, (53, 54))
    said = [str(w.message) for w in caught if "sparse_dp: self." in str(w.message)]
    assert not said, said
    assert len(ours.history) == len(reference.history) == 2
    pairs = [(ours.frac, reference.frac), (ours.stats["frac"], reference.stats["frac"])]
    pairs += [(a[k], b[k]) for a, b in zip(ours.history, reference.history) for k in ("loss", "frac")]
    for got, expected in pairs:
        assert float(got) == pytest.approx(float(expected), rel=1e-10, abs=0)
    assert float(reference.frac) not in (0.0, 1.0)  # a mean over points of both kinds: weights would show


class _AppendsLabels(SparseNet):
    """Lightning 2's outputs list: the batch's labels appended in every validation step."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch["labels"])


def test_rows_a_step_appends_are_the_batchs_even_where_every_replica_has_the_same():
    """Labels of one class in chunks of equal size are equal tensors in every replica: the module's list got one
    replica's 2 rows where one device appends the batch's 6, silently."""
    from tests.support.helpers import collate_dict, loader, random_samples, trainer

    batch = collate_dict(random_samples(6, seed=33))
    batch["labels"] = torch.ones_like(batch["labels"])
    ours, reference = _AppendsLabels(), _AppendsLabels()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # equal chunks: "taken as per-sample rows", said
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None).validate(ours, loader(batch))
    trainer(limit_val_batches=None).validate(reference, loader(batch))
    assert [len(t) for t in ours.seen] == [len(t) for t in reference.seen] == [6]
