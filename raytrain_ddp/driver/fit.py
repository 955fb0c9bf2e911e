"""The fit, once, for every launcher: its steps numbered in `run_training`, the way Lightning's
`_Connector.__init__` reads -- 1 plan, 2 hold, 3 resume point, 4 data, 5 recorder and sinks,
6 `launcher.run`, 7 report -- and what they share: the run directory's files and the plan
(`prepare`), the summary (`report`, `build_summary`), the finished-run answer
(`already_complete`) and the one line a failure is told in (`root_message`).

The launcher (its row of launch/table.py names it; the Protocol is launch/base.py's) is the
one thing that differs: Ray Train's `TorchTrainer` (`launcher.py`), this process (`local.py`)
or this machine's torchrun (`torchrun.py`). Everything else is here, once: one Ctrl-C
mechanism (`interrupt.Interrupt`), one `Recorder`, the hold taken and released, the resume
point resolved once (`resume.ResumePoint`).
Must not touch: how ranks start (the launchers), the training itself (`worker/`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid
from typing import Any, Callable, Optional, Sequence

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.data import steps as data_steps
from raytrain_ddp.driver import hold, ray_console
from raytrain_ddp.driver.console import ProgressPrinter, final_metrics, print_plan, print_summary
from raytrain_ddp.driver.interrupt import Interrupt, press_on
from raytrain_ddp.driver.resume import (
    ResumePoint, check_something_to_train, newest, prune_checkpoints, record_config, restore_config_if_untrained, resume_point,
)
from raytrain_ddp.driver.sinks import check_loggers, make_sinks
from raytrain_ddp.driver.stream import Recorder, line_key, tracked_step
from raytrain_ddp.errors import UserError
from raytrain_ddp.goodput import summary_figures
from raytrain_ddp.job import Job
from raytrain_ddp.launch import table as launchers
from raytrain_ddp.ray_compat import forget_earlier_fits
from raytrain_ddp.rundir import (
    ABORT_FILE, ATTEMPTS_FILE, METRICS_FILE, SUMMARY_FILE, JsonlFile, Location, read_jsonl, read_metrics, run_dir_of,
)
from raytrain_ddp.timeline import Timeline


@dataclasses.dataclass
class Start:
    """What a fit knows before its launcher starts anything: the resolved config and code, its
    run directory and id, the hold on that directory, its resume point, the checked data."""

    cfg: Config
    code: Any
    run_dir: Location
    fit_id: str
    held: hold.Hold
    resume: ResumePoint
    checked: Any
    timeline: Timeline


def run_training(cfg: Config, *, code: Any = None, datasets: Optional[dict[str, Any]] = None,
                 preflighted: bool = False, started_at: Optional[float] = None, sinks: Sequence[Any] = (),
                 stop: Any = None, launch: Any = None) -> dict[str, Any]:
    """Train `cfg` to the end; returns the summary (also written to summary.json).

    `code`: the user's model, loss and preprocess (`user.resolve`; by default resolved from the
    config's import paths); `datasets`: given from Python (Ray Datasets, or torch ones read into
    tables); `preflighted`: the caller ran `preflight(cfg)` already (the CLI does, before
    imports); `started_at`: where the start-up timeline starts (the process's start; default
    now); `sinks`: more takers of the metrics lines (`record`/`flush`/`close`, as
    `driver/sinks.py`'s; a sweep's trial reports to Tune through one); `stop`: a
    `threading.Event` set from another thread stops the fit as a Ctrl-C does (a sweep's trial
    that Tune stops); `launch`: the launcher the CLI started early (its row's `early_start`).
    """
    # 1 plan and 2 hold: the user's code, the preflight, the run directory held; 3 the resume point
    start = begin(cfg, code, datasets, preflighted=preflighted, started_at=started_at, entered=time.time())
    cfg, summary, launcher = start.cfg, None, launch
    try:
        if check_something_to_train(cfg, start.resume):  # another command for a finished run: exit 3
            return already_complete(cfg, start.run_dir, start.resume)  # the same command: exit 0, before Ray
        check_loggers(cfg)
        start.timeline.mark("cli")
        # 4 data: read or prepared where the launcher's ranks read it (Ray connects first)
        launcher = launcher or launchers.of(cfg).make(cfg)
        prepared, mailbox = launcher.start(start, datasets)
        job, total_steps = prepare(start, prepared)
        job = dataclasses.replace(job, mailbox=mailbox)
        # 5 the one recorder: progress lines, metrics.jsonl, the trackers, the caller's sinks
        recorder = recorder_for(cfg, job, total_steps, start.timeline, sinks)
        start.timeline.attach(start.run_dir)
        # 6 the launcher runs the ranks, under one Ctrl-C handler; 7 the report
        started = time.time()
        status, error = run(launcher, job, recorder, Interrupt(mailbox), stop)
        summary = report(cfg, start.run_dir, job, recorder, status, error, started)
        return summary
    finally:
        if launcher is not None:
            launcher.close()  # Ray stopped if started here; torchrun's processes and temp dir gone
        # last step -> here: fit_end, summary.json's shutdown_s; printed under --verbose
        start.timeline.finish(start.run_dir, summary, verbose=ray_console.verbose())
        start.held.release()  # after the launcher: no rank of this fit writes any more


def begin(cfg: Config, code: Any, datasets: Optional[dict[str, Any]], *, preflighted: bool = False,
          before_hold: Optional[Callable[[Location], None]] = None, started_at: Optional[float] = None,
          entered: Optional[float] = None) -> Start:
    """Steps 1-3, which `run_training` and `launcher.prepare_job` share: the user's code
    resolved, the preflight (once: the CLI runs it before importing torch and Ray), the run
    directory held, the resume point, the data checked. The hold is released if a step fails."""
    from raytrain_ddp.driver.preflight import in_process, precheck, preflight
    from raytrain_ddp.user import resolve

    if code is None:
        cfg, code = resolve(cfg)  # an import path that does not import fails here
    if not preflighted:
        preflight(cfg)  # a relative storage path under a Ray job, a machine too small (driver/preflight.py)
    run_dir, fit_id = run_dir_of(cfg), uuid.uuid4().hex
    if before_hold is not None:
        before_hold(run_dir)
    held = hold.take(cfg, fit_id)  # another live fit of this run directory: exit 2 here (driver/hold.py)
    try:
        resume = resume_point(cfg, run_dir)
        # Bad parquet or user code fails here, before Ray or any worker starts (Ray Datasets
        # given from Python are sampled through Ray, once connected: `launcher.RayLauncher.start`).
        checked = precheck(cfg, code, datasets) if datasets is None or in_process(datasets) else None
    except BaseException:
        held.release()
        raise
    return Start(cfg, code, run_dir, fit_id, held, resume, checked, Timeline(fit_id, started_at, entered))


def run(launcher: Any, job: Job, recorder: Recorder, interrupt: Interrupt, stop: Any = None) -> tuple[str, Optional[str]]:
    """Step 6: `launcher.run` with the recorder taking rank 0's records and one Ctrl-C handler
    (`Interrupt`: the first press saves the step and stops, a second stops at once); `stop`, set
    from another thread, is one more press. Returns (status, error)."""
    status, error, failure = "ok", None, None
    try:
        with recorder, press_on(stop, interrupt):
            try:
                status, error = launcher.run(job, recorder, interrupt)
            except KeyboardInterrupt:
                status = "interrupted"
                interrupt.abort()
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported in summary.json and printed
                status, failure = ("interrupted", None) if interrupt.fired else ("failed", exc)
            finally:
                interrupt.restore()
    except KeyboardInterrupt:  # a second Ctrl-C while the last records were written
        status = "interrupted"
    if status == "ok" and interrupt.fired:  # the ranks stopped where they were, as asked
        status = "interrupted"
    if failure is not None:  # the ranks' own account, whole, once the recorder has taken everything
        error = recorder.error_to_show(str(failure)) or root_message(failure)
    return status, error


def recorder_for(cfg: Config, job: Job, total_steps: int, timeline: Optional[Timeline] = None,
                 sinks: Sequence[Any] = ()) -> Recorder:
    """What takes rank 0's records (from `job.mailbox`): the progress lines, metrics.jsonl, the
    trackers, `sinks` (and the timeline's stamps)."""
    run_dir = Location.parse(job.run_dir)
    return Recorder(run_dir, job.fit_id, [ProgressPrinter(total_steps), *make_sinks(cfg, run_dir, job.fit_id), *sinks],
                    job.mailbox, write_metrics="jsonl" in cfg.run.loggers, timeline=timeline)


def prepare(start: Start, prepared: Any) -> tuple[Job, int]:
    """The run directory's config.yaml and history, the lines a killed driver had not written,
    the `Job` and the plan printed: (job, total steps)."""
    cfg, run_dir, resume = start.cfg, start.run_dir, start.resume
    run_dir.mkdir()
    if launchers.of(cfg).ray_history:  # local mode writes none (and does not import Ray)
        forget_earlier_fits(run_dir)  # Ray's checkpoint history must never contradict ours (ray_compat.py)
    record_config(cfg, run_dir, resume, start.fit_id)  # config.yaml + config-history.jsonl (resume.py)
    if resume.checkpoint is not None:
        recover_lines(run_dir, resume.checkpoint, resume.manifest)  # the lines a killed driver had not written
    for stale in (SUMMARY_FILE, ABORT_FILE):
        (run_dir / stale).delete()

    steps_per_epoch = data_steps.steps_per_epoch(prepared.spec.train_rows, cfg.train.global_batch_size)
    total_steps = data_steps.total_steps(cfg, steps_per_epoch)  # as each rank's loop computes it
    job = Job(cfg=cfg, spec=prepared.spec, run_dir=str(run_dir), fit_id=start.fit_id,
              resume_from=Location.parse(resume.checkpoint) if resume.checkpoint else None,
              user_code=start.code.dumps() if start.code.custom else None)
    params = start.checked.pipeline.params if start.checked and start.checked.pipeline else None
    print_plan(cfg, prepared.spec, run_dir, steps_per_epoch, total_steps, resume, params)
    return job, total_steps


def report(cfg: Config, run_dir: Location, job: Job, recorder: Recorder, status: str, error: Optional[str],
           started: float) -> dict[str, Any]:
    """After a fit: the run directory tidied, summary.json written, the summary printed."""
    if status == "ok" and recorder.abort is not None:
        status, error = "aborted", recorder.abort.get("reason")
    prune_checkpoints(run_dir, cfg.run.num_to_keep)  # run.num_to_keep over all fits, not only this one
    latest = newest(run_dir)  # state.pt loaded once, for both
    restore_config_if_untrained(run_dir, job.fit_id, latest)
    summary = build_summary(run_dir, job.fit_id, job.resume_from, status=status, error=error,
                            elapsed_s=time.time() - started, recorder=recorder, latest=latest)
    if status == "interrupted" and _trained_its_last_step(cfg, job, summary):
        # Ctrl-C (or SIGTERM) arrived as the last steps trained: the run is complete, and saying
        # "interrupted ... continues from step N" would send the same command to nothing to train.
        status = summary["status"] = "ok"
        summary.pop("error", None)
        print("raytrain-ddp: the interrupt came as the run trained its last step: the run is complete",
              file=sys.stderr, flush=True)
    summary["goodput"] = summary_figures(run_dir, job.fit_id, status, time.time())  # goodput.py
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    recorder.close(status)
    print_summary(summary)
    return summary


def _trained_its_last_step(cfg: Config, job: Job, summary: dict[str, Any]) -> bool:
    """Whether the newest valid checkpoint is at the run's end (the steps each rank's loop plans)."""
    total = data_steps.total_steps(cfg, data_steps.steps_per_epoch(job.spec.train_rows, cfg.train.global_batch_size))
    return summary.get("checkpoint_step") is not None and int(summary["checkpoint_step"]) >= total


def already_complete(cfg: Config, run_dir: Location, resume: ResumePoint) -> dict[str, Any]:
    """The same command on a complete run: nothing to train, exit 0, said in one line.

    `metrics.jsonl` first gets back any line of the checkpoint that a killed driver had not
    written (`recover_lines`). `summary.json` is the finishing fit's when it says `ok`;
    else (that driver was killed, or interrupted at the end) it is written now, status `ok`.
    """
    manifest, step, checkpoint = resume.manifest, resume.step, resume.checkpoint
    recover_lines(run_dir, checkpoint, manifest)
    trackers = [t for t in ("tensorboard", "mlflow", "wandb") if t in cfg.run.loggers]
    if trackers and (tracked_step(run_dir) or 0) < step:  # a driver killed before its trackers had the end
        check_loggers(cfg)
        fit = str(manifest.get("fit_id") or "")
        Recorder(run_dir, fit, make_sinks(cfg, run_dir, fit), write_metrics=False).catch_up(step)
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        summary = {}
    if summary.get("status") != "ok" or summary.get("checkpoint_step") != step:
        # the fit that trained the last step, as it would have said
        summary = build_summary(run_dir, str(manifest.get("fit_id") or ""), None, status="ok", error=None,
                                elapsed_s=0.0, latest=resume)
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    end = f"train.max_steps={cfg.train.max_steps}" if cfg.train.max_steps is not None else f"train.epochs={cfg.train.epochs}"
    print(f"raytrain-ddp: run {cfg.name!r} is complete: trained to {end} (checkpoint {checkpoint}, step {step}); "
          "nothing to train. To train further, raise train.max_steps or train.epochs", flush=True)
    return summary


def build_summary(run_dir: Location, fit_id: str, resumed_from: Any, *, status: str, error: Optional[str],
                  elapsed_s: float, recorder: Optional[Recorder] = None,
                  latest: Optional[ResumePoint] = None) -> dict[str, Any]:
    """The outcome of fit `fit_id`; records and attempts from the recorder (else read back from the
    run directory); `latest`: the newest valid checkpoint, when known (else found now)."""
    latest = latest if latest is not None else newest(run_dir)
    manifest = latest.manifest
    if recorder is not None:
        attempts, records = recorder.fit_attempts(), recorder.fit_records()
    else:
        attempts = [r for r in read_jsonl(run_dir / ATTEMPTS_FILE) if r.get("fit_id") == fit_id]
        records = read_metrics(run_dir / METRICS_FILE)
    # steps done: the checkpoint's, or further if steps ran after it (an abort, a failure)
    steps = max([int(manifest.get("step", 0))] + [int(r.get("step", 0)) for r in records[-1:]])
    summary: dict[str, Any] = {
        "status": status,
        "run_dir": str(run_dir),
        "steps": steps,
        # epochs trained, fractions included, as every metrics line counts them (Progress.epochs_done)
        "epochs": float(records[-1].get("epoch", 0)) if records else float(manifest.get("epoch", 0)),
        "attempts": len(attempts),
        "final_metrics": final_metrics(records),
        "checkpoint": str(latest.checkpoint) if latest.checkpoint else None,
        "checkpoint_step": latest.step if latest.checkpoint else None,  # where the same command continues
        "resumed_from": str(resumed_from) if resumed_from else None,
        "workers": attempts[-1]["world_size"] if attempts else None,
        "elapsed_s": round(elapsed_s, 2),
        "fit_id": fit_id,
    }
    if recorder is not None:
        summary["checkpoints"] = recorder.checkpoint_summary()
        if recorder.timeline is not None:  # the start-up timeline (timeline.py); shutdown_s once the fit ends
            summary["startup"] = recorder.timeline.summary()
    if error:
        summary["error"] = error
    return summary


def root_message(exc: BaseException) -> str:
    """Ray wraps worker errors a few layers deep; the innermost message is the useful one."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        nxt = exc.__cause__ or getattr(exc, "cause", None)
        if nxt is None or nxt is exc:
            break
        exc = nxt
    from raytrain_ddp.errors import in_user_code

    text = str(seen[-1]).strip()
    where = next((w for e in reversed(seen) if (w := in_user_code(e))), "")  # the user's file:line, if theirs
    return (text.splitlines()[-1] if text else type(seen[-1]).__name__) + where


def recover_lines(run_dir: Location, checkpoint: Any, manifest: Optional[dict[str, Any]] = None) -> int:
    """Before a fit (or the same command on a complete run): `metrics.jsonl` gets back the lines
    up to the checkpoint's step that it lacks, from the checkpoint's manifest, which carries
    every line the driver had not said it wrote (`RunLog.lines_to_save`); in step order.
    Returns how many. So a driver SIGKILLed between a checkpoint and its next write of the file
    (object stores: about once a second) loses no committed line, even after the last step.
    `manifest`: the checkpoint's, already read (the fit's `ResumePoint`)."""
    manifest = manifest if manifest is not None else ckpt.read_manifest(checkpoint)
    step = int(manifest.get("step", 0))
    metrics = JsonlFile(run_dir / METRICS_FILE)
    have = {line_key(r) for r in metrics.records}
    missing = {line_key(r): r for r in manifest.get("lines", [])
               if int(r.get("step", 0)) <= step and line_key(r) not in have}
    if not missing:
        return 0
    metrics.append(missing.values())
    metrics.sort(key=lambda r: (line_key(r)[0], line_key(r)[1] != "train"))
    metrics.flush()
    print(f"raytrain-ddp: metrics.jsonl: {len(missing)} line(s) up to step {step} taken back from {checkpoint} "
          "(the driver that trained them ended before writing them)", flush=True)
    return len(missing)
