"""Optional metric sinks on the driver: TensorBoard event files and MLflow (`run.loggers`).

Owns: turning the metrics lines of the record stream (`driver/stream.py`) into
TensorBoard scalars and MLflow metrics, and checking before Ray starts that the packages
a config asks for are installed. Must not touch: the run directory's JSONL files (the
recorder writes those), Ray, training.

A sink is an object with `record(line)`, `flush()` and `close(status)`; the recorder
hands it every metrics line (train and validation alike, in order) and never lets a
sink's failure stop a run. Every numeric field of a line becomes a scalar at the line's
`step` (`loss` -> `train/loss`, `val_loss` -> `val/loss`, `lr` -> `train/lr`, ...) with
its wall-clock `time`.

TensorBoard: event files written with tensorboardX (installed with ray[train]) into
`<run dir>/tensorboard/`; for a run directory in object storage they are written to a
local staging directory and copied up at every flush (`tensorboard --logdir` reads
s3:// and gs:// directly). MLflow: one MLflow run per fit in the experiment named
after the run (`name`), at `$MLFLOW_TRACKING_URI` (MLflow's own default otherwise), the
flattened config as params, ended FINISHED / FAILED / KILLED with the fit.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import TENSORBOARD_DIR, Location

SKIP = {"step", "epoch", "time", "attempt"}  # positions and bookkeeping, not curves
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX (installed with ray[train])"),
            "mlflow": ("mlflow", "mlflow")}


def check_loggers(cfg: Any) -> None:
    """A clear error, before Ray starts, when a logger's package is missing."""
    for logger in cfg.run.loggers:
        if logger in PACKAGES and importlib.util.find_spec(PACKAGES[logger][0]) is None:
            raise UserError(f"run.loggers includes {logger!r} but the {PACKAGES[logger][1]} package is not "
                            f"installed; pip install {PACKAGES[logger][0]}, or drop it from run.loggers")


def make_sinks(cfg: Any, run_dir: Location) -> list[Any]:
    sinks: list[Any] = []
    if "tensorboard" in cfg.run.loggers:
        sinks.append(TensorBoardSink(run_dir))
    if "mlflow" in cfg.run.loggers:
        sinks.append(MlflowSink(cfg, run_dir))
    return sinks


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The line's curves by tag: `val_*` under `val/`, everything else under `train/`."""
    out = {}
    for key, value in line.items():
        if key in SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
        out[tag] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, run_dir: Location) -> None:
        from tensorboardX import SummaryWriter

        self.target = run_dir / TENSORBOARD_DIR
        self._staging: Optional[Path] = None
        if self.target.is_local:
            logdir = self.target.local_path
        else:
            self._staging = Path(tempfile.mkdtemp(prefix="raytrain_ddp_tb_"))
            logdir = self._staging
        self.writer = SummaryWriter(logdir=str(logdir), flush_secs=5)

    def record(self, line: dict[str, Any]) -> None:
        step, when = int(line.get("step", 0)), line.get("time")
        for tag, value in scalars(line).items():
            if math.isfinite(value):
                self.writer.add_scalar(tag, value, global_step=step, walltime=when)

    def flush(self) -> None:
        self.writer.flush()
        if self._staging is not None:
            self.target.upload_from(self._staging)

    def close(self, status: str) -> None:
        self.writer.close()
        if self._staging is not None:
            self.target.upload_from(self._staging)
            shutil.rmtree(self._staging, ignore_errors=True)


class MlflowSink:
    ENDED = {"ok": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED

    def __init__(self, cfg: Any, run_dir: Location) -> None:
        import mlflow
        import yaml

        self.mlflow = mlflow
        self._timestamps = "timestamp" in inspect.signature(mlflow.log_metrics).parameters
        mlflow.set_experiment(cfg.name)
        self.run = mlflow.start_run(run_name=cfg.name, tags={"raytrain_ddp.run_dir": run_dir.uri})
        flat = _flatten(yaml.safe_load(cfg.to_yaml()))
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def record(self, line: dict[str, Any]) -> None:
        metrics = {tag: v for tag, v in scalars(line).items() if math.isfinite(v)}
        if metrics:
            when = line.get("time")
            self.mlflow.log_metrics(metrics, step=int(line.get("step", 0)),
                                    **({"timestamp": int(when * 1000)} if when and self._timestamps else {}))

    def flush(self) -> None:
        pass  # every log_metrics call is already sent

    def close(self, status: str) -> None:
        self.mlflow.end_run(status=self.ENDED.get(status, "FAILED"))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out
