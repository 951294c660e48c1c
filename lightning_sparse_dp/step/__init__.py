"""Step: the stages of one ``sparse_dp`` step, one file a stage, in data-path order.

The hub (:meth:`~lightning_sparse_dp.strategies.sparse_dp.SparseDataParallelStrategy.training_step`) calls them in
this order, each filling in its part of the step's :class:`~lightning_sparse_dp.step.context.StepContext`
(:mod:`.context`); a stage never calls another:

- :mod:`.prepare`: the batch where Lightning's loops move it (``batch_to_device``): what the hooks see; with one device
  the module's own step skips every stage; where the module has its own batch-transfer hooks, the chunks placed there;
- :mod:`.scatter`: the batch cut into chunks of whole samples (:mod:`lightning_sparse_dp.split`) and each chunk placed
  on its device, SparseTensor / TensorField built there, now or in its replica's thread;
- :mod:`.replicate`: the module's persistent replicas, built once and refreshed each step; :mod:`.copies`: the copies
  they carry (ME ``__slots__``, buffers) and :mod:`.check`: the check, deferred into the step, that they still fit;
- :mod:`.state`: the replicas' per-step state installed around the apply stage (:mod:`lightning_sparse_dp.replica`),
  and what the step left on the module merged into it after the weigh stage;
- :mod:`.apply`: every replica's step at once, one thread each, under what it runs under; :mod:`.errors`: a replica's
  error explained with the fix; :mod:`.manual`: manual optimization's optimizer calls met once;
- :mod:`.skipped`: steps that returned ``None`` for some chunks;
- :mod:`.weigh`: each replica's loss and its weight in the whole batch's;
- :mod:`.backward`: each replica's backward in its own thread, gradients reduced onto the module;
- :mod:`.gather`: the outputs back on the root device in batch order, the loss the weighted sum;
- :mod:`.log`: the replicas' ``self.log`` calls reduced and logged once.
"""
