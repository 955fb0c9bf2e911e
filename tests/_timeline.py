"""What the tests check of a fit's start-up timeline (`raytrain_ddp/timeline.py`): every
phase present once per start (a failed start's up to its process group), in order,
non-negative, and adding up to the start's measured time to its first step within 5 %;
summary.json's `startup` agreeing with timeline.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_ddp.rundir import TIMELINE_FILE, read_jsonl
from raytrain_ddp.timeline import ATTEMPT_PHASES, DRIVER_PHASES, FAILED_PHASES


def timeline_problems(run_dir: Path, summary: dict[str, Any], attempts: int = 1) -> list[str]:
    """What is wrong with this fit's timeline (empty: nothing)."""
    rows = [r for r in read_jsonl(Path(run_dir) / TIMELINE_FILE) if r.get("fit") == summary["fit_id"]]
    problems = []
    names = [r["phase"] for r in rows if r["attempt"] is None]
    if names != ["fit_start", *DRIVER_PHASES, "last_step", "fit_end"]:
        problems.append(f"driver phases {names}")
    start = next((r["t"] for r in rows if r["phase"] == "fit_start"), None)
    for number in range(1, attempts + 1):
        own = [r for r in rows if r["attempt"] == number]
        expected = ATTEMPT_PHASES[:FAILED_PHASES] if any(r.get("failed") for r in own) else ATTEMPT_PHASES
        if [r["phase"] for r in own] != list(expected):
            problems.append(f"attempt {number} phases {[r['phase'] for r in own]}")
            continue
        ts = [r["t"] for r in own]
        if ts != sorted(ts) or any(r["seconds"] < 0 for r in own):
            problems.append(f"attempt {number} out of order: {own}")
        begin = start if number == 1 else own[0]["t"] - own[0]["seconds"]
        phases = own + ([r for r in rows if r["phase"] in DRIVER_PHASES] if number == 1 else [])
        total, measured = sum(r["seconds"] for r in phases), own[-1]["t"] - begin
        if abs(total - measured) > 0.05 * measured:
            problems.append(f"attempt {number}: phases add up to {total:.3f}s, measured {measured:.3f}s")
    startup = summary.get("startup") or {}
    if len(startup.get("attempts", [])) < attempts or startup.get("shutdown_s") is None:
        problems.append(f"summary.json startup {startup}")
    elif abs(sum(startup["attempts"][0]["phases"].values()) - startup["attempts"][0]["to_first_step_s"]) > \
            0.05 * startup["attempts"][0]["to_first_step_s"]:
        problems.append(f"summary.json startup does not add up: {startup['attempts'][0]}")
    return problems
