"""The digits network (``examples/train_digits.py``) through Lightning's ``LightningCLI``: the strategy and its
options come from the command line or a YAML config, as for any Lightning strategy.

    .venv/bin/python examples/cli_digits.py fit --config examples/cli_digits.yaml
    .venv/bin/python examples/cli_digits.py fit --trainer.accelerator=cpu --trainer.devices=3 \\
        --trainer.strategy=lightning_sparse_dp.SparseDataParallelStrategy --trainer.strategy.loss_weighting=samples
    .venv/bin/python examples/cli_digits.py fit --trainer.strategy=sparse_dp --trainer.devices=3  # by its name

``import lightning_sparse_dp`` (below, through train_digits) registers the names; a class path needs no import.
LightningCLI needs ``jsonargparse[signatures]`` (the ``examples`` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import DigitNet, SparseDigits, collate  # noqa: E402  (registers the strategies)


class DigitsData(L.LightningDataModule):
    """scikit-learn's digits as sparse 2-D samples, the fixed 20 % validation split of ``train_digits.py``."""

    def __init__(self, batch_size: int = 48) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        digits = load_digits()
        x_train, x_val, y_train, y_val = train_test_split(
            digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
        )
        self.train, self.val = SparseDigits(x_train, y_train), SparseDigits(x_val, y_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=128, collate_fn=collate)


def main() -> None:
    cli = LightningCLI(DigitNet, DigitsData, seed_everything_default=0, save_config_kwargs={"overwrite": True})
    if cli.trainer.is_global_zero and "val_acc" in cli.trainer.callback_metrics:
        strategy = cli.trainer.strategy
        print(f"strategy={type(strategy).__name__} loss_weighting={getattr(strategy, 'loss_weighting', None)} "
              f"devices={len(getattr(strategy, 'parallel_devices', None) or [])}")
        print(f"val_acc={float(cli.trainer.callback_metrics['val_acc']):.4f}")


if __name__ == "__main__":
    main()
