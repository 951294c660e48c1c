"""One sparse_ddp process of tests/ddp/test_ddp.py (every rank runs this file).

    python -m tests.support.ddp_script OUT SCENARIO[,SCENARIO...] [NUM_NODES [LOSS_WEIGHTING]]

With one node, Lightning's popen launcher starts the other rank by running this command again; with
several, torchrun starts one process per node. Each scenario of ``tests.support.ddp_helpers.SCENARIOS`` is
fitted in turn with ``Trainer(strategy=SparseDDPStrategy(...), devices=2 / num_nodes, ...)``, and every
rank saves ``OUT/<scenario>-rank<global rank>.pt`` (see ``tests.support.ddp_helpers.result``).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_sparse_dp import SparseDDPStrategy  # noqa: E402
from tests.support.ddp_helpers import (  # noqa: E402
    ALL_SCENARIOS,
    MESSAGES,
    Capture,
    evaluate,
    listen,
    loaders,
    result,
    trainer_kwargs,
)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    num_nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    devices = 2 // num_nodes
    weighting = sys.argv[4] if len(sys.argv) > 4 else None  # overrides the scenario's (e.g. "equal": plain DDP)
    torch.set_num_threads(1)
    listen()
    for name in names:
        MESSAGES.clear()
        s = ALL_SCENARIOS[name]
        model = s.build(reference=False)
        train, val = loaders(s.per_rank, world_size=None, model=s.model)
        logger = Capture()
        strategy = SparseDDPStrategy(loss_weighting=weighting or s.loss_weighting, timeout=timedelta(seconds=120))
        trainer = L.Trainer(
            **trainer_kwargs(
                strategy=strategy, devices=devices, num_nodes=num_nodes, max_epochs=s.epochs, logger=logger, **s.trainer
            )
        )
        trainer.fit(model, train, val, ckpt_path=out / "sparse_dp.ckpt" if s.resume else None)
        saved = result(trainer, model, logger)
        if s.evaluate:
            saved.update(evaluate(trainer, model, val))
        torch.save(saved, out / f"{name}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
