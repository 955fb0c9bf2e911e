"""Same config, any worker count, same optimisation: 1, 2 and 4 workers end on the same
parameters, and so does a run that restarts on a different worker count mid-epoch.

Why this holds (and what these tests pin down): the global batch is fixed and the
accumulation steps are re-derived from the actual worker count at every start; exact
sharding gives step s the same 64 samples at any size; the loss scale makes every step
the mean over those 64; the checkpoint carries the optimizer state, schedule position,
step and position in the epoch. Only the floating-point summation order differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _elastic import ATOL, STEPS, elastic_cfg, max_difference, optimizer_difference, states_by_step
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.rundir import read_metrics

pytestmark = pytest.mark.timeout(480)


def _assert_same_state(state: dict, ref: dict) -> None:
    assert state["progress"] == ref["progress"]
    assert state["schedule"] == ref["schedule"]
    assert max_difference(state["model"], ref["model"]) < ATOL
    assert optimizer_difference(state["optimizer"], ref["optimizer"]) < ATOL


def test_four_workers_follow_the_one_worker_trajectory(reference, tmp_path):
    summary = run_training(elastic_cfg(tmp_path, "four", "scaling.num_workers=4"))
    assert summary["status"] == "ok", summary.get("error")
    assert summary["workers"] == 4 and summary["steps"] == STEPS
    states = states_by_step(Path(summary["run_dir"]))
    assert sorted(states) == sorted(reference.states) == [6, STEPS]
    for step in (6, STEPS):
        assert states[step]["run"]["world_size"] == 4 and reference.states[step]["run"]["world_size"] == 1
        _assert_same_state(states[step], reference.states[step])
    # the parameters did move: equality is not the trivial kind
    first = reference.states[6]["model"]
    assert max_difference(reference.states[STEPS]["model"], first) > 100 * ATOL


def test_two_workers_then_one_after_a_restart_follow_the_same_trajectory(reference, tmp_path, monkeypatch):
    # 2 workers: fail for good after step 8 (no restarts), so the latest checkpoint is step 6
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "rank=1,step=8,attempt=1,mode=raise")
    # run.recovery=checkpoint: the subject is a resize from a durable checkpoint, not a survivor's copy
    first = run_training(elastic_cfg(tmp_path, "resize", "scaling.num_workers=2", "run.max_failures=0",
                                     "run.recovery=checkpoint"))
    assert first["status"] == "failed" and "injected fault" in first["error"]
    at_six = states_by_step(Path(first["run_dir"]))
    assert sorted(at_six) == [6] and at_six[6]["run"]["world_size"] == 2
    _assert_same_state(at_six[6], reference.states[6])

    # the same run on 1 worker: accumulation 2 -> 4, resumes 6 steps into the epoch
    monkeypatch.delenv("RAYTRAIN_DDP_FAULT")
    second = run_training(elastic_cfg(tmp_path, "resize", "scaling.num_workers=1", "run.resume=latest"))
    assert second["status"] == "ok", second.get("error")
    assert second["resumed_from"] == first["checkpoint"]
    assert second["workers"] == 1 and second["steps"] == STEPS and second["attempts"] == 1
    final = states_by_step(Path(second["run_dir"]))[STEPS]
    assert final["run"]["world_size"] == 1
    _assert_same_state(final, reference.states[STEPS])
    # one history: steps 7 and 8 of the failed fit were truncated and redone, none twice
    train = [r for r in read_metrics(Path(second["run_dir"]) / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
