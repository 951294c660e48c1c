"""Capture of torch's mean-reduced losses: every denominator against torch's own ``reduction="sum"``,
and how a step's loss is read as a linear combination of its terms."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sparse_dp.loss.capture import TermCapture
from lightning_sparse_dp.loss.denominators import CAPTURED, bind, denominator, shared_arguments
from lightning_sparse_dp.loss.observer import outside_capture

_DEFAULT_DTYPE = torch.get_default_dtype()
torch.set_default_dtype(torch.float64)  # for the data below only (restored after it)
g = torch.Generator().manual_seed(0)
N, C = 23, 5
logits = torch.randn(N, C, generator=g)
labels = torch.randint(0, C, (N,), generator=g)
probs = torch.softmax(torch.randn(N, C, generator=g), 1)
x, y = torch.randn(N, 3, generator=g), torch.randn(N, 3, generator=g)
p01 = torch.rand(N, 3, generator=g)
class_weight = torch.rand(C, generator=g) + 0.1


def _ignored(index: int, fraction: float) -> torch.Tensor:
    t = labels.clone()
    t[torch.rand(N, generator=torch.Generator().manual_seed(1)) < fraction] = index
    return t


CASES = {
    "ce": (F.cross_entropy, (logits, labels), {}),
    "ce_ignore255": (F.cross_entropy, (logits, _ignored(255, 0.3)), {"ignore_index": 255}),
    "ce_ignore-100": (F.cross_entropy, (logits, _ignored(-100, 0.3)), {}),
    "ce_weight_ignore": (F.cross_entropy, (logits, _ignored(255, 0.3)), {"ignore_index": 255, "weight": class_weight}),
    "ce_smoothing": (F.cross_entropy, (logits, _ignored(-100, 0.2)), {"label_smoothing": 0.1}),
    "ce_smoothing_weight": (
        F.cross_entropy,
        (logits, _ignored(-100, 0.2)),
        {"label_smoothing": 0.2, "weight": class_weight},
    ),
    "ce_probabilities": (F.cross_entropy, (logits, probs), {}),
    "ce_probabilities_weight_smoothing": (
        F.cross_entropy,
        (logits, probs),
        {"weight": class_weight, "label_smoothing": 0.1},
    ),
    "ce_spatial": (
        F.cross_entropy,
        (torch.randn(4, C, 3, 2, generator=g), torch.randint(0, C, (4, 3, 2), generator=g)),
        {},
    ),
    "nll_weight_ignore": (
        F.nll_loss,
        (torch.log_softmax(logits, 1), _ignored(7, 0.4)),
        {"ignore_index": 7, "weight": class_weight},
    ),
    "bce": (F.binary_cross_entropy, (p01, (y > 0).double()), {}),
    "bce_weight": (F.binary_cross_entropy, (p01, (y > 0).double()), {"weight": torch.rand(N, 3, generator=g)}),
    "bce_logits_pos_weight": (
        F.binary_cross_entropy_with_logits,
        (x, (y > 0).double()),
        {"pos_weight": torch.rand(3, generator=g)},
    ),
    "mse": (F.mse_loss, (x, y), {}),
    "mse_weight": (F.mse_loss, (x, y), {"weight": torch.rand(N, 3, generator=g)}),
    "mse_broadcast": (F.mse_loss, (x, y[:1]), {}),
    "l1": (F.l1_loss, (x, y), {}),
    "l1_weight": (F.l1_loss, (x, y), {"weight": torch.rand(N, 3, generator=g)}),
    "smooth_l1": (F.smooth_l1_loss, (x, y), {"beta": 0.5}),
    "huber": (F.huber_loss, (x, y), {"delta": 0.7}),
    "huber_weight": (F.huber_loss, (x, y), {"delta": 0.7, "weight": torch.rand(N, 3, generator=g)}),
    "kl_batchmean": (F.kl_div, (torch.log_softmax(logits, 1), probs), {"reduction": "batchmean"}),
    "kl_mean": (F.kl_div, (torch.log_softmax(logits, 1), probs), {}),
    "legacy_size_average": (F.mse_loss, (x, y), {"size_average": True}),
}
torch.set_default_dtype(_DEFAULT_DTYPE)


@pytest.mark.filterwarnings("ignore:Using a target size", "ignore:reduction. 'mean' divides", "ignore:size_average")
@pytest.mark.parametrize("case", CASES)
def test_denominator_is_torchs_sum_over_its_mean(case):
    func, args, kwargs = CASES[case]
    if "weight" in kwargs and "weight" not in inspect.signature(func).parameters:
        pytest.skip(f"this torch's {func.__name__} has no weight argument (added in a later torch)")
    mean = func(*args, **kwargs)
    legacy = {k: None for k in ("size_average", "reduce") if k in kwargs}
    total = func(*args, **{**kwargs, **legacy, "reduction": "sum"})
    d = float(denominator(func, bind(func, args, kwargs)))
    assert d > 0
    torch.testing.assert_close(mean * d, total, rtol=1e-13, atol=0)


def test_every_captured_loss_has_a_case():
    assert {CASES[c][0] for c in CASES} == set(CAPTURED)


def test_all_ignored_has_denominator_zero_and_the_term_is_zero_not_nan():
    t = torch.full((N,), 255)
    capture = TermCapture()
    with capture:
        loss = nn.CrossEntropyLoss(ignore_index=255)(logits, t)
    assert float(capture.terms[0].denominator) == 0 and float(loss) == 0.0
    assert torch.isnan(F.cross_entropy(logits, t, ignore_index=255))  # what torch itself gives


def _capture(fn):
    capture = TermCapture()
    value = capture.run(fn)  # as the strategies run a step: the user's frames end at run()
    return capture, value


def test_linear_combinations_are_read_off():
    w = torch.tensor(0.25)  # a scheduled coefficient held in a tensor

    def step():
        levels = [F.binary_cross_entropy_with_logits(x[:, i], (y[:, i] > 0).double()) for i in range(3)]
        ce = nn.CrossEntropyLoss(ignore_index=255)(logits, _ignored(255, 0.3))
        total = sum(levels) / 3 + 0.5 * ce - w * F.l1_loss(x, y)
        total = (2 - total.double()).detach() * 1.0
        return -total + 2

    capture, loss = _capture(step)
    coeffs, r, _ = capture.combination(loss)
    assert [t.name for t in capture.terms] == ["F.binary_cross_entropy_with_logits"] * 3 + [
        "F.cross_entropy",
        "F.l1_loss",
    ]
    assert coeffs == pytest.approx([1 / 3] * 3 + [0.5, -0.25]) and r == 0.0


@pytest.mark.parametrize(
    "expr, why",
    [
        (lambda a, b: a.sqrt(), "sqrt"),
        (lambda a, b: a * b, "multiplies two losses"),
        (lambda a, b: torch.stack([a, b]).max(), "stack of losses other than by its mean or sum"),
        (lambda a, b: torch.cat([a.view(1), b.view(1)]).mean(), "list holding a loss"),
        (lambda a, b: a * nn.Parameter(torch.tensor(2.0)), "requires grad"),
        (lambda a, b: F.poisson_nll_loss(x, y.abs()) + a, "poisson_nll_loss"),
    ],
)
def test_non_linear_uses_are_named(expr, why):
    capture, loss = _capture(lambda: expr(F.mse_loss(x, y), F.l1_loss(x, y)))
    assert why in capture.combination(loss)


def test_a_stack_of_losses_reduced_by_its_mean_or_sum_is_a_combination():
    def step():
        losses = [F.mse_loss(x[i], y[i]) for i in range(3)]
        return torch.stack(losses).mean() + 0.5 * (2 * torch.stack(losses[:2])).sum()

    capture, loss = _capture(step)
    coeffs, r, _ = capture.combination(loss)
    assert coeffs == pytest.approx([1 / 3 + 1.0, 1 / 3 + 1.0, 1 / 3]) and r == 0.0


def test_terms_know_their_call_site_and_whether_it_is_in_a_loop():
    def per_sample():
        return [F.mse_loss(x[i], y[i]) for i in range(2)]

    def step():
        first = F.l1_loss(x, y)
        return first + sum(per_sample()) + F.cross_entropy(logits, labels, reduction="sum")

    capture, loss = _capture(step)
    sites = [(t.site, t.in_loop, t.is_sum) for t in capture.terms]
    assert [s[1:] for s in sites] == [(False, False), (True, False), (True, False), (False, True)]
    assert sites[1][0] == sites[2][0] != sites[0][0] != sites[3][0]
    assert all(t.where.startswith("test_terms.py:") for t in capture.terms)
    assert [t.rows for t in capture.terms] == [N, int(x[0].shape[0]), int(x[0].shape[0]), N]


def test_a_hand_written_mean_is_a_remainder_and_no_term_is_not_a_combination():
    mask = labels != 0
    capture, loss = _capture(lambda: F.mse_loss(x, y) + (x.pow(2).sum(1) * mask).sum() / mask.sum())
    coeffs, r, _ = capture.combination(loss)
    assert coeffs == [1.0] and r == pytest.approx(float((x.pow(2).sum(1) * mask).sum() / mask.sum()))
    capture, loss = _capture(lambda: F.cross_entropy(logits, labels, reduction="none").mean())
    assert "not computed from torch's mean-reduced losses" in capture.combination(loss)


def test_gradient_is_scaled_by_the_terms_scale():
    a = x.clone().requires_grad_()
    capture, loss = _capture(lambda: F.mse_loss(a, y) + 2 * F.l1_loss(a, y))
    capture.terms[0].scale, capture.terms[1].scale = 3.0, 0.0
    loss.backward()
    b = x.clone().requires_grad_()
    (3 * F.mse_loss(b, y)).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-14, atol=0)


def test_run_observes_the_step_in_its_thread_and_leaves_torch_as_it_was():
    """The capture is the step's thread's torch function mode from the start (issue 57): nothing of torch is replaced,
    and a loss imported by name is captured as ``F.*`` is."""
    from torch.nn.functional import cross_entropy  # imported by name: torch's own function

    before = (F.mse_loss, F.cross_entropy, torch.mean)
    capture = TermCapture()

    def step():
        assert torch._C._len_torch_function_stack() == 1  # the whole step runs under the thread's mode
        assert (F.mse_loss, F.cross_entropy, torch.mean) == before and F.mse_loss is before[0]
        first = nn.MSELoss()(x, y)  # nn.*Loss -> F.mse_loss
        return first + cross_entropy(logits, labels)

    loss = capture.run(step)
    assert torch._C._len_torch_function_stack() == 0 and F.mse_loss is before[0]
    assert [t.name for t in capture.terms] == ["F.mse_loss", "F.cross_entropy"]
    assert capture.combination(loss)[0] == [1.0, 1.0]


def test_a_loss_imported_by_name_before_any_other_is_captured():
    from torch.nn.functional import cross_entropy

    capture = TermCapture()
    loss = capture.run(lambda: cross_entropy(logits, labels))
    assert [t.name for t in capture.terms] == ["F.cross_entropy"] and capture.combination(loss)[0] == [1.0]


@pytest.mark.parametrize("keep", [True, False, torch.tensor(True), torch.tensor(False)])  # tensors: the CUDA path
def test_scaled_value_and_gradient(keep):
    from lightning_sparse_dp.loss.term import scaled_value as _scaled

    a = torch.tensor(float("nan") if not bool(keep) else 2.0, dtype=torch.float64, requires_grad=True)
    factor = torch.ones((), dtype=torch.float64)
    out = _scaled(a, keep, factor)
    factor.data.fill_(3.0)  # as Term.scale does after the step
    out.backward()
    assert float(out.detach()) == (2.0 if bool(keep) else 0.0) and float(a.grad) == (3.0 if bool(keep) else 0.0)


def test_outside_capture_pops_the_mode():
    seen = []

    @outside_capture
    def metric_update(logits, labels):  # what a metric computes: never one of the step's terms
        seen.append(torch._C._len_torch_function_stack())
        return F.cross_entropy(logits, labels) * 2

    capture = TermCapture()

    def step():
        metric_update(logits, labels)  # before the first loss: run with the mode popped, its loss not a term
        assert torch._C._len_torch_function_stack() == 1
        loss = F.mse_loss(x, y)
        metric_update(logits, labels)  # after it: the same, then the mode is back
        assert torch._C._len_torch_function_stack() == 1
        return 2 * loss  # still followed

    loss = capture.run(step)
    assert seen == [0, 0] and [t.name for t in capture.terms] == ["F.mse_loss"]
    assert capture.combination(loss)[0] == [2.0]
    assert outside_capture(lambda: torch._C._len_torch_function_stack())() == 0  # no capture: a plain call


def test_outside_capture_leaves_the_mode_when_the_step_entered_another_after_it():
    class Outer(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    depths = []
    capture = TermCapture()

    def step():
        loss = F.mse_loss(x, y)
        with Outer():  # on top of the capture: popping the top would pop this one
            outside_capture(lambda: depths.append(torch._C._len_torch_function_stack()))()
            tripled = loss * 3  # followed through both modes
        return tripled

    loss = capture.run(step)
    assert depths == [2] and capture.combination(loss)[0] == [3.0]


def test_a_reduction_over_rows_is_a_statistic_and_per_row_values_are_not():
    from lightning_sparse_dp.loss.sites import reduces_rows

    w = torch.ones(x.shape[1], dtype=x.dtype, requires_grad=True)  # a parameter
    a = x * w  # rows of the chunk: the batch enters without a gradient, as a network's input does
    for statistic in (
        a.mean(0),
        a.sum(0, keepdim=True) * 2,
        a.max(0).values,
        a.amax(0).unsqueeze(0),
        a.mean(),
        a.std(0),
    ):
        assert reduces_rows(statistic)
    index = labels % 2
    rows = (
        a,
        a[labels > 1],
        a.sum(1),
        a * 2 + 1,
        torch.stack([a[index == s].mean(0) for s in range(2)]),
        a.mean(0).detach(),
        a / (w.pow(2).mean() + 1).sqrt(),  # a statistic of the parameter alone: one value in every replica
    )
    assert not any(reduces_rows(r) for r in rows)


def test_the_arguments_every_row_shares_are_the_ones_compared_across_replicas():
    """``shared_arguments``: a class weight and ``pos_weight`` always, an element weight only when it broadcasts over
    the input's rows (a per-class ``[C]`` weight), never one that gives each row its own (also in a one-row chunk)."""
    x, y, p = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0]), torch.rand(5, 3)
    w, rows = torch.rand(3), torch.rand(5, 3)

    def shared(func, *args, **kwargs):
        return [t.shape for t in shared_arguments(func, bind(func, args, kwargs))]

    assert shared(F.cross_entropy, x, y, weight=w) == [(3,)]
    assert shared(F.cross_entropy, x, y) == [] and shared(F.nll_loss, x, y, weight=w) == [(3,)]
    assert shared(F.binary_cross_entropy_with_logits, x, p, weight=rows, pos_weight=w) == [(3,)]
    assert shared(F.binary_cross_entropy, p, p, weight=w) == [(3,)]
    assert shared(F.binary_cross_entropy, p, p, weight=rows) == []
    assert shared(F.binary_cross_entropy, p[:1], p[:1], weight=rows[:1]) == []  # one row, its own weight
    assert shared(F.mse_loss, x, p) == []


_H = (4, 8, 3, 3, 3)
_PER_SAMPLE_HEADS = {
    "adaptive_avg_pool3d": lambda h: F.adaptive_avg_pool3d(h, 1).flatten(1),
    "adaptive_max_pool3d": lambda h: F.adaptive_max_pool3d(h, 1).flatten(1),
    "adaptive_avg_pool2d": lambda h: F.adaptive_avg_pool2d(h[:, :, 0], 1).flatten(1),
    "adaptive_avg_pool1d": lambda h: F.adaptive_avg_pool1d(h.flatten(2), 1).flatten(1),
    "avg_pool3d": lambda h: F.avg_pool3d(h, 3).flatten(1),
    "mean_of_spatial_dims": lambda h: h.mean(dim=(2, 3, 4)),
    "mean_of_last_dim": lambda h: h.flatten(2).mean(-1),
    "amax_of_negative_dims": lambda h: h.amax(dim=(-3, -2, -1)),
}
_CHUNK_STATISTICS = {
    "mean_over_rows": lambda h: h.mean(0),
    "mean_over_rows_negative": lambda h: h.mean(-5),
    "mean_of_everything": lambda h: h.mean(),
    "max_over_rows": lambda h: h.max(0).values,
}


@pytest.mark.parametrize("head", list(_PER_SAMPLE_HEADS))
def test_per_sample_pooling_heads_are_not_a_statistic_of_the_chunk(head):
    """Dense pooling heads pool each sample alone (issue 59: ``adaptive_avg_pool3d`` was taken for a statistic of the
    chunk, autograd saving its dims -1..-3 as unsigned numbers, the first of which is a multiple of 5)."""
    from lightning_sparse_dp.loss.sites import reduces_rows

    h = torch.randn(*_H, requires_grad=True)
    assert not reduces_rows(_PER_SAMPLE_HEADS[head](h))


@pytest.mark.parametrize("head", list(_CHUNK_STATISTICS))
def test_reductions_over_the_rows_are_a_statistic_of_the_chunk(head):
    from lightning_sparse_dp.loss.sites import reduces_rows

    # a layer's output as autograd sees it: the batch (no gradient) times a parameter; a leaf that needs a gradient
    # is a parameter, whose statistics are one value in every replica (tests/loss/test_statistics.py)
    h = torch.randn(*_H) * torch.ones((), requires_grad=True)
    assert reduces_rows(_CHUNK_STATISTICS[head](h))


@pytest.mark.parametrize("pool", ["MinkowskiGlobalAvgPooling", "MinkowskiGlobalMaxPooling", "MinkowskiGlobalSumPooling"])
def test_me_global_pooling_is_one_row_per_sample_not_a_statistic(pool):
    import MinkowskiEngine as ME

    from lightning_sparse_dp.loss.sites import reduces_rows

    coords = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.int32)
    x = ME.SparseTensor(torch.randn(4, 3, requires_grad=True), coords)
    assert not reduces_rows(getattr(ME, pool)()(x).F)


def test_full_sums_and_means_are_terms_whether_their_input_is_positional_or_a_keyword():
    """``x.sum()``, ``torch.sum(input=x)``, ``torch.mean(x)``: terms (issue 66), a sum without denominator, a mean over
    its elements; a reduction along a dim, an integer count and a tensor that needs no gradient are not."""
    a = x.clone().requires_grad_()
    capture = TermCapture()
    value = capture.run(lambda: a.sum() + torch.sum(input=a) + 2 * torch.mean(a) + a.sum(0)[0] + (labels > 0).sum()
                        + x.sum())
    assert [t.name for t in capture.terms] == ["torch.sum", "torch.sum", "torch.mean"]
    assert [t.denominator for t in capture.terms] == [None, None, float(a.numel())]
    assert capture.combination(value)[0] == [1.0, 1.0, 2.0]
