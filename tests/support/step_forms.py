"""Training steps written as published code writes them, which the loss capture was never shown: each either trains
as one device does under the strategies, or the exactness check must say it does not (tests/exactness/)."""

from __future__ import annotations

import lightning as L
import MinkowskiEngine as ME
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.support.helpers import IN_CHANNELS, NUM_CLASSES


class PooledNet(L.LightningModule):
    """Convolutions, global pooling to ``[B, 16]`` (``.F``), a linear head; SGD. ``training_step`` is the plain
    cross-entropy of the head's logits (exact under the strategies)."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.body = nn.Sequential(
            ME.MinkowskiConvolution(IN_CHANNELS, 8, kernel_size=3, dimension=3),
            ME.MinkowskiReLU(),
            ME.MinkowskiConvolution(8, 16, kernel_size=2, stride=2, dimension=3),
            ME.MinkowskiReLU(),
            ME.MinkowskiGlobalAvgPooling(),
        )
        self.head = nn.Linear(16, NUM_CLASSES)
        self.lr = lr

    def features(self, batch):
        x = ME.SparseTensor(batch["features"], batch["coordinates"], device=self.device)
        return self.body(x).F

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.head(self.features(batch)), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualOptimization:
    """Mixin, first among the bases of a LightningModule: ``automatic_optimization = False`` and the training step
    users write for it: ``opt.zero_grad()``, ``self.manual_backward(loss)`` of :meth:`manual_loss` (``self.loss(batch)``
    unless overridden), :meth:`before_step`, ``opt.step()``, then :meth:`after_step`, whose value the step returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def manual_loss(self, batch, batch_idx):
        return self.loss(batch)

    def before_step(self, opt) -> None:
        """Between the backward and the optimizer's step (gradient clipping, say): nothing by default."""

    def after_step(self, loss):
        """After the optimizer's step (schedulers, logging): nothing by default, and the step returns nothing."""
        return None

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.manual_loss(batch, batch_idx)
        self.manual_backward(loss)
        self.before_step(opt)
        opt.step()
        return self.after_step(loss)


class CheckpointedLoss(PooledNet):
    """Activation checkpointing around the head and its loss (``torch.utils.checkpoint``)."""

    reentrant = True

    def training_step(self, batch, batch_idx):
        y = batch["labels"]
        w = torch.linspace(0.5, 1.5, NUM_CLASSES, dtype=self.head.weight.dtype)
        return checkpoint(lambda h: F.cross_entropy(self.head(h), y, weight=w), self.features(batch),
                          use_reentrant=self.reentrant)


class CheckpointedLossNonReentrant(CheckpointedLoss):
    reentrant = False


class CheckpointedHead(PooledNet):
    """What the strategy's message about a checkpointed loss asks for: the layers checkpointed, the loss outside."""

    reentrant = True

    def training_step(self, batch, batch_idx):
        w = torch.linspace(0.5, 1.5, NUM_CLASSES, dtype=self.head.weight.dtype)
        logits = checkpoint(self.head, self.features(batch), use_reentrant=self.reentrant)
        return F.cross_entropy(logits, batch["labels"], weight=w)


class CheckpointedHeadNonReentrant(CheckpointedHead):
    reentrant = False


class PerSampleGradients(PooledNet):
    """Per-sample gradients of the head (``torch.func.vmap(grad(...))`` over a loss), their mean norm logged; the step's
    loss the plain cross-entropy. ``penalty``: the mean norm also added to the loss (a gradient penalty)."""

    penalty = 0.0

    def training_step(self, batch, batch_idx):
        from torch.func import functional_call, grad, vmap

        h, y = self.features(batch), batch["labels"]
        params = dict(self.head.named_parameters())

        def one(p, x, t):
            return F.cross_entropy(functional_call(self.head, p, (x[None],)), t[None])

        norms = vmap(grad(one), in_dims=(None, 0, 0))(params, h, y)["weight"].flatten(1).norm(dim=1)
        self.log("grad_norm", norms.mean())
        return F.cross_entropy(self.head(h), y) + self.penalty * norms.mean()


class GradientPenalty(PerSampleGradients):
    penalty = 0.1


class ParameterStatistic(PooledNet):
    """A statistic of a parameter in the logits' path (``z / sqrt(mean(bias ** 2) + 1)``): one value in every replica."""

    def training_step(self, batch, batch_idx):
        z = self.head(self.features(batch))
        return F.cross_entropy(z / (self.head.bias.pow(2).mean() + 1).sqrt(), batch["labels"])


class ChunkStatisticOfLogits(PooledNet):
    """A statistic of the chunk in the logits' path (``z - z.mean(0)``): no split computes it as one device does."""

    def training_step(self, batch, batch_idx):
        z = self.head(self.features(batch))
        return F.cross_entropy(z - z.mean(0), batch["labels"])


class BackwardInside(PooledNet):
    """A ``.backward()`` on an auxiliary quantity inside the step (Lightning's ``zero_grad`` clears what it leaves)."""

    def training_step(self, batch, batch_idx):
        h = self.features(batch)
        self.head(h).pow(2).mean().backward(retain_graph=True)
        return F.cross_entropy(self.head(h), batch["labels"])


class _HandWrittenCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, y):
        ctx.save_for_backward(logits, y)
        return F.cross_entropy(logits, y)

    @staticmethod
    def backward(ctx, g):
        logits, y = ctx.saved_tensors
        p = logits.softmax(-1)
        p[torch.arange(len(y)), y] -= 1
        return g * p / len(y), None


class CustomFunctionLoss(PooledNet):
    """A custom ``torch.autograd.Function`` whose forward calls a loss and whose backward is written by hand."""

    def training_step(self, batch, batch_idx):
        return _HandWrittenCE.apply(self.head(self.features(batch)), batch["labels"])


class TeacherInPlace(PooledNet):
    """A teacher head updated in place (EMA of the student's) at the top of the step, BYOL / MoCo style."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.teacher = nn.Linear(16, NUM_CLASSES)
        self.teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.head.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        h = self.features(batch)
        return F.cross_entropy(self.head(h), batch["labels"]) + F.mse_loss(self.head(h), self.teacher(h))


class CoupledSamples(PooledNet):
    """A loss coupling the batch's samples: a softmax over every pair of samples' similarities (InfoNCE style)."""

    def training_step(self, batch, batch_idx):
        z = F.normalize(self.head(self.features(batch)), dim=1)
        similarities = z @ z.T / 0.5
        return F.cross_entropy(similarities, torch.arange(len(z), device=z.device))


class HandMadeSum(PooledNet):
    """The loss returned as a plain sum over the batch."""

    def training_step(self, batch, batch_idx):
        return self.head(self.features(batch)).sum()


class WarmedUpCoupling(PooledNet):
    """A plain cross-entropy, with a loss coupling the batch's samples (InfoNCE) added from the second optimizer step
    on (a warm-up): the first step is exact, the later ones are not."""

    def training_step(self, batch, batch_idx):
        z = self.features(batch)
        loss = F.cross_entropy(self.head(z), batch["labels"])
        if self.global_step >= 1:
            h = F.normalize(self.head(z), dim=1)
            loss = loss + F.cross_entropy(h @ h.T / 0.5, torch.arange(len(h), device=h.device))
        return loss


#: every form above, by name
FORMS = {cls.__name__: cls for cls in (
    CheckpointedLoss, CheckpointedLossNonReentrant, BackwardInside, CustomFunctionLoss, TeacherInPlace, CoupledSamples,
    HandMadeSum, WarmedUpCoupling,
)}
