"""Optional metric sinks on the driver: TensorBoard, MLflow and Weights & Biases (`run.loggers`).

Owns: turning the metrics lines of the record stream (`driver/stream.py`) into
TensorBoard scalars, MLflow metrics and W&B history rows, and checking before Ray starts
that the packages a config asks for are installed. Must not touch: the run directory's
JSONL files (the recorder writes those), Ray, training.

A sink is an object with `record(line)`, `flush()` and `close(status)`; the recorder never
lets a sink's failure stop a run. Every numeric field of a line becomes a scalar at the
line's `step` (`loss` -> `train/loss`, `val_loss` -> `val/loss`, `lr` -> `train/lr`, ...)
with its wall-clock `time` (`scalars`).

One point per step, the committed one. After a worker restart the steps since the resume
point are redone, and `metrics.jsonl` keeps only the redone lines. A tracker cannot take a
point back (MLflow and W&B histories are append-only; W&B refuses a step lower than one it
has), so the trackers here say `committed_only = True` and the recorder hands them a line
only once no restart can redo its step: when a checkpoint at or after that step is
reported, or when the fit ends; in step order, each (step, train|validation) once. The
console's progress lines stay live. The cost: trackers run one checkpoint interval behind
(`run.checkpoint_every_steps`; by default an epoch). With `run.validation: async` an epoch's val
line comes after its checkpoint, from rank 0's validator thread: the recorder hands the trackers
nothing past that step until it has come (W&B would refuse it after a later step). A fit that resumes a run's earlier
fit redoes that fit's steps past its checkpoint: TensorBoard (one log directory for every
fit) is told with a `SessionLog.START` at the first redone step (`fit_starts_at`), which
makes TensorBoard drop the earlier fit's points from there on (what torch's
`SummaryWriter(purge_step=...)` writes); MLflow and W&B start a new run per fit.

TensorBoard: event files written with tensorboardX (installed with ray[train]) into
`<run dir>/tensorboard/`; for a run directory in object storage they are written to a
local staging directory and copied up at every flush (`tensorboard --logdir` reads
s3:// and gs:// directly). MLflow: through `MlflowClient` and the run's id, never the
thread-local active run (the recorder logs from its own thread): one MLflow run per fit,
named after the run, in the experiment named after the run, at `$MLFLOW_TRACKING_URI`
(MLflow's own default otherwise), tagged with the fit id and the run directory; the
flattened config as params; ended FINISHED / FAILED / KILLED with the fit. W&B: one W&B
run per fit, named after the run, in the project named after the run (or
`$WANDB_PROJECT`), the run's config as its config; `WANDB_MODE=offline` works as usual.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from raytrain_ddp.driver.resume import flatten
from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import TENSORBOARD_DIR, Location

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

SKIP = {"step", "epoch", "time", "attempt"}  # positions and bookkeeping, not curves
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX (installed with ray[train])"),
            "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}
ENDED = {"ok": "FINISHED", "interrupted": "KILLED"}  # MLflow's statuses; anything else: FAILED
MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)


def check_loggers(cfg: "Config") -> None:
    """A clear error, before Ray starts, when a logger's package is missing."""
    for logger in cfg.run.loggers:
        if logger in PACKAGES and importlib.util.find_spec(PACKAGES[logger][0]) is None:
            raise UserError(f"run.loggers includes {logger!r} but the {PACKAGES[logger][1]} package is not "
                            f"installed; pip install {PACKAGES[logger][0]}, or drop it from run.loggers")


def make_sinks(cfg: "Config", run_dir: Location, fit_id: str = "") -> list[Any]:
    sinks: list[Any] = []
    if "tensorboard" in cfg.run.loggers:
        sinks.append(TensorBoardSink(run_dir))
    if "mlflow" in cfg.run.loggers:
        sinks.append(MlflowSink(cfg, run_dir, fit_id))
    if "wandb" in cfg.run.loggers:
        sinks.append(WandbSink(cfg, run_dir, fit_id))
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


def config_tree(cfg: "Config") -> dict[str, Any]:
    """The config as plain nested data (what config.yaml holds)."""
    import yaml

    return yaml.safe_load(cfg.to_yaml())


class TensorBoardSink:
    """TensorBoard event files, written synchronously: tensorboardX's `EventsWriter` (what its
    `SummaryWriter` writes through from a background queue, whose `flush` does not wait for the
    queue). So after `flush()` the file holds every point handed over, which `trackers.json`
    then says (driver/stream.py): a driver killed later loses none of them."""

    committed_only = True

    def __init__(self, run_dir: Location) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.record_writer import directory_check

        self.target = run_dir / TENSORBOARD_DIR
        self._staging: Optional[Path] = None
        if self.target.is_local:
            logdir = self.target.local_path
        else:
            self._staging = Path(tempfile.mkdtemp(prefix="raytrain_ddp_tb_"))
            logdir = self._staging
        directory_check(str(logdir))
        # A suffix that sorts by time: two fits within one second must neither share a file
        # name (the second would overwrite the first) nor be read out of order.
        self.writer = EventsWriter(os.path.join(str(logdir), "events"), f".{time.time_ns() // 1000}")

    def fit_starts_at(self, step: int) -> None:
        """This fit redoes the steps after `step`: TensorBoard drops earlier fits' points from step + 1."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.writer.write_event(Event(step=step + 1, wall_time=time.time(),
                                      session_log=SessionLog(status=SessionLog.START)))

    def record(self, line: dict[str, Any]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        step, when = int(line.get("step", 0)), line.get("time")
        when = float(when) if isinstance(when, (int, float)) else time.time()
        for tag, value in scalars(line).items():
            if math.isfinite(value):
                self.writer.write_event(Event(wall_time=when, step=step, summary=scalar(tag, value)))

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
    committed_only = True

    def __init__(self, cfg: "Config", run_dir: Location, fit_id: str = "") -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()  # $MLFLOW_TRACKING_URI, else MLflow's default
        experiment = self.client.get_experiment_by_name(cfg.name)
        if experiment is None:
            experiment_id = self.client.create_experiment(cfg.name)
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                self.client.restore_experiment(experiment_id)
        tags = {"raytrain_ddp.run_dir": run_dir.uri, **({"raytrain_ddp.fit_id": fit_id} if fit_id else {})}
        self.run = self.client.create_run(experiment_id, run_name=cfg.name, tags=tags)
        self.run_id = self.run.info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten(config_tree(cfg)).items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH])

    def record(self, line: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, when = int(line.get("step", 0)), line.get("time")
        stamp = int((when if isinstance(when, (int, float)) else time.time()) * 1000)
        metrics = [Metric(tag, v, stamp, step) for tag, v in scalars(line).items() if math.isfinite(v)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def flush(self) -> None:
        pass  # every log_batch call is already sent

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=ENDED.get(status, "FAILED"))


class WandbSink:
    committed_only = True
    EXIT_CODES = {"ok": 0, "interrupted": 255}  # wandb.finish's exit code; anything else 1 (failed)

    def __init__(self, cfg: "Config", run_dir: Location, fit_id: str = "") -> None:
        import wandb

        config = {**config_tree(cfg), "raytrain_ddp": {"fit_id": fit_id, "run_dir": run_dir.uri}}
        # WANDB_DIR / WANDB_MODE read now: wandb's process-wide settings keep the first fit's.
        env = {key: os.environ[var] for key, var in (("dir", "WANDB_DIR"), ("mode", "WANDB_MODE"))
               if os.environ.get(var)}
        # console="off": our progress lines stay ours (W&B would wrap stdout to capture them).
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or cfg.name, name=cfg.name, config=config,
                              settings=wandb.Settings(console="off", silent=True), **env)

    def record(self, line: dict[str, Any]) -> None:
        values = {tag: v for tag, v in scalars(line).items() if math.isfinite(v)}
        if values:
            self.run.log(values, step=int(line.get("step", 0)))

    def flush(self) -> None:
        pass  # the W&B service process writes (and uploads) on its own

    def close(self, status: str) -> None:
        self.run.finish(exit_code=self.EXIT_CODES.get(status, 1))
