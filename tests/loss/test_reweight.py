"""lightning_sparse_dp/loss/reweight.py: the re-weighting invariant, on parts whose losses are built as the capture
builds them (each captured term multiplied by its factor in the graph), for both strategies' reductions.

Independent reference: the gradient one device's loss gives, written out by hand (each term's own share of its
whole-batch term, or each part's share of the loss), against autograd through the strategy's reduction."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse_dp.loss.reweight import PartWeight, scaled, shifted
from lightning_sparse_dp.loss.term import Term
from lightning_sparse_dp.loss.weights import weighted_sum

REL = 1e-12


class _Capture:
    """What PartWeight.scale_terms reads of a TermCapture: its terms, each with the factor the capture multiplies in."""

    def __init__(self, count: int) -> None:
        self.terms = [Term("term", None, torch.ones((), dtype=torch.float64)) for _ in range(count)]


def _part_losses(xs, coefficients, captures, remainders):
    """Part i's loss: sum_t c_it * (x_it * factor_it) + r_i, the factors the captures hold."""
    return [
        sum(c * x * term._factor for c, x, term in zip(cs, row, capture.terms)) + r
        for cs, row, capture, r in zip(coefficients, xs, captures, remainders)
    ]


def _gradients(total, xs, remainders):
    grads = torch.autograd.grad(total, [x for row in xs for x in row] + list(remainders))
    n = sum(len(row) for row in xs)
    return grads[:n], grads[n:]


parts = st.integers(min_value=2, max_value=4)
floats = st.floats(min_value=0.05, max_value=3.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(parts, st.integers(min_value=1, max_value=3), st.data())
def test_shared_terms_reach_their_inputs_with_their_own_share_under_either_reduction(n, t, data):
    weights = [data.draw(floats) for _ in range(n)]
    total = sum(weights)
    weights = [w / total for w in weights]
    shares = [[data.draw(floats) for _ in range(t)] for _ in range(n)]
    coefficients = [[data.draw(floats) for _ in range(t)] for _ in range(n)]
    for ddp in (False, True):
        xs = [[torch.tensor(data.draw(floats), dtype=torch.float64, requires_grad=True) for _ in range(t)] for _ in range(n)]
        remainders = [torch.tensor(1.0, dtype=torch.float64, requires_grad=True) for _ in range(n)]
        captures = [_Capture(t) for _ in range(n)]
        if ddp:  # DDP: every rank's loss times its loss factor, the gradients averaged over the world size
            weights_of = [PartWeight.rank(n, w, s) for w, s in zip(weights, shares)]
        else:  # sparse_dp: the gather's weighted sum of the replicas' losses
            weights_of = [PartWeight.replica(w, s) for w, s in zip(weights, shares)]
        for part, capture in zip(weights_of, captures):
            part.scale_terms(capture)
        losses = _part_losses(xs, coefficients, captures, remainders)
        if ddp:
            reduced = sum(scaled(loss, part.loss_factor) for loss, part in zip(losses, weights_of)) / n
        else:
            reduced = weighted_sum(losses, [p.gather for p in weights_of], torch.device("cpu"))
        term_grads, remainder_grads = _gradients(reduced, xs, remainders)
        expected = [c * s for cs, ss in zip(coefficients, shares) for c, s in zip(cs, ss)]
        for got, want in zip(term_grads, expected):
            assert abs(float(got) - want) <= REL * abs(want), (ddp, float(got), want)
        for got, part in zip(remainder_grads, weights_of):  # the remainder passes with the part's reduction weight
            assert abs(float(got) - part.gather) <= REL * part.gather


@settings(max_examples=60, deadline=None)
@given(parts, st.data())
def test_without_shares_each_part_weighs_its_share_of_one_devices_loss(n, data):
    counts = [data.draw(st.integers(min_value=0, max_value=9)) for _ in range(n)]
    total = sum(counts) or 1
    weights = [c / total for c in counts]
    for ddp in (False, True):
        xs = [torch.tensor(data.draw(floats), dtype=torch.float64, requires_grad=True) for _ in range(n)]
        losses = [x * 2.0 for x in xs]
        if ddp:
            parts_ = [PartWeight.rank(n, w) for w in weights]
            reduced = sum(scaled(loss, p.loss_factor) for loss, p in zip(losses, parts_)) / n
        else:
            parts_ = [PartWeight.replica(w) for w in weights]
            assert all(p.loss_factor == 1.0 for p in parts_)  # the gather applies the weight itself
            reduced = weighted_sum(losses, [p.gather for p in parts_], torch.device("cpu"))
        for x, w in zip(xs, weights):
            (grad,) = torch.autograd.grad(reduced, [x], retain_graph=True)
            assert abs(float(grad) - 2.0 * w) <= REL * max(2.0 * w, 1e-300)


def test_a_part_of_weight_zero_adds_an_exact_zero_with_a_zero_gradient():
    x = torch.tensor(float("nan"), dtype=torch.float64, requires_grad=True)  # a mean over nothing
    out = scaled(x * 1.0, PartWeight.rank(3, 0.0).loss_factor)
    assert out.item() == 0.0
    (grad,) = torch.autograd.grad(out, [x])
    assert float(grad) == 0.0
    assert PartWeight.replica(0.0).inverse == 0.0 and PartWeight.rank(3).loss_factor == 1.0


@given(parts, st.data())
def test_shifted_losses_sum_to_the_whole_batchs_value_and_keep_their_gradients(n, data):
    weights = [data.draw(floats) for _ in range(n)]
    weights = [w / sum(weights) for w in weights]  # the replicas' weights in the gather sum to 1
    xs = [torch.tensor(data.draw(floats), dtype=torch.float64, requires_grad=True) for _ in range(n)]
    value = data.draw(floats)
    out = shifted([x * 1.0 for x in xs], weights, value)
    assert abs(sum(w * o.item() for w, o in zip(weights, out)) - value) <= 1e-12 * max(1.0, abs(value))
    for x, o in zip(xs, out):
        (grad,) = torch.autograd.grad(o, [x])
        assert float(grad) == 1.0
