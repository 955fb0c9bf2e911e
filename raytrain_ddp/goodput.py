"""Every second of a run accounted: the goodput report across fits, restarts and faults.

Owns: reading a run directory's own timestamps (through `rundir.Location`: local disk or
object storage, no service) and splitting its wall time into buckets; the interruptions
and their causes; the figures `run.checkpoint_every_steps: auto` plans with (`cadence_inputs`,
`young_interval_steps`, `auto_interval`). Pure: reading and arithmetic, no Ray, no torch;
read by the CLI, by the driver for each fit's summary line, and by rank 0 at each worker
group's start (`worker/checkpointer.py`): it sits beside `rundir.py`, below both. Must not
touch: writing any file (the driver's recorder and rank 0 write what is read here), the
console (`cli.py` prints `format_table`; the picture is `ops/goodput_plot.py`).

What is read, and who wrote it:
    timeline.jsonl       each fit's start, its start-up phases, its end and status (driver, `timeline.py`)
    config-history.jsonl each fit's id and when it prepared (driver): a fit's start without a timeline
    attempts.jsonl       each worker-group start (`time`), its checkpoints' count and stall
                         (`checkpoints`, `checkpoint_blocked_s`; `preempted`: one was the save before a
                         preemption), and what a resume threw away
                         (`redone_steps`, `redone_s`, `redone_until`: the dropped lines') (driver)
    metrics.jsonl        the kept lines: `time`, `steps_s` / `window_steps` (the window's step
                         time), `data_wait_fraction`, `exposed_comm_ms`; validation's `validation_s` (rank 0)
                         and, `run.validation: async`, `validation_async_s` (the validator thread's)

The buckets of one fit, from its start to its end (`fit_end`, else the last timestamp any
file shows for it: a killed driver writes no end):
    startup      fit start -> the first step of attempt 1 began (by phase, from the timeline), and
                 the first step's `compile` phase (train.compile; a restart's is recovery's)
    productive   the kept steps' time, less their data wait and exposed communication
    data_wait, exposed_comm   of the kept steps
    checkpoint_stall          the step loop waiting for saves (each attempt's, the last save too)
    validation   validation on the critical path: inline passes; async, the hand-off (and the
                 run's last validation, which the loop waits for)
    redone       steps a later resume threw away (work lost to a fault)
    recovery     an attempt's last recorded step -> the next attempt's first step (detection,
                 restart, restore: a restart's start-up is recovery)
    shutdown     the last attempt's end -> the fit's end
    other        what is left inside the attempts' spans (logging; ~0: a check of the arithmetic)
and between fits, `idle`: no fit holding the run. Goodput = productive / total. Off the
critical path, in no bucket (it overlaps the steps): `validation_async_s`, the seconds async
validation ran beside training.
Precision: a line covers `run.log_every_steps` steps, so the steps after a failed attempt's
last line count as recovery, not redone.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_ddp.rundir import (
    ATTEMPTS_FILE, HOLD_FILE, METRICS_FILE, SUMMARY_FILE, TIMELINE_FILE, Location, Where, read_jsonl,
)

CONFIG_HISTORY_FILE = "config-history.jsonl"  # driver/resume.py's
BUCKETS = ("productive", "startup", "data_wait", "exposed_comm", "checkpoint_stall", "validation",
           "redone", "recovery", "shutdown", "idle", "other")
ATTEMPT_PHASES = ("placed", "workers_up", "process_group", "data_ready", "model_built", "state_restored",
                  "compile")
FIT_PHASES = ("imports", "cli", "ray", "datasets")
CAUSE_OF_STATUS = {"interrupted": "Ctrl-C", "preempted": "preemption", "failed": "failed", "aborted": "failed",
                   "unschedulable": "failed"}
WORKER_LOST, PREEMPTION = "worker lost", "preemption"  # a restart's cause: a just-in-time save before it says which
RUNNING = "running"  # the fit holding the run now
HOLD_FRESH_S = 20.0  # a hold.json heartbeat this recent is a live fit (driver/hold.py's STALE_S)


@dataclass
class Attempt:
    record: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    redone_s: float = 0.0  # this attempt's work a later resume threw away
    redone_until: Optional[float] = None

    @property
    def number(self) -> int:
        return int(self.record.get("attempt", 1))

    @property
    def time(self) -> float:
        return float(self.record.get("time", 0.0))

    @property
    def start(self) -> float:
        """When its first kept step began (its registration time when it kept none)."""
        if not self.train:  # every line it made was thrown away, or it made none
            return self.redone_until - self.redone_s if self.redone_until else self.end
        first = self.train[0]
        return float(first["time"]) - float(first.get("steps_s", 0.0)) - float(first.get("checkpoint_blocked_s", 0.0))

    @property
    def end(self) -> float:
        times = [float(r["time"]) for r in self.train + self.val] + [self.time]
        return max(times + ([self.redone_until] if self.redone_until else []))

    @property
    def busy_until(self) -> float:
        """Its end, or later when what it measured outlasts its last line (a save after it)."""
        return self.start + max(self.end - self.start, sum(self.parts().values()))

    def parts(self) -> dict[str, float]:
        steps = sum(float(r.get("steps_s", 0.0)) for r in self.train)
        wait = sum(float(r.get("data_wait_fraction", 0.0)) * float(r.get("steps_s", 0.0)) for r in self.train)
        comm = sum(float(r.get("exposed_comm_ms", 0.0)) * int(r.get("window_steps", 0)) / 1e3 for r in self.train)
        stall = self.record.get("checkpoint_blocked_s")
        if stall is None:  # a run from before attempts.jsonl counted them
            stall = sum(float(r.get("checkpoint_blocked_s", 0.0)) for r in self.train)
        return {"productive": steps - wait - comm, "data_wait": wait, "exposed_comm": comm,
                "checkpoint_stall": float(stall), "validation": sum(float(r.get("validation_s", 0.0)) for r in self.val),
                "redone": self.redone_s}


@dataclass
class Fit:
    fit_id: str
    start: float
    end: Optional[float] = None
    status: Optional[str] = None  # None: no end was written (the driver was killed)
    attempts: list[Attempt] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)  # its timeline records

    def last_seen(self) -> float:
        return max([self.start] + [a.busy_until for a in self.attempts] + [float(p.get("t", 0.0)) for p in self.phases])


def load_fits(run_dir: Where, current: Optional[dict[str, Any]] = None) -> list[Fit]:
    """The run's fits in time order, each with its attempts and their lines.

    `current`: {"fit_id", "end", "status"} of the fit still running (its summary line), whose
    end no file holds yet.
    """
    where = Location.parse(run_dir)
    timeline = read_jsonl(where / TIMELINE_FILE)
    fits: dict[str, Fit] = {}
    for line in read_jsonl(where / CONFIG_HISTORY_FILE):
        if line.get("fit_id"):
            fits.setdefault(line["fit_id"], Fit(line["fit_id"], float(line.get("time", 0.0))))
    for rec in timeline:
        fit = fits.setdefault(rec.get("fit", ""), Fit(rec.get("fit", ""), float(rec.get("t", 0.0))))
        fit.phases.append(rec)
        if rec.get("phase") == "fit_start":
            fit.start = float(rec["t"])
        elif rec.get("phase") == "fit_end":
            fit.end, fit.status = float(rec["t"]), rec.get("status", "ok")
    for rec in read_jsonl(where / ATTEMPTS_FILE):
        fit = fits.setdefault(rec.get("fit_id", ""), Fit(rec.get("fit_id", ""), float(rec.get("time", 0.0))))
        fit.attempts.append(Attempt(rec))
    current = current or _holder(where)
    if current and current.get("fit_id") in fits:
        fit = fits[current["fit_id"]]
        fit.end, fit.status = float(current["end"]), current.get("status", "ok")
    if not any(f.status for f in fits.values()):
        _status_from_summary(where, fits)
    ordered = sorted((f for f in fits.values() if f.fit_id), key=lambda f: f.start)
    _assign_lines(ordered, read_jsonl(where / METRICS_FILE))
    return ordered


def _holder(where: Location) -> Optional[dict[str, Any]]:
    """The fit holding the run now (hold.json, a fresh heartbeat): running, not a killed driver."""
    try:
        held = json.loads((where / HOLD_FILE).read_text())
    except (FileNotFoundError, ValueError, OSError):
        return None
    now = time.time()
    if not isinstance(held, dict) or now - float(held.get("heartbeat", 0.0)) > HOLD_FRESH_S:
        return None
    return {"fit_id": held.get("fit_id"), "end": now, "status": RUNNING}


def _status_from_summary(where: Location, fits: dict[str, Fit]) -> None:
    """Without a timeline, summary.json says how the newest fit ended (its end: the last timestamp)."""
    try:
        summary = json.loads((where / SUMMARY_FILE).read_text())
    except (FileNotFoundError, ValueError, OSError):
        return
    fit = fits.get(summary.get("fit_id", ""))
    if fit is not None:
        fit.status = summary.get("status")


def _assign_lines(fits: list[Fit], lines: list[dict[str, Any]]) -> None:
    """Each kept line to the attempt that made it: its number (validation lines of older runs have
    none: any number), registered last before the line."""
    attempts = sorted((a for f in fits for a in f.attempts), key=lambda a: a.time)
    for line in sorted(lines, key=lambda r: float(r.get("time", 0.0))):
        t, number = float(line.get("time", 0.0)), line.get("attempt")
        owner = None
        for attempt in attempts:
            if attempt.time <= t and number in (None, attempt.number):
                owner = attempt
        if owner is None:
            continue
        (owner.train if "loss" in line else owner.val).append(line)
    for before, after in zip(attempts, attempts[1:]):  # a resume threw away the attempt before it's lines
        before.redone_s = float(after.record.get("redone_s", 0.0))
        before.redone_until = after.record.get("redone_until")


def fit_buckets(fit: Fit) -> tuple[dict[str, float], dict[str, float], list[tuple[str, float, float]]]:
    """One fit's buckets (seconds), its start-up by phase, and its bar's segments (bucket, from, to)."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    end = fit.end if fit.end is not None else fit.last_seen()
    if not fit.attempts:
        buckets["startup"] = max(0.0, end - fit.start)
        return buckets, _startup_phases(fit, buckets["startup"]), [("startup", fit.start, end)]
    attempts = fit.attempts
    first = attempts[0].start
    buckets["startup"] = max(0.0, first - fit.start)
    segments = [("startup", fit.start, first)]
    previous_end = None
    for attempt in attempts:
        if previous_end is not None:
            buckets["recovery"] += max(0.0, attempt.start - previous_end)
            segments.append(("recovery", previous_end, attempt.start))
        parts = attempt.parts()
        compiled = min(parts["productive"], sum(float(r.get("seconds", 0.0)) for r in fit.phases if r.get("phase") == "compile"
                                                and (r.get("attempt") or 1) == attempt.number))
        if compiled > 0:  # train.compile: inside the first step's time, yet start-up's (a restart's: recovery's)
            parts = {"recovery" if previous_end is not None else "startup": compiled,
                     **parts, "productive": parts["productive"] - compiled}
        # a save (or a validation) after the last line runs past it: out of the gap that follows
        other = max(0.0, (attempt.end - attempt.start) - sum(parts.values()))
        for name, seconds in parts.items():
            buckets[name] += seconds
        buckets["other"] += other
        segments += _spread(parts, other, attempt.start)
        previous_end = attempt.busy_until
    buckets["shutdown"] = max(0.0, end - previous_end)
    segments.append(("shutdown", previous_end, end))
    return buckets, _startup_phases(fit, buckets["startup"]), segments


def _spread(parts: dict[str, float], other: float, start: float) -> list[tuple[str, float, float]]:
    """An attempt's span drawn as consecutive pieces, one per bucket (their order, not their times)."""
    out, t = [], start
    for name, seconds in [*parts.items(), ("other", max(0.0, other))]:
        if seconds > 0:
            out.append((name, t, t + seconds))
            t += seconds
    return out


def _startup_phases(fit: Fit, startup_s: float) -> dict[str, float]:
    """The timeline's phases of the fit's first start; what is left of the start-up is `first_step`
    (the first step's own time is productive). Scaled down if they add up to more."""
    phases: dict[str, float] = {}
    for rec in fit.phases:
        name = rec.get("phase")
        if name in FIT_PHASES or (name in ATTEMPT_PHASES and rec.get("attempt") in (None, 1)):
            phases[name] = phases.get(name, 0.0) + float(rec.get("seconds", 0.0))
    if not phases:
        return {"before_first_step": startup_s} if startup_s else {}
    named = sum(phases.values())
    if named > startup_s > 0:
        return {k: v * startup_s / named for k, v in phases.items()}
    phases["first_step"] = startup_s - named
    return phases


def interruptions(fits: list[Fit]) -> list[dict[str, Any]]:
    """Every restart inside a fit and every fit that did not end ok, with its cause and recovery."""
    out = []
    for i, fit in enumerate(fits):
        for before, attempt in zip(fit.attempts, fit.attempts[1:]):
            out.append({"fit": fit.fit_id, "attempt": attempt.number, "at": before.busy_until,
                        "cause": attempt.record.get("cause") or (PREEMPTION if before.record.get("preempted")
                                                                  else WORKER_LOST),
                        "recovery_s": max(0.0, attempt.start - before.busy_until), "redone_s": before.redone_s})
        if fit.status in ("ok", RUNNING):
            continue
        cause = CAUSE_OF_STATUS.get(fit.status or "", "driver killed" if fit.status is None else "failed")
        end = fit.end if fit.end is not None else fit.last_seen()
        nxt = next((f for f in fits[i + 1:] if f.attempts), None)
        out.append({"fit": fit.fit_id, "attempt": None, "at": end, "cause": cause,
                    "recovery_s": max(0.0, nxt.attempts[0].start - end) if nxt else None,
                    "redone_s": fit.attempts[-1].redone_s if fit.attempts else 0.0})
    return out


def report(run_dir: Where, current: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The whole report: buckets (seconds), total, goodput, per fit, interruptions, MTTR, MTBI."""
    fits = load_fits(run_dir, current)
    total = dict.fromkeys(BUCKETS, 0.0)
    phases: dict[str, float] = {}
    per_fit, last_end = [], None
    for fit in fits:
        buckets, fit_phases, segments = fit_buckets(fit)
        end = fit.end if fit.end is not None else fit.last_seen()
        if last_end is not None and fit.start > last_end:
            total["idle"] += fit.start - last_end
        last_end = max(end, last_end or end)
        for name, seconds in buckets.items():
            total[name] += seconds
        for name, seconds in fit_phases.items():
            phases[name] = phases.get(name, 0.0) + seconds
        fit_total = sum(buckets.values())
        per_fit.append({"fit": fit.fit_id, "start": fit.start, "end": end, "status": fit.status or "driver killed",
                        "attempts": len(fit.attempts), "total_s": fit_total, "buckets": buckets,
                        "goodput": buckets["productive"] / fit_total if fit_total > 0 else 0.0,
                        "segments": [list(s) for s in segments]})
    wall = (last_end - fits[0].start) if fits else 0.0
    events = interruptions(fits)
    recovered = [e["recovery_s"] for e in events if e["recovery_s"] is not None]
    held = sum(total.values()) - total["idle"]
    by_cause: dict[str, int] = {}
    for event in events:
        by_cause[event["cause"]] = by_cause.get(event["cause"], 0) + 1
    return {"run_dir": str(Location.parse(run_dir)), "total_s": sum(total.values()), "wall_s": wall,
            "goodput": total["productive"] / wall if wall > 0 else 0.0, "buckets": total, "startup_phases": phases,
            "fits": per_fit, "interruptions": events, "by_cause": by_cause,
            "mttr_s": sum(recovered) / len(recovered) if recovered else None,
            "mtbi_s": held / len(events) if events else None, **cadence_figures(fits),
            "validation_async_s": sum(float(r.get("validation_async_s", 0.0)) for f in fits for a in f.attempts
                                      for r in a.val)}


def cadence_figures(fits: list[Fit]) -> dict[str, Optional[float]]:
    """The mean step time of the kept steps and the mean stall of one save, over the run."""
    steps = sum(int(r.get("window_steps", 0)) for f in fits for a in f.attempts for r in a.train)
    step_s = sum(float(r.get("steps_s", 0.0)) for f in fits for a in f.attempts for r in a.train)
    saves = sum(int(a.record.get("checkpoints", 0)) for f in fits for a in f.attempts)
    stall = sum(float(a.record.get("checkpoint_blocked_s", 0.0)) for f in fits for a in f.attempts)
    return {"step_s": step_s / steps if steps else None, "save_stall_s": stall / saves if saves else None}


def summary_figures(run_dir: Where, fit_id: str, status: str, end: float) -> dict[str, Any]:
    """{"fit": this fit's goodput, "run": the run's, "restarts": this fit's restarts (attempt, cause,
    seconds: its recovery), when it had any} for the fit's summary; {} if unreadable (the summary
    never fails for its goodput)."""
    try:
        rep = report(run_dir, current={"fit_id": fit_id, "end": end, "status": status})
    except Exception:  # noqa: BLE001 - a figure of the summary, never its outcome
        return {}
    fit = next((f for f in rep["fits"] if f["fit"] == fit_id), None)
    if fit is None:
        return {}
    restarts = [{"attempt": e["attempt"], "cause": e["cause"], "seconds": round(e["recovery_s"], 3)}
                for e in rep["interruptions"] if e["fit"] == fit_id and e["attempt"] is not None]
    return {"fit": round(fit["goodput"], 4), "run": round(rep["goodput"], 4),
            **({"restarts": restarts} if restarts else {})}


# ---------------------------------------------------------------- run.checkpoint_every_steps: auto


def young_interval_steps(mtbf_s: float, stall_s: float, step_s: float) -> int:
    """Young's optimal checkpoint interval sqrt(2 * MTBF * stall), in whole steps (at least 1)."""
    if step_s <= 0:
        return 1
    return max(1, round(math.sqrt(2.0 * mtbf_s * max(stall_s, 0.0)) / step_s))


def auto_interval(inputs: dict[str, Any]) -> tuple[Optional[int], str]:
    """`run.checkpoint_every_steps: auto`'s choice from `cadence_inputs` and the one line saying
    why; None (and its line) while the save stall or the step time is still unmeasured."""
    mtbf, stall, step_s = inputs["mtbf_s"], inputs.get("save_stall_s"), inputs.get("step_s")
    head = "run.checkpoint_every_steps auto"
    if stall is None or not step_s:
        return None, f"{head}: no save measured on this run yet; the first one, {PROBE_STEPS} steps in, measures it"
    steps = young_interval_steps(mtbf, stall, step_s)
    return steps, (f"{head}: every {steps} steps = sqrt(2 x MTBF {mtbf:.1f}s ({inputs['mtbf_from']}) x save stall "
                   f"{stall:.4f}s) = {math.sqrt(2 * mtbf * stall):.2f}s at {step_s:.4f}s a step (Young)")


PROBE_STEPS = 10  # auto, nothing measured yet: the first save this many steps in (worker/checkpointer.py)


def cadence_inputs(run_dir: Where, expected_mtbf_s: Optional[float], fit_id: Optional[str] = None) -> dict[str, Any]:
    """What `auto` plans with: the observed MTBI (else `run.expected_mtbf_s`), the measured save
    stall and step time (None until measured), and where the MTBF came from. `fit_id`: the fit
    asking, which is running (not a killed driver)."""
    try:
        figures = report(run_dir, {"fit_id": fit_id, "end": time.time(), "status": RUNNING} if fit_id else None)
    except (OSError, ValueError):
        figures = {"mtbi_s": None, "step_s": None, "save_stall_s": None}
    observed = figures["mtbi_s"]
    return {"mtbf_s": observed if observed is not None else expected_mtbf_s,
            "mtbf_from": "observed" if observed is not None else "run.expected_mtbf_s",
            "step_s": figures["step_s"], "save_stall_s": figures["save_stall_s"]}


# ---------------------------------------------------------------- the terminal table


def _s(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:,.1f}s"


def format_table(rep: dict[str, Any]) -> str:
    """The report as the terminal shows it: buckets, fits, interruptions."""
    total = rep["wall_s"] or 1e-9
    lines = [f"goodput {100 * rep['goodput']:.1f}% of {_s(rep['wall_s'])} ({rep['run_dir']})", "",
             f"  {'bucket':<18}{'seconds':>10}{'share':>8}"]
    for name in BUCKETS:
        seconds = rep["buckets"][name]
        if seconds >= 0.005 or name in ("productive", "idle"):
            lines.append(f"  {name:<18}{seconds:>10.2f}{100 * seconds / total:>7.1f}%")
        if name == "startup":
            lines += [f"    {phase:<16}{s:>10.2f}" for phase, s in rep["startup_phases"].items()]
    if rep.get("validation_async_s"):
        lines.append(f"  {'validation (async)':<18}{rep['validation_async_s']:>10.2f}  off the critical path, beside the steps")
    lines += ["", f"  {'fit':<10}{'status':<15}{'attempts':>9}{'wall':>10}{'goodput':>9}"]
    for fit in rep["fits"]:
        lines.append(f"  {fit['fit'][:8]:<10}{fit['status']:<15}{fit['attempts']:>9}{_s(fit['total_s']):>10}"
                     f"{100 * fit['goodput']:>8.1f}%")
    causes = ", ".join(f"{cause} {n}" for cause, n in sorted(rep["by_cause"].items())) or "none"
    lines += ["", f"  interruptions: {len(rep['interruptions'])} ({causes}); mean time to recover "
                  f"{_s(rep['mttr_s'])}, mean time between interruptions {_s(rep['mtbi_s'])}"]
    return "\n".join(lines)
