"""What the driver hands every worker: the resolved config, the data's shape, where the run lives.

Owns: `DataSpec` (computed on the driver from the data, read by models and the loop) and
`Job` (shipped in `train_loop_config`). Must not touch: Ray, torch.distributed. Both
are frozen: a worker never changes what the driver decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from raytrain_ddp.config import Config


@dataclass(frozen=True)
class DataSpec:
    """What the model and the loop need to know about the data, computed on the driver."""

    task: Literal["classification", "lm"]
    feature_shape: tuple[int, ...]
    num_classes: int  # vocabulary size for "lm"
    train_rows: int
    val_rows: int
    source: str


@dataclass(frozen=True)
class Job:
    """What the driver decided, shipped to every worker in `train_loop_config`."""

    cfg: Config
    spec: DataSpec
    run_dir: str
    fit_id: str  # one per `run_training` call; tells this fit's checkpoints from older ones
    resume_from: Optional[str] = None  # checkpoint chosen (and verified) by the driver
