"""What rank 0 records about the run, and the step timing behind it.

Owns: the lines of `metrics.jsonl` (what a line holds and the log cadence), the
attempt record in `attempts.jsonl`, the abort record, `Outbox` (rank 0's end of the
record stream) and `StepMeter` (wall time, data wait and all-reduce traffic between two
log lines). Must not touch: the model, the run directory's files (the driver writes
them from the stream, `driver/stream.py`), reading them back.

Why a stream and not a file: on a cluster the run directory may be a bucket, or a disk
only the driver's node has. Rank 0 sends each record to the driver's mailbox actor
(fire-and-forget) and the driver writes it; only rank 0 sends (every rank's step takes
the same wall time: the gradient all-reduce synchronises them). Why our own history at
all: Ray Train V2 keeps reported metrics only next to checkpoints.

Train lines carry `step`, `epoch` (epochs trained, fractions included: `Progress.epochs_done`), `time` (wall clock, epoch seconds), `loss`, `lr`,
`samples_per_s`, `data_wait_fraction`, `allreduce_calls`, `allreduce_bytes` (per
optimizer step, averaged over the steps since the previous line), where the wrapper times
its all-reduces (naive, bucketed, native on CPU) `comm_ms` (gradient communication per
step), `exposed_comm_ms` (the part of it the step waited for after backward) and
`comm_overlap_fraction` (the part backward hid, 0..1),
`checkpoint_blocked_s` (seconds the step loop waited for checkpoints since the previous
line), `steps_s` and `window_steps` (the wall seconds and the number of the optimizer steps
since the previous line: what `raytrain-ddp goodput` adds up), `nonfinite_steps`
(cumulative) and `attempt`. Validation lines carry `step`,
`epoch`, `time`, `validation_s` (how long validation held the step loop), `validation_async_s`
(`run.validation: async`: the validator thread's seconds, off the training path), `attempt`, `val_loss`, `val_accuracy` (classifiers, and token accuracy for lm:
`worker/step.accuracy_counts`), `val_perplexity` (lm) and `val_<name>` for each of the
user's `train.metrics` (`worker/user_metrics.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from raytrain_ddp.job import Job
from raytrain_ddp.parallel.collectives import from_main
from raytrain_ddp.worker.context import Rank

if TYPE_CHECKING:
    from raytrain_ddp.worker.state import TrainState
    from raytrain_ddp.data.worker_data import WorkerData


class StepMeter:
    """Accumulates wall time, data wait and all-reduce traffic between two log lines.

    A step's wall time runs from the end of the previous step to the end of this one,
    so it includes the time spent waiting for the next window of batches. Time between
    `pause()` and `resume()` (validation, checkpointing) counts towards nothing, and only
    that time: what ran before the pause is the next step's, and `resume` returns the
    seconds it left out, the figure the lines report (`validation_s`,
    `checkpoint_blocked_s`), so a window's step time, saves and validations add up to its
    wall time (`goodput.py` relies on it).
    `wait_seconds` and `comm` are the cumulative counters of the data iterator and the
    wrapper; the meter works with their differences.
    """

    def __init__(self, global_batch_size: int, wait_seconds: float = 0.0, comm: Optional[dict] = None) -> None:
        self.global_batch_size = global_batch_size
        self._last_end = time.perf_counter()
        self._excluded_wait = 0.0
        self._paused_wait: Optional[float] = None
        self._paused_from = self._last_end
        self._start_window(wait_seconds, comm)

    def _start_window(self, wait_seconds: float, comm: Optional[dict]) -> None:
        self._steps = 0
        self._seconds = 0.0
        self._wait_start = wait_seconds
        self._excluded_wait = 0.0
        self._comm_start = dict(comm or {})

    def count_comm_from(self, comm: dict) -> None:
        """Count all-reduces from `comm` on (a new wrapper's counters, which start at zero)."""
        self._comm_start = dict(comm)

    def step_done(self) -> None:
        now = time.perf_counter()
        self._seconds += now - self._last_end
        self._last_end = now
        self._steps += 1

    def pause(self, wait_seconds: float) -> None:
        now = time.perf_counter()
        self._seconds += now - self._last_end  # since the last step's end: the next step's time
        self._last_end = self._paused_from = now
        self._paused_wait = wait_seconds

    def resume(self, wait_seconds: float) -> Optional[float]:
        """Step time runs again; returns the seconds the pause left out (None when not paused:
        a pause ends once)."""
        if self._paused_wait is None:
            return None
        now = time.perf_counter()
        self._excluded_wait += wait_seconds - self._paused_wait
        self._paused_wait = None
        self._last_end = now
        return now - self._paused_from

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
            "steps_s": self._seconds,  # the window's step time in seconds (goodput.py adds them up)
            "window_steps": self._steps,
        }
        if "comm_s" in comm:  # the wrapper times its all-reduces (see WrappedModel.comm_stats)
            comm_s = comm["comm_s"] - self._comm_start.get("comm_s", 0.0)
            exposed_s = comm["exposed_comm_s"] - self._comm_start.get("exposed_comm_s", 0.0)
            out["comm_ms"] = 1e3 * comm_s / steps
            out["exposed_comm_ms"] = 1e3 * exposed_s / steps
            if comm_s > 0:
                out["comm_overlap_fraction"] = min(1.0, max(0.0, 1.0 - exposed_s / comm_s))
        self._start_window(wait_seconds, comm)
        return out


class Outbox:
    """Rank 0's end of the record stream; a no-op on other ranks and without a mailbox.

    `send` does not wait (a Ray actor call whose result nobody reads); `flush` returns
    once every earlier send has reached the mailbox (it names how many there were: an
    async actor's calls can run in any order), so nothing is lost when the worker exits
    right after.
    """

    def __init__(self, mailbox: Any, enabled: bool = True) -> None:
        self.mailbox = mailbox if enabled else None
        self.attempt = 0
        self.seq = 0
        self._durable, self._durable_ref = 0, None
        self._sending = threading.Lock()  # the loop's thread and the validator's (`worker/validator.py`)

    def start_attempt(self, record: dict[str, Any]) -> int:
        """This worker group's attempt number (1, 2, ...), counted by the driver's mailbox."""
        self.attempt = int(self._call("attempt", record, wait=True) or 1) if self.mailbox is not None else 1
        self.seq = 0
        return self.attempt

    def send(self, kind: str, **fields: Any) -> None:
        if self.mailbox is not None:
            with self._sending:  # one number per event, in the order they are put
                self.seq += 1
                self._call("put", {"kind": kind, "attempt": self.attempt, "seq": self.seq, **fields}, wait=False)

    def flush(self) -> None:
        if self.mailbox is not None:
            self._call("flush", self.attempt, self.seq, wait=True)

    def stop_requested(self) -> bool:
        """Whether the driver asked the run to stop (its Ctrl-C); False on ranks other than 0."""
        return bool(self._call("stop_requested", wait=True)) if self.mailbox is not None else False

    def durable_step(self) -> int:
        """The newest step whose lines the run directory durably holds, as the driver last said
        for this attempt (0: not known). Never waits: the answer to the previous ask, if it has
        come, and a new ask; so it may lag, never lead (a lower answer only carries more lines)."""
        if self.mailbox is None:
            return 0
        fn = self.mailbox.durable_for
        if not hasattr(fn, "remote"):  # an in-process mailbox
            self._durable = int(self._call("durable_for", self.attempt, wait=True) or 0)
            return self._durable
        import ray

        if self._durable_ref is not None:
            ready, _ = ray.wait([self._durable_ref], timeout=0)
            if not ready:
                return self._durable
            self._durable = max(self._durable, int(ray.get(ready[0]) or 0))
        self._durable_ref = fn.remote(self.attempt)
        return self._durable

    def _call(self, method: str, *args: Any, wait: bool) -> Any:
        fn = getattr(self.mailbox, method)
        if hasattr(fn, "remote"):  # the mailbox actor
            ref = fn.remote(*args)
            if wait:
                import ray

                return ray.get(ref)
            return None
        result = fn(*args)  # an in-process mailbox (tests without Ray)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result


class RunLog:
    """Rank 0's record of this worker group: its attempt number, metrics lines, abort.

    Every rank holds one (the attempt number is broadcast, the meter runs everywhere);
    only rank 0 sends. A train line is sent every `run.log_every_steps`, on the last
    step and on an epoch's last step, averaged over the steps since the previous line.
    """

    def __init__(self, job: Job, rank: Rank, state: "TrainState", data: "WorkerData", total_steps: int) -> None:
        self.job, self.rank, self.state, self.data = job, rank, state, data
        self.total_steps = total_steps
        self.outbox = Outbox(getattr(job, "mailbox", None), enabled=rank.is_main)
        self.attempt = self._record_attempt()
        self.meter = StepMeter(job.cfg.train.global_batch_size, data.wait_seconds, state.wrapper.comm_stats)
        self._last_result: Any = None  # the loss is read from it only when a line needs it
        self._blocked_s = 0.0  # checkpoint time the step loop waited for, since the previous line
        self._tuning_said = False
        self._transport_said = False
        self.last_pause_s = 0.0  # the seconds the newest pause (validation, a save) held the step loop
        # The lines made at the last completed step (train, validation), on every rank: a
        # survivor's copy of that step carries them, since rank 0's sends die with rank 0.
        self.step_lines: list[dict[str, Any]] = []
        # Rank 0's lines the driver has not said it wrote durably: every checkpoint carries
        # them (`lines_to_save`), so a driver killed before writing them loses none.
        self.unsaved_lines: list[dict[str, Any]] = []
        self._unsaved_lock = threading.Lock()  # the validator's thread adds lines too (`worker/validator.py`)

    def _record_attempt(self) -> int:
        """Rank 0 registers this worker-group start with the driver; every rank learns the number."""
        number = 0
        if self.rank.is_main:
            number = self.outbox.start_attempt({"fit_id": self.job.fit_id, "world_size": self.rank.world_size,
                                                "time": time.time()})
        return from_main(number, self.rank.device)

    def resumed_at(self, step: int, origin: Optional[dict[str, Any]] = None,
                   lines: Optional[list[dict[str, Any]]] = None) -> None:
        """Steps past the checkpoint are redone: the driver drops their lines (one history).

        `origin` ({"resumed_from": "scratch" | "checkpoint" | "replica", "checkpoint": name})
        joins this attempt's line in attempts.jsonl. `lines`: the lines of step `step`
        that the checkpoint carries (a survivor's copy); the driver keeps those it lacks --
        the lost worker may have been rank 0, whose last sends died with it.
        """
        self.outbox.send("resumed", step=step, origin=origin or {}, lines=list(lines or []))
        if self.rank.is_main:  # carried on by the next checkpoints until the driver says it wrote them
            self.unsaved_lines = [r for r in lines or [] if int(r.get("step", 0)) <= step]
        self.meter = StepMeter(self.job.cfg.train.global_batch_size, self.data.wait_seconds,
                               self.state.wrapper.comm_stats)

    @property
    def epochs(self) -> float:
        """Epochs trained now, fractions included (what a line's `epoch` says)."""
        return self.state.progress.epochs_done(self.data.steps_per_epoch)

    def step(self, result: Any, end_of_epoch: bool) -> None:
        self.meter.step_done()
        self._last_result = result
        self.step_lines = []
        self._announce_decisions()
        step = self.state.progress.step
        if step % self.job.cfg.run.log_every_steps == 0 or step >= self.total_steps or end_of_epoch:
            self._line({"step": step, "epoch": self.epochs, "time": time.time(), "loss": result.loss,
                        "lr": result.lr, **self._window()})

    @property
    def last_loss(self) -> float:
        """The last step's loss (a host read of a device value: at epoch ends and on lines only)."""
        return math.nan if self._last_result is None else self._last_result.loss

    def validation(self, val: dict[str, float]) -> dict[str, float]:
        """Called inside `paused()`, right after validating: the pause so far is validation's and
        ends here, so `validation_s` is exactly what the step time leaves out; sending the line
        and the flush after it are step time, as every train line's sending is."""
        validation_s = self._end_pause()
        if val:
            self._line({"step": self.state.progress.step, "epoch": self.epochs, "time": time.time(),
                        "validation_s": validation_s, "attempt": self.attempt, **val})
        self.outbox.flush()  # the epoch's lines are with the driver before its checkpoint
        return val

    def validated(self, step: int, epochs: float, val: dict[str, float], stall_s: float, async_s: float) -> None:
        """run.validation=async (`worker/validator.py`, from its thread): the line of the checkpoint
        at `step`; `validation_s` is what the hand-off held the step loop, `validation_async_s` the
        thread's seconds, off the training path."""
        if val:
            self._line({"step": step, "epoch": epochs, "time": time.time(), "validation_s": stall_s,
                        "validation_async_s": async_s, "attempt": self.attempt, **val})
        self.outbox.flush()

    def checkpoint_saved(self, step: int, name: str, blocked_s: float, preemption: bool = False) -> None:
        """A checkpoint held the step loop for `blocked_s` (counted into the next train line);
        `preemption`: the just-in-time save before one (the restart's cause, `goodput.py`)."""
        self._blocked_s += blocked_s
        self.outbox.send("checkpoint", step=step, name=name, blocked_s=blocked_s,
                         **({"preemption": True} if preemption else {}))

    def stopped(self, step: int, name: str) -> None:
        """The driver asked to stop (Ctrl-C) and every rank stops after `step`, saved as `name`."""
        self.outbox.flush()
        self.rank.say(f"stopped after step {step} as the driver asked (Ctrl-C); it is saved ({name})")

    def abort(self, reason: str) -> None:
        """Every rank stops together (non-finite policy): the failed step's line and why."""
        progress = self.state.progress
        self._line({"step": progress.step + 1, "epoch": self.epochs, "time": time.time(), "loss": math.nan,
                    "lr": self.state.schedule.lr, **self._window()})
        self.outbox.send("abort", record={"step": progress.step + 1, "reason": reason})
        self.outbox.flush()
        self.rank.say(f"aborting: {reason}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Validation and checkpoints count towards neither step time nor data wait; on leaving,
        `last_pause_s` holds the seconds left out (a save reports them as its stall)."""
        self.meter.pause(self.data.wait_seconds)
        try:
            yield
        finally:
            self._end_pause()

    def _end_pause(self) -> float:
        """Ends the current pause, once: the seconds it left out of the step time."""
        left_out = self.meter.resume(self.data.wait_seconds)
        if left_out is not None:
            self.last_pause_s = left_out
        return self.last_pause_s

    def _announce_decisions(self) -> None:
        """Rank 0 prints, once each, what the wrapper decided while training: the layout
        (parallel.bucket_cap_mb/compress auto) and where bucketed's all-reduces go (parallel.shm)."""
        wrapper = self.state.wrapper
        if not self._transport_said and getattr(wrapper, "transport", "undecided") != "undecided":
            self._transport_said = True
            if wrapper.transport == "shm":
                self.rank.say(f"gradients all-reduced through shared memory: all {self.rank.world_size} "
                              "workers are on one host (parallel.shm)")
            elif getattr(wrapper, "shm", False) and wrapper.world_size > 1 and self.rank.device.type == "cpu":
                self.rank.say("gradients all-reduced by the process group: shared memory needs every "
                              "worker on one host, CPU tensors and room in /dev/shm")
        if self._tuning_said:
            return
        tuned = getattr(wrapper, "tuning", None)
        if tuned is not None:
            self._tuning_said = True
            self.rank.say(f"parallel auto tuning at step {self.state.progress.step}: {tuned['text']}")

    def _line(self, record: dict[str, Any]) -> None:
        """Every rank keeps the line, rank 0 sends it. Loss and validation figures are reduced
        over ranks, so a survivor's line says what rank 0's said; the timing fields are the
        rank's own (every rank's step takes the same wall time: the all-reduce syncs them)."""
        record = {k: _plain(v) for k, v in record.items()}
        self.step_lines.append(record)
        if self.rank.is_main:
            with self._unsaved_lock:
                self.unsaved_lines = self.unsaved_lines[-(MAX_UNSAVED_LINES - 1):] + [record]
            self.outbox.send("metrics", record=record)

    def lines_to_save(self) -> list[dict[str, Any]]:
        """The lines a checkpoint of this step carries: every line of rank 0's that the run
        directory may not durably hold yet (past the step the driver last said it wrote, for this
        attempt). A driver killed before writing them (object stores are rewritten about once a
        second) loses none: the next start takes them from the checkpoint it resumes."""
        durable = self.outbox.durable_step()
        with self._unsaved_lock:
            self.unsaved_lines = [r for r in self.unsaved_lines if int(r.get("step", 0)) > durable]
            return list(self.unsaved_lines)

    def _window(self) -> dict[str, Any]:
        blocked, self._blocked_s = self._blocked_s, 0.0
        return {**self.meter.summarize(self.data.wait_seconds, self.state.wrapper.comm_stats),
                "checkpoint_blocked_s": blocked,
                "nonfinite_steps": self.state.progress.nonfinite_steps, "attempt": self.attempt}


MAX_UNSAVED_LINES = 10_000  # a checkpoint carries at most this many lines (a run that never saves)


def _plain(value: Any) -> Any:
    """Python numbers (a tensor or numpy scalar does not travel as a metric)."""
    return value.item() if hasattr(value, "item") else value
