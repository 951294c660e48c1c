"""sparse_ddp's parts without a multi-process fit: registration, the sync batch norm plugin, a rank's count, its
fallback said, the exchange of summaries, the process group's end."""

from __future__ import annotations

import os
import socket

import lightning as L
import pytest
import torch


def test_registered_without_touching_ddp():
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    from lightning_sparse_dp import SparseDDPStrategy

    assert StrategyRegistry["sparse_ddp"]["strategy"] is SparseDDPStrategy
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy  # DDPStrategy.register_strategies was not re-run
    with pytest.raises(ValueError, match="loss_weighting"):
        SparseDDPStrategy(loss_weighting="voxels")
    with pytest.raises(ValueError, match="split"):
        SparseDDPStrategy(split="random")


def test_sync_batchnorm_flag_gives_the_process_group_plugin():
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    from lightning_sparse_dp.syncbn.process_group import ProcessGroupSyncBatchNorm

    def resolved(**kwargs):  # the plugin setup applies (SparseDDPStrategy.setup resolves it first)
        t = L.Trainer(strategy="sparse_ddp", accelerator="cpu", devices=2, logger=False, **kwargs)
        t.strategy._resolve_layer_sync()
        return t.strategy._layer_sync

    assert type(resolved(sync_batchnorm=True)) is ProcessGroupSyncBatchNorm
    assert resolved() is None

    class Mine(TorchSyncBatchNorm):  # a plugin of the user's own is kept
        pass

    assert type(resolved(plugins=[Mine()])) is Mine


def test_layer_sync_plugin_swaps_and_reverts_me_batch_norm():
    import MinkowskiEngine as ME
    from torch import nn

    from lightning_sparse_dp.syncbn.batchnorm import SyncBatchNorm
    from lightning_sparse_dp.syncbn.process_group import ProcessGroupCollective, ProcessGroupSyncBatchNorm

    model = nn.Sequential(ME.MinkowskiBatchNorm(4), nn.BatchNorm1d(4), ME.MinkowskiSyncBatchNorm(4))
    keys = {k: v for k, v in model.state_dict().items()}
    plugin = ProcessGroupSyncBatchNorm()
    plugin.apply(model)
    layers = [model[0].bn, model[1], model[2].bn]
    assert all(isinstance(m, SyncBatchNorm) and isinstance(m.collective, ProcessGroupCollective) for m in layers)
    assert all(m.update_running_stats for m in layers)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == {k: v.data_ptr() for k, v in keys.items()}
    plugin.revert(model)
    assert [type(model[0].bn), type(model[1]), type(model[2].bn)] == [nn.BatchNorm1d, nn.BatchNorm1d, nn.SyncBatchNorm]


def test_local_count_reads_the_batch_as_sparse_dp_chunks_do():
    from lightning_sparse_dp.ddp.exchange import local_count
    from tests.support.ddp_helpers import Scenes, collate

    scenes = Scenes(3, seed=5)
    batch = collate([scenes[i] for i in range(3)])
    points = batch["coordinates"].shape[0]
    assert local_count(batch, "samples") == 3
    assert local_count(batch, "points") == points
    assert local_count(batch, "equal") == 1
    assert local_count(batch, "auto") == 3  # a per-sample tensor ("labels") is there: samples
    per_point = {k: v for k, v in batch.items() if k != "labels"}
    assert local_count(per_point, "auto") == points  # per-point targets only: points
    ignored = lambda chunk: float((chunk["point_labels"] != 0).sum())  # noqa: E731  (ignore_index=0)
    assert local_count(batch, ignored) == float((batch["point_labels"] != 0).sum())
    with pytest.raises(ValueError, match="loss_weighting"):
        local_count(batch, "voxels")


def test_the_process_group_is_destroyed_at_exit(tmp_path):
    """sparse_ddp leaves no gloo process group up when the interpreter exits (gloo can abort at shutdown otherwise)."""
    from tests.support.helpers import run_isolated

    run_isolated(
        """
        import atexit
        import torch.distributed as dist
        import lightning_sparse_dp
        from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, trainer
        trainer(strategy="sparse_ddp", devices=1, max_steps=1).fit(SparseNet(), loader(collate_dict(random_samples(4))))
        assert dist.is_initialized()  # DDPStrategy leaves the group up after fit
        atexit._run_exitfuncs()  # what the interpreter runs at exit
        assert not dist.is_initialized()
        """,
        tmp_path,
        timeout=240,
    )


def test_a_hand_written_masked_mean_on_one_rank_is_its_own_sum(caplog):
    import logging

    import torch.nn.functional as F

    from lightning_sparse_dp import SparseDDPStrategy
    from lightning_sparse_dp.loss.capture import TermCapture
    from tests.support.ddp_helpers import Scenes, collate

    t = L.Trainer(strategy=SparseDDPStrategy(), accelerator="cpu", devices=1, logger=False)
    strategy, batch = t.strategy, collate([Scenes(3, seed=1)[i] for i in range(3)])
    logits = torch.randn(batch["point_labels"].shape[0], 4, requires_grad=True)
    mask = batch["point_labels"] != 0

    strategy._capture, strategy._batch, strategy._count = (
        TermCapture(),
        batch,
        3.0,
    )  # as _weighted sets them around the step
    loss = strategy._capture.run(
        lambda: (F.cross_entropy(logits, batch["point_labels"], reduction="none") * mask).sum() / mask.sum()
    )
    with caplog.at_level(logging.INFO):
        assert strategy._term_scale(loss) == 1.0
    # one rank: its sum over its own count is the whole batch's (the sum is a term, issue 66); two ranks say it
    # (tests/ddp/test_ddp.py, said_remainder)
    assert "cannot weight" not in caplog.text and strategy._capture.terms[-1].name == "torch.sum"

    strategy._capture = TermCapture()
    loss = strategy._capture.run(lambda: F.cross_entropy(logits, batch["point_labels"], ignore_index=0))
    assert strategy._term_scale(loss) == 1.0 and strategy._capture.terms[0].scale == 1.0


def _gather_worker(rank: int, port: int, out: str) -> None:

    import torch.distributed as dist

    from lightning_sparse_dp.ddp.exchange import gather_objects

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small = gather_objects({"rank": rank, "samples": [3, 4][rank]}, torch.device("cpu"))
    large = gather_objects("x" * (10 if rank == 0 else 5000), torch.device("cpu"), size=4096)  # one rank too large
    torch.save({"small": small, "large": large}, f"{out}/gather-{rank}.pt")
    dist.destroy_process_group()


def test_gather_objects_gives_every_rank_every_object_in_rank_order(tmp_path):

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_worker, args=(port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"gather-{rank}.pt")
        assert got["small"] == [{"rank": 0, "samples": 3}, {"rank": 1, "samples": 4}]
        assert got["large"] == ["x" * 10, "x" * 5000]  # the second round, taken by both ranks


def _agreed_worker(rank: int, port: int, out: str) -> None:

    import torch.distributed as dist

    from lightning_sparse_dp.strategies.exactness import agreed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def step():  # the probe's share of rank 0 holds nothing to average: its step raises, rank 1's does not
        if rank == 0:
            raise ZeroDivisionError("division by zero")
        return torch.ones(1)

    try:
        agreed(step, 2)
        raised = None
    except RuntimeError as err:
        raised = str(err)
    after = torch.tensor([float(rank + 1)])
    dist.all_reduce(after)  # the ranks' next collectives pair up: none went on to one the other skipped
    torch.save({"raised": raised, "after": float(after), "ok": agreed(lambda: rank, 2)}, f"{out}/agreed-{rank}.pt")
    dist.destroy_process_group()


def test_a_probe_step_that_raises_on_one_rank_raises_on_every_rank(tmp_path):
    """The exactness check's step on the ranks' shares of the probe: a failure on one rank only is known to every rank
    before any goes on, and all raise naming it (rank 1 went on to its weighting's gather and its backward while
    rank 0 left the check: the fit hung, or gloo aborted on mismatched collectives)."""
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(_agreed_worker, args=(port, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise AssertionError("the ranks still run after 120 s: a rank waits in a collective the other skipped")
    for rank in range(2):
        got = torch.load(tmp_path / f"agreed-{rank}.pt")
        assert got["raised"] == "rank 0's step on its share of the probe raised ZeroDivisionError: division by zero"
        assert got["after"] == 3.0 and got["ok"] == rank


def _fixed_pair_worker(rank: int, port: int, out: str) -> None:

    import torch.distributed as dist

    from lightning_sparse_dp.ddp.exchange import gather_step_outputs
    from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sampler = PointBalancedBatchSampler(None, 4, num_replicas=2, rank=rank, num_samples=4, shuffle=False,
                                        split="contiguous")
    logits = torch.arange(8.0).reshape(4, 2)[2 * rank : 2 * rank + 2]  # this rank's 2 samples, one row each
    merged = {
        str(layout): gather_step_outputs([logits, 2 * logits], sampler, 0, torch.device("cpu"), output_layout=layout)
        for layout in (None, {"output": "fixed"})
    }
    torch.save(merged, f"{out}/pair-{rank}.pt")
    dist.destroy_process_group()


def test_predict_outputs_merge_by_output_layout_and_say_sparse_ddps_class(tmp_path):
    """A fixed pair of per-sample logits was taken as one entry per sample (four entries of one row where one device
    returns the pair), and the line named SparseDataParallelStrategy(output_layout=...), which SparseDDPStrategy did not
    take (passed on to DDP, it crashed). SparseDDPStrategy takes output_layout now, and the line names it."""
    import torch.multiprocessing as mp

    from lightning_sparse_dp import SparseDDPStrategy

    assert SparseDDPStrategy(output_layout={"output": "fixed"}).output_layout == {"output": "fixed"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fixed_pair_worker, args=(port, str(tmp_path)), nprocs=2)
    whole = torch.arange(8.0).reshape(4, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"pair-{rank}.pt")
        fixed = got[str({"output": "fixed"})]
        assert len(fixed) == 2 and torch.equal(fixed[0], whole) and torch.equal(fixed[1], 2 * whole)
        assert len(got["None"]) == 4  # unnamed: taken as one entry per sample, as said


def test_the_merge_s_lines_under_sparse_ddp_name_it():
    from lightning_sparse_dp.ddp.exchange import _SaidBySparseDDP

    line = "sparse_dp: step output x ... SparseDataParallelStrategy(output_layout={'x': 'fixed'})"
    assert _SaidBySparseDDP._renamed(line) == "sparse_ddp: step output x ... SparseDDPStrategy(output_layout={'x': 'fixed'})"


def _scalar_worker(rank: int, port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist

    from lightning_sparse_dp.ddp.exchange import gather_step_outputs
    from lightning_sparse_dp.ddp.sampler import PointBalancedBatchSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sampler = PointBalancedBatchSampler(None, 4, num_replicas=2, rank=rank, num_samples=4, shuffle=False,
                                        split="contiguous")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = gather_step_outputs({"max_logit": torch.tensor(float(rank + 1))}, sampler, 0, torch.device("cpu"))
    torch.save({"value": float(merged["max_logit"]), "said": [str(w.message) for w in caught]}, f"{out}/scalar-{rank}.pt")
    dist.destroy_process_group()


def test_a_0_dim_predict_output_that_differs_between_ranks_is_said():
    """A predict step's 0-dim output (a maximum, a sum of the share's features) came back as the ranks' values weighted
    by their samples, on every rank, silently (1.04 off for a sum). No rank knows the batch's value: it is said now."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_scalar_worker, args=(port, out), nprocs=2)
        for rank in range(2):
            got = torch.load(f"{out}/scalar-{rank}.pt")
            assert got["value"] == 1.5  # the ranks' values weighted by their 2 samples each, as the line says
            said = [m for m in got["said"] if "step output output['max_logit'] differs" in m]
            assert len(said) == 1 and said[0].startswith("sparse_ddp:"), got["said"]
