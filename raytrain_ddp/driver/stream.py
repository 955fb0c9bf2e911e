"""The run's record stream: rank 0 -> Ray -> the driver, which writes it and shows it.

Owns: `Mailbox` (a small actor the driver owns, on the driver's node: rank 0 puts
events, the driver takes them) and `Recorder` (the driver's side: a thread that takes
the events and hands them on -- `metrics.jsonl`, `attempts.jsonl` and `abort.json` in
the run directory, the console's progress lines, and the optional TensorBoard / MLflow /
W&B sinks, which get a line only once it is committed -- see `Recorder`). Must not
touch: what a record holds (`worker/meter.py` makes them), training.

Why an actor and not files: on a cluster whose nodes do not share a filesystem, rank 0
cannot write the run directory the driver reads (and object stores cannot be appended
to). Why not `ray.train.report` for metrics: each report waits for Ray Train's
controller to poll (2 s), and V2 keeps reported metrics only next to checkpoints.
Sending to the mailbox is fire-and-forget for rank 0 (`.remote()` without waiting);
the driver long-polls (`take` returns as soon as anything arrived), so a line reaches
the run directory within milliseconds of being made.

Events (dicts, in the order rank 0 sent them: each carries its `attempt` and a `seq`
counted from the attempt's start; Ray may run two calls of an async actor out of order,
and a later call can even be taken before an earlier one has arrived, so the recorder
holds an event back until every earlier one of its attempt was applied -- see `Reorder`):
    {"kind": "attempt",   "record": {...}}   a worker group started (attempts.jsonl); one whose
                                             start failed and is retried carries `start_failed`
                                             (the controller's: `driver/startup.py`), said in one line
    {"kind": "metrics",   "record": {...}}   a train or validation line (metrics.jsonl); one of
                                             each per step: a redone one replaces its earlier self
    {"kind": "resumed",   "step": N, "origin": {...}, "lines": [...]}  lines past step N are
                                             redone: drop them; the attempt's line records where
                                             it started from; `lines` (the checkpoint's: those
                                             since the previous one) fill in any up to N that a
                                             lost rank 0 or a killed driver never wrote
    {"kind": "abort",     "record": {...}}   every rank stopped together (abort.json)
    {"kind": "checkpoint", "step": N, "name": ..., "blocked_s": ...}  the attempt's line in
                                             attempts.jsonl counts them (`checkpoints`,
                                             `checkpoint_blocked_s`, `preempted` after a save
                                             before a preemption); a resume adds to it what
                                             the dropped lines had cost (`redone_*`)
    {"kind": "validating", "step": N}        run.validation=async: step N's val line comes later, from
                                             rank 0's validator thread (`worker/validator.py`)
    {"kind": "fault", "cause": "node lost"}  the controller declared a node dead before the
                                             restart (`node_loss.py`): the next attempt's `cause`
    {"kind": "timeline", "source": "worker" | "controller", "stamps": {...}}  the start-up
                                             timeline's stamps (`timeline.py`): rank 0's with its
                                             first step; the controller's (attempt 0) per group start
    {"kind": "error",     "record": {...}}   any rank's error, whole (`worker/failure.py`); not
                                             numbered: applied as it arrives
The other way, the driver -> the workers: `request_stop` (Ctrl-C), which rank 0 reads at
its step-boundary polls (`stop_requested`) and all ranks agree on; and `set_durable`
(attempt, step) after each write of metrics.jsonl, which rank 0 asks for (`durable_for`)
before a checkpoint: the lines past it travel in the checkpoint, so a killed driver loses
none (`driver/fit.py: recover_lines` takes them back at the next start; docs/reliability.md#metrics-that-survive-a-killed-driver).
"""

# Over 500 lines: both ends of one event protocol (the mailboxes, the recorder), stated once above.
from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from typing import Any, Optional

from raytrain_ddp.driver.reorder import GAP_TIMEOUT_S, Reorder  # noqa: F401 - tests import them from here
from raytrain_ddp.ray_compat import HEAD_NODE_RESOURCE
from raytrain_ddp.rundir import ABORT_FILE, ATTEMPTS_FILE, METRICS_FILE, TRACKED_FILE, JsonlFile, Location

logger = logging.getLogger(__name__)

REMOTE_FLUSH_S = 1.0  # object stores: rewrite metrics.jsonl at most this often (one PUT each)
FLUSH_TIMEOUT_S = 10.0  # rank 0's final flush waits at most this long for its puts to land


class _Events:
    """What both mailboxes hold: the queued events, the attempt counter of one fit, the
    puts queued per attempt, the driver's stop request. Each mailbox adds how a taker waits."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._attempts = 0
        self._received: dict[int, int] = {}  # attempt -> puts queued so far
        self._stop = False
        self._durable = (0, 0)  # (attempt, step): the run directory durably holds that attempt's lines up to step

    def _durable_for(self, attempt: int) -> int:
        return self._durable[1] if self._durable[0] == attempt else 0

    def _queue_attempt(self, record: dict[str, Any]) -> int:
        self._attempts += 1
        self._events.append({"kind": "attempt", "attempt": self._attempts, "seq": 0,
                             "record": {**record, "attempt": self._attempts}})
        return self._attempts

    def _queue(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        attempt = event.get("attempt", 0)
        self._received[attempt] = self._received.get(attempt, 0) + 1

    def _drain(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


class Mailbox(_Events):
    """The actor's class: a buffer of events, and the attempt counter of one fit."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived: Optional[asyncio.Event] = None

    def _signal(self) -> asyncio.Event:
        if self._arrived is None:  # created inside the actor's event loop
            self._arrived = asyncio.Event()
        return self._arrived

    async def attempt(self, record: dict[str, Any]) -> int:
        """Number this worker-group start (1, 2, ...) and queue its attempts.jsonl line."""
        attempt = self._queue_attempt(record)
        self._signal().set()
        return attempt

    async def put(self, event: dict[str, Any]) -> None:
        self._queue(event)
        self._signal().set()

    async def flush(self, attempt: int = 0, sent: int = 0, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Returns once the `sent` puts of `attempt` have all been queued (False: not within `timeout_s`).

        Not a plain round trip: Ray runs an async actor's calls in any order, so this call
        can overtake the puts sent before it.
        """
        deadline = time.monotonic() + timeout_s
        while self._received.get(attempt, 0) < sent:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def error(self, record: dict[str, Any]) -> None:
        """A rank's error, whole (any rank; `worker/failure.py`)."""
        self._events.append({"kind": "error", "record": record})
        self._signal().set()

    async def request_stop(self) -> None:
        """The driver's Ctrl-C: the workers stop at their next agreed step boundary, saved."""
        self._stop = True

    async def set_durable(self, attempt: int, step: int) -> None:
        """The driver wrote metrics.jsonl: it durably holds `attempt`'s history up to `step`."""
        self._durable = (attempt, step)

    async def durable_for(self, attempt: int) -> int:
        """Asked by rank 0 before a checkpoint: lines up to this step need not travel in it."""
        return self._durable_for(attempt)

    async def stop_requested(self) -> bool:
        """Asked by rank 0 at its step-boundary polls (`worker/preemption.py`)."""
        return self._stop

    async def take(self, timeout_s: float) -> list[dict[str, Any]]:
        """Everything queued so far; waits up to `timeout_s` for the first event."""
        if not self._events:
            try:
                await asyncio.wait_for(self._signal().wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        events = self._drain()
        self._signal().clear()
        return events


class LocalMailbox(_Events):
    """The mailbox of local mode (`scaling.num_workers: 0`): the same calls, in this process,
    from the loop's thread (rank 0's `Outbox`) to the recorder's; no actor, no Ray."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = threading.Condition()

    def attempt(self, record: dict[str, Any]) -> int:
        with self._arrived:
            attempt = self._queue_attempt(record)
            self._arrived.notify_all()
            return attempt

    def put(self, event: dict[str, Any]) -> None:
        with self._arrived:
            self._queue(event)
            self._arrived.notify_all()

    def flush(self, attempt: int = 0, sent: int = 0, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        return True  # every put is already queued when it returns

    def request_stop(self) -> None:
        self._stop = True

    def set_durable(self, attempt: int, step: int) -> None:
        self._durable = (attempt, step)

    def durable_for(self, attempt: int) -> int:
        return self._durable_for(attempt)

    def stop_requested(self) -> bool:
        return self._stop

    def take(self, timeout_s: float) -> list[dict[str, Any]]:
        with self._arrived:
            if not self._events:
                self._arrived.wait(timeout_s)
            return self._drain()


def open_mailbox() -> Any:
    """Start the mailbox actor on the head node (else the driver's); it dies with the driver.

    The head, because the cluster does not outlive it: a lost worker node must not take the
    run's records with it (issue #15), and the driver's own node is not always the head (a
    driver on a worker node; on the two-node local cluster both nodes share one address and
    the driver may attach to either).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_NODE_RESOURCE in n.get("Resources", {})]
    where = heads[0] if heads else ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0, max_restarts=0)(Mailbox).options(
        # soft=False: a soft affinity was seen placing it on the other node when the head
        # had no idle worker process yet.
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=where, soft=False))
    return actor.remote()


class Recorder:
    """Driver side: takes the mailbox's events in a thread and hands them on.

    Writes `metrics.jsonl` (when `jsonl` is among `run.loggers`), `attempts.jsonl` and
    `abort.json` into the run directory, and passes the metrics lines to each sink (the
    console's `ProgressPrinter`, TensorBoard, MLflow, W&B: objects with `record(line)`,
    `flush()` and `close(status)`). Keeps what the summary needs: the lines, this fit's
    attempts, the abort, the checkpoints' blocked times.

    Live sinks (the console) get every line as it arrives, redone ones too. A sink with
    `committed_only = True` (the trackers, `driver/sinks.py`) gets what `metrics.jsonl`
    ends up holding and nothing else: a line is held back until no restart can redo its
    step -- a checkpoint at or after it was reported (a restart resumes from that
    checkpoint or a later step; lines past the resume step are dropped, a redone line
    replaces its held self), or the fit ended -- then handed over in step order, each
    (step, train|validation) at most once. The one exception, logged: a restart that falls
    back below a reported checkpoint (its asynchronous upload died with the worker) redoes
    steps already handed over; those keep their first point. After each flush
    `trackers.json` says up to which step the trackers had every committed line; the next
    fit hands them what a killed driver had not (`_catch_up_trackers`).
    """

    def __init__(self, run_dir: Location, fit_id: str, sinks: list[Any], mailbox: Any = None,
                 write_metrics: bool = True, timeline: Any = None) -> None:
        self.run_dir, self.fit_id, self.sinks, self.mailbox = run_dir, fit_id, list(sinks), mailbox
        self.timeline = timeline  # the fit's start-up timeline (timeline.py), or None
        self._trackers = [s for s in self.sinks if getattr(s, "committed_only", False)]
        self._held: dict[tuple[int, str], dict[str, Any]] = {}  # lines the trackers have not had yet
        self._handed: set[tuple[int, str]] = set()  # (step, kind) the trackers have had in this fit
        self._handed_up_to = 0  # the highest step of those
        # run.validation=async: the step whose val line is still coming (`validating` events), and the
        # newest checkpoint's step: the trackers get nothing past the first before its line (W&B
        # refuses a step lower than one it has), then everything up to the second
        self._awaiting: Optional[int] = None
        self._checkpointed = 0
        self._fit_started = False  # the first `resumed` event: where this fit starts
        self._tracked_before = tracked_step(run_dir) if self._trackers else None  # what earlier fits' trackers had
        self._tracked_said: Optional[int] = self._tracked_before
        self.metrics = JsonlFile(run_dir / METRICS_FILE)
        self._lines = {_line_key(r) for r in self.metrics.records}  # (step, kind) of every line held
        self._fit_lines: set[tuple[int, str]] = set()  # those this fit made (earlier fits' are not its outcome)
        self.attempts = JsonlFile(run_dir / ATTEMPTS_FILE)
        self.write_metrics = write_metrics
        self.abort: Optional[dict[str, Any]] = None
        self._cause: Optional[str] = None  # why the next worker group starts (`fault` events)
        self.errors: list[dict[str, Any]] = []  # the ranks' errors, whole, as they arrived
        self.on_deterministic_error: Any = None  # called with the first one retrying cannot help
        self.checkpoints: list[dict[str, Any]] = []
        self.last_step = 0
        self._flushed_at = 0.0
        self._durable_said = (0, 0)
        self._resumed_attempt = 0  # the newest attempt whose `resumed` event (and its drops) was applied
        self._order = Reorder()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="raytrain-ddp-recorder", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Recorder":
        if self.mailbox is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Take what is still queued, write everything; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._drain(timeout_s=0.0)
        self.handle([], final=True)  # an event still missing now is not coming
        with self._lock:
            self._commit(None)  # the fit is over: nothing can be redone any more
        self.flush(force=True)

    def close(self, status: str) -> None:
        for sink in self.sinks:
            try:
                sink.close(status)
            except Exception as exc:  # noqa: BLE001 - a sink never decides the run's outcome
                logger.warning("closing %s failed: %s", type(sink).__name__, exc)

    def _run(self) -> None:
        while not self._stop.is_set() and self._drain(timeout_s=0.5):
            pass

    def _drain(self, timeout_s: float) -> bool:
        """Apply what the mailbox holds; False once it cannot hold more (no mailbox, Ray shut down)."""
        if self.mailbox is None:
            return False
        if isinstance(self.mailbox, LocalMailbox):  # local mode: no Ray
            self.handle(self.mailbox.take(timeout_s))
            return True
        import ray

        if not ray.is_initialized():  # the mailbox went with Ray; calling it would start a new Ray instance
            return False
        try:
            events = ray.get(self.mailbox.take.remote(timeout_s), timeout=timeout_s + 30)
        except SystemExit:  # Ray is shutting down under this call (it raises SystemExit(0) here)
            return False
        except Exception as exc:  # noqa: BLE001 - the mailbox is gone: nothing more comes
            if not self._stop.is_set():
                logger.debug("mailbox unavailable: %s", exc)
                time.sleep(0.2)
            return True
        self.handle(events)
        return True

    # ------------------------------------------------------------ events

    def handle(self, events: list[dict[str, Any]], final: bool = False) -> None:
        """Apply the events that rank 0's order allows now (`final`: all that are held), then write."""
        with self._lock:
            ready = self._order.push(events)
            for event in ready + (self._order.release_all() if final else []):
                self._apply(event)
            self.flush()

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "metrics":
            self._apply_metrics(event["record"])
        elif kind == "attempt":
            cause, self._cause = self._cause, None  # a node loss the controller declared before this start
            self.attempts.append([{**event["record"], **({"cause": cause} if cause else {})}])
            if "start_failed" in event["record"]:  # Ray Train starts the group again (driver/startup.py)
                self._say_start_retry(event["record"])
        elif kind == "fault":
            self._cause = event.get("cause")
        elif kind == "resumed":
            self._apply_resumed(event)
        elif kind == "abort":
            self.abort = event["record"]
            (self.run_dir / ABORT_FILE).write_text(json.dumps(self.abort))
        elif kind == "timeline" and self.timeline is not None:
            if event.get("source") == "controller":
                self.timeline.controller(event.get("stamps", {}))
            else:
                self.timeline.worker(int(event.get("attempt", 1)), event.get("stamps", {}))
        elif kind == "error":
            self.errors.append(event["record"])
            if event["record"].get("deterministic") and self.on_deterministic_error is not None:
                callback, self.on_deterministic_error = self.on_deterministic_error, None  # once
                callback(event["record"])
        elif kind == "checkpoint":
            self.checkpoints.append({k: event[k] for k in ("step", "name", "blocked_s") if k in event})
            self._amend_attempt_stall(event)
            self._commit(int(event["step"]))
        elif kind == "validating":
            self._awaiting = int(event["step"])

    def _say_start_retry(self, record: dict[str, Any]) -> None:
        """One line per failed start that is retried; the next attempt's cause names it."""
        self._cause = f"start: {record['start_failed']}"
        print(f"raytrain-ddp: the workers' start failed: {record['start_failed']}; starting them again with "
              f"fresh ports (try {int(record.get('try', 1)) + 1} of {record.get('tries', '?')})",
              file=sys.stderr, flush=True)

    def _apply_metrics(self, record: dict[str, Any]) -> None:
        """A train or validation line: into metrics.jsonl (a redone one replaces its earlier self), the sinks."""
        key = _line_key(record)
        if key in self._lines:  # a redone line (validation after a restart at an epoch's end) replaces its earlier self
            self.metrics.keep(lambda r: _line_key(r) != key)
        self._lines.add(key)
        self._fit_lines.add(key)
        self.metrics.append([record])
        self.last_step = max(self.last_step, int(record.get("step", 0)))
        if self.timeline is not None and "loss" in record and "time" in record:
            self.timeline.last_step(float(record["time"]))
        for sink in self.sinks:
            if sink not in self._trackers:
                self._call(sink, "record", record)
        if self._trackers and key not in self._handed:
            self._held[key] = record
        if key == (self._awaiting, "validation"):  # the awaited val line: the trackers catch up
            self._awaiting = None
            self._commit(self._checkpointed)

    def _apply_resumed(self, event: dict[str, Any]) -> None:
        """Lines past the resumed step are dropped; the checkpoint's own lines fill in what is missing."""
        step = int(event["step"])
        self._resumed_attempt = max(self._resumed_attempt, int(event.get("attempt", 0)))
        self._awaiting = None  # a resumed group validates again what it must (`worker/validator.py`)
        redone = _redone(self.metrics.records, step)  # what the dropped lines had cost (goodput.py)
        self.metrics.keep(lambda r: r.get("step", 0) <= step)
        self._held = {key: r for key, r in self._held.items() if key[0] <= step}
        if not self._fit_started:
            self._fit_started = True
            self._catch_up_trackers(step)
        elif any(key[0] > step for key in self._handed):
            logger.warning("record stream: resumed at step %d, below a reported checkpoint; the trackers "
                           "keep their first point of the steps up to %d", step, max(k[0] for k in self._handed))
        self._lines = {_line_key(r) for r in self.metrics.records}
        self.attempts.amend_last({"resumed_step": step, **event.get("origin", {}), **redone})
        self.last_step = step
        # The checkpoint's lines up to `step` that this file lacks: those a lost rank 0 did
        # not deliver (a survivor's copy carries its step's), or that a killed driver had
        # not written yet (every checkpoint carries the lines since the previous one).
        for record in sorted(event.get("lines", []), key=lambda r: int(r.get("step", 0))):
            if int(record.get("step", 0)) <= step and _line_key(record) not in self._lines:
                self._apply_metrics(record)

    def _amend_attempt_stall(self, event: dict[str, Any]) -> None:
        """The attempt's line in attempts.jsonl keeps its checkpoints' count and stall (the
        saves after its last metrics line too: the final one), for `raytrain-ddp goodput`."""
        mine = [r for r in self.attempts.records
                if r.get("fit_id") == self.fit_id and r.get("attempt") == event.get("attempt")]
        if not mine or mine[-1] is not self.attempts.records[-1]:
            return  # a late event of an older attempt: its line is no longer the last
        record = mine[-1]
        self.attempts.amend_last({"checkpoints": int(record.get("checkpoints", 0)) + 1,
                                  "checkpoint_blocked_s": float(record.get("checkpoint_blocked_s", 0.0))
                                  + float(event.get("blocked_s", 0.0)),
                                  **({"preempted": True} if event.get("preemption") else {})})

    def _catch_up_trackers(self, step: int) -> None:
        """This fit starts after `step`: the trackers drop earlier fits' points past what they
        are known to hold (`trackers.json`, else `step`), and get the lines from there to
        `step` that a killed driver had not handed them, from metrics.jsonl."""
        since = step if self._tracked_before is None else min(self._tracked_before, step)
        for sink in self._trackers:
            if hasattr(sink, "fit_starts_at"):
                self._call(sink, "fit_starts_at", since)
        for record in sorted((r for r in self.metrics.records if since < int(r.get("step", 0)) <= step),
                             key=lambda r: (_line_key(r)[0], _line_key(r)[1] != "train")):
            self._handed.add(_line_key(record))
            self._handed_up_to = max(self._handed_up_to, _line_key(record)[0])
            for sink in self._trackers:
                self._call(sink, "record", record)

    def catch_up(self, step: int) -> None:
        """The same command on a complete run (no fit): the trackers get the committed lines up
        to `step` they lack, and their runs end ok."""
        with self._lock:
            self._catch_up_trackers(step)
        self.flush(force=True)
        self.close("ok")

    def _commit(self, step: Optional[int]) -> None:
        """Hand the trackers the held lines up to `step` (None: all), in step order, train first;
        while a val line is awaited, none past its step."""
        if step is not None:
            self._checkpointed = max(self._checkpointed, step)
            step = step if self._awaiting is None else min(step, self._awaiting)
        ready = sorted((key for key in self._held if step is None or key[0] <= step),
                       key=lambda k: (k[0], k[1] != "train"))
        for key in ready:
            record = self._held.pop(key)
            self._handed.add(key)
            self._handed_up_to = max(self._handed_up_to, key[0])
            for sink in self._trackers:
                self._call(sink, "record", record)

    def _call(self, sink: Any, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a failing sink must not stop training or the others
            logger.warning("%s.%s failed: %s", type(sink).__name__, method, exc)

    def flush(self, force: bool = False) -> None:
        """Write the files; on object stores at most every REMOTE_FLUSH_S unless forced."""
        now = time.monotonic()
        if not force and not self.run_dir.is_local and now - self._flushed_at < REMOTE_FLUSH_S:
            return
        self._flushed_at = now
        self.attempts.flush()
        if self.write_metrics:
            self.metrics.flush()
        self._say_durable()
        for sink in self.sinks:
            self._call(sink, "flush")
        self._say_tracked()

    def _say_tracked(self) -> None:
        """After the trackers' flush: `trackers.json` says up to which step they had every
        committed line, so the next fit hands them what a killed driver had not (`_catch_up_trackers`)."""
        step = self._handed_up_to
        if self._trackers and step and step != self._tracked_said:
            self._tracked_said = step
            (self.run_dir / TRACKED_FILE).write_text(json.dumps({"step": step}) + "\n")

    def _say_durable(self) -> None:
        """Tell rank 0 how far metrics.jsonl now durably holds the newest attempt's history, so
        that its checkpoints stop carrying those lines (`RunLog.lines_to_save`). Said only for an
        attempt whose `resumed` event was applied: the lines it redoes are out of the file by then."""
        durable = (self._resumed_attempt, max((int(r.get("step", 0)) for r in self.metrics.records), default=0))
        if self.mailbox is None or durable == self._durable_said or durable[0] == 0:
            return
        self._durable_said = durable
        if isinstance(self.mailbox, LocalMailbox):
            self.mailbox.set_durable(*durable)
            return
        import ray

        if ray.is_initialized():
            try:
                self.mailbox.set_durable.remote(*durable)
            except Exception as exc:  # noqa: BLE001 - the mailbox is gone: rank 0 keeps carrying its lines
                logger.debug("mailbox unavailable: %s", exc)

    # ------------------------------------------------------------ what the summary reads

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self.metrics.records)

    def error_to_show(self, ray_text: str) -> Optional[str]:
        """The whole message of the fit's failure when the ranks told it: the first
        deterministic error, else the last one if Ray's account of it (`ray_text`) was cut."""
        chosen = next((e for e in self.errors if e.get("deterministic")), None)
        if chosen is None and self.errors and "truncated" in ray_text:
            chosen = self.errors[-1]
        return chosen["message"] if chosen else None

    def fit_records(self) -> list[dict[str, Any]]:
        """The lines this fit made and kept (a redone step's line counts once, the committed one)."""
        return [r for r in self.metrics.records if _line_key(r) in self._fit_lines]

    def fit_attempts(self) -> list[dict[str, Any]]:
        return [r for r in self.attempts.records if r.get("fit_id") == self.fit_id]

    def checkpoint_summary(self) -> dict[str, Any]:
        blocked = [c["blocked_s"] for c in self.checkpoints if "blocked_s" in c]
        if not blocked:
            return {"count": 0}
        return {"count": len(blocked), "blocked_s_total": round(sum(blocked), 4),
                "blocked_s_mean": round(sum(blocked) / len(blocked), 4), "blocked_s_max": round(max(blocked), 4)}


def _redone(records: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """The lines past `step` that a resume drops: their steps are done again. Their step count,
    seconds (steps and validation) and the newest line's time go into the resuming attempt's line."""
    dropped = [r for r in records if int(r.get("step", 0)) > step]
    if not dropped:
        return {}
    return {"redone_steps": sum(int(r.get("window_steps", 0)) for r in dropped),
            "redone_s": sum(float(r.get("steps_s", 0.0)) + float(r.get("validation_s", 0.0)) for r in dropped),
            "redone_until": max(float(r.get("time", 0.0)) for r in dropped)}


def _line_key(record: dict[str, Any]) -> tuple[int, str]:
    """A step has at most one train line (`loss`) and one validation line (`val_loss`)."""
    return int(record.get("step", 0)), "train" if "loss" in record else "validation"


def tracked_step(run_dir: Location) -> Optional[int]:
    """The step up to which the run's trackers had every committed line (`trackers.json`), if said."""
    try:
        return int(json.loads((run_dir / TRACKED_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


line_key = _line_key  # the same key, for the run directory's other readers (driver/fit.py)
