"""Unit tests of lightning_sparse_dp/ddp/logged_means.py: which logged values are held, and the batch size and value
each is settled to (the process runs in tests/ddp/test_ddp.py compare whole fits with one device)."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_sparse_dp.ddp.logged_means import HeldMeans, settle, whole_value
from lightning_sparse_dp.loss.decide import SiteTerms, Summary


def _log(results: _ResultCollection, name: str, value: float, **options) -> None:
    options.setdefault("batch_size", 3)
    results.log("training_step", name, torch.tensor(value, dtype=torch.float64), sync_dist_fn=lambda v, **_: v, **options)


def _row(value):
    """A rank's row of a logged value: a loss-like value (9.0, a summary of the rank's losses) is read as the batch's;
    others are not."""
    return ("losses" if float(value) == 9.0 else None, [float(value)], None, 1.0)


def test_held_means_reach_the_results_only_as_settled_and_others_at_once():
    results = _ResultCollection(training=True)
    with HeldMeans(results, row=_row) as means:
        _log(results, "held", 2.0, on_step=False, on_epoch=True, sync_dist=True)
        _log(results, "own", 5.0, on_step=False, on_epoch=True)  # no sync_dist: the rank's own, accumulated now
        _log(results, "summed", 1.0, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")  # a count
        _log(results, "loss_sum", 9.0, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")  # the loss
    assert "update_metrics" not in vars(results)  # the instance's own method is back
    assert list(means.calls) == ["training_step.held", "training_step.loss_sum"]
    assert means.calls["training_step.held"].row == _row(2.0) and means.calls["training_step.loss_sum"].reduction == "sum"
    means.calls.pop("training_step.loss_sum")
    assert float(results["training_step.held"].cumulated_batch_size) == 0  # nothing accumulated yet
    assert float(results["training_step.own"].value) == 15.0 and float(results["training_step.summed"].value) == 1.0
    means.release({"training_step.held": (torch.tensor(4.0, dtype=torch.float64), 7)})
    held = results["training_step.held"]
    assert float(held.value) == 28.0 and int(held.cumulated_batch_size) == 7


def _ranks(*rows):
    """rows: per rank (samples, {name: (value, batch_size, explicit)}); the value is its own row."""
    return [(samples, {k: (v, size, explicit) for k, (v, size, explicit) in named.items()}) for samples, named in rows]


def _mean_of_rows(rows, like, name):
    return torch.tensor(sum(rows) / len(rows), dtype=like.dtype)


class _Call:
    def __init__(self, value: float, reduction: str = "mean") -> None:
        self.value, self.reduction = torch.tensor(value, dtype=torch.float64), reduction


def test_batch_size_is_one_devices_sum_of_counts_or_the_one_constant():
    mine = {"a": _Call(1.0), "b": _Call(1.0), "c": _Call(1.0), "d": _Call(1.0)}
    ranks = _ranks(
        (2, {"a": (1.0, 40, False), "b": (1.0, 2, True), "c": (1.0, 8, True), "d": (1.0, 5, True)}),
        (3, {"a": (3.0, 40, False), "b": (3.0, 3, True), "c": (3.0, 8, True)}),
    )
    settled = settle(ranks, _mean_of_rows, mine)
    assert settled["a"][1] == 80  # inferred on each rank (its points, equal by chance): summed, as one device infers
    assert settled["b"][1] == 5  # each rank's own sample count: summed
    assert settled["c"][1] == 8  # one constant that is not the ranks' counts: counted once, as one device weighs it
    assert settled["d"] == (torch.tensor(1.0, dtype=torch.float64), 5)  # logged by one rank only: that rank's
    assert float(settled["a"][0]) == 2.0


def test_a_batch_size_of_each_shares_points_is_summed():
    """Fixed-size point clouds logged with ``batch_size=<the share's points>``: equal on every rank (48 and 48), they
    were taken for one constant (48 where one device weighs the step by 96), so epoch means mixing such steps with
    unequal ones were off (3.9e-4), silently. Each rank's points are gathered with its samples now."""
    mine = {"p": _Call(1.0), "k": _Call(1.0)}
    ranks = [(3, {"p": (1.0, 48, True), "k": (1.0, 32, True)}, [48]), (3, {"p": (3.0, 48, True), "k": (3.0, 32, True)}, [48])]
    settled = settle(ranks, _mean_of_rows, mine)
    assert settled["p"][1] == 96  # each share's points: summed, as one device counts the batch's
    assert settled["k"][1] == 32  # neither the shares' samples nor their points: one constant


def test_whole_value_weights_by_the_means_element_counts_else_by_the_ranks_counts():
    like = torch.tensor(0.0, dtype=torch.float64)
    by_counts = whole_value([(None, [1.0], 1, 10.0), (None, [4.0], 3, 10.0)], like, memory=None)
    assert float(by_counts) == (1.0 * 1 + 4.0 * 3) / 4
    by_ranks = whole_value([(None, [1.0], None, 1.0), (None, [4.0], 3, 2.0)], like, memory=None)
    assert float(by_ranks) == (1.0 * 1 + 4.0 * 2) / 3


def test_a_value_weighted_by_the_ranks_counts_is_said_once(caplog):
    """A logged value that differs between the ranks and is neither a combination of the losses nor a counted mean
    (a hand-made ``correct / labeled``) is weighted by ``n_r``, one device's only for a mean over what that counts:
    said once per name, on rank 0, as sparse_dp says it (silently before: 0.17 relative off per step); equal values and
    counted means are not said."""
    like, warnings = torch.tensor(0.0, dtype=torch.float64), WarningCache()
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            whole_value([(None, [0.5], None, 3.0), (None, [0.2], None, 4.0)], like, None, "acc_ratio", warnings)
        whole_value([(None, [0.5], None, 3.0), (None, [0.5], None, 4.0)], like, None, "lr", warnings)
        whole_value([(None, [0.5], 10, 3.0), (None, [0.2], 30, 4.0)], like, None, "acc_mean", warnings)
    said = [r.getMessage() for r in caplog.records if "sync_dist=True) differs between ranks" in r.getMessage()]
    assert len(said) == 1 and "self.log('acc_ratio', ..., sync_dist=True)" in said[0], said


def _levels(coeffs: list[float], values: list[float], rows: list[int]) -> Summary:
    """A rank's summary of a logged ``sum(losses) / len(losses)`` over decoder levels: one call per level it reached."""
    site = SiteTerms(7, "completion.py:157", "F.binary_cross_entropy_with_logits", True, [False] * len(coeffs),
                     coeffs, [float(r) for r in rows], values, rows, False, [False] * len(coeffs), [0] * len(coeffs))
    return Summary(None, 6, 6.0, [site], [(0, j) for j in range(len(coeffs))], tolerance=1e-15)


def test_a_logged_loss_whose_ranks_called_it_different_numbers_of_times_is_said_with_its_reason(caplog):
    """The completion example under sparse_ddp (2 gloo ranks, float64): validation's decoder prunes by its own scores
    and stopped after the first level on one rank's share, so the logged val_loss (a mean over the levels reached) had
    no global value and was weighted by n_r, 3.8e-3 off one device's, said only as a value that "differs between
    ranks and is not a mean the step computed". The reason is said now, once per name, with the fix."""
    like, warnings = torch.tensor(0.0, dtype=torch.float64), WarningCache()
    rows = [(_levels([0.5, 0.5], [0.7, 0.6], [300, 120]), [0.65], None, 6.0), (_levels([1.0], [0.8], [250]), [0.8], None, 6.0)]
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            value = whole_value(rows, like, None, "val_loss", warnings)
    said = [r.getMessage() for r in caplog.records if "self.log('val_loss', ...) is a combination" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("sparse_ddp:") and "different numbers of times" in said[0], said
    assert "call the loss at every level" in said[0] and "differs between ranks" not in caplog.text
    assert float(value) == (0.65 + 0.8) / 2  # weighted by n_r, as the line says


def test_a_sum_or_maximum_of_the_loss_across_ranks_is_the_batch_s():
    """reduce_fx="sum" of the loss logged with sync_dist=True was each rank's own loss summed over the ranks (2x one
    device's on 2 ranks), "max" the larger of the ranks' own: each rank now accumulates the batch's value, a sum its
    1 / world_size share of it, which Lightning's reduction across ranks gives back."""
    mine = {"s": _Call(1.0, "sum"), "m": _Call(1.0, "max")}
    ranks = _ranks((2, {"s": (1.0, 4, False), "m": (1.0, 4, False)}), (2, {"s": (3.0, 4, False), "m": (3.0, 4, False)}))
    settled = settle(ranks, _mean_of_rows, mine)
    assert float(settled["s"][0]) * 2 == 2.0 and float(settled["m"][0]) == 2.0  # the batch's 2.0, as one device's


def test_an_integer_count_logged_as_a_mean_is_the_ranks_sum(caplog):
    """mask.sum() logged with sync_dist=True was the ranks' counts averaged (37 where one device logs 74), said as
    "not a mean" with fixes that give no count. It is the ranks' sum, as sparse_dp sums its replicas' integers."""
    rows = [(None, [37.0], None, 3.0), (None, [37.0], None, 4.0)]
    with caplog.at_level(logging.INFO):
        value = whole_value(rows, torch.tensor(37), None, "count", WarningCache())
    assert value.dtype == torch.int64 and int(value) == 74 and "differs between ranks" not in caplog.text


def test_a_summed_value_is_held_only_where_every_rank_holds_it():
    """A count logged with reduce_fx="sum" whose value a mean of the step also holds on one rank (an accuracy of 1.0
    beside a count of 1) was held there for the step's gather while the other rank let Lightning reduce it at once: the
    ranks' collectives no longer matched and both waited until the process group timed out. The hold is agreed on by
    every rank now (``all_ranks``, one all-reduce of a flag): held where every rank reads it as a mean, else reduced by
    Lightning on every rank."""
    asked = []

    def on_other_rank_not(flag: bool) -> bool:  # the other rank's row of the count matched no mean
        asked.append(flag)
        return False

    def counted(value):
        return (None, [float(value)], 1 if float(value) == 1.0 else None, 1.0)  # 1.0 matched to a mean's count

    results = _ResultCollection(training=True)
    with HeldMeans(results, row=counted, all_ranks=on_other_rank_not) as means:
        _log(results, "acc", 1.0, on_step=False, on_epoch=True, sync_dist=True)  # a mean: held, no agreement asked
        _log(results, "n_seen", 1.0, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
    assert asked == [True] and list(means.calls) == ["training_step.acc"]
    assert float(results["training_step.n_seen"].value) == 1.0  # reduced by Lightning, as on the other rank
    results = _ResultCollection(training=True)
    with HeldMeans(results, row=counted, all_ranks=lambda flag: flag) as means:  # every rank reads it as a mean
        _log(results, "n_seen", 1.0, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
    assert list(means.calls) == ["training_step.n_seen"]


def test_a_constant_batch_size_equal_to_every_share_is_the_constant_once_seen_as_one(caplog):
    """``batch_size=self.hparams.batch_size`` (3, the loader's per-rank batch size): at steps where both ranks' shares had
    3 samples it was read as each share's count (6 for the step), at a step of shares of 4 and 3 as the constant 3, so
    the epoch's mean weighed the steps unlike one device (6.2e-3 off), silently. Once read as a constant it stays one,
    and the earlier steps' reading is said."""
    constants: dict[str, bool] = {}
    mine = {"c": _Call(1.0)}
    equal = _ranks((3, {"c": (1.0, 3, True)}), (3, {"c": (1.0, 3, True)}))
    uneven = _ranks((4, {"c": (1.0, 3, True)}), (3, {"c": (1.0, 3, True)}))
    cache = WarningCache()
    assert settle(equal, _mean_of_rows, mine, constants, cache)["c"][1] == 6  # no step told it from the shares' count
    with caplog.at_level(logging.INFO):
        assert settle(uneven, _mean_of_rows, mine, constants, cache)["c"][1] == 3
    said = [r.getMessage() for r in caplog.records if "is one constant" in r.getMessage()]
    assert len(said) == 1 and "batch_size=3" in said[0], said
    assert settle(equal, _mean_of_rows, mine, constants, cache)["c"][1] == 3  # the constant from now on
