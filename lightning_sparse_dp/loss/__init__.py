"""The exact loss: what makes the replicas' (ranks') losses the one-device loss over the whole batch.

One module per idea, in the order a step meets them:

- :mod:`~lightning_sparse_dp.loss.values`: the loss of a step's output (Lightning's rule), and whether a logged
  value is it;
- :mod:`~lightning_sparse_dp.loss.denominators`: torch's mean-reduced losses and their denominators as torch defines
  them (which calls are captured);
- :mod:`~lightning_sparse_dp.loss.observer`: the torch function mode every replica's step runs under, what it notes
  of the step's calls; :mod:`~lightning_sparse_dp.loss.capture`: each captured call of a replica's step becomes a term
  (:mod:`~lightning_sparse_dp.loss.term`: value, denominator, call site), its gradient scalable after the step;
  :mod:`~lightning_sparse_dp.loss.forms`: how the
  step's arithmetic combines terms; :mod:`~lightning_sparse_dp.loss.sites`: where the user's code called a loss and
  what its input is;
- :mod:`~lightning_sparse_dp.loss.means`: which elements a logged mean is over (each one-value ``torch.mean`` a step
  computes, counted), and the names a mean goes by (:data:`~lightning_sparse_dp.loss.means.MEAN_NAMES`);
- :mod:`~lightning_sparse_dp.loss.decide`: the replicas' summaries read as matched terms or per-sample losses, and
  each term's weight, a step's readings kept for later steps of the same structure (:mod:`~lightning_sparse_dp.loss.memory`:
  what earlier steps told of each call site);
  :mod:`~lightning_sparse_dp.loss.readings`: how one call site is read in full (:mod:`~lightning_sparse_dp.loss.classes`:
  per-class losses in a loop, paired across replicas by their targets' class); :mod:`~lightning_sparse_dp.loss.step`:
  that decision applied to a step and said once where it falls back; :mod:`~lightning_sparse_dp.loss.reweight`: one
  replica's (rank's) re-weighting, the invariant between its weight, its terms' shares and the value shift stated once;
- :mod:`~lightning_sparse_dp.loss.weights`: the per-chunk weights (``"auto"``, ``"samples"``, ``"points"``, a
  callable) where the loss is weighted as a whole;
- :mod:`~lightning_sparse_dp.loss.collectives`: ``sparse_ddp`` steps that reduce across ranks themselves.

A new kind of loss goes to :mod:`~lightning_sparse_dp.loss.denominators` (its denominator) and, if the step's
arithmetic on it needs a new rule, :mod:`~lightning_sparse_dp.loss.forms`.
"""

from lightning_sparse_dp.loss.weights import chunk_counts, chunk_weights

__all__ = ["chunk_counts", "chunk_weights"]
