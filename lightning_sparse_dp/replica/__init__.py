"""Replica: what makes a replica's step one device's step, for the module, its metrics, its logs and its loggers.

Installed around the apply stage and undone after it, in each replica's own thread where it can be:

- :mod:`.install`: each replica's per-step state put in place before its step and taken back after it;
- :mod:`.changes`: the module's attributes around a step: each replica's own copies of its lists and dicts, merged
  back as one device's step leaves them; :mod:`.snapshot`: which attributes are followed, and how values are
  copied and compared; :mod:`.attributes`: the same for the module's submodules; :mod:`.watch`: what of that (and
  of the replicas' trainer views and recorders) the persistent replicas hold from step to step while it holds;
- :mod:`.metrics`: torchmetrics metrics copied per replica, reset each step; :mod:`.metric_merge`: their states
  merged into the root's metrics in batch order; :mod:`.metric_updates`: what their updates and ``compute`` did
  beyond the states (one number per chunk made the whole batch's update; attributes set on the copies, said);
- :mod:`.recorder`: each replica's ``self.log`` recorded, checked as Lightning checks it;
- :mod:`.effects`: the loggers' calls of a replica's step, run once (the root replica's), as DDP's rank 0 does.
"""
