"""How far replica threads in one process could go: plain Lightning's step with its network part in bare threads.

Plain Lightning's step (:class:`NetworkClock` times its parts, inside the Trainer) is the network part,
``training_step`` and the backward of its loss on the whole batch, plus serial work: Lightning's loop, zero_grad,
the optimizer step, the hooks, the step's ``self.log`` calls. Replicas that are threads of one process can at best
run the network part as ``R`` bare threads do (:func:`bare_thread_times`): each thread with its own copy of the
module (``copy.deepcopy``) on ``1/R`` of the batch's samples (consecutive, collated with the model's own collate),
with the thread shares sparse_dp gives its replicas (:func:`lightning_sparse_dp.runtime.threads.split_threads`, each thread
``torch.set_num_threads(share)``), and nothing else: no split, placing, replication, loss gather, gradient
reduction or logging. So, with ``plain`` plain Lightning's step, ``serial`` its serial part and ``bare`` the bare
threads' wall time (started together, to the slowest one's end), all measured in one process::

    ceiling = plain / (serial + bare)

the speedup over plain Lightning that a thread-based strategy would reach if everything of its own cost nothing
(:func:`ceiling`). It bounds ``sparse_dp-R``'s speedup from above, with sync BN too (whose replicas also wait for
each other at every synchronized layer). The step's ``self.log`` calls count as serial: outside a Trainer
Lightning's ``self.log`` returns at once (after one warning, silenced here), so ``bare`` holds none of them, and
:class:`NetworkClock` leaves them in the serial part, since a strategy makes them once, after the gather
(sparse_dp's ``emit``).

Some of a strategy's own work no thread-parallel strategy can leave out: the batch planned and cut into chunks,
each chunk placed, the replicas handed their work twice a step (forward, then backward) and their gradients added.
:func:`floor_fraction` of :func:`unavoidable_seconds` is the most of the ceiling a step could reach with everything
else of its own at no cost (``bench.py``'s ``digits_floor_fraction_*``).

What keeps ``bare`` above the whole batch's network part over ``R`` on a CPU is the per-operation work that every
thread pays in full whatever its share of the points (module calls, ME's coordinate and kernel maps, autograd), the
part of it that holds the GIL (one thread at a time), and the cores (``R`` above the core count).
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning as L
import torch

from lightning_sparse_dp.runtime.threads import split_threads, threads_per_replica


class NetworkClock(L.Callback):
    """Per training batch, the wall seconds of the network part: ``training_step`` plus the backward of its loss,
    less the time of the step's ``self.log`` calls.

    ``training_step`` and ``log`` are timed by wrapping the module's (instance attributes, set at ``setup``; plain
    Lightning's single-device strategy calls ``lightning_module.training_step``), the backward between Lightning's
    ``on_before_backward`` and ``on_after_backward`` hooks. Use it beside a clock of the whole step: the step minus
    :attr:`times` is the step's serial part, its ``self.log`` calls included (a thread-parallel strategy makes them
    once, after the gather).

    Attributes:
        times: one entry per training batch, in order.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._step = self._logged = self._backward_start = 0.0

    def setup(self, trainer, pl_module, stage):
        step, log = pl_module.training_step, pl_module.log

        def timed_step(*args, **kwargs):
            self._logged = 0.0
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._step = time.perf_counter() - start

        def timed_log(*args, **kwargs):
            start = time.perf_counter()
            try:
                return log(*args, **kwargs)
            finally:
                self._logged += time.perf_counter() - start

        pl_module.training_step, pl_module.log = timed_step, timed_log

    def on_before_backward(self, trainer, pl_module, loss):
        self._backward_start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        self.times.append(self._step - self._logged + time.perf_counter() - self._backward_start)


def _network_pass(module: torch.nn.Module, batch: Any) -> None:
    """``training_step`` on ``batch`` and the backward of its loss (gradients dropped after)."""
    out = module.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    module.zero_grad(set_to_none=True)


def bare_thread_times(
    module: torch.nn.Module,
    samples: Sequence[Any],
    collate: Callable[[list[Any]], Any],
    replicas: int,
    steps: int,
    warmup: int,
) -> list[float]:
    """Wall seconds of the network part of one batch in ``replicas`` bare threads, one entry per timed pass.

    Args:
        module: a LightningModule on the CPU; each thread trains its own ``copy.deepcopy`` (training mode).
        samples: the batch's samples (``len(samples) >= replicas``), in the order a DataLoader collates them.
        collate: the DataLoader's ``collate_fn``.
        replicas: ``R >= 2`` threads; thread ``k`` takes samples ``[round(k*n/R), round((k+1)*n/R))``.
        steps, warmup: timed passes and untimed passes before them.

    Each pass starts the threads' ``training_step`` + backward together (a barrier) and ends with the slowest
    thread's. ME's OpenMP and OpenBLAS get sparse_dp's share of the cores for the passes
    (:func:`~lightning_sparse_dp.runtime.threads.split_threads`, undone after), and each thread that intra-op count.

    Raises:
        ValueError: ``replicas < 2`` or fewer samples than ``replicas``.
    """
    if replicas < 2 or len(samples) < replicas:
        raise ValueError(f"need replicas >= 2 and at least that many samples, got {replicas} and {len(samples)}")
    bounds = [round(k * len(samples) / replicas) for k in range(replicas + 1)]
    chunks = [collate(list(samples[bounds[k] : bounds[k + 1]])) for k in range(replicas)]
    copies = [copy.deepcopy(module).train() for _ in range(replicas)]
    split = split_threads(replicas)
    share = split.per_replica if split is not None else threads_per_replica(replicas)
    configured = threading.local()
    gate = threading.Barrier(replicas + 1)

    def run(k: int) -> None:
        if not getattr(configured, "done", False):
            torch.set_num_threads(share)  # per thread with OpenMP, as sparse_dp's replica threads set it
            configured.done = True
        gate.wait()
        _network_pass(copies[k], chunks[k])

    times = []
    try:
        with warnings.catch_warnings(), ThreadPoolExecutor(replicas) as pool:
            warnings.simplefilter("ignore")  # self.log outside a Trainer: one warning, nothing logged
            for i in range(warmup + steps):
                futures = [pool.submit(run, k) for k in range(replicas)]  # each blocks at the gate: one per thread
                gate.wait()
                start = time.perf_counter()
                for f in futures:
                    f.result()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
    finally:
        if split is not None:
            split.restore()
    return times


def ceiling(plain: Sequence[float], network: Sequence[float], bare: Sequence[float]) -> float:
    """``median(plain) / (median(plain - network) + median(bare))``: the thread-parallel ceiling (module docstring).

    Args:
        plain: plain Lightning's step times (s), one per step.
        network: the same steps' network parts (s, :class:`NetworkClock`), ``len(network) == len(plain)``.
        bare: :func:`bare_thread_times` (s).
    """
    serial = statistics.median(p - n for p, n in zip(plain, network, strict=True))
    return statistics.median(plain) / (serial + statistics.median(bare))


#: The stages of a sparse_dp step (``StageTimes`` names) that any thread-parallel strategy training the same model on
#: the same batch has to run in some form: the batch planned (``split``) and, on the main thread, placed
#: (``place``: nothing when the replicas place their own chunks), each chunk cut and placed (``scatter<i>``, in the
#: replicas' threads at once: the slowest counts) and the replicas' gradients added (``reduce``).
UNAVOIDABLE_STAGES = ("split", "place", "reduce")


def unavoidable_seconds(stages: dict[str, float], dispatch_s: float) -> float:
    """Seconds of a sparse_dp step's own work that no thread-parallel strategy can leave out.

    ``stages``: the step's stage medians (s; ``StageTimes.medians``): :data:`UNAVOIDABLE_STAGES` plus the slowest
    ``scatter<i>``; ``dispatch_s``: one hand-over of no-op callables to the replica threads and back
    (``bench_micro.dispatch_us``), paid twice a step (the forward, then the backward Lightning calls). Everything
    else of the step (replicating, the per-step state, loss weights, gather, logging, the replicas' own extras) is
    left out: this is what remains when all of that costs nothing.
    """
    scatter = max((v for k, v in stages.items() if k.startswith("scatter") and k[7:].isdigit()), default=0.0)
    return sum(stages.get(name, 0.0) for name in UNAVOIDABLE_STAGES) + scatter + 2 * dispatch_s


def floor_fraction(ceiling_step_s: float, unavoidable_s: float) -> float:
    """The most of the ceiling a thread-parallel strategy could reach whose only own costs are ``unavoidable_s``
    (:func:`unavoidable_seconds`): ``ceiling_step_s / (ceiling_step_s + unavoidable_s)``, where ``ceiling_step_s`` is
    the ceiling's step (serial part plus bare threads: plain Lightning's step over :func:`ceiling`). A ceiling
    fraction target above it cannot be met by trimming the rest of the step.
    """
    return ceiling_step_s / (ceiling_step_s + unavoidable_s)


__all__ = ["UNAVOIDABLE_STAGES", "NetworkClock", "bare_thread_times", "ceiling", "floor_fraction", "unavoidable_seconds"]
