"""`raytrain-ddp sweep` end to end (issue #43), in one sweep run twice: Ctrl-C, then the same command.

The acceptance sweep, shrunk to fit the suite: 6 trials over `train.lr` (loguniform) and
the MLP's width on the quickstart's digits, ASHA, 1-worker trials, 2 at a time, 2
epochs each. One local Ray head (`cluster/local-head.sh`) serves the module: both sweep
commands and the retraining join it as `train` joins a running cluster, so Ray starts
once. The CLI is interrupted (SIGINT to its process alone, as a terminal's Ctrl-C) once
a trial has finished and another is past a checkpoint; the same command then runs the
sweep to its end. Checked: the interrupted command exits 130; no finished trial runs
again (its summary's fit is the same); the interrupted ones continue from their
checkpoints (a second fit resumed past step 0) and their metrics.jsonl holds no step
twice; the report ranks the trials by val_loss and names the stopped ones; the sweep
leaves 0 placement groups; best.yaml retrained with `train` gives the best trial's
val_loss bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from _two_node import two_node_env
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.driver.hold import held_live
from raytrain_ddp.rundir import Location, read_jsonl, read_metrics
from raytrain_ddp.sweep.report import named, read_trials
from _hooks import ENABLE, STEP_DELAY_ENV

pytestmark = pytest.mark.timeout(2400)

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "examples" / "configs" / "sweep.yaml"
CLI = Path(sys.executable).parent / "raytrain-ddp"
HEAD = REPO / "cluster" / "local-head.sh"
# A checkpoint every 2 steps: a trial is past its first one moments after its workers start.
SMALL = ["train.epochs=2", "run.log_every_steps=5", "run.checkpoint_every_steps=2", "sweep.max_concurrent_trials=2"]
HEAD_CPUS = "5"  # what the embedded instance of this sweep would hold: 2 trials, the trial processes, the data
# Every worker the head starts sleeps this long after each step (tests/_hooks.py), so an
# epoch outlasts the way of ASHA's stop to the workers: a stopped trial stops mid-fit.
STEP_DELAY_S = "0.1"


def _summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def head():
    """The module's Ray: a local head, stopped exactly (its own processes) at the end; the
    environment that joins it (RAY_ADDRESS, its token)."""
    up = subprocess.run([str(HEAD), "start"], env={**two_node_env(), **ENABLE, STEP_DELAY_ENV: STEP_DELAY_S,
                                                    "RT2N_HEAD_CPUS": HEAD_CPUS, "RT2N_UP_TIMEOUT_S": "420"},
                        capture_output=True, text=True, timeout=480)  # 245 s seen at CI's load
    said = [ln.split("state dir ", 1)[1].strip() for ln in up.stderr.splitlines() if "state dir " in ln]
    state = Path(up.stdout.strip().splitlines()[-1]) if up.returncode == 0 else Path(said[0]) if said else None
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield {**two_node_env(state), "PYTHONUNBUFFERED": "1"}
    finally:
        if state is not None:  # what `start` started, even when it gave up
            subprocess.run([str(HEAD), "stop", str(state)], env=two_node_env(), capture_output=True, timeout=120)


def _newest_epoch(run_dir: Path):
    """The epochs completed at the run's newest checkpoint (None: no checkpoint yet)."""
    found = ckpt.find_checkpoints(Location.parse(str(run_dir)))
    try:
        return int(ckpt.read_manifest(found[0]).get("epoch", 0)) if found else None
    except ckpt.CheckpointError:  # being written: looked at again at the next poll
        return None


def _newest_step(run_dir: Path) -> int:
    """The step of the run's newest valid checkpoint (0: none)."""
    for found in ckpt.find_checkpoints(Location.parse(str(run_dir))):
        try:
            return int(ckpt.read_manifest(found).get("step", 0))
        except ckpt.CheckpointError:  # cut short by the interrupt: the one before counts
            continue
    return 0


def _released(trials: Path, timeout_s: float) -> None:
    """Wait (bounded) until no fit of the interrupted command holds a trial's run directory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and trials.exists() and any(
            held_live(Location.parse(str(d))) for d in trials.iterdir() if d.is_dir()):
        time.sleep(0.5)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, head):
    tmp = tmp_path_factory.mktemp("sweep")
    env = head
    command = [str(CLI), "sweep", str(SWEEP), f"run.storage_path={tmp / 'runs'}", *SMALL]
    trials = tmp / "runs" / "sweep" / "trials"
    log = open(tmp / "first.log", "wb")
    proc = subprocess.Popen(command, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while proc.poll() is None and time.monotonic() < deadline:
            dirs = [d for d in trials.iterdir() if d.is_dir()] if trials.exists() else []
            done = [d for d in dirs if _summary(d).get("status") == "ok"]
            # still training (a live fit holds it, its workers started: not one ASHA stopped) ...
            training = [d for d in dirs if not _summary(d) and held_live(Location.parse(str(d)))
                        and (d / "attempts.jsonl").exists()]
            # ... past a checkpoint, none interrupted before its first (it could only start over),
            # one still in its first epoch (ASHA has not judged it: Tune still runs it, not a stop)
            newest = {d: _newest_epoch(d) for d in training}
            if done and newest and None not in newest.values() and 0 in newest.values():
                break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp / "first.log").read_text()[-4000:]
        os.kill(proc.pid, signal.SIGINT)
        first_rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait(timeout=30)
    _released(trials, 60)  # the joined cluster ends the interrupted job's trials as its driver goes
    before = {d.name: {**_summary(d), "_checkpoint_step": _newest_step(d)} for d in trials.iterdir() if d.is_dir()}
    second = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=1500,
                            start_new_session=True)
    yield tmp, first_rc, before, second, env


def test_interrupted_sweep_continues_keeping_finished_trials(swept):
    tmp, first_rc, before, second, _ = swept
    assert first_rc == 130, (tmp / "first.log").read_text()[-4000:]
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    trials = tmp / "runs" / "sweep" / "trials"
    finished_before = {name for name, s in before.items() if s.get("status") == "ok"}
    resumed = {}  # trial -> (the step its second fit resumed from, its newest checkpoint at the interrupt)
    for run_dir in (d for d in trials.iterdir() if d.is_dir()):
        if run_dir.name in finished_before:  # not run again: the same fit wrote its summary
            assert _summary(run_dir)["fit_id"] == before[run_dir.name]["fit_id"], run_dir.name
        fits = [r for r in read_jsonl(run_dir / "attempts.jsonl")]
        if len({r["fit_id"] for r in fits}) > 1:
            resumed[run_dir.name] = (max(int(r.get("resumed_step") or 0) for r in fits),
                                     before.get(run_dir.name, {}).get("_checkpoint_step", 0))
        keys = Counter((r["step"], "loss" in r) for r in read_metrics(run_dir / "metrics.jsonl"))
        assert not [k for k, n in keys.items() if n > 1], (run_dir.name, keys)
    # Each interrupted trial continued from its newest checkpoint (one Tune started as the
    # interrupt came has none, and starts over), and the fixture interrupted one past a checkpoint.
    assert resumed and all(step == newest for step, newest in resumed.values()), resumed
    assert any(step > 0 for step, _ in resumed.values()), resumed


def test_report_ranks_names_the_stopped_and_leaves_no_placement_group(swept):
    tmp, _, _, second, _ = swept
    where = tmp / "runs" / "sweep"
    outcome = json.loads((where / "sweep.json").read_text())
    assert outcome["status"] == "finished" and outcome["trials"] == 6, outcome
    assert outcome["placement_groups_left"] == 0, outcome
    rows = read_trials(Location.parse(str(where)), "val_loss", "min")
    assert len(rows) == 6
    best = [r["best"] for r in rows]
    assert best == sorted(best), best
    stopped = [named(r) for r in rows if r["status"] == "stopped early"]  # by their drawn values (#57)
    assert all(r["status"] in ("finished", "stopped early") for r in rows), [r["status"] for r in rows]
    assert f"{len(stopped)} stopped early ({'; '.join(stopped) or 'none'})" in second.stdout
    # our lines only (#57): no Tune box or TensorBoard hint, no trial's own lines, no stop notices
    assert not [line for line in second.stdout.splitlines() if line.startswith(("╭", "│", "View detailed", "To visualize",
                                                                                 "raytrain-ddp: status", "[rank "))]
    assert "raytrain-ddp: stopped" not in second.stderr
    report = subprocess.run([str(CLI), "sweep", "--report", str(where)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and rows[0]["trial"] in report.stdout.splitlines()[1], report.stdout
    assert (where / "curves.png").stat().st_size > 0


def test_best_config_retrains_to_the_best_trials_val_loss_bit_for_bit(swept):
    tmp, env = swept[0], swept[4]
    where = tmp / "runs" / "sweep"
    best_row = next(r for r in read_trials(Location.parse(str(where)), "val_loss", "min") if r["status"] == "finished")
    out = subprocess.run([str(CLI), "train", str(where / "best.yaml")], env=env, cwd=tmp, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    retrained = _summary(tmp / "runs" / "sweep-best")["final_metrics"]["val_loss"]
    assert retrained == best_row["final"], (retrained, best_row)
