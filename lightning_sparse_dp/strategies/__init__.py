"""Strategies: the two Lightning strategies, registered as ``"sparse_dp"`` and ``"sparse_ddp"``, and what they share.

- :mod:`~lightning_sparse_dp.strategies.sparse_dp`: :class:`~.sparse_dp.SparseDataParallelStrategy`, one process, one
  replica thread per device; its step hooks run the hub that calls the stages of :mod:`lightning_sparse_dp.step` in
  data-path order (``docs/architecture.md`` draws the path); :mod:`~lightning_sparse_dp.strategies.stages`: its four
  public stages (``scatter``, ``replicate``, ``parallel_apply``, ``gather``), methods to override;
- :mod:`~lightning_sparse_dp.strategies.single_process`: Lightning's plumbing for a strategy of one process (world size
  1, collectives as no-ops, the batch left where the DataLoader put it, the replica threads from setup to teardown);
- :mod:`~lightning_sparse_dp.strategies.sparse_ddp`: :class:`~.sparse_ddp.SparseDDPStrategy`, Lightning's DDP with the
  same split, loss weights and batch norm over processes (its pieces in :mod:`lightning_sparse_dp.ddp`);
- :mod:`~lightning_sparse_dp.strategies.base`: the options both take and how they are checked, their registration and
  the ``LayerSync`` plugin they resolve;
- :mod:`~lightning_sparse_dp.strategies.checks`: the setup checks both run on the module (``dataloader_iter`` steps,
  batch norm per replica, the fewest points a chunk may hold);
- :mod:`~lightning_sparse_dp.strategies.exactness`: the exactness check's two runs of the first training step on
  either strategy (:mod:`lightning_sparse_dp.exactness` compares them).
"""
