"""DDP: the pieces of ``sparse_ddp`` (:class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy`) across
processes, on ``torch.distributed`` through Lightning's DDP (``docs/architecture.md`` draws a rank's step):

- :mod:`.sampler`: each rank's point-balanced share of every global batch
  (:class:`~.sampler.PointBalancedBatchSampler`);
- :mod:`.rank_loaders`: the DataLoaders made from it for each rank;
- :mod:`.logged_means`: a step's ``sync_dist`` means held back and logged as the global batch's;
- :mod:`.exchange`: what ranks exchange: summaries in one fixed-size all-gather (the loss's terms, the held means)
  and the outputs gathered for prediction; and each rank's count ``n_r``, read from its batch.
"""
