"""Process: every piece of state this package keeps for the whole process, declared in this one file.

The modules that use these objects import them from here (under their own local names); no other module of the package
holds a module-level mutable object or changes a process-wide setting. Nothing here is set per step; a step's state is
its :class:`~lightning_sparse_dp.step.context.StepContext` and the strategy's attributes.

Caches of facts that do not change while the process runs (keyed by types, code objects and callables), filled on first
use and never invalidated:

- :data:`ONE_LEVEL_LAYOUTS` (``split/leaves.py``): a one-level batch's flattening, by container type and keys (at most
  64 entries);
- :data:`LOSS_SITES` (``loss/sites.py``): how each call site of a mean-reduced loss in user code reads, by code object
  and instruction offset; :data:`LOSS_PARAMETERS` (``loss/denominators.py``): a loss function's parameter names and
  defaults;
- :data:`PLAIN_TYPES` (``replica/snapshot.py``): whether a type is a plain object of the user's;
  :data:`FUSED_BATCH_NORM` (``syncbn/collective.py``): whether a layer type takes the fused batch-norm path;
- and, memoized the same way with ``functools.cache``: ``runtime/me.py`` (what the installed MinkowskiEngine has),
  ``loss/sites.py`` (a code object's instructions), ``replica/effects.py`` (the logger and Trainer view classes) and
  ``replica/snapshot.py`` (a bare LightningModule's keys).

One-time messages: :data:`SAID_ONCE`, Lightning's ``WarningCache`` (each message once per process) for the module-level
functions that warn (the split's roles, loss weights, the gather, log reduction, metric merges, recorders); a
strategy keeps its own cache for its messages (once per strategy).

Thread-local (one value per thread, set only while a replica's call or step runs in it): :data:`REPLICA_CALL`
(``runtime/executor.py``: the cores a replica thread pinned itself to, the replicas of the call it runs),
:data:`MEAN_COUNTS` (``loss/means.py``), :data:`STEP_OBSERVER` (``loss/capture.py``), :data:`STEP_EFFECTS`
(``replica/effects.py``) and :data:`FLOAT64_DEFAULTS` (``runtime/defaults.py``: the exactness check's float64 runs,
in place of the process-wide ``torch.set_default_dtype``).

Process-wide settings the package changes, and when:

- ``sys.meta_path``: ``runtime/namespaces.py`` puts its finders there at ``import lightning_sparse_dp`` (the
  ``pytorch_lightning`` mirror, imported once the process imports ``pytorch_lightning``);
- Lightning's rank-zero logger: ``lightning_sparse_dp/__init__.py`` puts back where its lines went before the import;
- the intra-op thread counts of torch, OpenMP, OpenBLAS and ME's coordinate manager: split between CPU replicas at setup
  and given back at teardown (``runtime/threads.py``, :class:`~lightning_sparse_dp.runtime.threads.ThreadSplit`), and a
  replica thread's CPU affinity (``pin_replicas``); ``runtime/threads.py`` reads torch's default count at import.
"""

from __future__ import annotations

import threading
from typing import Any

from lightning.pytorch.utilities.rank_zero import WarningCache

ONE_LEVEL_LAYOUTS: dict[tuple[Any, ...], tuple[Any, tuple[tuple[Any, ...], ...], tuple[str, ...]]] = {}
LOSS_SITES: dict[tuple[Any, int], Any] = {}
LOSS_PARAMETERS: dict[Any, tuple[list[str], dict[str, Any]]] = {}
PLAIN_TYPES: dict[type, bool] = {}
FUSED_BATCH_NORM: dict[type, bool] = {}

SAID_ONCE = WarningCache()

REPLICA_CALL = threading.local()  # .cores: the CPU ids this replica thread pinned itself to; .replicas: the call's count
MEAN_COUNTS = threading.local()  # .counts: {id(mean): (mean, count)} of this thread's step, while it counts
STEP_OBSERVER = threading.local()  # .active: the observer of this thread's step, while it runs
STEP_EFFECTS = threading.local()  # .effects / .index: the step this replica thread runs (unset outside it); .inside
FLOAT64_DEFAULTS = threading.local()  # .on: this thread runs the exactness check's float64 copies

__all__ = [
    "FLOAT64_DEFAULTS",
    "FUSED_BATCH_NORM", "LOSS_PARAMETERS", "LOSS_SITES", "MEAN_COUNTS", "ONE_LEVEL_LAYOUTS", "PLAIN_TYPES", "REPLICA_CALL",
    "SAID_ONCE", "STEP_EFFECTS", "STEP_OBSERVER",
]
