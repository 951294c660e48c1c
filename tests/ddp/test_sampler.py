"""PointBalancedBatchSampler: every sample once, same steps on every rank, sparse_dp's assignment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from lightning_sparse_dp import PointBalancedBatchSampler, split_batch
from lightning_sparse_dp.ddp.exchange import local_count
from lightning_sparse_dp.ddp.rank_loaders import replace_batch_sampler
from lightning_sparse_dp.ddp.sampler import global_batches, measure_point_counts
from tests.support.helpers import collate_dict, random_samples


def _all_ranks(counts, global_batch_size, world_size, epoch=0, **kwargs):
    """Per rank, the list of batches it yields in ``epoch``."""
    out = []
    for rank in range(world_size):
        s = PointBalancedBatchSampler(counts, global_batch_size, num_replicas=world_size, rank=rank, **kwargs)
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 500), min_size=1, max_size=60),
    world_size=st.integers(1, 5),
    per_rank=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
    split=st.sampled_from(["balanced", "contiguous"]),
)
def test_every_sample_once_and_same_steps_on_every_rank(counts, world_size, per_rank, shuffle, drop_last, epoch, split):
    gbs = per_rank * world_size
    if len(counts) < world_size:
        with pytest.raises(ValueError, match="fewer than the"):
            PointBalancedBatchSampler(counts, gbs, num_replicas=world_size, rank=0)
        return
    ranks = _all_ranks(counts, gbs, world_size, epoch, shuffle=shuffle, drop_last=drop_last, split=split)
    steps = {len(r) for r in ranks}
    assert len(steps) == 1  # the same number of steps on every rank: no rank waits in a collective alone
    seen = [i for r in ranks for batch in r for i in batch]
    assert len(seen) == len(set(seen))  # no sample repeated (no padding)
    assert all(batch for r in ranks for batch in r)  # every rank has a sample in every step
    if drop_last:
        assert len(seen) == (len(counts) // gbs) * gbs
    else:
        assert sorted(seen) == list(range(len(counts)))  # none dropped
    for step in range(steps.pop()):  # a step's global batch: full, or the remainder (joined if < world size)
        size = sum(len(r[step]) for r in ranks)
        assert size >= world_size and size < gbs + world_size


def test_global_batches_rules():
    assert global_batches(range(9), 4, 2, drop_last=False) == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]  # 1 < 2 ranks: joined
    assert global_batches(range(10), 4, 2, drop_last=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert global_batches(range(10), 4, 2, drop_last=True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert global_batches(range(3), 4, 3, drop_last=False) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        global_batches(range(2), 4, 3, drop_last=False)
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        global_batches(range(8), 2, 4, drop_last=False)


def test_shares_are_sparse_dps_balanced_split_of_the_collated_global_batch():
    samples = random_samples(23, seed=3, min_points=2, max_points=40)
    counts = [s[0].shape[0] for s in samples]
    world_size, gbs = 3, 9
    ranks = _all_ranks(counts, gbs, world_size, epoch=1, shuffle=True, seed=5)
    sampler = PointBalancedBatchSampler(counts, gbs, num_replicas=world_size, rank=0, shuffle=True, seed=5)
    sampler.set_epoch(1)
    for step, batch in enumerate(sampler.global_batches()):
        _, plan = split_batch(collate_dict([samples[i] for i in batch]), world_size, assignment="balanced")
        expected = [[batch[int(p)] for p in positions] for positions in plan.chunk_samples]
        assert [r[step] for r in ranks] == expected


def test_balanced_points_are_more_even_than_an_index_split():
    torch.manual_seed(0)
    counts = torch.distributions.LogNormal(8.0, 0.8).sample((240,)).long().tolist()
    k = 4

    def imbalance(split):
        ranks = _all_ranks(counts, 24, k, split=split, shuffle=True)
        ratios = []
        for step in range(len(ranks[0])):
            loads = [sum(counts[i] for i in r[step]) for r in ranks]
            if split == "balanced":  # Graham's list-scheduling bound: max <= sum / k + (1 - 1/k) * largest sample
                largest = max(counts[i] for r in ranks for i in r[step])
                assert max(loads) <= sum(loads) / k + (1 - 1 / k) * largest
            ratios.append(max(loads) / (sum(loads) / k))
        return sum(ratios) / len(ratios)

    assert imbalance("balanced") < imbalance("contiguous") - 0.2  # seen: 1.09 vs 1.50


def test_epochs_and_seeds():
    counts = list(range(1, 31))
    first = _all_ranks(counts, 6, 2, epoch=0, shuffle=True, seed=1)
    assert first == _all_ranks(counts, 6, 2, epoch=0, shuffle=True, seed=1)  # identical on every call / rank
    assert first != _all_ranks(counts, 6, 2, epoch=1, shuffle=True, seed=1)
    assert first != _all_ranks(counts, 6, 2, epoch=0, shuffle=True, seed=2)
    ordered = _all_ranks(counts, 6, 2, shuffle=False, split="contiguous")
    assert ordered[0][0] == [0, 1, 2] and ordered[1][0] == [3, 4, 5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank=2"):
        PointBalancedBatchSampler([1, 2, 3], 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="needs point_counts"):
        PointBalancedBatchSampler(None, 2, num_replicas=2, rank=0, num_samples=4)
    with pytest.raises(ValueError, match="split="):
        PointBalancedBatchSampler([1, 2], 2, num_replicas=1, rank=0, split="random")
    with pytest.raises(ValueError, match=">= 0"):
        PointBalancedBatchSampler([1, -2], 2, num_replicas=1, rank=0)
    assert len(PointBalancedBatchSampler(None, 2, num_replicas=2, rank=0, num_samples=4, split="contiguous")) == 2


def test_measured_point_counts_and_local_counts():
    samples = random_samples(5, seed=4)
    assert measure_point_counts(samples, range(5)) == [s[0].shape[0] for s in samples]
    assert measure_point_counts(samples, [1], count_fn=lambda item: 7) == [7]
    with pytest.raises(TypeError, match="point_counts"):
        measure_point_counts([("no", "tensor")], [0])
    batch = collate_dict(samples)
    assert local_count(batch, "samples") == 5.0
    assert local_count(batch, "points") == float(sum(s[0].shape[0] for s in samples))
    assert local_count(batch, "equal") == 1.0
    with pytest.raises(ValueError, match="loss_weighting"):
        local_count(batch, "voxels")


def test_replace_batch_sampler_keeps_the_loader():
    samples = random_samples(8, seed=6)
    loader = DataLoader(samples, batch_size=2, collate_fn=collate_dict)
    sampler = PointBalancedBatchSampler([s[0].shape[0] for s in samples], 4, num_replicas=2, rank=1, shuffle=False)
    new = replace_batch_sampler(loader, sampler)
    assert new.collate_fn is collate_dict and new.batch_sampler is sampler
    got = [b["labels"].tolist() for b in new]
    want = [[samples[i][2] for i in ids] for ids in sampler]
    assert got == want and len(got) == 2


def test_an_item_without_tensors_names_the_argument_that_counts_it():
    from lightning_sparse_dp import SparseDDPStrategy

    dataset = [{"path": f"/data/{i}.ply", "size": 10 + i} for i in range(3)]
    with pytest.raises(TypeError, match=r"SparseDDPStrategy\(count_points=fn\)") as info:
        measure_point_counts(dataset, range(3))
    argument = str(info.value).split("SparseDDPStrategy(")[1].split("=")[0]
    strategy = SparseDDPStrategy(**{argument: lambda item: item["size"]})  # what the message says, accepted
    assert measure_point_counts(dataset, range(3), strategy.count_points) == [10, 11, 12]
