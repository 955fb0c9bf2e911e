"""The `recovery` section's kill runs: `run.recovery` replica and live side by side (issue #28).

Owns: one measurement, every mode from one invocation, interleaved run by run so a busy
machine loads them alike. Must not touch: the training loop, the recovery machinery
(`recovery/replica.py`, `recovery/live.py`), any run directory but the temporary ones it makes.

`kills` runs per mode of the quickstart (2 workers, `train.max_steps=40`, a durable
checkpoint every 10 steps, a metrics line every step), each through
`driver.fit.run_training` with its own embedded Ray; a watcher SIGKILLs rank 1's
`RayTrainWorker` from outside once step `KILL_AT` is logged (`kill._kill_a_worker`).
`checkpoint` (the steps since the last durable checkpoint redone) is the comparison, in
the first `COMPARE_KILLS` rounds only. Per run:
- `kill_to_next_step_s`: the kill to the `time` of the first train line made after it;
- `steps_redone`: train lines made after the kill for a step at or below the last step
  logged before it (the watcher's view, so lines the driver later drops still count);
- `survivors_kept`: every rank but the killed one has the same pid after the recovery as
  before the kill (Ray's state API, read again once the next step is logged);
- `bytes_to_newcomers`: live, the tensor bytes of the state one survivor sends the
  replacement over the group (the state as its checkpoint holds it); replica and
  checkpoint, the `state.pt` every restarted worker reads from storage (the survivor's own
  copy is pruned by the run's end, so the final checkpoint's size stands for it);
- restart modes: `resumed_from` / `resumed_step` and `kill_to_restart_s` from
  attempts.jsonl, `kill_to_copy_s` (a survivor's copy complete, seen from outside);
- live: `newcomer`, where the replacement's seconds went (`newcomer_timeline`).
`no_failure`: `rounds` pairs of uninterrupted runs of `STEADY_STEPS` (replica, live; the
order alternates); the step time is the median gap between consecutive train lines (epoch
ends, the steps after a checkpoint and the first `STEADY_WARMUP` left out: a 40-step run
timed mostly its start-up); `live_overhead_pct` is the median over the pairs of
live's step time over replica's, so each ratio compares runs that shared the machine's load.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import stats
from raytrain_ddp.ray_compat import WORKER_NICENESS_ENV
from benchmarks.kill import _BUNDLE, QUICKSTART, _kill_a_worker

MODES = ("replica", "live")
COMPARE = "checkpoint"  # the mode without a survivor's copy, for comparison
COMPARE_KILLS = 2
KILL_AT, MAX_STEPS, CHECKPOINT_EVERY, RUN_TIMEOUT_S = 14, 40, 10, 300.0
STEADY_STEPS, STEADY_WARMUP = 200, 20  # the no-failure runs: steps timed after the warm-up (start-up transients)
KILLS, ROUNDS = 5, 3  # the full preset: the median of 5 kills per mode, 3 pairs for the step time
TARGETS = {"kill_to_next_step_s": 5.0, "steps_redone": 0, "live_overhead_pct": 2.0}
_SURVIVOR = re.compile(r"_r(\d+)$")


def workers_by_rank() -> dict[int, int]:
    """rank -> pid of every live RayTrainWorker (the bundle index is the rank on one node)."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                         filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    out = {}
    for actor in actors:
        bundles = [int(m.group(1)) for key in (getattr(actor, "required_resources", None) or {})
                   if (m := _BUNDLE.search(key))]
        if bundles and int(getattr(actor, "pid", 0) or 0) > 0:
            out[bundles[0]] = int(actor.pid)
    return out


class _Watcher(threading.Thread):
    """Kills rank 1 once step `kill_at` is logged; follows the run until the recovered group
    trains (`first_recovered`), noting the pids before the kill and then, and the last step
    the first attempt completed (lines the driver later drops are seen here only)."""

    def __init__(self, run_dir: Path, kill_at: int, console: "_Console", mode: str) -> None:
        super().__init__(name="live-recovery-watcher", daemon=True)
        self.run_dir, self.kill_at, self.console, self.stop = run_dir, kill_at, console, threading.Event()
        self.mode = mode
        self.killed: dict[str, Any] = {}
        self.before: dict[int, int] = {}
        self.after: dict[int, int] = {}
        self.last_done = 0  # the newest step of attempt 1's lines seen, including one that finished as the kill landed
        self.copy_at: Optional[float] = None  # when a survivor's copy had its manifest (written last)
        self.error: Optional[str] = None

    def _steps(self) -> list[dict[str, Any]]:
        from raytrain_ddp.rundir import read_metrics

        return [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "loss" in r]

    def run(self) -> None:
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not self.stop.is_set() and time.monotonic() < deadline:
                lines = self._steps()
                if lines and max(r["step"] for r in lines) >= self.kill_at:
                    self.last_done = max(r["step"] for r in lines)
                    break
                self.stop.wait(0.02)
            self.before = workers_by_rank()
            self.killed = _kill_a_worker()
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.copy_at is None and any(self.run_dir.glob("checkpoint_*_r[0-9]*/manifest.json")):
                    self.copy_at = time.time()
                lines = self._steps()
                if self.mode != "live":  # attempt 1's last step: the driver drops it once a new group resumes before it
                    self.last_done = max([self.last_done] + [r["step"] for r in lines if r.get("attempt", 1) == 1])
                if first_recovered(lines, self.console.newcomer) is not None:
                    self.after = workers_by_rank()
                    return
                self.stop.wait(0.02)
        except Exception as exc:  # noqa: BLE001 - reported by the section
            self.error = f"{type(exc).__name__}: {exc}"


_JOINED = re.compile(r"live: replacement rank \d+ continues at step (\d+)")


def first_recovered(lines: list[dict[str, Any]], newcomer: list[str]) -> Optional[dict[str, Any]]:
    """The first train line of a step trained after the recovery: a restarted group's first
    line (attempt > 1), or in live mode the line of the step after the one the replacement
    joined at (a line made after the kill can be of a step both workers finished just before
    it landed). None until there is one."""
    restarted = [r for r in lines if r.get("attempt", 1) > 1]
    if restarted:
        return restarted[0]
    joined = next((int(m.group(1)) for ln in newcomer if (m := _JOINED.search(ln))), None)
    return None if joined is None else next((r for r in lines if r["step"] == joined + 1), None)


def _cfg(mode: str, storage: Path, name: str, steps: int = MAX_STEPS) -> Any:
    from raytrain_ddp.config import load_config

    return load_config(QUICKSTART, [
        f"run.storage_path={storage}", f"name={name}", f"run.recovery={mode}", "run.log_every_steps=1",
        f"run.checkpoint_every_steps={CHECKPOINT_EVERY}", f"train.max_steps={steps}", "run.max_failures=1",
        "run.dashboard=true"])  # the kill finds rank 1's worker through the state API (kill.py)


class _Console:
    """The run's console lines go to stderr (progress, not the report); the newcomer's own
    account of its seconds (`recovery/live.py`) is kept for the timeline."""

    def __init__(self) -> None:
        self.newcomer: list[str] = []

    def write(self, text: str) -> int:
        self.newcomer += [ln for ln in text.splitlines() if "live: replacement rank" in ln]
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ...: stderr's
        return getattr(sys.stderr, name)


_NEWCOMER = re.compile(r"training function started at (\d+):(\d+):([\d.]+), then torchft and its manager took "
                       r"([\d.]+)s, the quorum and the state ([\d.]+)s, data, model and loading ([\d.]+)s")


def newcomer_timeline(killed_at: float, lines: list[str], next_step_s: float) -> dict[str, Any]:
    """Where the seconds from the kill to the next step went, from the replacement's own line
    (`recovery/live.py`), each point in s from the kill: `function_s` (Ray's part: noticing the
    loss, a new process, its imports of Ray Train and torch, the train context), `group_s`
    (torchft imported, its manager up), `state_s` (quorum, the survivors' state received),
    `loaded_s` (data, model, optimizer, state loaded), then `first_step_s` to the next step's line."""
    match = next((m for ln in lines if (m := _NEWCOMER.search(ln))), None)
    if match is None:
        return {}
    h, mi, sec, group, state, setup = match.groups()
    day = time.localtime(killed_at)  # the line's clock is local time, within a second or so of the kill
    entered = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, int(h), int(mi), 0, 0, 0, -1)) + float(sec)
    if entered - killed_at < -43200:  # the kill before midnight, the line after it
        entered += 86400
    out = {"function_s": entered - killed_at}
    out["group_s"] = out["function_s"] + float(group)
    out["state_s"] = out["group_s"] + float(state)
    out["loaded_s"] = out["state_s"] + float(setup)
    out["first_step_s"] = next_step_s - out["loaded_s"]
    return out


def _train(cfg: Any, console: Optional[_Console] = None) -> dict[str, Any]:
    from raytrain_ddp.driver.fit import run_training

    with contextlib.redirect_stdout(console or _Console()):  # type: ignore[type-var]
        try:
            summary = run_training(cfg)
        except Exception as exc:  # noqa: BLE001 - Ray's own start can fail on a loaded machine: once more
            print(f"    {cfg.name}: {type(exc).__name__}: {exc}; starting the run again", file=sys.stderr, flush=True)
            time.sleep(5)
            summary = run_training(cfg.model_copy(update={"name": cfg.name + "-again"}))
    if summary.get("status") != "ok":
        raise RuntimeError(f"{cfg.name}: the run ended {summary.get('status')}: {summary.get('error')}")
    return summary


def kill_run(mode: str, storage: Path, log=print) -> dict[str, Any]:
    """One quickstart run in `mode` with rank 1 SIGKILLed after step `KILL_AT`."""
    from raytrain_ddp import checkpoint as ckpt
    from raytrain_ddp.rundir import read_jsonl, read_metrics
    from raytrain_ddp.recovery.live import tensor_bytes

    cfg = _cfg(mode, storage, f"kill-{mode}")
    console = _Console()
    watcher = _Watcher(storage / cfg.name, KILL_AT, console, mode)
    watcher.start()
    try:
        summary = _train(cfg, console)
    finally:
        watcher.stop.set()
        watcher.join(timeout=10)
    if watcher.error or not watcher.killed:
        raise RuntimeError(f"{mode}: {watcher.error or 'no worker was killed'}")
    killed_at, killed_rank = watcher.killed["time"], watcher.killed["rank"]
    run_dir = Path(summary["run_dir"])
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    last_done = max([watcher.last_done] + [r["step"] for r in lines if r["time"] < killed_at])
    recovered = first_recovered(lines, console.newcomer)
    if recovered is None:
        raise RuntimeError(f"{mode}: no step was trained after the recovery")
    if mode == "live":  # every step the group completed before the kill landed is in the state the replacement got
        last_done = max(last_done, recovered["step"] - 1)
    after = lines[lines.index(recovered):]
    attempts = [a for a in read_jsonl(run_dir / "attempts.jsonl") if a.get("fit_id") == summary["fit_id"]]
    restart = attempts[-1] if len(attempts) > 1 else {}
    final = ckpt.load_checkpoint(summary["checkpoint"])
    row = {
        "mode": mode, "killed_rank": killed_rank, "last_step_before_kill": last_done,
        "kill_to_next_step_s": recovered["time"] - killed_at,
        "steps_redone": sum(1 for r in after if r["step"] <= last_done),
        "survivors_kept": bool(watcher.after) and all(watcher.after.get(r) == p for r, p in watcher.before.items()
                                                      if r != killed_rank),
        "pids_before": watcher.before, "pids_after": watcher.after, "attempts": summary["attempts"],
        "bytes_to_newcomers": (tensor_bytes({k: v for k, v in final.items() if k != "run"}) if mode == "live" else
                               cfg.scaling.num_workers * _size(Path(str(summary["checkpoint"])) / "state.pt")),
        "resumed_from": restart.get("resumed_from", "live" if mode == "live" else None),
        "resumed_step": restart.get("resumed_step"),
        "kill_to_restart_s": float(restart["time"]) - killed_at if "time" in restart else None,
        "kill_to_copy_s": watcher.copy_at - killed_at if watcher.copy_at else None,
        "load_avg": list(os.getloadavg()),
    }
    copy = _SURVIVOR.search(str(restart.get("checkpoint") or ""))  # a survivor's copy: ..._r<rank>
    row["survivor_rank"] = int(copy.group(1)) if copy and row["resumed_from"] == "replica" else None
    if mode == "live":
        row["newcomer"] = newcomer_timeline(killed_at, console.newcomer, row["kill_to_next_step_s"])
        log(f"    live: the newcomer's seconds from the kill: {_fmt_timeline(row['newcomer'])}")
    log(f"    {mode}: killed rank {killed_rank} after step {last_done}; next trained step "
        f"{row['kill_to_next_step_s']:.1f} s after the kill (load {row['load_avg'][0]:.1f}), "
        f"{row['steps_redone']} step(s) redone, survivors kept their processes: {row['survivors_kept']}, "
        f"{row['bytes_to_newcomers']:,} bytes to the new worker(s)")
    return row


def _fmt_timeline(t: dict[str, Any]) -> str:
    names = (("function_s", "training function"), ("group_s", "torchft up"), ("state_s", "state received"),
             ("loaded_s", "loaded"))
    return ", ".join(f"{label} {t[k]:+.2f}" for k, label in names if t.get(k) is not None) + (
        f", then the first step {t['first_step_s']:.2f}" if t.get("first_step_s") is not None else "")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def step_time_run(mode: str, storage: Path) -> float:
    """Median seconds between consecutive train lines of an uninterrupted run of `STEADY_STEPS`
    (epoch ends, the steps after a checkpoint and the first `STEADY_WARMUP` left out)."""
    from raytrain_ddp.rundir import read_metrics

    summary = _train(_cfg(mode, storage, f"steady-{mode}", STEADY_STEPS))
    lines = [r for r in read_metrics(Path(summary["run_dir"]) / "metrics.jsonl")
             if "loss" in r and r["step"] > STEADY_WARMUP]
    gaps = [b["time"] - a["time"] for a, b in zip(lines, lines[1:])  # `epoch` counts fractions: whole epochs compared
            if b["step"] == a["step"] + 1 and math.floor(a["epoch"]) == math.floor(b["epoch"])
            and b["step"] % CHECKPOINT_EVERY != 1]
    if not gaps:
        raise RuntimeError(f"{mode}: no two consecutive train lines to time")
    return statistics.median(gaps)


def side_by_side(kills: int = KILLS, rounds: int = ROUNDS, compare: int = 0, log=print,
                 only: Optional[str] = None) -> dict[str, Any]:
    """Every mode from one invocation, interleaved (the order turns each round); each run
    starts its own Ray. `compare`: rounds that also kill a `checkpoint` run. `only`: one
    mode's kill runs (a look at one mode; no step-time pairs)."""
    saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", WORKER_NICENESS_ENV) if k in os.environ}
    modes = (only,) if only else MODES + ((COMPARE,) if compare else ())
    rounds = 0 if only else rounds
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    steps: dict[str, list[float]] = {m: [] for m in MODES if m in modes}
    failures: dict[str, list[str]] = {m: [] for m in modes}
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-bench-live-") as tmp:
            for i in range(kills):
                order = [m for m in modes if m != COMPARE or i < compare]
                for mode in order[i % len(order):] + order[:i % len(order)]:
                    try:
                        runs[mode].append(kill_run(mode, Path(tmp) / f"kill{i}", log=log))
                    except Exception as exc:  # noqa: BLE001 - a failed recovery is a result: kept, counted
                        failures[mode].append(f"{type(exc).__name__}: {str(exc)[:300]}")
                        log(f"    {mode}: FAILED: {failures[mode][-1]}")
            for i in range(rounds):
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    steps[mode].append(step_time_run(mode, Path(tmp) / f"steady{i}"))
                    log(f"    {mode}: no failure, median step {1e3 * steps[mode][-1]:.1f} ms "
                        f"(load {os.getloadavg()[0]:.1f})")
    finally:
        os.environ.update(saved)
    out: dict[str, Any] = {"kill_at": KILL_AT, "max_steps": MAX_STEPS, "checkpoint_every_steps": CHECKPOINT_EVERY,
                           "steady_steps": STEADY_STEPS, "steady_warmup": STEADY_WARMUP,
                           "world_size": 2, "config": "examples/configs/quickstart.yaml", "killed": "rank 1",
                           "modes": list(modes), "targets": dict(TARGETS)}
    for mode in modes:
        rows = runs[mode] or [{"kill_to_next_step_s": float("nan"), "steps_redone": -1, "survivors_kept": False,
                               "bytes_to_newcomers": 0}]
        out[mode] = {"runs": runs[mode], "failures": failures[mode],
                     "kill_to_next_step_s": stats([r["kill_to_next_step_s"] for r in rows]),
                     "steps_redone_max": max(r["steps_redone"] for r in rows),
                     "survivors_kept_all": all(r["survivors_kept"] for r in rows),
                     "bytes_to_newcomers": statistics.median(r["bytes_to_newcomers"] for r in rows)}
        if mode in steps and steps[mode]:
            out[mode].update(step_time_s=steps[mode], step_time_median_s=statistics.median(steps[mode]))
    if rounds:
        ratios = [live / rep for rep, live in zip(steps["replica"], steps["live"])]
        out["live_over_replica_step_time"] = ratios
        out["live_overhead_pct"] = 100 * (statistics.median(ratios) - 1)
    return out


def table(result: dict[str, Any]) -> list[str]:
    """The side by side as markdown rows (report.py prints them): one column per mode."""
    modes = result.get("modes", list(MODES))
    by = [result[m] for m in modes]

    def spread(m: dict[str, Any]) -> str:
        k = m["kill_to_next_step_s"]
        return f"{k['min']:.1f} / {k['max']:.1f}"

    def step_ms(m: dict[str, Any]) -> str:
        return f"{1e3 * m['step_time_median_s']:.2f}" if "step_time_median_s" in m else "-"

    rows = [("kill -> next trained step, median of runs (s)",
             [f"{m['kill_to_next_step_s']['median']:.1f}" for m in by]),
            ("... min / max (s)", [spread(m) for m in by]),
            ("runs (failed)", [f"{len(m['runs'])} ({len(m['failures'])})" for m in by]),
            ("completed steps redone (max)", [str(m["steps_redone_max"]) for m in by]),
            ("survivors' pids unchanged (all runs)", [str(m["survivors_kept_all"]) for m in by]),
            ("bytes to the new worker(s)", [f"{m['bytes_to_newcomers']:,.0f}" for m in by]),
            ("step time, no failure (median ms)", [step_ms(m) for m in by])]
    out = ["| | " + " | ".join(f"run.recovery={m}" for m in modes) + " |", "|---|" + "---|" * len(modes)]
    out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    if "live_overhead_pct" in result:
        ratios = ", ".join(f"{r:.3f}" for r in result["live_over_replica_step_time"])
        out.append(f"| live's step time over replica's (median of {len(result['live_over_replica_step_time'])} "
                   f"pairs: {ratios}) | | {result['live_overhead_pct']:+.1f} % |" + " |" * (len(modes) - 2))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m benchmarks.live_recovery [--kills N] [--rounds N] [--compare N] [--only MODE]
    [--out FILE]`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_recovery")
    parser.add_argument("--kills", type=int, default=KILLS)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="pairs of uninterrupted runs for the step time")
    parser.add_argument("--compare", type=int, default=0, help="rounds that also kill a run.recovery=checkpoint run")
    parser.add_argument("--only", choices=MODES + (COMPARE,), default=None, help="one mode's kill runs alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = side_by_side(args.kills, args.rounds, args.compare, only=args.only,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(table(result)))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
