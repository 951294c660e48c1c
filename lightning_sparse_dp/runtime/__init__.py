"""Runtime: what the strategies run on: threads, devices, clocks and the installed libraries.

- :mod:`.process`: every piece of state the package keeps for the whole process, declared in one file;
- :mod:`.executor`: the persistent replica threads (:class:`~.executor.ReplicaExecutor`), one per replica;
- :mod:`.threads`: CPU cores split between replicas, pinned or not; :mod:`.stall`: a replica that does not finish,
  reported; :mod:`.randomness`: replicas drawing from a shared generator under ``deterministic=True``, said;
- :mod:`.devices`: the devices' checks, device contexts and streams (the GPU-only code, kept thin);
- :mod:`.timing`: stage times and Lightning profiler actions;
- :mod:`.me`: the installed MinkowskiEngine (this project's patches, its coordinate manager);
- :mod:`.namespaces`: the same package for modules written against ``pytorch_lightning``;
- :mod:`.compat`: every private Lightning and torchmetrics name the package uses, reached there only;
- :mod:`.defaults`: float64 defaults for torch's factory functions in the exactness check's threads only.
"""
