"""The batch-composition invariance check of MinkowskiEngine ops (used by test_me_invariance.py).

:class:`Sample` / :class:`Batch`: random samples and the batches they sit in (first, or in the
middle); :func:`per_sample` reads a sample's part of an op's output (its rows by coordinates, its
points, its global row); :func:`check_invariance` runs an op on a sample alone and inside batches
and compares outputs and gradients (float64, :data:`TOL` relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any  # a tests.project.test_me_invariance.Case

import MinkowskiEngine as ME
import numpy as np
import torch

D = 3
CHANNELS = 3
TOL = 1e-12


# --------------------------------------------------------------------------------------------
# samples and batches


@dataclass
class Sample:
    coords: torch.Tensor  # int32 [n, D], unique
    float_coords: torch.Tensor  # float64 [m, D], continuous, several points per voxel
    feats: torch.Tensor  # float64 [n, CHANNELS]
    field_feats: torch.Tensor  # float64 [m, CHANNELS]
    queries: torch.Tensor  # float64 [q, D], continuous points inside the sample's extent


def make_sample(seed: int, size: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    coords = torch.randint(0, 9, (3 * size, D), generator=g, dtype=torch.int32).unique(dim=0)
    coords = coords[torch.randperm(len(coords), generator=g)[:size]]
    float_coords = torch.rand(2 * size, D, generator=g, dtype=torch.float64) * 9
    float_coords = torch.cat([float_coords, float_coords[: size // 2].floor() + 0.25])  # shared voxels
    queries = torch.rand(size, D, generator=g, dtype=torch.float64) * 8
    return Sample(
        coords=coords,
        float_coords=float_coords,
        feats=torch.randn(len(coords), CHANNELS, generator=g, dtype=torch.float64),
        field_feats=torch.randn(len(float_coords), CHANNELS, generator=g, dtype=torch.float64),
        queries=queries,
    )


class Batch:
    """Samples collated in the given order; features are leaves that record gradients."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples
        self.size = len(samples)
        self.coords, self.feats = ME.utils.sparse_collate(
            [s.coords for s in samples], [s.feats for s in samples], dtype=torch.int32
        )
        self.feats = self.feats.clone().requires_grad_(True)
        self.field_coords = self._with_batch([s.float_coords for s in samples])
        self.field_feats = torch.cat([s.field_feats for s in samples]).requires_grad_(True)
        self.queries = self._with_batch([s.queries for s in samples])
        self.point_rows = self._rows([len(s.coords) for s in samples])
        self.field_rows = self._rows([len(s.float_coords) for s in samples])
        self.query_rows = self._rows([len(s.queries) for s in samples])
        self._manager = None

    @staticmethod
    def _with_batch(parts):
        return torch.cat([torch.cat([torch.full((len(p), 1), float(b), dtype=p.dtype), p], 1) for b, p in enumerate(parts)])

    @staticmethod
    def _rows(lengths):
        ends = np.cumsum([0] + lengths)
        return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]

    @property
    def manager(self) -> ME.CoordinateManager:
        """One coordinate manager per batch, shared by the inputs an op combines (cat, union)."""
        if self._manager is None:
            self._manager = ME.CoordinateManager(D=D, coordinate_map_type=ME.CoordinateMapType.CPU)
        return self._manager

    def sparse(self, **kwargs) -> ME.SparseTensor:
        return ME.SparseTensor(self.feats, self.coords, coordinate_manager=self.manager, **kwargs)

    def sparse_with_duplicates(self, mode) -> ME.SparseTensor:
        """A SparseTensor quantizing the continuous points (floored, several points per voxel)."""
        coords = torch.cat([self.field_coords[:, :1], self.field_coords[:, 1:].floor()], 1).int()
        return ME.SparseTensor(self.field_feats, coords, quantization_mode=mode, coordinate_manager=self.manager)

    def field(self, mode=ME.SparseTensorQuantizationMode.UNWEIGHTED_AVERAGE) -> ME.TensorField:
        return ME.TensorField(self.field_feats, self.field_coords, quantization_mode=mode, coordinate_manager=self.manager)


# --------------------------------------------------------------------------------------------
# outputs per sample


def sample_rows_of(out: ME.SparseTensor, b: int):
    """Rows of batch index ``b`` sorted by coordinates: (int coordinates [n, D], features [n, C])."""
    C = out.C
    rows = torch.nonzero(C[:, 0] == b).flatten()
    coords = C[rows, 1:].to(torch.int64)
    order = np.lexsort(coords.numpy().T[::-1]) if len(rows) else np.zeros(0, dtype=np.int64)
    order = torch.as_tensor(order, dtype=torch.int64)
    return coords[order], out.F[rows[order]]


def per_sample(kind: str, out, batch: Batch, b: int):
    """Sample ``b``'s part of an op's output: (keys compared exactly, values compared to 1e-12)."""
    if kind == "sparse":
        return sample_rows_of(out, b)
    if kind == "global":
        # one row per sample, in batch-index order
        assert out.C[:, 0].tolist() == list(range(batch.size)), f"global rows not in batch order: {out.C[:, 0].tolist()}"
        return out.C[b, 1:].to(torch.int64), out.F[b]
    rows = {"points": batch.point_rows, "field": batch.field_rows, "queries": batch.query_rows}[kind][b]
    values = out.F if isinstance(out, (ME.SparseTensor, ME.TensorField)) else out
    return torch.arange(rows.stop - rows.start), values[rows]


def assert_close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    scale = max(1.0, float(expected.abs().max()))
    diff = float((actual - expected).abs().max())
    assert diff <= TOL * scale, f"{what}: max |difference| {diff:.3e} (scale {scale:.3e})"


@dataclass
class Result:
    keys: torch.Tensor
    values: torch.Tensor
    input_grad: torch.Tensor
    param_grads: list


def run(case: Any, module, samples: list[Sample], order: list[int], target: int) -> Result:
    """Collate ``samples`` in ``order``, run the op, take sample ``target``'s output, back-propagate
    a fixed weighting of it; gradients of the other samples' inputs must be zero."""
    batch = Batch([samples[i] for i in order])
    b = order.index(target)
    module.zero_grad(set_to_none=True)
    out = case.forward(module, batch)
    keys, values = per_sample(case.kind, out, batch, b)
    g = torch.Generator().manual_seed(1234)
    weights = torch.randn(values.shape, generator=g, dtype=values.dtype)
    input_grad = torch.zeros(0)
    if values.requires_grad:
        (values * weights).sum().backward()
        leaf, rows = (batch.field_feats, batch.field_rows) if case.field_input else (batch.feats, batch.point_rows)
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        input_grad = grad[rows[b]]
        others = torch.cat([grad[rows[i]] for i in range(batch.size) if i != b] + [grad[:0]])
        assert float(others.abs().sum()) == 0.0, "gradient reached other samples' inputs"
    param_grads = [p.grad.clone() if p.grad is not None else None for p in module.parameters()]
    return Result(keys, values.detach(), input_grad, param_grads)


def check_invariance(case: Any, seeds: list[int], sizes: list[int], target: int, middle: int):
    torch.manual_seed(seeds[0])
    module = case.make().double().eval() if case.eval_mode else case.make().double()
    samples = [make_sample(s, n) for s, n in zip(seeds, sizes)]
    others = [i for i in range(len(samples)) if i != target]
    compositions = {
        "alone": [target],
        "first": [target] + others,
        "middle": others[:middle] + [target] + others[middle:],
    }
    ref = run(case, module, samples, compositions["alone"], target)
    assert ref.values.numel() > 0 or case.kind == "sparse"
    for name, order in compositions.items():
        if name == "alone":
            continue
        got = run(case, module, samples, order, target)
        assert torch.equal(got.keys, ref.keys), f"{case.name} ({name}): coordinates differ from the sample alone"
        assert_close(got.values, ref.values, f"{case.name} ({name}): output")
        assert_close(got.input_grad, ref.input_grad, f"{case.name} ({name}): input gradient")
        for i, (gp, rp) in enumerate(zip(got.param_grads, ref.param_grads)):
            if rp is None:
                assert gp is None or float(gp.abs().max()) == 0.0
            else:
                assert_close(gp, rp, f"{case.name} ({name}): gradient of parameter {i}")


class Pair(torch.nn.Module):
    """Two branches on the same coordinates, combined by ``combine`` (cat, union, broadcast)."""

    def __init__(self, combine, left, right):
        super().__init__()
        self.combine, self.left, self.right = combine, left, right

    def forward(self, x):
        return self.combine(self.left(x), self.right(x))
