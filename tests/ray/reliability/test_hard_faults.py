"""Real faults in real runs on the session's local Ray (issue #6, items 1, 2, 4, 6).

Faults are injected through the test-only `RAYTRAIN_DDP_FAULT` plan (`tests/_hooks.py`, loaded through the hooks interface):
`hang` makes one rank stop taking part in collectives (and write its pid, so this test
can SIGKILL it from outside), `raise` fails a rank, `nan` poisons one rank's loss. Each
run is a background thread joined with a deadline: a hang fails the test, never CI.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from _harness import BackgroundRun, tiny, train_lines, wait_for
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.rundir import read_metrics
from raytrain_ddp.rundir import read_jsonl
from _timeline import timeline_problems

pytestmark = pytest.mark.timeout(300)

FAULT = "RAYTRAIN_DDP_FAULT"
PORT_FAULT = "RAYTRAIN_DDP_PORT_FAULT"
RUN_TIMEOUT_S = 240  # generous: this 2-core machine runs other suites at the same time


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(ckpt.read_manifest(p)["step"]) for p in ckpt.find_checkpoints(run_dir)
                  if (p / ckpt.MANIFEST_FILE).exists())


def test_worker_sigkilled_mid_epoch_resumes_from_the_survivors_copy_and_loses_nothing(ray_cluster, tmp_path,
                                                                                      monkeypatch):
    pidfile = tmp_path / "rank1.pid"
    # rank 1 finishes step 12 (checkpoint at 10, epoch = 22 steps), then parks and reports its pid
    monkeypatch.setenv(FAULT, f"rank=1,step=12,attempt=1,mode=hang,pidfile={pidfile}")
    run = BackgroundRun(tiny(tmp_path, "sigkill", "train.epochs=1", "run.log_every_steps=1"))
    run_dir = tmp_path / "sigkill"

    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), RUN_TIMEOUT_S, "rank 1's pid", run=run))
    assert pid != os.getpid()
    # rank 0's lines reach the driver through Ray, the step-10 checkpoint storage through an
    # upload in the background: both within milliseconds; wait for them, boundedly
    wait_for(lambda: [r["step"] for r in train_lines(run_dir)][-1:] == [12] and _checkpoint_steps(run_dir) == [10],
             30, "rank 0's line for step 12 and the step-10 checkpoint")
    os.kill(pid, signal.SIGKILL)  # from outside, no warning, no cleanup

    summary = run.result(RUN_TIMEOUT_S)
    assert summary["status"] == "ok", summary.get("error")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert summary["attempts"] == 2 and summary["steps"] == 22  # the planned count, not more, not less
    assert json.loads((run_dir / "summary.json").read_text())["attempts"] == 2
    attempts = [r for r in read_jsonl(run_dir / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    assert [r["attempt"] for r in attempts] == [1, 2]
    assert timeline_problems(run_dir, summary, attempts=2) == []  # the restart's start-up too (issue #39)

    lines = train_lines(run_dir)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, 23)), steps  # each step once: no gap, no duplicate
    # rank 0, waiting for rank 1 in step 13's all-reduce, saw it fail and wrote step 12 (#15):
    # attempt 2 starts there, past the step-10 checkpoint, and redoes no completed step
    assert [r["attempt"] for r in lines] == [1] * 12 + [2] * 10
    assert [(r["resumed_from"], r["resumed_step"]) for r in attempts] == [("scratch", 0), ("replica", 12)]
    state = ckpt.load_checkpoint(summary["checkpoint"])
    assert (state["progress"]["step"], state["progress"]["epoch"], state["progress"]["steps_into_epoch"]) == (22, 1, 0)


def test_worker_that_always_fails_stops_after_max_failures_plus_one_attempts(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT, "rank=1,step=2,attempt=any,mode=raise")
    # run.recovery=checkpoint: every attempt restarts before step 2 (a survivor's copy of step 2
    # would let attempt 2 pass the fault, which this test is not about)
    cfg = tiny(tmp_path, "always", "train.epochs=1", "run.max_failures=1", "run.recovery=checkpoint")
    summary = BackgroundRun(cfg).result(RUN_TIMEOUT_S)
    assert summary["status"] == "failed"
    assert summary["attempts"] == cfg.run.max_failures + 1 == 2
    # the original exception, not a wrapper's description of it
    assert "RuntimeError" in summary["error"] or "injected fault" in summary["error"], summary["error"]
    assert "injected fault on rank 1 after step 2" in summary["error"], summary["error"]
    on_disk = json.loads((tmp_path / "always" / "summary.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == summary["error"]


def test_rank_that_stops_collectives_fails_the_run_within_the_configured_timeout(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT, "rank=1,step=3,attempt=any,mode=hang")
    cfg = tiny(tmp_path, "hang", "train.epochs=1", "parallel.collective_timeout_s=5", "run.max_failures=0")
    summary = BackgroundRun(cfg).result(RUN_TIMEOUT_S)  # the default timeout (300 s) would overrun this
    assert summary["status"] == "failed" and summary["attempts"] == 1
    error = summary["error"]
    assert "all-reduce of bucket" in error, error  # which operation
    assert "did not finish within 5s" in error, error  # the configured timeout fired
    assert "on rank 0 of 2" in error, error


def test_nonfinite_loss_on_one_rank_is_skipped_by_all_counted_and_weights_stay_finite(ray_cluster, tmp_path,
                                                                                      monkeypatch, capfd):
    monkeypatch.setenv(FAULT, "rank=1,step=3,mode=nan,attempt=any")
    # and the first start meets a port another program took right after Ray picked it (issue #56):
    # the group is started again with fresh ports, outside run.max_failures=0
    monkeypatch.setenv(PORT_FAULT, f"rank=0,mark={tmp_path / 'port-taken'}")
    summary = BackgroundRun(tiny(tmp_path, "nan", "train.epochs=1", "run.log_every_steps=1",
                                 "run.max_failures=0")).result(RUN_TIMEOUT_S)
    assert summary["status"] == "ok", summary.get("error")
    assert (tmp_path / "port-taken").exists()
    assert summary["steps"] == 22 and summary["attempts"] == 2  # the failed start, then one that trained
    attempts = [r for r in read_jsonl(tmp_path / "nan" / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    assert "EADDRINUSE" in attempts[0]["start_failed"] and attempts[1]["cause"].startswith("start: "), attempts
    restarts = summary["goodput"]["restarts"]
    assert [r["attempt"] for r in restarts] == [2] and "EADDRINUSE" in restarts[0]["cause"], summary["goodput"]
    assert restarts[0]["seconds"] > 0, restarts
    err = capfd.readouterr().err
    assert err.count("the workers' start failed: a port was taken by another program (EADDRINUSE); starting them "
                     "again with fresh ports (try 2 of 3)") == 1, err[-3000:]
    assert timeline_problems(tmp_path / "nan", summary, attempts=2) == []

    lines = train_lines(tmp_path / "nan")
    assert [r["step"] for r in lines] == list(range(1, 23))
    assert math.isnan(lines[2]["loss"])  # step 3: the poisoned mean loss, reported as is
    assert [r["nonfinite_steps"] for r in lines] == [0, 0] + [1] * 20
    assert all(math.isfinite(r["loss"]) for r in lines[3:])
    assert lines[-1]["loss"] < lines[0]["loss"]  # training went on after the skip
    state = ckpt.load_checkpoint(summary["checkpoint"])
    assert state["progress"]["nonfinite_steps"] == 1  # format 2: the count lives in the progress component
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    for slot in state["optimizer"]["state"].values():
        assert all(torch.isfinite(t).all() for t in slot.values() if torch.is_tensor(t))
    assert summary["final_metrics"]["nonfinite_steps"] == 1
    assert read_metrics(tmp_path / "nan")[-1]["val_loss"] == pytest.approx(summary["final_metrics"]["val_loss"])
