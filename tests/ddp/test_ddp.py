"""sparse_ddp in real processes (gloo, CPU) against one device with the whole global batch, in float64.

One popen launch of ``tests/support/ddp_script.py`` (2 ranks) fits every scenario of
``tests.support.ddp_helpers.SCENARIOS`` in turn; each test compares one scenario's parameters, buffers and
logged values with the same module fitted here on one device (``strategy="auto"``) on the same global
batches, at 1e-10 relative per tensor. ``LSDP_MULTINODE=1`` adds a run of two "nodes" on localhost
started by torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.support.ddp_helpers import (
    ALL_SCENARIOS,
    SAID_SCENARIOS,
    SCENARIOS,
    SIDE_BY_SIDE,
    TERM_SCENARIOS,
    VAL_SAMPLES,
    Capture,
    evaluate,
    loaders,
    result,
    trainer_kwargs,
)
from tests.support.exact import relative_difference

ROOT = Path(__file__).resolve().parents[2]
RTOL = 1e-10
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    return env


def _run(commands: list[list[str]], timeout: float) -> None:
    """Run the commands at once, each in its own session; on timeout kill every process they started."""
    procs = [
        subprocess.Popen(
            c, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for c in commands
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"sparse_ddp processes did not finish in {timeout} s")
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]


def _fit_sparse_dp_checkpoint(out: Path) -> None:
    """One epoch with sparse_dp (2 CPU replicas) on the global batches of 2 ranks: the checkpoint to resume."""
    s = SCENARIOS["resume"]
    model = s.build(reference=True)
    train, val = loaders(s.per_rank, world_size=2, model=s.model)
    t = L.Trainer(**trainer_kwargs(strategy="sparse_dp", devices=2, max_epochs=1, logger=False, **s.trainer))
    t.fit(model, train, val)
    t.save_checkpoint(out / "sparse_dp.ckpt")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sparse_ddp")
    _fit_sparse_dp_checkpoint(out)
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), ",".join(SCENARIOS)]], timeout=300)
    return out


def _reference(name: str) -> dict:
    s = ALL_SCENARIOS[name]
    model = s.build(reference=True)
    train, val = loaders(s.per_rank, world_size=2, model=s.model)
    logger = Capture()
    options = {k: v for k, v in s.trainer.items() if k != "sync_batchnorm"}  # one device: plain batch norm is exact
    t = L.Trainer(**trainer_kwargs(devices=1, max_epochs=s.epochs, logger=logger, **options))
    t.fit(model, train, val)
    out = result(t, model, logger)
    if s.evaluate:
        out.update(evaluate(t, model, val))
    return out


def _logged(history) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {}
    for _, metrics in history:
        for k, v in metrics.items():
            series.setdefault(k, []).append(v)
    return series


def _assert_same_as_reference(ours: dict, ref: dict, resumed: bool = False) -> None:
    assert ours["state"].keys() == ref["state"].keys()
    for k, v in ours["state"].items():
        if v.is_floating_point():
            assert v.dtype == torch.float64, k
            assert relative_difference(v, ref["state"][k]) <= RTOL, (k, relative_difference(v, ref["state"][k]))
        else:
            assert torch.equal(v, ref["state"][k]), k
    mine, theirs = _logged(ours["history"]), _logged(ref["history"])
    assert mine.keys() == theirs.keys()
    for k in theirs:
        expected = theirs[k][-len(mine[k]) :] if resumed else theirs[k]  # a resumed run logs its last epoch only
        assert mine[k] == pytest.approx(expected, rel=RTOL), k
    assert {"train_loss_step", "train_loss_epoch", "val_loss"} <= mine.keys()
    assert len(mine["train_loss_step"]) >= 2
    assert ours["bn_types"] == ref["bn_types"]  # sync batch norm reverted at teardown


def _load(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}-rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_processes_equal_one_device(ddp_runs, name):
    ranks = [_load(ddp_runs, name, r) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    for k, v in ranks[0]["state"].items():  # every rank ends with the same parameters and buffers
        assert torch.equal(v, ranks[1]["state"][k]), k
    ref = _reference(name)
    _assert_same_as_reference(ranks[0], ref, resumed=SCENARIOS[name].resume)
    if SCENARIOS[name].evaluate:  # test: the same logged loss; predict: every rank returns one device's predictions
        assert ranks[0]["test_loss"] == ranks[1]["test_loss"] == pytest.approx(ref["test_loss"], rel=RTOL)
        if "predictions" in ref:  # per-sample lists (scan pairs' features), gathered in dataset order
            for rank in ranks:
                assert len(rank["predictions"]) == len(ref["predictions"]) == VAL_SAMPLES
                for got, want in zip(rank["predictions"], ref["predictions"], strict=True):
                    for x, y in zip(got, want, strict=True):
                        assert x.shape == y.shape and relative_difference(x, y) <= RTOL
        else:  # per-sample or per-point rows, in the global batch's order (per-point ones came in rank order)
            for rank in ranks:
                assert rank["predicted"].shape == ref["predicted"].shape
                assert relative_difference(rank["predicted"], ref["predicted"]) <= RTOL


@pytest.fixture(scope="module")
def ddp_term_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sparse_ddp_terms")
    _run(
        [[sys.executable, "-m", "tests.support.ddp_script", str(out), ",".join([*TERM_SCENARIOS, *SAID_SCENARIOS])]],
        timeout=400,
    )
    return out


@pytest.mark.parametrize("name", list(TERM_SCENARIOS))
def test_losses_as_written_on_two_processes_equal_one_device(ddp_term_runs, name):
    """loss_weighting="terms": an ignore label (some ranks' shares all ignored) and a BCE per decoder level."""
    ranks = [_load(ddp_term_runs, name, r) for r in range(2)]
    for k, v in ranks[0]["state"].items():
        assert torch.equal(v, ranks[1]["state"][k]), k
    ref = _reference(name)
    for k, v in ranks[0]["state"].items():
        if v.is_floating_point():
            assert relative_difference(v, ref["state"][k]) <= RTOL, (k, relative_difference(v, ref["state"][k]))
    mine, theirs = _logged(ranks[0]["history"]), _logged(ref["history"])
    assert len(mine["train_loss"]) >= 4
    assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=RTOL)  # each step's whole-batch value
    assert name != "terms_ignore" or {"train_loss_epoch_only", "train_loss_constant", "val_loss"} <= theirs.keys()
    for epoch_level in ("train_loss_epoch_only", "train_loss_constant", "val_loss"):  # sync_dist epoch means
        if epoch_level in theirs:
            assert len(mine[epoch_level]) == len(theirs[epoch_level]) >= 2, epoch_level
            assert mine[epoch_level] == pytest.approx(theirs[epoch_level], rel=RTOL), epoch_level


@pytest.mark.parametrize(
    "name, words",
    [
        ("said_remainder", "hand-written masked mean"),
        ("said_statistic", "a statistic of the chunk"),
    ],
)
def test_what_no_split_computes_exactly_is_said_on_ranks(ddp_term_runs, name, words):
    ranks = [_load(ddp_term_runs, name, r) for r in range(2)]
    messages = ranks[0]["messages"]
    said = [m for m in messages if "loss_weighting='terms' cannot" in m and "exactness check" not in m]
    assert len(said) == 1 and words in said[0], messages
    # the exactness check's line names the fallback its run on the probe's shares met, where it differs
    assert all(words in m for m in messages if "exactness check" in m and "differs" in m), messages
    ref = _reference(name)
    assert (
        max(relative_difference(v, ref["state"][k]) for k, v in ranks[0]["state"].items() if v.is_floating_point())
        > 1e-12
    )


def test_a_mean_over_a_dense_grid_sized_by_each_share_is_said_on_ranks(ddp_term_runs):
    """x.dense() without shape= sizes each rank's grid by its share's largest coordinates, a mean over it not one
    device's: said once by rank 0, as sparse_dp says it of its replicas."""
    messages = _load(ddp_term_runs, "said_dense", 0)["messages"]
    said = [m for m in messages if "SparseTensor.dense() without shape=" in m]
    assert len(said) == 1 and said[0].startswith("sparse_ddp:") and "each rank's grid" in said[0], messages


def test_validation_inside_a_fit_reads_its_losses_as_validate_does_on_ranks(ddp_term_runs):
    """The training steps call the loss in a loop a number of times that changes from step to step (said), which the
    site memory keeps; validation inside the fit read its own loop of three views by that memory, could not weigh it
    term by term and weighted the ranks by their samples: val_loss 2.7e-4 off a validate() run on the same weights
    (4.8e-4 off one device's fit at the first epoch), said as a hand-made mean. Evaluation steps keep a memory of their
    own, as under sparse_dp (and a validation's loop no longer makes a fixed training loop fall back: terms_views)."""
    s, rank = ALL_SCENARIOS["said_views"], _load(ddp_term_runs, "said_views", 0)
    model = s.build(reference=True)
    model.load_state_dict(rank["state"])
    _, val = loaders(s.per_rank, world_size=2, model=s.model)
    t = L.Trainer(**trainer_kwargs(devices=1, logger=False))
    t.validate(model, val, verbose=False)
    assert _logged(rank["history"])["val_loss"][-1] == pytest.approx(float(t.callback_metrics["val_loss"]), rel=RTOL)
    messages = rank["messages"]
    assert [m for m in messages if "is called in a loop a number of times that changes" in m], messages  # training's
    assert not [m for m in messages if "self.log('val_loss'" in m], messages


@pytest.mark.parametrize("name", ["terms_ignore", "terms_per_sample", "terms_manual"])
def test_one_weight_per_rank_is_not_exact_here(ddp_term_runs, name):  # the comparison above can fail
    ref = _reference(name)
    out = ddp_term_runs / f"points-{name}"
    out.mkdir()
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), name, "1", "points"]], timeout=120)
    ours = _load(out, name, 0)
    assert (
        max(relative_difference(v, ref["state"][k]) for k, v in ours["state"].items() if v.is_floating_point()) > 1e-4
    )


def test_plain_ddp_is_not_exact_here(ddp_runs):  # the comparisons above can fail: uneven shares, equal weights
    ref = _reference("points")
    out = ddp_runs / "plain"
    out.mkdir()
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), "points", "1", "equal"]], timeout=120)
    ours = _load(out, "points", 0)
    worst = max(relative_difference(v, ref["state"][k]) for k, v in ours["state"].items() if v.is_floating_point())
    assert worst > 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(os.environ.get("LSDP_MULTINODE") != "1", reason="two simulated nodes: set LSDP_MULTINODE=1")
def test_two_nodes_on_localhost_equal_one_device(tmp_path):
    port = str(_free_port())
    names = ["points", "syncbn"]
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "tests.support.ddp_script",
            str(tmp_path),
            ",".join(names),
            "2",
        ]
        for node in range(2)
    ]
    _run(commands, timeout=240)
    for name in names:
        nodes = [_load(tmp_path, name, r) for r in range(2)]
        for k, v in nodes[0]["state"].items():
            assert torch.equal(v, nodes[1]["state"][k]), k  # both nodes end with identical parameters
        _assert_same_as_reference(nodes[0], _reference(name))




def _distance(state: dict, ref: dict) -> float:
    return max(relative_difference(v, ref["state"][k]) for k, v in state.items() if v.is_floating_point())


def test_a_loss_normalized_across_ranks_by_the_user_is_weighted_as_ddp_does_and_said(ddp_term_runs):
    """DETR-style: dist.all_reduce of a count in the step; exact by default (test above), and said once."""
    said = [m for m in _load(ddp_term_runs, "terms_detr", 0)["messages"] if "calls dist.all_reduce at" in m]
    assert len(said) == 1 and "scene_models.py" in said[0] and "weighted equally, as DDP" in said[0], said


@pytest.fixture(scope="module")
def ddp_equal_runs(ddp_term_runs) -> Path:
    out = ddp_term_runs / "equal"
    out.mkdir()
    _run([[sys.executable, "-m", "tests.support.ddp_script", str(out), ",".join(SIDE_BY_SIDE), "1", "equal"]], timeout=400)
    return out


def test_sparse_ddp_is_never_further_from_one_device_than_plain_ddp(ddp_term_runs, ddp_equal_runs, capsys):
    """Every loss shape, 2 ranks, float64, the same global batches: sparse_ddp's distance to one device (largest
    relative difference of a parameter or buffer) is at most DDP's equal averaging's (or rounding, 1e-12)."""
    rows = []
    for name in SIDE_BY_SIDE:
        ref = _reference(name)
        ours = _distance(_load(ddp_term_runs, name, 0)["state"], ref)
        ddp = _distance(_load(ddp_equal_runs, name, 0)["state"], ref)
        rows.append((name, ours, ddp))
    with capsys.disabled():
        print("\n| loss shape | sparse_ddp | plain DDP (equal weights) |\n|---|---|---|")
        for name, ours, ddp in rows:
            print(f"| {name} | {ours:.1e} | {ddp:.1e} |")
    for name, ours, ddp in rows:
        assert ours <= max(ddp, 1e-12), (name, ours, ddp)


def test_logged_values_as_users_write_them_are_one_devices_on_ranks(ddp_term_runs):
    """sync_dist=True: loss.item() with batch_size=, float(loss), masked accuracies, a mean over all points."""
    mine, theirs = _logged(_load(ddp_term_runs, "logged", 0)["history"]), _logged(_reference("logged")["history"])
    for name, rel in (
        ("loss_item", 1e-10),
        ("loss_float", 1e-10),
        ("acc", 1e-6),
        ("acc_fn", 1e-10),
        ("labeled", 1e-10),
    ):
        assert len(mine[name]) >= 2 and mine[name] == pytest.approx(theirs[name], rel=rel), name
