"""One trial of a sweep: a full fit of ours inside a Ray Tune class trainable.

Owns: the trial's config (the base config with its drawn values, named by its trial id,
its run directory `trials/<trial id>` under the sweep's: `trial_config`), `trial.json`
in it (the drawn values, a failure outside the fit, where Tune stopped it), `run_trial`
(the fit, its validation lines handed to a callable) and `trainable()`, the
`tune.Trainable` around it. Must not touch: training (`run_training` does it all: hold,
resume, fault tolerance, exact data), the search (`sweep/run.py`).

Why the Train V2 pattern: the trial builds our launcher's `TorchTrainer` and calls `fit`
(`Tuner(trainer)` is deprecated), so a trial is exactly a `train` run. Why a sink: rank
0's validation lines reach the trial process through the driver's record stream
(`driver/stream.py`), which runs there; each is handed on once no restart can redo it
(`committed_only`), so Tune never sees a step twice.

Why a class trainable and not a function one: Tune ends a stopped trial (ASHA, the time
budget) by calling its `stop`, then lets the actor go. A function trainable's `stop`
only flags the training thread and returns at once, so the actor died while our fit was
still running, and its placement group outlived it (Ray's #54305). Here `cleanup` asks
the fit to stop as a Ctrl-C does (the step saved, `run_training`'s `stop`) and waits,
bounded by `STOP_WAIT_S`, until `run_training` has returned: by then Ray Train's
controller has shut its worker group down and removed its placement group. Past the
bound the actor goes anyway; its controller then dies with it and Ray Train's own
placement-group cleaner removes the group (`sweep/run.py` counts what is left).

A trial whose run directory is complete (summary `ok` at its last step) is not trained
again: its recorded validation lines are reported instead, so a restored sweep ranks it
with the others.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any, Callable, Optional

from raytrain_ddp.config import validate_config
from raytrain_ddp.config.sweep import with_values
from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import METRICS_FILE, SUMMARY_FILE, Location, read_metrics

TRIAL_FILE = "trial.json"  # in each trial's run directory: trial id, drawn values, a failure outside the fit
TRIALS_DIR = "trials"
STOP_WAIT_S = 60.0  # how long a stopped trial waits for its fit to save and give its workers back


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


class ValidationSink:
    """A recorder sink: each committed validation line, its numbers only, to `report`."""

    committed_only = True  # only what metrics.jsonl keeps (driver/stream.py's Recorder)

    def __init__(self, report: Callable[[dict[str, float]], None]) -> None:
        self.report = report
        self.reported = 0

    def record(self, line: dict[str, Any]) -> None:
        if "val_loss" in line:
            self.reported += 1
            self.report(numeric(line))

    def flush(self) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def completed(run_dir: Location) -> bool:
    """The run directory holds a finished fit (summary ok): its trial is not trained again."""
    summary = run_dir / SUMMARY_FILE
    return summary.exists() and json.loads(summary.read_text()).get("status") == "ok"


def run_trial(values: dict[str, Any], *, base: dict[str, Any], sweep_dir: str, trial_id: str,
              report: Callable[[dict[str, float]], None], stop: threading.Event) -> None:
    """One full fit of ours for `values`, each validation line to `report`; `stop` set from
    another thread stops it as a Ctrl-C does (saved, workers given back)."""
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.driver.resume import NothingToTrain

    cfg = trial_config(base, values, Location.parse(sweep_dir), trial_id)
    run_dir = Location.parse(cfg.run.storage_path) / cfg.name
    run_dir.mkdir()
    trial = {"trial_id": trial_id, "values": values}
    (run_dir / TRIAL_FILE).write_text(json.dumps(trial) + "\n")
    if completed(run_dir):
        return _report_recorded(run_dir, report)
    sink = ValidationSink(report)
    try:
        summary = run_training(cfg, sinks=[sink], stop=stop)
    except NothingToTrain:  # trained to the end by an earlier sweep, whose driver died before its summary
        return _report_recorded(run_dir, report)
    except UserError as exc:
        (run_dir / TRIAL_FILE).write_text(json.dumps({**trial, "error": str(exc)}) + "\n")
        raise TrialFailed(str(exc)) from None
    if stop.is_set() and summary.get("status") != "ok":  # Tune stopped it (ASHA, the time budget): for the report
        (run_dir / TRIAL_FILE).write_text(json.dumps({**trial, "stopped_at_step": summary.get("steps")}) + "\n")
        return None
    if summary.get("status") != "ok":
        raise TrialFailed(f"{summary.get('status')}: {summary.get('error', '')}".rstrip(": "))
    if not sink.reported:  # complete already (a driver killed at the end): nothing trained now
        _report_recorded(run_dir, report)
    return None


def _report_recorded(run_dir: Location, report: Callable[[dict[str, float]], None]) -> None:
    for line in read_metrics(run_dir / METRICS_FILE):
        if "val_loss" in line:
            report(numeric(line))


_END = object()  # the queue's last item: the fit returned (an exception instead: it raised)


def trainable() -> type:
    """The `tune.Trainable` of a trial (built here: Ray Tune is imported by the sweep only).

    `setup` starts the fit on a thread; each `step` returns its next validation line (the
    last one, marked done, once the fit has returned); `cleanup` stops it and waits.
    """
    from ray import tune
    from ray.tune.result import RESULT_DUPLICATE

    class FitTrial(tune.Trainable):
        def setup(self, config: dict[str, Any], base: Optional[dict[str, Any]] = None,
                  sweep_dir: str = "") -> None:
            self._lines: queue.Queue = queue.Queue()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._fit, args=(dict(config), base or {}, sweep_dir),
                                            daemon=True, name="raytrain-ddp-trial-fit")
            self._thread.start()

        def _fit(self, values: dict[str, Any], base: dict[str, Any], sweep_dir: str) -> None:
            try:
                run_trial(values, base=base, sweep_dir=sweep_dir, trial_id=self.trial_id,
                          report=self._lines.put, stop=self._stop)
                self._lines.put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to `step`, which raises it in Tune's thread
                self._lines.put(exc)

        def step(self) -> dict[str, Any]:
            item = self._lines.get()  # the fit is bounded: it reports or ends
            if item is _END:
                return {RESULT_DUPLICATE: True, "done": True}  # Tune repeats the last line, as done
            if isinstance(item, BaseException):
                raise item
            return item

        def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
            return {}  # nothing of Tune's to keep: the fit resumes from its run directory's checkpoints

        def load_checkpoint(self, checkpoint: Any) -> None:
            pass

        def cleanup(self) -> None:
            self._stop.set()
            self._thread.join(STOP_WAIT_S)

    return FitTrial
