"""What the driver hands every worker: the resolved config, the data's shape, where the run lives.

Owns: `DataSpec` (computed on the driver from the data, read by models and the loop) and
`Job` (shipped in `train_loop_config`). Must not touch: Ray, torch.distributed. Both
are frozen: a worker never changes what the driver decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from raytrain_ddp.config import Config


@dataclass(frozen=True)
class DataSpec:
    """What the model and the loop need to know about the data, computed on the driver."""

    task: Literal["classification", "lm", "other"]
    feature_shape: tuple[int, ...]
    num_classes: int  # vocabulary size for "lm"; 0 when unknown (a user pipeline's token labels)
    train_rows: int
    val_rows: int
    source: str
    # A user pipeline's columns as the model sees them (after data.preprocess):
    # name -> (shape of one row, dtype name). Empty for the built-in data path.
    columns: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    # data.sharding='sharded': the chunk stores' directory (`rundir.Location`; `data/store.py`)
    # holding train/ and val/. Where the data is, not what it is: not in `state_dict`.
    store: Optional[Any] = None

    def state_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's `run` record and `raytrain-ddp export` carry it)."""
        return {"task": self.task, "feature_shape": list(self.feature_shape), "num_classes": self.num_classes,
                "train_rows": self.train_rows, "val_rows": self.val_rows, "source": self.source,
                "columns": {k: [list(shape), dtype] for k, (shape, dtype) in self.columns.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DataSpec":
        columns = {k: (tuple(shape), dtype) for k, (shape, dtype) in state.get("columns", {}).items()}
        return cls(state["task"], tuple(state["feature_shape"]), int(state["num_classes"]),
                   int(state["train_rows"]), int(state["val_rows"]), state["source"], columns)


@dataclass(frozen=True)
class Job:
    """What the driver decided, shipped to every worker in `train_loop_config`."""

    cfg: Config
    spec: DataSpec
    run_dir: str
    fit_id: str  # one per `run_training` call; tells this fit's checkpoints from older ones
    resume_from: Optional[Any] = None  # checkpoint chosen (and verified) by the driver: a `rundir.Location`
    mailbox: Any = None  # the driver's record-stream actor (`driver/stream.py`); rank 0 sends its lines there
    # The user's model factory, loss and preprocess (`raytrain_ddp.user.UserCode`), pickled
    # on the driver and unpickled only on the workers, whose runtime_env carries their modules.
    user_code: Optional[bytes] = None
