"""Exactness: the strategy's training step measured against one device's, on float64 copies, the outcome said.

Files, in the order a check runs them:

- :mod:`~lightning_sparse_dp.exactness.probe`: the float64 copies of the module and the batch, the random generators
  set and given back;
- :mod:`~lightning_sparse_dp.exactness.compare`: what a run left (:class:`~.compare.StepRecord`), and the relative
  differences of two runs, tensor by tensor;
- :mod:`~lightning_sparse_dp.exactness.check`: when to check, the two runs compared, the info line, warning or error.

The strategies give the check their runs: ``sparse_dp`` in :mod:`lightning_sparse_dp.strategies.exactness`.
"""

from lightning_sparse_dp.exactness.check import TOLERANCE, ExactnessCheck, ExactnessError

__all__ = ["ExactnessCheck", "ExactnessError", "TOLERANCE"]
