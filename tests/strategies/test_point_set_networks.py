"""Completion and registration networks on 3 replicas against one device with the whole batch (issue 18).

- the completion example (``examples/train_completion.py``, ME's ``completion.py`` style): its
  predictions on 3 replicas are one device's (the same generated coordinates, logits within 1e-10 in
  float64), and with a per-sample loss, or its own per-level BCE means (``loss_weighting="terms"``,
  the default), and synchronized batch norm so are its parameters;
- a registration network (FCGF style: two scans per sample, correspondences ``[K, 2]`` of rows of the
  collated scans): a hardest-negative contrastive loss over matched pairs, averaged over pairs, trains
  to one device's parameters with ``loss_weighting`` counting pairs, and its per-sample features are
  one device's with no option at all.
"""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_sparse_dp  # noqa: F401  (registers strategy="sparse_dp")
from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import assert_same_states, relative_difference, same_start
from tests.support.helpers import load_file, trainer
from tests.support.pairs import PairNet, pair_batch, pairs_in

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

completion = load_file("examples/train_completion.py")


def _by_coordinates(coordinates: torch.Tensor, logits: torch.Tensor):
    order = ((coordinates[:, 0].long() * 256 + coordinates[:, 1]) * 256 + coordinates[:, 2]).argsort()
    return coordinates[order], logits[order]


def _same_shapes(ours, reference) -> int:
    """Per-sample predictions equal: the same coordinates, logits within 1e-10 (relative); returns the voxels."""
    ours = [s for batch in ours for s in batch]
    reference = [s for batch in reference for s in batch]
    assert len(ours) == len(reference)
    voxels = 0
    for (c, f), (rc, rf) in zip(ours, reference, strict=True):
        c, f = _by_coordinates(c, f)
        rc, rf = _by_coordinates(rc, rf)
        assert torch.equal(c, rc)
        assert f.dtype == torch.float64 and relative_difference(f, rf) <= 1e-10
        voxels += len(c)
    return voxels


def _loader(shapes, batch_size=4):
    return DataLoader(shapes, batch_size=batch_size, collate_fn=completion.collate)


def test_completion_predictions_on_three_replicas_are_one_devices():
    train, val = completion.Shapes(12, seed=1, grid=12), completion.Shapes(7, seed=2, grid=12)
    torch.manual_seed(0)
    model = completion.Completion(lr=0.02)
    trainer(strategy="sparse_dp", devices=3, max_epochs=2, max_steps=-1, precision="64-true").fit(model, _loader(train))
    ours = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(model, _loader(val))
    reference = trainer(devices=1, precision="64-true").predict(model, _loader(val))
    assert [len(b) for b in ours] == [4, 3]  # one (coordinates, logits) per sample, per batch
    assert _same_shapes(ours, reference) > 0  # shapes were generated, so agreeing is not trivial


class SGDCompletion(completion.Completion):
    """The example's network and its own loss (ME's: each level's BCE a mean over that level's voxels, averaged
    over levels: exact by default through ``loss_weighting="terms"``), with SGD for the comparison: Adam divides
    by the root of the squared gradient, which turns gradients that are 0 up to rounding (1e-17) into steps of
    the learning rate, so it cannot be compared at 1e-10."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class PerSampleCompletion(SGDCompletion):
    """The completion network with its loss averaged per sample (each level's BCE a mean over the sample's
    generated voxels), then over samples and levels: a hand-written mean, exact under the sample weighting that
    ``"terms"`` falls back to."""

    def step(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"])
        target_key, _ = x.coordinate_manager.insert_and_map(batch["target_coordinates"], string_id="target")
        scores, targets, out = self.net(x, target_key)
        b = completion.num_samples(batch)
        loss = 0
        for s, t in zip(scores, targets):
            bce = F.binary_cross_entropy_with_logits(s.F[:, 0], t.to(s.F.dtype), reduction="none")
            ids = s.C[:, 0].long()
            sums = torch.zeros(b, dtype=bce.dtype).index_add(0, ids, bce)
            loss = loss + (sums / torch.bincount(ids, minlength=b)).mean()
        return loss / len(scores), out


@pytest.mark.parametrize("module_cls", [SGDCompletion, PerSampleCompletion], ids=["own-loss", "per-sample-loss"])
def test_completion_trains_to_one_devices_parameters_with_no_option_but_sync_batchnorm(module_cls):
    shapes = completion.Shapes(11, seed=3, grid=12)
    ours, reference = same_start(module_cls, seed=0)
    common = dict(max_epochs=1, max_steps=-1, precision="64-true")
    trainer(strategy="sparse_dp", devices=3, sync_batchnorm=True, **common).fit(ours, _loader(shapes, 6))
    trainer(devices=1, **common).fit(reference, _loader(shapes, 6))
    assert_same_states(ours, reference)
    assert relative_difference(ours.net.score[1].kernel, completion.Completion().net.score[1].kernel) > 1e-3


# --- registration ------------------------------------------------------------------------------------

def _pairs(batches):
    return DataLoader(batches, batch_size=None)


def test_registration_pairs_train_to_one_devices_parameters_and_predict_its_features():
    batches = [pair_batch(range(0, 7)), pair_batch(range(7, 12))]
    ours, reference = same_start(PairNet, seed=0)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    pairs = SparseDataParallelStrategy(loss_weighting=pairs_in)
    common = dict(max_steps=2, precision="64-true")
    trainer(strategy=pairs, devices=3, sync_batchnorm=True, **common).fit(ours, _pairs(batches))
    trainer(devices=1, **common).fit(reference, _pairs(batches))
    assert_same_states(ours, reference)
    assert relative_difference(reference.net[0].kernel, start["net.0.kernel"]) > 1e-3
    # predictions with no option but devices=3: one (features0, features1) per sample, one device's
    predicted = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(ours, _pairs(batches))
    expected = trainer(devices=1, precision="64-true").predict(reference, _pairs(batches))
    assert [len(b) for b in predicted] == [7, 5]
    for got, want in zip((p for b in predicted for p in b), (p for b in expected for p in b), strict=True):
        for x, y in zip(got, want, strict=True):
            assert x.shape == y.shape and relative_difference(x, y) <= 1e-10


def test_out_of_range_correspondences_are_refused_at_the_first_batch():
    batch = pair_batch(range(3))
    batch["correspondences"][-1, 1] = len(batch["sinput1_C"])
    with pytest.raises(Exception, match="is not a row of batch\\['sinput1_C'\\]"):
        trainer(strategy="sparse_dp", devices=3).fit(PairNet(), _pairs([batch]))


class _Outputs(L.Callback):
    def __init__(self):
        self.outputs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


class DecomposingNet(PairNet):
    """A training step that returns ME's per-sample idiom beside the loss: ``{"loss", "features": [f0_b]}``."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        x = ME.SparseTensor(batch["sinput0_F"], batch["sinput0_C"])
        return {"loss": loss, "features": self.net(x).decomposed_features}


def test_training_step_per_sample_outputs_reach_callbacks_as_one_devices():
    batches = [pair_batch(range(20, 27))]
    ours, reference = same_start(DecomposingNet, seed=0)
    seen, expected = _Outputs(), _Outputs()
    trainer(strategy=SparseDataParallelStrategy(loss_weighting=pairs_in), devices=3, sync_batchnorm=True,
            precision="64-true", callbacks=[seen]).fit(ours, _pairs(batches))
    trainer(devices=1, precision="64-true", callbacks=[expected]).fit(reference, _pairs(batches))
    got, want = seen.outputs[0]["features"], expected.outputs[0]["features"]
    assert len(got) == len(want) == 7
    coordinates = [c for c in ME.SparseTensor(batches[0]["sinput0_F"], batches[0]["sinput0_C"]).decomposed_coordinates]
    for x, y, c in zip(got, want, coordinates, strict=True):
        assert x.shape == y.shape == (len(c), 8)
        # rows of one sample in ME's decomposition order: compare as multisets of rows
        assert relative_difference(x[x[:, 0].argsort()], y[y[:, 0].argsort()]) <= 1e-10


def _shared_manager_batch(num: int, seed: int) -> dict:
    """An input and a target SparseTensor on one coordinate manager (a completion collate's), per-sample labels."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(10, 50, (num,), generator=g).tolist()
    coords = ME.utils.batched_coordinates(
        [torch.randint(0, 8, (n, 3), generator=g, dtype=torch.int32).unique(dim=0) for n in sizes]
    )
    x = ME.SparseTensor(torch.randn(len(coords), 3, generator=g, dtype=torch.float64), coords)
    shifted = coords.clone()
    shifted[:, 1] += 1
    target = ME.SparseTensor(torch.ones(len(shifted), 1, dtype=torch.float64), shifted,
                             coordinate_manager=x.coordinate_manager)
    return {"x": x, "target": target, "labels": torch.randint(0, 4, (num,), generator=g)}


class _UnionNet(L.LightningModule):
    """Input and target, built on one coordinate manager in the batch, joined by ME's union (which needs one)."""

    def __init__(self):
        super().__init__()
        self.a = ME.MinkowskiConvolution(3, 4, kernel_size=3, dimension=3)
        self.b = ME.MinkowskiConvolution(1, 4, kernel_size=1, dimension=3)
        self.pool = ME.MinkowskiGlobalAvgPooling()

    def training_step(self, batch, batch_idx):
        joined = ME.MinkowskiUnion()(self.a(batch["x"]), self.b(batch["target"]))
        return F.cross_entropy(self.pool(joined).F, batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sparse_tensors_of_the_batch_on_one_coordinate_manager_stay_on_one_in_each_chunk():
    """Each chunk's tensors that shared a coordinate manager in the batch are built on one manager again (each got its
    own: ME's union refused them, "All inputs must have the same coordinate manager", in the step and in the
    exactness check's copies); trained as one device."""
    batches = [_shared_manager_batch(7, 0), _shared_manager_batch(8, 1)]
    ours, reference = same_start(_UnionNet)
    for model, kwargs in ((ours, {"strategy": "sparse_dp", "devices": 3}), (reference, {})):
        trainer(precision="64-true", max_steps=2, **kwargs).fit(model, DataLoader(batches, batch_size=None))
    assert_same_states(ours, reference)
