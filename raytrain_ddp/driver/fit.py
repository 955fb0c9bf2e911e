"""What every fit does before and after training, on Ray (`launcher.py`) or in this process
(`local.py`): the run directory's files and the plan before (`prepare`), the summary after
(`report`, `build_summary`), and the one line a failure is told in (`root_message`).

Must not touch: Ray's trainer or cluster (`launcher.py`), the training itself (`worker/`).
Ray Data is imported only to prepare datasets for a Ray fit (`prepared` is None).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.data import steps as data_steps
from raytrain_ddp.driver.console import final_metrics, print_plan, print_summary
from raytrain_ddp.goodput import summary_figures
from raytrain_ddp.driver.resume import prune_checkpoints, record_config, restore_config_if_untrained
from raytrain_ddp.driver.stream import Recorder, line_key, tracked_step
from raytrain_ddp.job import Job
from raytrain_ddp.launch import table as launchers
from raytrain_ddp.ray_compat import forget_earlier_fits
from raytrain_ddp.rundir import (
    ABORT_FILE, ATTEMPTS_FILE, METRICS_FILE, SUMMARY_FILE, JsonlFile, Location, read_jsonl, read_metrics,
)


def prepare(cfg: Config, run_dir: Location, fit_id: str, resume_from: Any, checked: Any, code: Any,
             given: Optional[dict[str, Any]], prepared: Any = None) -> tuple[Job, Any, int]:
    """Datasets (Ray Data's, unless `prepared` already holds local mode's), the run directory's
    config.yaml, the `Job` and the plan printed: (job, prepared, total steps)."""
    if prepared is None:
        import ray.data

        from raytrain_ddp.data.ray_datasets import prepare_datasets
        from raytrain_ddp.driver.memory import check_exact_fits

        ray.data.DataContext.get_current().enable_progress_bars = False
        prepared = prepare_datasets(cfg, checked, code, given, fits=check_exact_fits)
    run_dir.mkdir()
    if launchers.of(cfg).ray_history:  # local mode writes none (and does not import Ray)
        forget_earlier_fits(run_dir)  # Ray's checkpoint history must never contradict ours (ray_compat.py)
    record_config(cfg, run_dir, resume_from, fit_id)  # config.yaml + config-history.jsonl (resume.py)
    if resume_from is not None:
        recover_lines(run_dir, resume_from)  # the lines a killed driver had not written (below)
    for stale in (SUMMARY_FILE, ABORT_FILE):
        (run_dir / stale).delete()

    steps_per_epoch = data_steps.steps_per_epoch(prepared.spec.train_rows, cfg.train.global_batch_size)
    total_steps = data_steps.total_steps(cfg, steps_per_epoch)  # as each rank's loop computes it
    job = Job(cfg=cfg, spec=prepared.spec, run_dir=str(run_dir), fit_id=fit_id,
              resume_from=Location.parse(resume_from) if resume_from else None,
              user_code=code.dumps() if code.custom else None)
    params = checked.pipeline.params if checked.pipeline else None
    print_plan(cfg, prepared.spec, run_dir, steps_per_epoch, total_steps, resume_from, params)
    return job, prepared, total_steps


def report(cfg: Config, run_dir: Location, job: Job, recorder: Recorder, status: str, error: Optional[str],
           started: float) -> dict[str, Any]:
    """After a fit: the run directory tidied, summary.json written, the summary printed."""
    if status == "ok" and recorder.abort is not None:
        status, error = "aborted", recorder.abort.get("reason")
    prune_checkpoints(run_dir, cfg.run.num_to_keep)  # run.num_to_keep over all fits, not only this one
    restore_config_if_untrained(run_dir, job.fit_id)
    summary = build_summary(job, status=status, error=error, elapsed_s=time.time() - started, recorder=recorder)
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


def already_complete(cfg: Config, run_dir: Location, checkpoint: Any) -> dict[str, Any]:
    """The same command on a complete run: nothing to train, exit 0, said in one line.

    `metrics.jsonl` first gets back any line of the checkpoint that a killed driver had not
    written (`recover_lines`). `summary.json` is the finishing fit's when it says `ok`;
    else (that driver was killed, or interrupted at the end) it is written now, status `ok`.
    """
    manifest = ckpt.read_manifest(checkpoint)
    step = int(manifest.get("step", 0))
    recover_lines(run_dir, checkpoint)
    trackers = [t for t in ("tensorboard", "mlflow", "wandb") if t in cfg.run.loggers]
    if trackers and (tracked_step(run_dir) or 0) < step:  # a driver killed before its trackers had the end
        from raytrain_ddp.driver.sinks import check_loggers, make_sinks

        check_loggers(cfg)
        fit = str(manifest.get("fit_id") or "")
        Recorder(run_dir, fit, make_sinks(cfg, run_dir, fit), write_metrics=False).catch_up(step)
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        summary = {}
    if summary.get("status") != "ok" or summary.get("checkpoint_step") != step:
        records = read_metrics(run_dir / METRICS_FILE)  # the fit that trained the last step, as it would have said
        attempts = [r for r in read_jsonl(run_dir / ATTEMPTS_FILE) if r.get("fit_id") == manifest.get("fit_id")]
        summary = {"status": "ok", "run_dir": str(run_dir), "steps": step,
                   "epochs": float(records[-1].get("epoch", 0)) if records else float(manifest.get("epoch", 0)),
                   "attempts": len(attempts), "final_metrics": final_metrics(records), "checkpoint": str(checkpoint),
                   "checkpoint_step": step, "resumed_from": None,
                   "workers": attempts[-1].get("world_size") if attempts else None, "elapsed_s": 0.0,
                   "fit_id": manifest.get("fit_id")}
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    end = f"train.max_steps={cfg.train.max_steps}" if cfg.train.max_steps is not None else f"train.epochs={cfg.train.epochs}"
    print(f"raytrain-ddp: run {cfg.name!r} is complete: trained to {end} (checkpoint {checkpoint}, step {step}); "
          "nothing to train. To train further, raise train.max_steps or train.epochs", flush=True)
    return summary


def build_summary(job: Job, *, status: str, error: Optional[str], elapsed_s: float,
                  recorder: Optional[Recorder] = None) -> dict[str, Any]:
    """The outcome; records and attempts from the recorder (else read back from the run directory)."""
    run_dir = recorder.run_dir if recorder is not None else Location.parse(job.run_dir)
    latest = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    manifest = ckpt.read_manifest(latest[1]) if latest else {}
    if recorder is not None:
        attempts, records = recorder.fit_attempts(), recorder.fit_records()
    else:
        attempts = [r for r in read_jsonl(run_dir / ATTEMPTS_FILE) if r.get("fit_id") == job.fit_id]
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
        "checkpoint": str(latest[1]) if latest else None,
        "checkpoint_step": int(manifest["step"]) if latest else None,  # where the same command continues
        "resumed_from": str(job.resume_from) if job.resume_from else None,
        "workers": attempts[-1]["world_size"] if attempts else None,
        "elapsed_s": round(elapsed_s, 2),
        "fit_id": job.fit_id,
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


def recover_lines(run_dir: Location, checkpoint: Any) -> int:
    """Before a fit (or the same command on a complete run): `metrics.jsonl` gets back the lines
    up to the checkpoint's step that it lacks, from the checkpoint's manifest, which carries
    every line the driver had not said it wrote (`RunLog.lines_to_save`); in step order.
    Returns how many. So a driver SIGKILLed between a checkpoint and its next write of the file
    (object stores: about once a second) loses no committed line, even after the last step."""
    manifest = ckpt.read_manifest(checkpoint)
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
