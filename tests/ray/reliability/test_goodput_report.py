"""The goodput report on a run whose faults the test injects and times (issue #40): one fit sequence.

Fit 1 (`raytrain-ddp train`, a process of its own) trains with a known per-step delay
(`RAYTRAIN_DDP_STEP_DELAY_S`), loses rank 1 after step 8 (`RAYTRAIN_DDP_FAULT`, exit) and,
with `run.recovery=checkpoint`, resumes from the checkpoint of step 5: steps 6-8 are
redone. Once attempt 2 is past step 14 the test sends Ctrl-C. After a pause the test
times, fit 2 resumes with `run.checkpoint_every_steps=auto` and trains to its end. Every
rank logs when each step ended (`RAYTRAIN_DDP_SAMPLE_LOG`): the ground truth of the
redone and kept steps' times. Then the report must add up to the wall time, match the
injected redone work and pause, name both interruptions, read the same from `s3://`, and
fit 2's auto cadence must be Young's interval of what the run had measured before it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp.goodput import report
from raytrain_ddp.rundir import Location, read_jsonl, read_metrics
from _hooks import ENABLE, FAULT_ENV, SAMPLE_LOG_ENV, STEP_DELAY_ENV

pytestmark = pytest.mark.timeout(1500)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"
CLI = Path(sys.executable).parent / "raytrain-ddp"
DELAY_S, KILL_AT, SAVE_EVERY, STOP_AFTER, PAUSE_S, MORE_STEPS = 0.1, 8, 5, 14, 3.0, 12


def _train(tmp: Path, env: dict, *overrides: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp / f"train-{len(list(tmp.glob('train-*.log')))}.log", "wb")
    args = [str(CLI), "train", str(TINY), f"run.storage_path={tmp / 'runs'}", "name=gp", "run.log_every_steps=1",
            "run.recovery=checkpoint", "run.max_failures=1", *overrides]
    proc = subprocess.Popen(args, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, log


def _wait(proc: subprocess.Popen, hold: Path, timeout_s: float) -> float:
    """Wait for the process to end; returns when the fit let go of the run (hold.json deleted:
    from then on no fit holds it -- what the process does after that, exiting, is idle time)."""
    deadline, released, held = time.monotonic() + timeout_s, None, False
    while proc.poll() is None and time.monotonic() < deadline:
        there = hold.exists()
        held = held or there
        if released is None and held and not there:
            released = time.time()
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
        proc.wait(timeout=30)
        raise AssertionError(f"raytrain-ddp train still running after {timeout_s}s")
    return released if released is not None else time.time()


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("goodput")
    run_dir, samples = tmp / "runs" / "gp", tmp / "samples"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    base.update(ENABLE, PYTHONUNBUFFERED="1", **{STEP_DELAY_ENV: str(DELAY_S), SAMPLE_LOG_ENV: str(samples)})
    first = {**base, FAULT_ENV: f"rank=1,step={KILL_AT},attempt=1,mode=exit"}
    started = time.time()
    proc, log = _train(tmp, first, "train.epochs=100", f"run.checkpoint_every_steps={SAVE_EVERY}")
    try:
        deadline = time.monotonic() + 600  # past it (a very busy machine): Ctrl-C where it is
        while proc.poll() is None and time.monotonic() < deadline:
            lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and r.get("attempt") == 2]
            if lines and lines[-1]["step"] >= STOP_AFTER:
                break
            time.sleep(0.3)
        assert proc.poll() is None, (tmp / "train-0.log").read_text()[-4000:]
        os.kill(proc.pid, signal.SIGINT)
        ended = _wait(proc, run_dir / "hold.json", 180)
        assert proc.returncode == 130, (tmp / "train-0.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
    stopped = json.loads((run_dir / "summary.json").read_text())["steps"]
    before = report(run_dir)  # what fit 2's auto cadence may know
    time.sleep(PAUSE_S)
    for _ in range(2):  # a machine so busy that the local Ray did not start: once more (it leaves no record)
        resumed = time.time()
        proc, log = _train(tmp, base, f"train.max_steps={stopped + MORE_STEPS}", "run.checkpoint_every_steps=auto",
                           "run.expected_mtbf_s=5")
        try:
            finished = _wait(proc, run_dir / "hold.json", 400)
        finally:
            log.close()
        out = sorted(tmp.glob("train-*.log"))[-1].read_text()
        if not (proc.returncode == 2 and "the local Ray instance did not start" in out):
            break
    assert proc.returncode == 0, out[-4000:]
    yield {"run_dir": run_dir, "samples": samples, "started": started, "ended": ended, "resumed": resumed,
           "finished": finished, "stopped": stopped, "before": before, "out": out, "tmp": tmp}


def _rank0_steps(samples: Path) -> list[dict]:
    """Rank 0's step log, in time order: one line per step it finished (each attempt, each fit)."""
    rows = [{**r, "process": path.name} for path in samples.glob("samples-rank0-*.jsonl") for r in read_jsonl(path)]
    return sorted(rows, key=lambda r: r["time"])


def test_buckets_add_up_to_the_wall_time_and_productive_is_the_kept_steps(faulted):
    rep = report(faulted["run_dir"])
    wall = faulted["finished"] - faulted["started"]  # the first process's start -> the last one's release
    assert sum(rep["buckets"].values()) == pytest.approx(rep["wall_s"], rel=1e-6)
    assert rep["wall_s"] == pytest.approx(wall, rel=0.01), (rep["wall_s"], wall)
    assert rep["buckets"]["other"] <= 0.01 * rep["wall_s"], rep["buckets"]
    lines = [r for r in read_metrics(faulted["run_dir"] / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, faulted["stopped"] + MORE_STEPS + 1))  # each step once, kept
    b = rep["buckets"]
    kept = sum(r["steps_s"] for r in lines)
    assert b["productive"] + b["data_wait"] + b["exposed_comm"] == pytest.approx(kept, rel=0.01)
    # the kept steps' times from rank 0's own step log: between consecutive steps of one
    # worker group, less the saves and validations between them (the first step of each
    # group starts at its restore, which the log does not show: its line's time is used)
    steps, by_step = _rank0_steps(faulted["samples"]), {r["step"]: r for r in lines}
    val = {r["step"]: r["validation_s"] for r in read_metrics(faulted["run_dir"] / "metrics.jsonl") if "val_loss" in r}
    kept_runs = [(a, b2) for a, b2 in zip(steps, steps[1:]) if b2["step"] == a["step"] + 1
                 and a["process"] == b2["process"] and _last_run_of(steps, b2) is b2]
    measured = sum(b2["time"] - a["time"] - by_step[b2["step"]]["checkpoint_blocked_s"] - val.get(a["step"], 0.0)
                   for a, b2 in kept_runs)
    firsts = sum(by_step[s]["steps_s"] for s in by_step if s not in {b2["step"] for _, b2 in kept_runs})
    assert measured + firsts == pytest.approx(kept, rel=0.01)
    assert b["productive"] > len(lines) * DELAY_S


def _last_run_of(steps: list[dict], row: dict) -> dict:
    """The last time rank 0 finished this step: the one that was kept."""
    return [r for r in steps if r["step"] == row["step"]][-1]


def test_redone_and_idle_are_the_injected_ones(faulted):
    rep = report(faulted["run_dir"])
    steps = _rank0_steps(faulted["samples"])
    first_attempt = {r["step"]: r["time"] for r in steps  # fit 1's first worker group
                     if r["attempt"] == 1 and r["step"] <= KILL_AT and r["time"] < faulted["ended"]}
    redone = first_attempt[KILL_AT] - first_attempt[SAVE_EVERY]  # steps 6-8, thrown away by the resume at 5
    assert rep["buckets"]["redone"] == pytest.approx(redone, abs=0.5)
    assert rep["buckets"]["redone"] >= (KILL_AT - SAVE_EVERY) * DELAY_S
    # the pause the test made: from fit 1 letting go of the run to fit 2's start
    assert rep["buckets"]["idle"] == pytest.approx(faulted["resumed"] - faulted["ended"], abs=0.5)
    assert rep["buckets"]["idle"] >= PAUSE_S - 0.5


def test_every_interruption_is_named(faulted):
    rep = report(faulted["run_dir"])
    assert [(e["cause"], e["attempt"]) for e in rep["interruptions"]] == [("worker lost", 2), ("Ctrl-C", None)]
    assert [f["status"] for f in rep["fits"]] == ["interrupted", "ok"] and rep["by_cause"] == {"worker lost": 1,
                                                                                               "Ctrl-C": 1}
    worker = rep["interruptions"][0]
    assert worker["redone_s"] == pytest.approx(rep["buckets"]["redone"]) and worker["recovery_s"] > 0
    assert rep["mttr_s"] > 0 and rep["mtbi_s"] == pytest.approx((rep["wall_s"] - rep["buckets"]["idle"]) / 2)
    assert sum(rep["startup_phases"].values()) == pytest.approx(rep["buckets"]["startup"], rel=1e-6)
    assert rep["startup_phases"]["ray"] > 0  # from the timeline (timeline.jsonl)
    # the summary line ends with the fit's goodput and the run's
    assert re.search(r"raytrain-ddp: status ok \|.*\| goodput \d+% \(run \d+%\)\n", faulted["out"]), faulted["out"][-2000:]


def test_auto_cadence_is_youngs_interval_of_what_the_run_measured(faulted):
    before = faulted["before"]
    match = re.search(r"run\.checkpoint_every_steps auto: every (\d+) steps = sqrt\(2 x MTBF ([\d.]+)s \(observed\)",
                      faulted["out"])
    assert match, faulted["out"][-3000:]
    chosen, mtbf = int(match.group(1)), float(match.group(2))
    # fit 1's observed MTBI (not run.expected_mtbf_s), with fit 2's start-up so far held too
    assert before["mtbi_s"] - 0.1 <= mtbf <= before["mtbi_s"] + (faulted["finished"] - faulted["resumed"]) / 2
    young = math.sqrt(2 * mtbf * before["save_stall_s"]) / before["step_s"]  # stall and step time: fit 1's
    assert abs(chosen - young) <= 1, (chosen, young, before["save_stall_s"], before["step_s"])


def test_a_run_in_object_storage_gives_the_same_report(faulted):
    from _moto import s3_bucket

    local = Location.parse(faulted["run_dir"])
    with s3_bucket(faulted["tmp"], "goodput") as _:
        remote = Location.parse("s3://goodput/runs/gp")
        for child, info in local.children():
            if child.name.endswith((".jsonl", ".json")):
                (remote / child.name).write_bytes(child.read_bytes())
        from_s3, from_disk = report("s3://goodput/runs/gp"), report(local)
    assert from_s3["run_dir"] == "s3://goodput/runs/gp"
    assert {**from_s3, "run_dir": None} == {**from_disk, "run_dir": None}
