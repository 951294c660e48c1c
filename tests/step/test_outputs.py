"""Step outputs combined as one device returns them: fixed-size values by ``output_layout``, the
warning for ambiguous ones, the roles directly, and ``None`` from some replicas."""

from __future__ import annotations

import warnings

import MinkowskiEngine as ME
import pytest
import torch
from torch import Tensor

from lightning_sparse_dp import SparseDataParallelStrategy, split_batch
from lightning_sparse_dp.loss.weights import chunk_weights
from lightning_sparse_dp.step.gather import gather_outputs
from tests.support.exact import fit_float64, same_start, trainer64
from tests.support.helpers import NUM_CLASSES, SparseNet, collate_dict, loader, random_samples, trainer

pytestmark = pytest.mark.usefixtures("both_preparations")  # on the main thread and in the replicas' (conftest)

# --- step outputs of a fixed size --------------------------------------------------------------------


class Histogram(SparseNet):
    def predict_step(self, batch, batch_idx):
        labels = batch["labels"]
        return {"hist": torch.bincount(labels, minlength=NUM_CLASSES), "n": labels.shape[0]}


def _hist_batch(num_samples=9):
    return collate_dict(random_samples(num_samples, seed=11))


def test_fixed_size_output_with_output_layout_is_the_one_device_value():
    batch = _hist_batch()
    strategy = SparseDataParallelStrategy(output_layout={"hist": "sum", "n": "sum"}, split="contiguous")
    [out] = trainer(strategy=strategy, devices=3).predict(Histogram(), loader(batch))
    [ref] = trainer(devices=1).predict(Histogram(), loader(batch))
    assert out["hist"].tolist() == ref["hist"].tolist() == torch.bincount(batch["labels"], minlength=NUM_CLASSES).tolist()
    assert out["n"] == ref["n"] == 9


def test_ambiguous_unnamed_output_warns():
    batch = _hist_batch(12)  # chunks of 3 samples; a [NUM_CLASSES] = [4] output per chunk: not per-sample
    with pytest.warns(UserWarning, match=r"output\['hist'\] has the same length \(4\) in every chunk.*output_layout"):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3).predict(Histogram(), loader(batch))
    batch = _hist_batch(9)  # chunks of 3 samples, a [4] output: matches nothing, concatenated, with a warning
    with pytest.warns(UserWarning, match=r"output\['hist'\] has the same length \(4\).*concatenated"):
        trainer(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3).predict(Histogram(), loader(batch))


def test_a_number_output_that_differs_between_chunks_is_said_and_named_roles_give_one_devices():
    """A step output that is a Python number of the chunk (its samples, a fraction) comes back as the list of the
    replicas' values where one device returns one number: said once per output, naming it and the fix; equal
    numbers are the value, silently; ``output_layout={"n": "sum"}`` gives one device's count."""
    batch = _hist_batch(7)  # chunks of 3, 2 and 2 samples (in the balanced split's order)

    class Counts(SparseNet):
        def predict_step(self, batch, batch_idx):
            return {"n": int(batch["labels"].shape[0]), "same": 3, "name": "scene"}

    with pytest.warns(UserWarning, match=r"step output output\['n'\] \(int\) differs between the replicas' chunks") as rec:
        [out] = trainer(strategy="sparse_dp", devices=3).predict(Counts(), loader(batch))
    assert sorted(out["n"]) == [2, 2, 3] and out["same"] == 3 and out["name"] == "scene"
    assert sum("differs between the replicas' chunks" in str(w.message) for w in rec) == 1
    strategy = SparseDataParallelStrategy(output_layout={"n": "sum"})
    [out] = trainer(strategy=strategy, devices=3).predict(Counts(), loader(batch))
    [ref] = trainer(devices=1).predict(Counts(), loader(batch))
    assert out == ref == {"n": 7, "same": 3, "name": "scene"}


def test_a_count_output_equal_in_every_chunk_is_said():
    """``len(labels)`` over equal chunks (6 samples: 2, 2, 2) is one number in every replica, which was given as the
    batch's silently (2 where one device returns 6). It is said, naming the role that gives one device's count; so is
    any other nonzero integer all replicas agree on (a count of hits, 1 in each chunk where one device counts 3)."""
    batch = collate_dict(random_samples(6, seed=3, min_points=10, max_points=10))

    class Counts(SparseNet):
        def predict_step(self, batch, batch_idx):
            hits = int((batch["labels"] == int(batch["labels"][0])).sum())  # 1 in every chunk here: a count all the same
            return {"n": int(batch["labels"].shape[0]), "points": int(batch["coordinates"].shape[0]), "k": 5,
                    "hits": hits, "none": 0}

    batch["labels"] = torch.tensor([0, 1, 1, 2, 2, 0])  # chunks (0, 1), (2, 3), (4, 5): one hit of its first each
    with pytest.warns(UserWarning, match=r"step output output\['n'\] is 2 in every replica, which is also.*"
                                         r"output_layout=\{'n': 'sum'\}") as record:
        [out] = trainer(strategy="sparse_dp", devices=3).predict(Counts(), loader(batch))
    assert out == {"n": 2, "points": 20, "k": 5, "hits": 1, "none": 0}
    said = [str(w.message) for w in record]
    assert any("output['hits'] is 1 in every replica: it is given as that one value" in m for m in said)
    assert not any("output['none']" in m for m in said)  # 0: a count and a constant alike
    strategy = SparseDataParallelStrategy(output_layout={"n": "sum", "points": "sum", "hits": "sum", "k": "first"})
    [out] = trainer(strategy=strategy, devices=3).predict(Counts(), loader(batch))
    [ref] = trainer(devices=1).predict(Counts(), loader(batch))
    assert out == {"n": 6, "points": 60, "k": 5, "hits": 3, "none": 0}
    assert ref["n"] == 6 and ref["points"] == 60


def test_output_roles_directly():
    batch = _hist_batch(7)
    chunks, plan = split_batch(batch, 3, assignment="balanced")
    outs = [{"p": c["labels"].double(), "h": torch.ones(2), "m": torch.tensor([1.0, 3.0]) * (j + 1), "l": j}
            for j, c in enumerate(chunks)]
    layout = {"p": "samples", "h": "sum", "m": "mean", "l": "list"}
    weights = chunk_weights(plan, "samples")
    got = gather_outputs(outs, plan, weights, torch.device("cpu"), layout)
    assert got["p"].tolist() == batch["labels"].double().tolist()
    assert got["h"].tolist() == [3.0, 3.0]
    expected = sum(w * (j + 1) for j, w in enumerate(weights))
    assert got["m"].tolist() == pytest.approx([expected, 3 * expected])
    assert got["l"] == [0, 1, 2]
    with pytest.raises(ValueError, match="use one of"):
        gather_outputs(outs, plan, weights, torch.device("cpu"), {"h": "stack"})


@pytest.mark.parametrize("kind", ["loss", "per-sample", "per-point", "other", "named"])
def test_a_bare_tensor_output_is_gathered_as_the_same_tensor_under_a_key(kind):
    """A step that returns a tensor (its loss, most often) takes a shorter way through the gather: the same value as
    the tensor returned under a dict key, by every rule (and by ``output_layout``, by the name ``"output"``)."""
    batch = _hist_batch(7)
    chunks, plan = split_batch(batch, 3, assignment="balanced")
    weights = chunk_weights(plan, "samples")
    make = {
        "loss": lambda j, c: c["features"].sum() * (j + 1),
        "per-sample": lambda j, c: c["labels"].double() + j,
        "per-point": lambda j, c: c["features"][:, 0] * 2,
        "other": lambda j, c: torch.arange(5 + j, dtype=torch.float64),
        "named": lambda j, c: torch.full((2,), float(j)),
    }[kind]
    tensors = [make(j, c) for j, c in enumerate(chunks)]
    layout, keyed = ({"output": "sum"}, {"v": "sum"}) if kind == "named" else (None, None)
    got = gather_outputs(tensors, plan, weights, torch.device("cpu"), layout)
    ref = gather_outputs([{"v": t} for t in tensors], plan, weights, torch.device("cpu"), keyed)["v"]
    assert type(got) is Tensor and got.shape == ref.shape and torch.equal(got, ref)
    if kind == "per-point":
        assert torch.equal(got, batch["features"][:, 0] * 2)  # the batch's own row order


# --- messages that point the right way ---------------------------------------------------------------


def test_none_from_some_replicas_names_them_and_says_what_skipping_means():
    class SkipsSmall(SparseNet):
        def training_step(self, batch, batch_idx):
            if batch["labels"].shape[0] < 3:
                return None
            return super().training_step(batch, batch_idx)

    batch = collate_dict(random_samples(7, seed=15))  # contiguous chunks of 3, 2, 2 samples
    with pytest.raises(ValueError, match=r"training_step returned None in replica\(s\) \[1, 2\] \(the batch's samples "
                       r"3, 4, 5, 6\).*Decide on the whole batch"):
        fit_float64(SkipsSmall(), batch, strategy=SparseDataParallelStrategy(split="contiguous"), devices=3)


class ReturnsCoordinates(SparseNet):
    """A predict step that returns coordinates, as ME users save predictions with their points: the batch's own, a
    stride-1 tensor's ``.C`` beside its ``.F``, a strided tensor's, a globally pooled tensor's; and an int32 pair of
    labels per sample, which is not coordinates."""

    def predict_step(self, batch, batch_idx):
        import MinkowskiEngine as ME

        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        same, strided = self.net[0](x), self.net[:3](x)
        pooled = ME.MinkowskiGlobalAvgPooling()(strided)
        return {
            "coordinates": batch["coordinates"], "C": same.C, "F": same.F, "strided_C": strided.C,
            "strided_F": strided.F, "pooled_C": pooled.C, "pooled_F": pooled.F,
            "pairs": torch.stack([batch["labels"], batch["labels"]], 1).int(),
            "C_long": same.C.long(), "batch_column": same.C[:, 0], "batch_column_2d": same.C[:, :1].long(),
            "float_C": torch.cat([batch["coordinates"][:, :1], batch["coordinates"][:, 1:] + 0.25], 1).double(),
        }


def _by_coordinates(coordinates, features):
    return {tuple(c): f for c, f in zip(coordinates.tolist(), features)}


def test_coordinates_a_step_returns_carry_the_batchs_sample_ids():
    """A chunk's coordinates count its own samples in column 0 (0..b_i-1): returned from the step they came back with
    those, so grouping predictions by ``C[:, 0]`` mixed samples of different chunks, silently. They come back with the
    batch's sample ids: per-point and per-sample ones equal to one device's, a strided tensor's the same (coordinate,
    feature) pairs; an int32 output that is not coordinates is left as it is (float64, 3 replicas)."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (161, 162)]
    results = {}
    for strategy, devices in (("auto", 1), ("sparse_dp", 3)):
        torch.manual_seed(0)
        module = ReturnsCoordinates()
        results[strategy] = trainer(strategy=strategy, devices=devices, precision="64-true").predict(module, loader(*batches))
    for one, ours in zip(results["auto"], results["sparse_dp"]):
        assert one["coordinates"][:, 0].unique().numel() == 7
        for key in ("coordinates", "C", "pooled_C", "pairs", "batch_column", "batch_column_2d"):
            assert torch.equal(ours[key], one[key]), key
        for key in ("C_long", "float_C"):  # int64 and float copies, and the batch column alone: the chunk's ids before
            assert torch.equal(ours[key], one[key]), key
        for key in ("F", "pooled_F"):
            torch.testing.assert_close(ours[key], one[key], rtol=1e-10, atol=0)
        strided_one, strided_ours = (_by_coordinates(r["strided_C"], r["strided_F"]) for r in (one, ours))
        assert strided_ours.keys() == strided_one.keys()
        for c in strided_one:
            torch.testing.assert_close(strided_ours[c], strided_one[c], rtol=1e-10, atol=0)


class ReturnsSparseTensors(SparseNet):
    """A predict step that returns the network's SparseTensors (``return self(x)``): stride 1, strided, pooled."""

    def predict_step(self, batch, batch_idx):
        import MinkowskiEngine as ME

        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        strided = self.net[:3](x)
        field = ME.TensorField(batch["features"], batch["coordinates"].to(batch["features"].dtype), device=self.device)
        return {"same": self.net[0](x), "strided": strided, "pooled": ME.MinkowskiGlobalAvgPooling()(strided),
                "field": self.net[0](field.sparse()).slice(field)}


def test_sparse_tensors_a_step_returns_come_back_as_one_sparse_tensor_of_the_batch():
    """The replicas' SparseTensors came back as their list (said). They come back as one SparseTensor of the batch:
    a stride-1 or pooled one with one device's rows (coordinates equal, features at 1e-10, float64), a strided one with
    one device's (coordinate, feature) rows and per-sample features, in chunk order; its tensor stride kept. A
    TensorField (``out.slice(field)``) came back as the list, and the roles its warning named crashed in ME; it is one
    TensorField of the batch now, and a role that cannot combine it is refused by name."""
    import MinkowskiEngine as ME

    batches = [collate_dict(random_samples(7, seed=s)) for s in (171, 172)]
    results = {}
    for strategy, devices in (("auto", 1), ("sparse_dp", 3)):
        torch.manual_seed(0)
        results[strategy] = trainer(strategy=strategy, devices=devices, precision="64-true").predict(
            ReturnsSparseTensors(), loader(*batches)
        )
    for one, ours in zip(results["auto"], results["sparse_dp"]):
        for key in ("same", "pooled"):
            assert type(ours[key]) is ME.SparseTensor and ours[key].tensor_stride == one[key].tensor_stride
            assert torch.equal(ours[key].C, one[key].C), key
            torch.testing.assert_close(ours[key].F, one[key].F, rtol=1e-10, atol=1e-15)
        strided_one, strided_ours = (_by_coordinates(r["strided"].C, r["strided"].F) for r in (one, ours))
        assert ours["strided"].tensor_stride == one["strided"].tensor_stride == [2, 2, 2]
        assert strided_ours.keys() == strided_one.keys()
        for c in strided_one:
            torch.testing.assert_close(strided_ours[c], strided_one[c], rtol=1e-10, atol=0)
        for mine, theirs in zip(ours["strided"].decomposed_features, one["strided"].decomposed_features, strict=True):
            torch.testing.assert_close(mine.sort(0).values, theirs.sort(0).values, rtol=1e-10, atol=0)
        assert type(ours["field"]) is ME.TensorField and torch.equal(ours["field"].C, one["field"].C)
        torch.testing.assert_close(ours["field"].F, one["field"].F, rtol=1e-10, atol=1e-15)
    strategy = SparseDataParallelStrategy(output_layout={"field": "sum"})
    with pytest.raises(ValueError, match=r"output\['field'\] is an ME TensorField, which the role 'sum' cannot"):
        trainer(strategy=strategy, devices=3, precision="64-true").predict(ReturnsSparseTensors(), loader(batches[0]))


class ReturnsPruned(SparseNet):
    """A predict step that returns its input pruned by a feature threshold, which leaves one sample no rows."""

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return ME.MinkowskiPruning()(x, x.F[:, 0] > -4)


@pytest.mark.parametrize("emptied", ["one sample", "a whole chunk"])
def test_a_pruned_sparse_tensor_with_a_sample_left_without_rows_comes_back_as_one_of_the_batch(emptied):
    """A SparseTensor in which a sample (or a whole chunk) has no rows left (pruned away) came back as the replicas'
    list, with a false 'differs' line: its coordinates were taken for the batch's only with every sample present.
    An ME tensor's ``.C`` is coordinates by construction: it comes back as one SparseTensor with one device's
    (coordinate, feature) rows (row order aside, as a strided tensor's), the emptied samples absent as on one device."""
    samples = random_samples(7, seed=5)
    _, plan = split_batch(collate_dict(samples), 3)
    gone = [4] if emptied == "one sample" else plan.chunk_samples[1].tolist()
    for i in gone:
        coords, feats, label = samples[i]
        samples[i] = (coords, torch.full_like(feats, -5.0), label)  # pruned away whole
    batch = collate_dict(samples)
    results = {}
    for strategy, devices in (("auto", 1), ("sparse_dp", 3)):
        results[strategy] = trainer(strategy=strategy, devices=devices, precision="64-true").predict(
            ReturnsPruned(), loader(batch)
        )
    one, ours = results["auto"][0], results["sparse_dp"][0]
    assert type(ours) is ME.SparseTensor and not set(gone) & set(ours.C[:, 0].tolist())
    rows_one, rows_ours = _by_coordinates(one.C, one.F), _by_coordinates(ours.C, ours.F)
    assert rows_ours.keys() == rows_one.keys()
    for c in rows_one:
        torch.testing.assert_close(rows_ours[c], rows_one[c], rtol=1e-10, atol=0)


def test_only_tensors_shaped_as_the_batchs_coordinates_are_taken_for_coordinates():
    """An int32 per-sample output whose column 0 numbers the chunk's samples is taken for coordinates (a pooled
    tensor's ``.C``: the batch's sample ids given back) only when it has the batch's coordinate columns (``D+1``); an
    int32 ``(prediction, label)`` pair whose predictions happen to be ``0..b_i-1`` is left as the chunks gave it."""
    from lightning_sparse_dp.split.merge import coordinates_back

    batch = collate_dict(random_samples(7, seed=181))
    _, plan = split_batch(batch, 3)
    assert plan.coordinate_columns == (4,)
    for width, taken in ((4, True), (2, False)):
        values = [torch.zeros(len(s), width, dtype=torch.int32) for s in plan.chunk_samples]
        for v in values:
            v[:, 0] = torch.arange(len(v))
        back = coordinates_back(values, plan, "samples")
        assert (back is not values) == taken
        if taken:
            assert [b[:, 0].tolist() for b in back] == [s.tolist() for s in plan.chunk_samples]


# --- 0-dim outputs other than the loss ---------------------------------------------------------------


class Scores(SparseNet):
    """Outputs beside the loss of a batch weighted by its samples: a mean over the chunk's points (the share of active
    features), a count and a maximum, each gathered for ``on_train_batch_end`` as one device's where it can tell."""

    def __init__(self):
        super().__init__(lr=0.1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        active = (self.net[0](x).F[:, 0] > 0).double().mean()  # a mean over the chunk's points, not its samples
        hit = logits.argmax(1) == batch["labels"]
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        return {"loss": loss, "active": active, "correct": hit.sum(), "top": logits.detach().max(),
                "active_detached": active.detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append({k: v.detach().clone() for k, v in outputs.items()})


def test_zero_dim_outputs_are_one_devices_where_the_step_tells_and_said_where_not():
    """A mean the step computed (``.mean()``, here over points) is its whole-batch mean by element counts, a 0-dim
    integer count is the replicas' sum (both one device's; they were means weighted by the chunks' samples, a fraction
    for the count), and a value neither tells (a maximum) is the weighted mean, said once naming it."""
    batch = {k: v.double() if v.is_floating_point() else v for k, v in collate_dict(random_samples(7, seed=71)).items()}
    ours, reference = same_start(Scores)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_float64(ours, batch, strategy="sparse_dp", devices=3)
    fit_float64(reference, batch)
    said = " ".join(str(w.message) for w in caught)
    ours_out, ref_out = ours.seen[0], reference.seen[0]
    assert float(ours_out["active"]) == pytest.approx(float(ref_out["active"]), rel=1e-12)
    assert float(ours_out["active_detached"]) == pytest.approx(float(ref_out["active"]), rel=1e-12)  # the same mean
    assert "output['active_detached']" not in said
    assert ours_out["correct"].dtype == ref_out["correct"].dtype and int(ours_out["correct"]) == int(ref_out["correct"])
    assert "step output output['correct'] is a 0-dim integer tensor" in said
    assert "step output output['active']" not in said
    assert "step output output['top'] differs between the replicas and is not a combination" in said


class PredictsMeans(SparseNet):
    """A predict step that returns means over the chunk's points: in a dict beside the logits, or bare."""

    bare = False

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        points = self.net[0](x).F
        if self.bare:
            return points.mean()
        return {"mean_activation": points.mean(), "logits": self(x)}


@pytest.mark.parametrize("bare", [False, True])
def test_a_mean_a_predict_step_returns_is_the_whole_batchs(bare):
    """A 0-dim mean over the chunk's points returned by ``predict_step`` is the whole batch's mean, as a validation
    step's is (the chunks' means were weighted by their samples, silently: 3e-2 to 1e-1 relative off)."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (171, 172)]
    results = {}
    for strategy, devices in (("auto", 1), ("sparse_dp", 3)):
        torch.manual_seed(0)
        module = PredictsMeans()
        module.bare = bare
        results[strategy] = trainer(strategy=strategy, devices=devices, precision="64-true").predict(module, loader(*batches))
    for one, ours in zip(results["auto"], results["sparse_dp"]):
        if bare:
            torch.testing.assert_close(ours, one, rtol=1e-10, atol=0)
            continue
        for key in ("mean_activation", "logits"):
            torch.testing.assert_close(ours[key], one[key], rtol=1e-10, atol=0)


class ReturnsLogits(SparseNet):
    """Evaluation and predict steps that return the batch's logits (no loss), after a loss the step computed."""

    def logits(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        logits = self(x)
        self.loss_seen = torch.nn.functional.cross_entropy(logits, batch["labels"]).detach()
        return logits

    def validation_step(self, batch, batch_idx):
        return self.logits(batch)

    def predict_step(self, batch, batch_idx):
        return self.logits(batch)


def test_steps_that_return_predictions_say_nothing_of_a_loss_weighting(caplog):
    """A predict step (and an evaluation step) returning logits has no loss to weigh: nothing is said of the loss's
    weighting (the predict step said "loss_weighting='terms' cannot weight the step's loss term by term", naming a
    fix for a loss it has not), and the predictions are one device's."""
    import logging

    batches = [collate_dict(random_samples(7, seed=s)) for s in (195, 196)]
    torch.manual_seed(0)
    module = ReturnsLogits()
    one = trainer(devices=1, precision="64-true").predict(module, loader(*batches))
    with caplog.at_level(logging.INFO):
        ours = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(module, loader(*batches))
        trainer(strategy="sparse_dp", devices=3, limit_val_batches=None, precision="64-true").validate(module, loader(*batches))
    assert "cannot weight the step's loss" not in caplog.text
    for a, b in zip(ours, one):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)


class PredictsIndices(SparseNet):
    """A predict step that returns the row indices of its confident points (``torch.nonzero``): as many as the chunk
    has, counted in its own rows."""

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        points = self.net[0](x).F
        return {"confident": torch.nonzero(points.max(1).values > 0).squeeze(1)}


def test_integers_a_predict_step_selects_from_its_chunk_are_said():
    """Row indices of another length than the chunk's samples or points are each chunk's own: concatenated they are not
    one device's (they were, silently); said once, naming the output and the role that keeps the concatenation, which
    silences it."""
    batches = [collate_dict(random_samples(7, seed=s)) for s in (181, 182)]
    torch.manual_seed(0)
    module = PredictsIndices()
    [one] = trainer(devices=1).predict(module, loader(batches[0]))
    with pytest.warns(UserWarning, match=r"step output output\['confident'\] is an integer tensor of other lengths") as got:
        ours = trainer(strategy="sparse_dp", devices=3).predict(module, loader(*batches))
    assert sum("output['confident'] is an integer tensor" in str(w.message) for w in got) == 1  # once for two batches
    assert ours[0]["confident"].numel() == one["confident"].numel()  # the same selection, counted in chunks' rows
    assert not torch.equal(ours[0]["confident"], one["confident"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is an integer tensor of other lengths")
        strategy = SparseDataParallelStrategy(output_layout={"confident": "cat"})
        trainer(strategy=strategy, devices=3).predict(module, loader(*batches))


class PredictsSelected(SparseNet):
    """A predict step that returns the features of the points its batch labels as class 1 (``o[mask]``): as many rows
    as its chunk selects, in its samples' order."""

    def predict_step(self, batch, batch_idx):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        points = self.net[0](x).F
        return {"selected": points[batch["features"][:, 0] > 0]}


def test_float_rows_a_predict_step_selects_are_said_where_the_chunks_reorder_the_samples():
    """Float rows of another length than the chunks' samples or points come in chunk order; where the balanced split
    put the samples in the chunks out of the batch's order, that is not one device's order (it was silently): said
    once, naming the output and the role that keeps the chunk order. The contiguous split keeps the batch's order:
    one device's rows, unsaid."""
    batch = collate_dict(random_samples(7, seed=191))
    torch.manual_seed(0)
    module = PredictsSelected()
    [one] = trainer(devices=1, precision="64-true").predict(module, loader(batch))
    with pytest.warns(UserWarning, match=r"output\['selected'\] has other lengths than the chunks' samples") as got:
        ours = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(module, loader(batch, batch))[0]
    assert sum("output['selected'] has other lengths" in str(w.message) for w in got) == 1
    assert ours["selected"].shape == one["selected"].shape and not torch.equal(ours["selected"], one["selected"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has other lengths than the chunks' samples")
        strategy = SparseDataParallelStrategy(split="contiguous")
        [kept] = trainer(strategy=strategy, devices=3, precision="64-true").predict(module, loader(batch))
        strategy = SparseDataParallelStrategy(output_layout={"selected": "cat"})
        trainer(strategy=strategy, devices=3, precision="64-true").predict(module, loader(batch))
    torch.testing.assert_close(kept["selected"], one["selected"], rtol=1e-10, atol=0)


class _DenseGrids(SparseNet):
    """Per-sample dense grids returned from predict: ``x.dense()`` sizes the grid by the tensor's own coordinates."""

    def predict_step(self, batch, batch_idx):
        import MinkowskiEngine as ME

        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return self.net[0](x).dense()[0]


def test_per_sample_rows_of_different_shapes_in_the_chunks_name_the_fix():
    """Each chunk's grid had its own extent: the merge's torch.cat raised 'Sizes of tensors must match', naming
    nothing. It names the output, the chunks' shapes and the fixes."""
    batch = collate_dict(random_samples(7, seed=21))
    with pytest.raises(ValueError, match=r"step output output has rows of different shapes.*x.dense\(shape=.*'list'"):
        trainer(strategy="sparse_dp", devices=3).predict(_DenseGrids(), loader(batch))


class _SampleIds(SparseNet):
    def predict_step(self, batch, batch_idx):
        return {"ids": torch.unique(batch["coordinates"][:, 0]), "labels": batch["labels"]}


def test_the_chunks_own_sample_ids_returned_are_said():
    """torch.unique(x.C[:, 0]) per chunk is 0..b-1: merged as per-sample rows it was [0, 1, 2, 0, 1, 0, 1] where one
    device returns 0..6, silently. It is said, naming what comes back with the batch's ids."""
    batch = collate_dict(random_samples(7, seed=22))
    with pytest.warns(UserWarning, match=r"step output output\['ids'\] holds 0..b-1 in every chunk"):
        [out] = trainer(strategy="sparse_dp", devices=3).predict(_SampleIds(), loader(batch))
    assert torch.equal(out["labels"], batch["labels"])


class _Detections(SparseNet):
    """Per-sample detections, ``None`` for a sample without any (labels 0 here), as detection code returns them."""

    def predict_step(self, batch, batch_idx):
        import MinkowskiEngine as ME

        logits = self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device))
        return [None if int(y) == 0 else logits[i : i + 1].repeat(int(y), 1) for i, y in enumerate(batch["labels"])]


@pytest.mark.parametrize("samples", [9, 10])
def test_per_sample_outputs_with_none_for_some_samples_come_back_per_sample(samples):
    """A None entry was not alike the tensors beside it, so the list was not taken as per-sample: merged position by
    position (3 entries where one device returns 9) or refused as 'another structure'. It is per-sample now."""
    batch = collate_dict(random_samples(samples, seed=26))
    batch["labels"][::3] = 0
    torch.manual_seed(0)
    [ours] = trainer(strategy="sparse_dp", devices=3, precision="64-true").predict(_Detections(), loader(batch))
    torch.manual_seed(0)
    [one] = trainer(devices=1, precision="64-true").predict(_Detections(), loader(batch))
    assert len(ours) == len(one) == samples
    for a, b in zip(ours, one):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-10, atol=0)


class _FixedWithNone(SparseNet):
    def predict_step(self, batch, batch_idx):
        import MinkowskiEngine as ME

        return self(ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)), None


class _Background(SparseNet):
    """Per-point integer predictions that are all 0 (background), with one sample per replica."""

    def predict_step(self, batch, batch_idx):
        return torch.zeros(len(batch["coordinates"]), dtype=torch.long)


def test_a_fixed_pair_with_none_and_zero_predictions_stay_as_they_are():
    """``(logits, None)`` in chunks of two samples was taken for per-sample entries (a list of 6); all-zero per-point
    predictions over chunks of one sample looked like each chunk's batch column and came back as sample ids."""
    batch = collate_dict(random_samples(6, seed=30))
    [pair] = trainer(strategy="sparse_dp", devices=3).predict(_FixedWithNone(), loader(batch))
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[1] is None and pair[0].shape[0] == 6
    one = collate_dict(random_samples(3, seed=31))
    [pred] = trainer(strategy="sparse_dp", devices=3).predict(_Background(), loader(one))
    assert pred.shape[0] == len(one["coordinates"]) and not pred.any()


class _MeanOfClassZero(SparseNet):
    """Returns, and feeds a MeanMetric with, the mean feature of the points of label-0 samples: a selection that is
    empty in a chunk without such a sample (its mean NaN there)."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.zero_mean = torchmetrics.MeanMetric()
        self.returned: list[float] = []

    def training_step(self, batch, batch_idx):
        points = (batch["labels"] == 0)[batch["coordinates"][:, 0].long()]
        value = batch["features"][points, 0].mean()
        self.zero_mean.update(value)
        return {"loss": self.loss(batch), "zero_mean": value}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.returned.append(float(outputs["zero_mean"]))


def test_a_mean_over_nothing_in_one_chunk_leaves_the_batchs_mean_returned_and_in_a_metric():
    """A mean the step computes over a selection empty in one chunk is NaN there; the whole batch's value weighted the
    replicas' means by their element counts, 0 * NaN making it NaN: the returned value was NaN and the MeanMetric fed
    with it skipped the update (torchmetrics drops NaN), where one device's are the mean over the batch's points. A
    chunk with nothing to average adds nothing now."""
    batch = collate_dict(random_samples(6, seed=12, min_points=10, max_points=10))
    batch["labels"] = torch.tensor([0, 1, 1, 2, 0, 3])  # contiguous chunks of 2: the second has no label 0
    ours, reference = same_start(_MeanOfClassZero, seed=0)
    trainer64(strategy=SparseDataParallelStrategy(split="contiguous"), devices=3, max_steps=2).fit(
        ours, loader(batch, batch))
    trainer64(max_steps=2).fit(reference, loader(batch, batch))
    assert len(ours.returned) == 2 and ours.returned == pytest.approx(reference.returned, rel=1e-12)
    assert float(ours.zero_mean.compute()) == pytest.approx(float(reference.zero_mean.compute()), rel=1e-6)
