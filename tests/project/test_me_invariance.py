"""Batch-composition invariance of MinkowskiEngine ops on CPU, in float64.

Data parallelism stands on one property: what a network computes for a sample does not depend on
which other samples share its batch. For every op family that ME's examples use, each test builds
the same sample alone, first in a batch and in the middle of a batch, runs the op, and checks:

* per-sample outputs (rows of the sample's batch index, compared by coordinates) are the same to
  1e-12 relative, coordinates exactly;
* per-point outputs (slice, interpolation) are the same for the sample's points;
* global outputs (global pooling) have one row per sample, in batch-index order, as ME's examples
  and the GPU backend assume (``out.F[b]`` is sample ``b``);
* gradients of a fixed per-sample loss reach the sample's input features (and the op's parameters)
  identically, and nothing reaches the other samples.

ME 0.5.4 as released fails several of these on CPU (global pooling rows out of batch order, index
mode writing rows permuted, default global modes raising for batches > 1, slice from strided
tensors); scripts/build_minkowski.sh patches them (see scripts/minkowski_patches/).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import MinkowskiEngine as ME
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.invariance import CHANNELS, Batch, D, Pair, assert_close, check_invariance, make_sample

# ME_INVARIANCE_NO_SHRINK=1: report failures without shrinking them (to count the failures of an
# unpatched ME quickly)
SETTINGS = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    **({"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get("ME_INVARIANCE_NO_SHRINK") else {}),
)


# --------------------------------------------------------------------------------------------
# the op families


@dataclass
class Case:
    name: str
    make: Callable[[], torch.nn.Module]
    forward: Callable  # (module, Batch) -> output
    kind: str  # "sparse", "global", "points", "field", "queries"
    field_input: bool = False
    eval_mode: bool = False


def seq(*layers):
    return torch.nn.Sequential(*layers)


def conv(k, s=1, **kw):
    return ME.MinkowskiConvolution(CHANNELS, 4, kernel_size=k, stride=s, dimension=D, **kw)


def on_sparse(module, batch):
    return module(batch.sparse())


def strided_then(*layers):
    """Layers applied after a stride-2 convolution (for transposed ops)."""
    return seq(ME.MinkowskiConvolution(CHANNELS, CHANNELS, kernel_size=2, stride=2, dimension=D), *layers)


POOL = {"max": ME.MinkowskiMaxPooling, "avg": ME.MinkowskiAvgPooling, "sum": ME.MinkowskiSumPooling}
GLOBAL_MODES = [m for name, m in ME.PoolingMode.__members__.items() if name.startswith("GLOBAL_")]
QUANT = [
    ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE,
    ME.SparseTensorQuantizationMode.UNWEIGHTED_SUM,
    ME.SparseTensorQuantizationMode.RANDOM_SUBSAMPLE,
    ME.SparseTensorQuantizationMode.MAX_POOL,
]


class Slice(torch.nn.Module):
    """TensorField -> sparse -> max pooling to tensor stride ``stride`` -> linear -> slice back to the points."""

    def __init__(self, stride, mode=ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE):
        super().__init__()
        self.mode = mode
        self.lin = ME.MinkowskiLinear(CHANNELS, 4)
        self.pools = seq(*[ME.MinkowskiMaxPooling(2, 2, dimension=D) for _ in range(int(np.log2(stride)))])

    def forward(self, batch):
        field = batch.field(self.mode)
        return self.lin(self.pools(field.sparse())).slice(field)


def generative():
    return seq(
        ME.MinkowskiConvolution(CHANNELS, CHANNELS, kernel_size=2, stride=2, dimension=D),
        ME.MinkowskiGenerativeConvolutionTranspose(CHANNELS, 4, kernel_size=2, stride=2, dimension=D),
    )


class Prune(torch.nn.Module):
    """Generative transposed convolution, then pruning of the voxels whose first feature is <= 0."""

    def __init__(self):
        super().__init__()
        self.gen, self.prune = generative(), ME.MinkowskiPruning()

    def forward(self, x):
        y = self.gen(x)
        return self.prune(y, (y.F[:, 0] > 0).detach())


class Interp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.interp = conv(3), ME.MinkowskiInterpolation()

    def forward(self, batch):
        return self.interp(self.conv(batch.sparse()), batch.queries)


class AtCoordinates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv(3)

    def forward(self, batch):
        return self.conv(batch.sparse()).features_at_coordinates(batch.queries.floor())


class Union(torch.nn.Module):
    """Union of a tensor and its stride-2-and-back generative reconstruction (different coordinates)."""

    def __init__(self):
        super().__init__()
        self.lin = ME.MinkowskiLinear(CHANNELS, 4)
        self.gen = generative()
        self.union = ME.MinkowskiUnion()

    def forward(self, x):
        return self.union(self.lin(x), self.gen(x))


def field_forward(mode):
    return lambda module, batch: module(batch.field(mode).sparse())


def hyper_cross():
    generator = ME.KernelGenerator(kernel_size=3, region_type=ME.RegionType.HYPER_CROSS, dimension=D)
    return ME.MinkowskiConvolution(CHANNELS, 4, kernel_generator=generator, dimension=D)


class Splat(torch.nn.Module):
    """TensorField.splat(): trilinear splatting of the points onto the grid."""

    def __init__(self):
        super().__init__()
        self.lin = ME.MinkowskiLinear(CHANNELS, 4)

    def forward(self, batch):
        return self.lin(batch.field().splat())


CASES = [
    Case("conv", lambda: conv(3), on_sparse, "sparse"),
    Case("conv hyper-cross kernel", hyper_cross, on_sparse, "sparse"),
    Case("conv dilated", lambda: conv(3, dilation=2), on_sparse, "sparse"),
    Case("conv strided k2", lambda: conv(2, 2), on_sparse, "sparse"),
    Case("conv strided k3", lambda: conv(3, 2), on_sparse, "sparse"),
    Case("conv expand_coordinates", lambda: conv(3, expand_coordinates=True), on_sparse, "sparse"),
    Case(
        "conv transposed",
        lambda: strided_then(ME.MinkowskiConvolutionTranspose(CHANNELS, 4, 2, 2, dimension=D)),
        on_sparse,
        "sparse",
    ),
    Case(
        "conv transposed k3",
        lambda: strided_then(ME.MinkowskiConvolutionTranspose(CHANNELS, 4, 3, 2, dimension=D)),
        on_sparse,
        "sparse",
    ),
    Case("conv generative transposed", generative, on_sparse, "sparse"),
    Case("channelwise conv", lambda: ME.MinkowskiChannelwiseConvolution(CHANNELS, 3, dimension=D), on_sparse, "sparse"),
    Case(
        "channelwise conv strided",
        lambda: ME.MinkowskiChannelwiseConvolution(CHANNELS, 3, stride=2, dimension=D),
        on_sparse,
        "sparse",
    ),
    *[Case(f"{n} pooling", (lambda P=P: P(3, 1, dimension=D)), on_sparse, "sparse") for n, P in POOL.items()],
    *[Case(f"{n} pooling strided", (lambda P=P: P(2, 2, dimension=D)), on_sparse, "sparse") for n, P in POOL.items()],
    *[
        Case(f"{n} pooling strided k3", (lambda P=P: P(3, 2, dimension=D)), on_sparse, "sparse")
        for n, P in POOL.items()
    ],
    Case(
        "pooling transposed", lambda: strided_then(ME.MinkowskiPoolingTranspose(2, 2, dimension=D)), on_sparse, "sparse"
    ),
    *[
        Case(f"global pooling {m.name}", (lambda m=m: ME.MinkowskiGlobalPooling(m)), on_sparse, "global")
        for m in GLOBAL_MODES
    ],
    *[
        Case(f"{cls.__name__}()", cls, on_sparse, "global")
        for cls in (
            ME.MinkowskiGlobalPooling,
            ME.MinkowskiGlobalAvgPooling,
            ME.MinkowskiGlobalMaxPooling,
            ME.MinkowskiGlobalSumPooling,
        )
    ],
    *[
        Case(
            f"global pooling {m.name} after strided conv",
            (lambda m=m: seq(conv(2, 2), ME.MinkowskiGlobalPooling(m))),
            on_sparse,
            "global",
        )
        for m in GLOBAL_MODES
    ],
    Case(
        "broadcast addition",
        lambda: Pair(ME.MinkowskiBroadcastAddition(), conv(3), seq(conv(2, 2), ME.MinkowskiGlobalMaxPooling())),
        on_sparse,
        "sparse",
    ),
    Case(
        "broadcast multiplication",
        lambda: Pair(ME.MinkowskiBroadcastMultiplication(), conv(3), seq(conv(3), ME.MinkowskiGlobalPooling())),
        on_sparse,
        "sparse",
    ),
    Case(
        "broadcast concatenation",
        lambda: Pair(ME.MinkowskiBroadcastConcatenation(), conv(3), ME.MinkowskiGlobalPooling()),
        on_sparse,
        "sparse",
    ),
    Case("instance norm", lambda: seq(conv(3), ME.MinkowskiInstanceNorm(4)), on_sparse, "sparse"),
    Case(
        "linear / relu / dropout / batch norm (eval)",
        lambda: seq(
            ME.MinkowskiLinear(CHANNELS, 4), ME.MinkowskiReLU(), ME.MinkowskiDropout(0.5), ME.MinkowskiBatchNorm(4)
        ),
        on_sparse,
        "sparse",
        eval_mode=True,
    ),
    Case("ME.cat", lambda: Pair(ME.cat, conv(3), ME.MinkowskiLinear(CHANNELS, 2)), on_sparse, "sparse"),
    Case(
        "ME.cat strided",
        lambda: Pair(ME.cat, conv(2, 2), ME.MinkowskiMaxPooling(2, 2, dimension=D)),
        on_sparse,
        "sparse",
    ),
    Case("union", Union, on_sparse, "sparse"),
    Case("pruning", Prune, on_sparse, "sparse"),
    *[
        Case(
            f"TensorField.sparse() {q.name}",
            lambda: ME.MinkowskiLinear(CHANNELS, 4),
            field_forward(q),
            "sparse",
            field_input=True,
        )
        for q in QUANT
    ],
    *[
        Case(
            f"SparseTensor with duplicates {q.name}",
            lambda: ME.MinkowskiLinear(CHANNELS, 4),
            (lambda q=q: lambda module, batch: module(batch.sparse_with_duplicates(q)))(),
            "sparse",
            field_input=True,
        )
        for q in QUANT
    ],
    Case("TensorField.splat()", Splat, lambda m, b: m(b), "sparse", field_input=True),
    Case(
        "TensorField.sparse(tensor_stride=2)",
        lambda: ME.MinkowskiLinear(CHANNELS, 4),
        lambda m, b: m(b.field().sparse(tensor_stride=2)),
        "sparse",
        field_input=True,
    ),
    *[  # of the global pooling classes, only MinkowskiGlobalMaxPooling takes a TensorField
        Case(
            f"global max pooling {m.name} of a TensorField",
            (lambda m=m: ME.MinkowskiGlobalMaxPooling(m)),
            lambda module, batch: module(batch.field()),
            "global",
            field_input=True,
        )
        for m in GLOBAL_MODES
        if "MAX" in m.name
    ],
    Case(
        "TensorField.sparse() then global max pooling",
        ME.MinkowskiGlobalMaxPooling,
        field_forward(ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE),
        "global",
        field_input=True,
    ),
    *[
        Case(f"slice at stride {s}", (lambda s=s: Slice(s)), lambda m, b: m(b), "field", field_input=True)
        for s in (1, 2, 4, 8)
    ],
    Case(
        "slice at stride 4 (RANDOM_SUBSAMPLE)",
        lambda: Slice(4, ME.SparseTensorQuantizationMode.RANDOM_SUBSAMPLE),
        lambda m, b: m(b),
        "field",
        field_input=True,
    ),
    Case("interpolation", Interp, lambda m, b: m(b), "queries"),
    Case("features_at_coordinates", AtCoordinates, lambda m, b: m(b), "queries"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@SETTINGS
@given(data=st.data())
def test_per_sample_output_does_not_depend_on_the_batch(case, data):
    k = data.draw(st.integers(2, 5), label="samples")
    seeds = data.draw(st.lists(st.integers(0, 2**16), min_size=k, max_size=k, unique=True), label="seeds")
    sizes = data.draw(st.lists(st.integers(4, 40), min_size=k, max_size=k), label="points")
    target = data.draw(st.integers(0, k - 1), label="target")
    middle = data.draw(st.integers(1, max(1, k - 2)), label="middle")
    check_invariance(case, seeds, sizes, target, middle)


@pytest.mark.parametrize("mode", GLOBAL_MODES, ids=[m.name for m in GLOBAL_MODES])
def test_global_pooling_rows_are_the_samples_in_batch_order(mode):
    """Known values: row b of a global pooling is sample b's sum / mean / max, in every mode."""
    samples = [make_sample(seed, n) for seed, n in zip(range(6), (30, 5, 17, 40, 9, 23))]
    batch = Batch(samples)
    out = ME.MinkowskiGlobalPooling(mode)(batch.sparse())
    reduce = {"SUM": lambda f: f.sum(0), "AVG": lambda f: f.mean(0), "MAX": lambda f: f.max(0).values}
    expected = torch.stack([reduce[mode.name.split("_")[1]](s.feats) for s in samples])
    assert out.C[:, 0].tolist() == list(range(len(samples)))
    assert_close(out.F.detach(), expected, mode.name)


@pytest.mark.parametrize("mode", GLOBAL_MODES, ids=[m.name for m in GLOBAL_MODES])
def test_global_pooling_of_samples_of_one_point_each(mode):
    """Known values: where every sample has one point (a data-parallel chunk can be such), each pooled row is its
    sample's point and the gradient reaches each point once; ``decomposed_features`` gives the points back, of a
    SparseTensor and of a TensorField. ME 0.5.4 as released asserted ``in_size > out_size`` building the origin map
    (patch 15)."""
    samples = [make_sample(seed, 1) for seed in range(4)]
    batch = Batch(samples)
    x = batch.sparse()
    out = ME.MinkowskiGlobalPooling(mode)(x)
    assert out.C[:, 0].tolist() == list(range(len(samples)))
    assert_close(out.F.detach(), batch.feats.detach(), mode.name)
    (grad,) = torch.autograd.grad((out.F * torch.arange(1.0, 1 + CHANNELS, dtype=out.F.dtype)).sum(), batch.feats)
    assert_close(grad, torch.arange(1.0, 1 + CHANNELS, dtype=grad.dtype).expand_as(grad), mode.name)
    assert_close(torch.cat(x.decomposed_features).detach(), batch.feats.detach(), "decomposed_features")
    field = ME.TensorField(batch.feats.detach(), batch.coords.double())
    assert_close(ME.MinkowskiGlobalPooling(mode)(field.sparse()).F, batch.feats.detach(), f"{mode.name} of field.sparse()")
    assert_close(torch.cat(field.decomposed_features), batch.feats.detach(), "a TensorField's decomposed_features")


@pytest.mark.parametrize("mode", QUANT, ids=[q.name for q in QUANT])
@pytest.mark.parametrize("negative", [False, True], ids=["signed", "negative"])
def test_tensor_field_quantization_values(mode, negative):
    """Known values: each voxel's features are the mean / sum / max of its points' features (or
    one of its points' for RANDOM_SUBSAMPLE), also when every value is negative."""
    samples = [make_sample(seed, n) for seed, n in zip(range(3), (25, 8, 31))]
    batch = Batch(samples)
    feats = -batch.field_feats.detach().abs() if negative else batch.field_feats.detach()
    field = ME.TensorField(feats, batch.field_coords, quantization_mode=mode)
    out = field.sparse()
    voxel_of_point = torch.cat([batch.field_coords[:, :1], batch.field_coords[:, 1:].floor()], 1).to(torch.int64)
    rows = {tuple(c): i for i, c in enumerate(out.C.to(torch.int64).tolist())}
    assert len(rows) == len(torch.unique(voxel_of_point, dim=0))
    members = {}
    for p, c in enumerate(voxel_of_point.tolist()):
        members.setdefault(rows[tuple(c)], []).append(p)
    for row, points in members.items():
        f = feats[points]
        got = out.F[row]
        if mode == ME.SparseTensorQuantizationMode.RANDOM_SUBSAMPLE:
            assert any(torch.equal(got, g) for g in f)
            continue
        expected = {
            ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE: f.mean(0),
            ME.SparseTensorQuantizationMode.UNWEIGHTED_SUM: f.sum(0),
            ME.SparseTensorQuantizationMode.MAX_POOL: f.max(0).values,
        }[mode]
        assert_close(got, expected, f"{mode.name}, voxel of points {points}")
