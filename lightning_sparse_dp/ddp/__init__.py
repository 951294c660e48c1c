"""DDP: the pieces of ``sparse_ddp`` (:class:`~lightning_sparse_dp.strategies.sparse_ddp.SparseDDPStrategy`) across
processes, on ``torch.distributed`` through Lightning's DDP:

- :mod:`.sampler`: each rank's point-balanced share of every global batch
  (:class:`~.sampler.PointBalancedBatchSampler`);
- :mod:`.rank_loaders`: the DataLoaders made from it for each rank;
- :mod:`.logged_means`: a step's ``sync_dist`` means held back and logged as the global batch's;
- :mod:`.exchange`: the one fixed-size all-gather per step of the ranks' loss summaries and counts, and the outputs
  gathered for prediction.
"""
