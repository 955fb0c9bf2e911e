"""How many optimizer steps the data gives: per epoch, and in the whole run.

Owns: the one formula both sides use, the driver for its plan and its summary
(`driver/launcher.py`) and every rank for its loop (`worker/loop.py`), so they cannot
disagree. Only full global batches are trained on: an epoch's remainder (fewer than
`train.global_batch_size` rows) is dropped at any worker count. Must not touch: reading
data, the batches themselves (`worker_data.py`).
"""

from __future__ import annotations

from raytrain_ddp.config import Config


def steps_per_epoch(train_rows: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch of `train_rows` rows: the full global batches."""
    return train_rows // global_batch_size


def total_steps(cfg: Config, steps_in_epoch: int) -> int:
    """Optimizer steps in the run: `train.max_steps` when set, else `train.epochs` epochs."""
    return cfg.train.max_steps or cfg.train.epochs * steps_in_epoch
