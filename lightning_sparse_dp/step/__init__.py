"""Step: the stages of one ``sparse_dp`` step, one file a stage, in data-path order.

The strategy's hub calls them in order; each returns its results, which the hub writes into the step's
:class:`~lightning_sparse_dp.step.context.StepContext`: ``docs/architecture.md`` draws the path and says where a
stage's file uses another's helpers. The files:

- :mod:`.context`: what a step is given (:class:`~lightning_sparse_dp.step.context.StepCall`) and its stages'
  results (:class:`~lightning_sparse_dp.step.context.StepContext`);
- :mod:`.prepare`: the batch at Lightning's ``batch_to_device``: what the hooks see, what the step splits;
- :mod:`.scatter`: chunks of whole samples (:mod:`lightning_sparse_dp.split`) placed on their devices;
- :mod:`.replicate`: the module's persistent replicas; :mod:`.copies`: what they carry beyond torch's replication (ME
  ``__slots__``, buffer copies); :mod:`.check`: the deferred check that they still fit;
- :mod:`.state`: the replicas' per-step state (:mod:`lightning_sparse_dp.replica`), and what the step left on the
  module merged into it;
- :mod:`.apply`: what each replica's step runs under; :mod:`.errors`: a replica's error explained with the fix;
  :mod:`.manual`: manual optimization's calls met once;
- :mod:`.skipped`: steps that returned ``None`` for some chunks;
- :mod:`.weigh`: each replica's loss and its weight in the whole batch's;
- :mod:`.backward`: each replica's backward in its own thread, gradients reduced onto the module;
- :mod:`.gather`: the outputs on the root device in batch order, the loss the weighted sum;
- :mod:`.log`: the replicas' ``self.log`` calls reduced, to be logged once.
"""
