"""The start-up timeline (issue #39): where a fit's seconds go before its first step, for
the first start and every restart, and from its last step to its end (`timeline.jsonl`,
`summary.json["startup"]`; the contract: /work/wt/TIMELINE.md, docs/usage.md).

Owns: `Timeline` (the driver's: one per fit, it turns stamps into phases and writes them),
`WorkerStamps` (rank 0's: the wall-clock times its loop reaches each phase, sent once
after the first step through the record stream) and `process_start_time`. Must not touch:
training, the record stream's order (`driver/stream.py` hands stamps on as they come).

Every phase is measured, not estimated: its `t` is the wall clock when it ended, its
`seconds` the time since the previous phase's end, so one start's phases add up to its
time to the first step exactly (clock skew between nodes aside). Where the stamps come from:
    imports                      the process's start -> the launcher's entry (the CLI's parse and
                                 imports; a script's imports, its own work, and train() reading
                                 a torch Dataset; 0 s for a later fit of the same process)
    cli, ray, datasets           the driver (`launcher.py`, `driver/local.py`)
    placed, workers_up,          Ray Train's controller (`driver/startup.py`, a worker-group
    process_group                callback): the group's start, its actors up, the process
                                 group formed; `placed` ends at rank 0's process start, so
                                 a reused (prestarted) process shows 0 s placed
    data_ready .. first_step     rank 0's loop (`WorkerStamps`); `compile` (train.compile): the
                                 seconds torch.compile's backend took, which torch spends inside
                                 the first step, counted from `state_restored` (0 s without it)
A stamp that never came (local mode has no Ray) is a phase of 0 s. A start that failed and was
retried (`driver/startup.py`) has the phases up to `process_group`, which ends at its failure.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

DRIVER_PHASES = ("imports", "cli", "ray", "datasets")
ATTEMPT_PHASES = ("placed", "workers_up", "process_group", "data_ready", "model_built", "state_restored",
                  "compile", "first_step")
CONTROLLER_PHASES = ("workers_up", "process_group")
FAILED_PHASES = ATTEMPT_PHASES.index("process_group") + 1  # a failed start's phases: up to its process group


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """When a process started, as unix seconds (Linux /proc); None elsewhere.

    /proc gives the start in clock ticks since boot. The boot's unix time comes from the
    boot clock, not /proc/stat's `btime`: that is whole seconds, and its lost fraction
    (up to 1 s) moved every start earlier by the same amount."""
    try:
        stat = Path(f"/proc/{pid or 'self'}/stat").read_text()
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, AttributeError):  # no /proc, or no boot clock (not Linux)
        return None
    ticks = float(stat.rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class WorkerStamps:
    """Rank 0's side: `mark(phase)` at each phase's end; `sent()` the stamps once the first
    step is done (None on later steps and on every other rank)."""

    def __init__(self, enabled: bool = True, given: Optional[dict[str, float]] = None) -> None:
        self.enabled = enabled
        self.stamps: dict[str, float] = dict(given or {})  # a launcher's own (torchrun: workers_up, process_group)
        start = process_start_time()
        if start is not None:
            self.stamps["process_start"] = start
        self._sent = False

    def mark(self, phase: str) -> None:
        if self.enabled and phase not in self.stamps:
            self.stamps[phase] = time.time()

    def first_step_done(self, outbox: Any, compile_s: float = 0.0) -> None:
        """After every step: the first one sends the stamps through rank 0's outbox (`worker/meter.py`);
        `compile_s`: the compilation inside it (`worker/compiled.CompileClock`), its own phase."""
        if not self.enabled or self._sent:
            return
        if compile_s and "state_restored" in self.stamps:
            self.stamps["compile"] = self.stamps["state_restored"] + compile_s
        self.mark("first_step")
        self._sent = True
        outbox.send("timeline", source="worker", stamps=dict(self.stamps))


class Timeline:
    """The driver's timeline of one fit: `mark` a driver phase, take the controller's and
    rank 0's stamps as they arrive (`controller`, `worker`), `attach` the run directory
    once it exists (rows made before wait in memory), `end` with the fit's status."""

    def __init__(self, fit_id: str, started: Optional[float] = None, entered: Optional[float] = None) -> None:
        """`started`: the process's start (default `entered`); `entered`: the launcher's entry (default now)."""
        self.fit_id = fit_id
        entered = float(entered if entered is not None else time.time())
        self.started = float(started if started is not None else entered)
        self.rows: list[dict[str, Any]] = []
        self._file: Any = None
        self._groups: list[dict[str, float]] = []  # the controller's stamps, one per worker-group start
        self._pending: dict[int, dict[str, float]] = {}  # rank 0's stamps waiting for their group's
        self.expects_controller = False  # a Ray fit: rank 0's stamps wait for the controller's
        self._lock = threading.Lock()
        self._driver_end = self.started
        self.last_step_t: Optional[float] = None
        self._row("fit_start", None, self.started, 0.0)
        self._row("imports", None, max(entered, self.started), max(0.0, entered - self.started))
        self._driver_end = max(entered, self.started)

    # ------------------------------------------------------------ stamps in

    def mark(self, phase: str, applies: bool = True) -> None:
        """A driver phase ends now (`applies=False`: it does not apply here, 0 s)."""
        t = time.time() if applies else self._driver_end
        with self._lock:
            self._row(phase, None, t, max(0.0, t - self._driver_end))
            self._driver_end = t

    def controller(self, stamps: dict[str, float]) -> None:
        """A worker group started (Ray Train's controller): its begin, actors up, process group."""
        with self._lock:
            self._groups.append(dict(stamps))
            if "failed" in stamps:  # a start that failed and is retried: no rank 0 stamps come for it
                self._write_attempt(len(self._groups), {})
            self._write_ready()

    def worker(self, attempt: int, stamps: dict[str, float]) -> None:
        """Rank 0's stamps of `attempt`, sent with its first step: the attempt's phases are
        written once its group's controller stamps are in too (or at the end without them)."""
        with self._lock:
            self._pending[int(attempt)] = dict(stamps)
            self._write_ready()

    def _write_ready(self, final: bool = False) -> None:
        for attempt in sorted(self._pending):
            if not final and self.expects_controller and attempt > len(self._groups):
                continue
            self._write_attempt(attempt, self._pending.pop(attempt))
        self.flush()

    def _write_attempt(self, attempt: int, stamps: dict[str, float]) -> None:
        group = self._groups[attempt - 1] if 0 < attempt <= len(self._groups) else {}
        begin = self._driver_end if attempt <= 1 else group.get("begin", self._driver_end)
        ends = {k: v for k, v in group.items() if k in CONTROLLER_PHASES}
        ends.update({k: v for k, v in stamps.items() if k in ATTEMPT_PHASES})
        proc = stamps.get("process_start")
        if proc is not None and "workers_up" in ends:  # placed: the first worker process's start
            ends["placed"] = min(max(proc, begin), ends["workers_up"])
        failed = "failed" in group  # its process group failed to form: its phases end there
        if failed:
            ends["process_group"] = group["failed"]
        previous = begin
        for phase in ATTEMPT_PHASES[:FAILED_PHASES] if failed else ATTEMPT_PHASES:
            t = max(previous, float(ends.get(phase, previous)))
            self._row(phase, attempt, t, t - previous, **({"failed": True} if failed else {}))
            previous = t

    def last_step(self, t: float) -> None:
        self.last_step_t = max(self.last_step_t or 0.0, float(t))

    def end(self, status: str) -> float:
        """The fit ends now: `last_step` and `fit_end` rows; returns last step -> now, in seconds."""
        now = time.time()
        with self._lock:
            self._write_ready(final=True)
            last = self.last_step_t if self.last_step_t is not None else now
            self._row("last_step", None, last, 0.0)
            self._row("fit_end", None, now, max(0.0, now - last), status=status)
            self.flush()
        return max(0.0, now - last)

    def finish(self, run_dir: Any, summary: Optional[dict[str, Any]], verbose: bool = False) -> None:
        """The fit is over (its Ray stopped): `end`, and summary.json's `startup` completed
        with the last step -> end time; printed under `--verbose`. Nothing if the run
        directory was never written (a refusal before the fit)."""
        if self._file is None:
            return
        status = str((summary or {}).get("status", "failed"))
        self.end(status)
        startup = self.summary()
        if summary is not None:
            import json

            from raytrain_ddp.rundir import SUMMARY_FILE

            summary["startup"] = startup
            try:
                (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            except OSError:
                pass
        if verbose:
            for line in format_timeline(startup):
                print(f"raytrain-ddp: {line}", flush=True)

    # ------------------------------------------------------------ out

    def attach(self, run_dir: Any) -> None:
        """Write to `run_dir`'s timeline.jsonl from now on (the rows so far first)."""
        from raytrain_ddp.rundir import TIMELINE_FILE, JsonlFile

        with self._lock:
            self._file = JsonlFile(run_dir / TIMELINE_FILE)
            self._file.append(self.rows)
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError:  # a record file must not end the run
                pass

    def summary(self) -> dict[str, Any]:
        """`summary.json["startup"]`: each start's phases and its time to the first step."""
        driver = {r["phase"]: r["seconds"] for r in self.rows if r["attempt"] is None and r["phase"] in DRIVER_PHASES}
        attempts: list[dict[str, Any]] = []
        for number in sorted({r["attempt"] for r in self.rows if r["attempt"] is not None}):
            rows = [r for r in self.rows if r["attempt"] == number]
            phases = {**(driver if number == 1 else {}), **{r["phase"]: r["seconds"] for r in rows}}
            begin = self.started if number == 1 else rows[0]["t"] - rows[0]["seconds"]
            attempts.append({"attempt": number, "phases": phases, "to_first_step_s": round(rows[-1]["t"] - begin, 3),
                             **({"failed": True} if rows[-1].get("failed") else {})})  # to its failure, then
        end = next((r for r in self.rows if r["phase"] == "fit_end"), None)
        return {"attempts": attempts, "shutdown_s": end["seconds"] if end else None}

    def _row(self, phase: str, attempt: Optional[int], t: float, seconds: float, **extra: Any) -> None:
        row = {"fit": self.fit_id, "attempt": attempt, "phase": phase, "t": round(t, 3),
               "seconds": round(seconds, 3), **extra}
        self.rows.append(row)
        if self._file is not None:
            self._file.append([row])


def format_timeline(startup: dict[str, Any]) -> list[str]:
    """The timeline as console lines (`--verbose`, the bench)."""
    lines = []
    for attempt in startup.get("attempts", []):
        phases = " | ".join(f"{name} {seconds:.2f}s" for name, seconds in attempt["phases"].items())
        end = "its failure (retried)" if attempt.get("failed") else "the first step"
        lines.append(f"start-up, attempt {attempt['attempt']}: {attempt['to_first_step_s']:.2f}s to {end} = {phases}")
    if startup.get("shutdown_s") is not None:
        lines.append(f"last step -> end: {startup['shutdown_s']:.2f}s")
    return lines
