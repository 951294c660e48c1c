"""Steps sparse_dp refuses or hands on, against plain Lightning and DDP: ``dataloader_iter`` steps (refused; run by
sparse_ddp), batches without a tensor, empty validation loaders, ``num_nodes``, an unpatched MinkowskiEngine."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_sparse_dp import SparseDataParallelStrategy
from tests.support.exact import assert_same_states, same_start
from tests.support.helpers import SparseNet, collate_dict, loader, random_samples, sample_loader, trainer


class _IterSteps(SparseNet):
    """training_step(self, dataloader_iter), as Lightning's fetcher tests write it."""

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)  # Lightning 2: (batch, batch_idx, dataloader_idx)
        return self.loss(batch)


def test_a_dataloader_iter_step_is_refused_by_sparse_dp_and_runs_on_sparse_ddp(in_process_ddp):
    batches = [collate_dict(random_samples(6, seed=s)) for s in (61, 62)]
    said = r"training_step\(self, dataloader_iter\).*step\(self, batch, batch_idx\)"
    with pytest.raises(MisconfigurationException, match=said):
        trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(_IterSteps(), loader(*batches))
    ours, reference = same_start(_IterSteps)
    trainer(strategy="sparse_ddp", devices=1, max_steps=2).fit(ours, loader(*batches))
    trainer(max_steps=2).fit(reference, loader(*batches))
    assert_same_states(ours, reference, rel=1e-5)


class _IntBatches(L.LightningModule):
    """Batches that are lists of ints (a collate_fn of list): no tensor in the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1).double()

    def training_step(self, batch, batch_idx):
        x = torch.tensor(batch, dtype=torch.float64)[:, None] / 10
        return torch.nn.functional.mse_loss(self.layer(x), 2 * x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batches_without_a_tensor_are_split_as_lists_of_samples(in_process_ddp):
    """A list of 7 ints on 3 replicas is split into lists of whole entries (3, 2, 2): one device's parameters; on
    sparse_ddp a dataset of ints keeps Lightning's DistributedSampler instead of raising."""
    data = lambda: torch.utils.data.DataLoader(list(range(14)), batch_size=7, collate_fn=list)  # noqa: E731
    ours, reference = _IntBatches(), _IntBatches()
    trainer(strategy="sparse_dp", devices=3, max_steps=2).fit(ours, data())
    trainer(max_steps=2).fit(reference, data())
    for p, q in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
    assert not torch.equal(ours.layer.weight, _IntBatches().layer.weight)
    ddp, plain = _IntBatches(), _IntBatches()
    trainer(strategy="sparse_ddp", devices=1, max_steps=2).fit(ddp, data())
    trainer(strategy="ddp", devices=1, max_steps=2).fit(plain, data())  # the same DistributedSampler, shuffled
    for p, q in zip(ddp.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)


def test_an_empty_validation_loader_is_skipped_by_sparse_ddp_as_by_ddp(in_process_ddp):
    class WithVal(SparseNet):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.loss(batch))

    samples = random_samples(6, seed=71)
    empty = torch.utils.data.DataLoader([], batch_size=2, collate_fn=collate_dict)
    t = trainer(strategy="sparse_ddp", devices=1, max_steps=2, limit_val_batches=None)
    t.fit(WithVal(), sample_loader(samples), empty)
    assert t.global_step == 2


def test_num_nodes_is_refused_with_the_pointer_to_sparse_ddp():
    with pytest.raises(MisconfigurationException, match=r"num_nodes=2.*strategy='sparse_ddp'"):
        trainer(strategy="sparse_dp", devices=3, num_nodes=2)
    assert trainer(strategy="sparse_dp", devices=3, num_nodes=1).strategy.num_nodes == 1


def test_an_unpatched_minkowski_engine_is_refused_for_cpu_replicas_and_said_on_gpus(monkeypatch):
    """Without this project's build marker (a stock ME), CPU replicas are refused before the first step with the
    defects and the build command; allow_unpatched_me=True goes on with a warning; GPUs get a warning naming what
    the missing patches cost. With the marker (this environment's ME) nothing is said."""
    from lightning_sparse_dp.runtime import me as _me

    assert _me.build_info() is not None and not _me.missing_patches(_me.CPU_PATCHES)  # the project's build
    monkeypatch.setattr(_me, "build_info", lambda: None)
    batch = collate_dict(random_samples(6, seed=81))
    with pytest.raises(
        MisconfigurationException, match=r"stock MinkowskiEngine.*global pooling rows.*build_minkowski\.sh"
    ):
        trainer(strategy="sparse_dp", devices=3).fit(SparseNet(), loader(batch))
    with pytest.warns(UserWarning, match=r"stock MinkowskiEngine.*allow_unpatched_me=True"):
        trainer(strategy=SparseDataParallelStrategy(allow_unpatched_me=True), devices=3).fit(SparseNet(), loader(batch))
    trainer(strategy="sparse_dp", devices=1).fit(SparseNet(), loader(batch))  # one replica: nothing to differ
    gpu = _me.unpatched_message("sparse_dp", "cuda", _me.missing_patches(_me.GPU_PATCHES))
    assert "on GPUs the replicas still train exactly" in gpu and "13:" in gpu
    assert "build_minkowski.sh --cuda " in gpu  # the flag before the interpreter: after it, the script ignores it
