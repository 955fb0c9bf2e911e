"""One trial of a sweep: a full fit of ours inside a Ray Tune function trainable.

Owns: the trial's config (the base config with its drawn values, named by its trial id,
its run directory `trials/<trial id>` under the sweep's: `trial_config`), `trial.json`
in it (the drawn values, a failure outside the fit), and `TuneReport`, the sink that
hands each committed validation line to Tune. Must not touch: training (`run_training`
does it all: hold, resume, fault tolerance, exact data), the search (`sweep/run.py`).

Why the Train V2 pattern: the trial function builds our launcher's `TorchTrainer` and
calls `fit` (`Tuner(trainer)` is deprecated), so a trial is exactly a `train` run. Why a
sink: rank 0's validation lines reach the trial process through the driver's record
stream (`driver/stream.py`), which runs there; `ray.tune.report` is called from the
recorder's thread with each line once no restart can redo it (`committed_only`), so
Tune never sees a step twice. A trial whose run directory is complete (summary `ok` at
its last step) is not trained again: its recorded validation lines are reported instead,
so a restored sweep ranks it with the others.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from raytrain_ddp.config import validate_config
from raytrain_ddp.config.sweep import with_values
from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import METRICS_FILE, SUMMARY_FILE, Location, read_metrics

TRIAL_FILE = "trial.json"  # in each trial's run directory: trial id, drawn values, a failure outside the fit
TRIALS_DIR = "trials"


class TrialFailed(Exception):
    """The trial's fit ended without finishing (its summary's status and error)."""


def trial_config(base: dict[str, Any], values: dict[str, Any], sweep_dir: Location, trial_id: str) -> Any:
    """The trial's Config: base + values, `name` = the trial id, stored under the sweep's trials/."""
    data = with_values(base, values)
    data["name"] = trial_id
    data.setdefault("run", {})["storage_path"] = str(sweep_dir / TRIALS_DIR)
    return validate_config(data, f"trial {trial_id}")


def numeric(line: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TuneReport:
    """A recorder sink: each committed validation line to Tune, with its step and epoch."""

    committed_only = True  # only what metrics.jsonl keeps (driver/stream.py's Recorder)

    def record(self, line: dict[str, Any]) -> None:
        if "val_loss" not in line:
            return
        from ray import tune

        tune.report(numeric(line))  # raises SystemExit in this thread once Tune stops the trial

    def flush(self) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def completed(run_dir: Location) -> bool:
    """The run directory holds a finished fit (summary ok): its trial is not trained again."""
    summary = run_dir / SUMMARY_FILE
    return summary.exists() and json.loads(summary.read_text()).get("status") == "ok"


def run_trial(values: dict[str, Any], *, base: dict[str, Any], sweep_dir: str) -> None:
    """The Tune function trainable: one full fit of ours for `values`."""
    from ray import tune

    from raytrain_ddp.driver.launcher import run_training
    from raytrain_ddp.driver.resume import NothingToTrain

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(base, values, Location.parse(sweep_dir), trial_id)
    run_dir = Location.parse(cfg.run.storage_path) / cfg.name
    run_dir.mkdir()
    trial = {"trial_id": trial_id, "values": values}
    (run_dir / TRIAL_FILE).write_text(json.dumps(trial) + "\n")
    if completed(run_dir):
        return _report_recorded(run_dir)
    stop, done = threading.Event(), threading.Event()
    # Not a daemon: when Tune ends this trial's actor, the interpreter waits for it, so the
    # fit stops through our Ctrl-C path (step saved, workers and placement group given back).
    watch = threading.Thread(target=_watch_tune, args=(stop, done), name="raytrain-ddp-tune-stop")
    watch.start()
    try:
        summary = run_training(cfg, sinks=[TuneReport()], stop=stop)
    except NothingToTrain:  # trained to the end by an earlier sweep, whose driver died before its summary
        return _report_recorded(run_dir)
    except UserError as exc:
        done.set()
        (run_dir / TRIAL_FILE).write_text(json.dumps({"trial_id": trial_id, "values": values,
                                                      "error": str(exc)}) + "\n")
        raise TrialFailed(str(exc)) from None
    finally:
        done.set()
    if stop.is_set():  # Tune stopped it (ASHA, the time budget, the sweep's Ctrl-C): said for the report
        (run_dir / TRIAL_FILE).write_text(json.dumps({**trial, "stopped_at_step": summary.get("steps")}) + "\n")
        return None
    if summary.get("status") != "ok":
        raise TrialFailed(f"{summary.get('status')}: {summary.get('error', '')}".rstrip(": "))


def _watch_tune(stop: threading.Event, done: threading.Event) -> None:
    """Set `stop` once Tune asks this trial to stop; return when the trial's fit is done."""
    from raytrain_ddp.ray_compat import tune_trial_stopping

    while not done.wait(0.25):
        if not stop.is_set() and tune_trial_stopping():
            stop.set()


def _report_recorded(run_dir: Location) -> None:
    from ray import tune

    for line in read_metrics(run_dir / METRICS_FILE):
        if "val_loss" in line:
            tune.report(numeric(line))
