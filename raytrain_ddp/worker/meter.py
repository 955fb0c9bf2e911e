"""What rank 0 records about the run, and the step timing behind it.

Owns: the lines of `metrics.jsonl` (what a line holds and the log cadence), the
attempt record in `attempts.jsonl`, `abort.json`, and `StepMeter` (wall time, data wait
and all-reduce traffic between two log lines). Must not touch: the model, Ray, reading
the files back (the driver's console does that).

Why our own file: Ray Train V2 keeps reported metrics only next to checkpoints, so the
history of a run lives in `metrics.jsonl`, written by rank 0 only (every rank's step
takes the same wall time: the gradient all-reduce synchronises them).

Train lines carry `step`, `epoch`, `loss`, `lr`, `samples_per_s`, `data_wait_fraction`,
`allreduce_calls`, `allreduce_bytes` (per optimizer step, averaged over the steps since
the previous line), `nonfinite_steps` (cumulative) and `attempt`. Validation lines carry
`step`, `epoch`, `val_loss` and, for classifiers, `val_accuracy`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from raytrain_ddp import rundir
from raytrain_ddp.job import Job
from raytrain_ddp.parallel.collectives import from_main
from raytrain_ddp.worker.context import Rank


class StepMeter:
    """Accumulates wall time, data wait and all-reduce traffic between two log lines.

    A step's wall time runs from the end of the previous step to the end of this one,
    so it includes the time spent waiting for the next window of batches. Time between
    `pause()` and `resume()` (validation, checkpointing) counts towards nothing.
    `wait_seconds` and `comm` are the cumulative counters of the data iterator and the
    wrapper; the meter works with their differences.
    """

    def __init__(self, global_batch_size: int, wait_seconds: float = 0.0, comm: Optional[dict] = None) -> None:
        self.global_batch_size = global_batch_size
        self._last_end = time.perf_counter()
        self._excluded_wait = 0.0
        self._paused_wait: Optional[float] = None
        self._start_window(wait_seconds, comm)

    def _start_window(self, wait_seconds: float, comm: Optional[dict]) -> None:
        self._steps = 0
        self._seconds = 0.0
        self._wait_start = wait_seconds
        self._excluded_wait = 0.0
        self._comm_start = dict(comm or {})

    def step_done(self) -> None:
        now = time.perf_counter()
        self._seconds += now - self._last_end
        self._last_end = now
        self._steps += 1

    def pause(self, wait_seconds: float) -> None:
        self._paused_wait = wait_seconds

    def resume(self, wait_seconds: float) -> None:
        if self._paused_wait is not None:
            self._excluded_wait += wait_seconds - self._paused_wait
            self._paused_wait = None
        self._last_end = time.perf_counter()

    @property
    def steps(self) -> int:
        return self._steps

    def summarize(self, wait_seconds: float, comm: Optional[dict] = None) -> dict[str, float]:
        """Per-step averages since the previous call; starts a new window."""
        steps = max(1, self._steps)
        seconds = max(self._seconds, 1e-9)
        comm = dict(comm or {})
        waited = wait_seconds - self._wait_start - self._excluded_wait
        out = {
            "samples_per_s": self.global_batch_size * self._steps / seconds,
            "data_wait_fraction": min(1.0, max(0.0, waited / seconds)),
            "allreduce_calls": (comm.get("allreduce_calls", 0) - self._comm_start.get("allreduce_calls", 0)) / steps,
            "allreduce_bytes": (comm.get("allreduce_bytes", 0) - self._comm_start.get("allreduce_bytes", 0)) / steps,
        }
        self._start_window(wait_seconds, comm)
        return out


class MetricsWriter:
    """Appends one JSON object per line, flushed at once so the driver can tail it.

    Disabled (a no-op) on every rank but 0.
    """

    def __init__(self, path: os.PathLike | str, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            rundir.append_jsonl(self.path, record)

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run redoes those steps; keep one history)."""
        if self.enabled and self.path.exists():
            rundir.rewrite_jsonl(self.path, [r for r in rundir.read_metrics(self.path) if r.get("step", 0) <= step])


class RunLog:
    """Rank 0's record of this worker group: its attempt number, metrics lines, abort.

    Every rank holds one (the attempt number is broadcast, the meter runs everywhere);
    only rank 0 writes. A train line is written every `run.log_every_steps`, on the last
    step and on an epoch's last step, averaged over the steps since the previous line.
    """

    def __init__(self, job: Job, rank: Rank, state: Any, data: Any, total_steps: int) -> None:
        self.job, self.rank, self.state, self.data = job, rank, state, data
        self.total_steps = total_steps
        self.run_dir = Path(job.run_dir)
        self.writer = MetricsWriter(self.run_dir / rundir.METRICS_FILE, enabled=rank.is_main)
        self.attempt = self._record_attempt()
        self.meter = StepMeter(job.cfg.train.global_batch_size, data.wait_seconds, state.wrapper.comm_stats)
        self.last_loss = math.nan

    def _record_attempt(self) -> int:
        """Rank 0 appends this worker-group start to attempts.jsonl; every rank learns the number."""
        number = 0
        if self.rank.is_main:
            path = self.run_dir / rundir.ATTEMPTS_FILE
            number = 1 + sum(1 for r in rundir.read_jsonl(path) if r.get("fit_id") == self.job.fit_id)
            rundir.append_jsonl(path, {"fit_id": self.job.fit_id, "attempt": number,
                                       "world_size": self.rank.world_size, "time": time.time()})
        return from_main(number, self.rank.device)

    def resumed_at(self, step: int) -> None:
        """Steps past the checkpoint are redone: drop their lines, keep one history."""
        self.writer.truncate_after(step)
        self.meter = StepMeter(self.job.cfg.train.global_batch_size, self.data.wait_seconds,
                               self.state.wrapper.comm_stats)

    def step(self, result: Any, epoch: int, end_of_epoch: bool) -> None:
        self.meter.step_done()
        self.last_loss = result.loss
        step = self.state.progress.step
        if step % self.job.cfg.run.log_every_steps == 0 or step >= self.total_steps or end_of_epoch:
            self.writer.write({"step": step, "epoch": epoch + 1, "loss": result.loss, "lr": result.lr,
                               **self._window()})

    def validation(self, epoch: int, val: dict[str, float]) -> dict[str, float]:
        if val:
            self.writer.write({"step": self.state.progress.step, "epoch": epoch + 1, **val})
        return val

    def abort(self, reason: str) -> None:
        """Every rank stops together (non-finite policy): the failed step's line and why."""
        progress = self.state.progress
        self.writer.write({"step": progress.step + 1, "epoch": progress.epoch + 1, "loss": math.nan,
                           "lr": self.state.schedule.lr, **self._window()})
        if self.rank.is_main:
            (self.run_dir / rundir.ABORT_FILE).write_text(json.dumps({"step": progress.step + 1, "reason": reason}))
        self.rank.say(f"aborting: {reason}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Validation and checkpoints count towards neither step time nor data wait."""
        self.meter.pause(self.data.wait_seconds)
        try:
            yield
        finally:
            self.meter.resume(self.data.wait_seconds)

    def _window(self) -> dict[str, Any]:
        return {"nonfinite_steps": self.state.progress.nonfinite_steps, "attempt": self.attempt,
                **self.meter.summarize(self.data.wait_seconds, self.state.wrapper.comm_stats)}
