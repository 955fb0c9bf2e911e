"""A simulated spot reclaim end to end (the guard's policy: tests/local/elastic/test_preemption.py).

The poll returns a synthetic signal at step 4 (`RAYTRAIN_DDP_PREEMPT`), rank 1 is killed
after step 9 as the reclaimed node would be, and the run must continue from the just-in-time
checkpoint with every step trained once and the parameters of the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _elastic import ATOL, STEPS, elastic_cfg, max_difference, states_by_step
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.rundir import read_metrics
from _hooks import PREEMPT_ENV as SIMULATE_ENV
from raytrain_ddp.rundir import read_jsonl


@pytest.mark.timeout(480)
def test_simulated_preemption_checkpoints_and_the_run_continues_without_lost_steps(reference, tmp_path, monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "step=4,attempt=1,ranks=1,deadline_s=none")
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "rank=1,step=9,attempt=1,mode=exit")  # the node goes away
    cfg = elastic_cfg(tmp_path, "spot", "scaling.num_workers=[1, 2]", "run.checkpoint_every_steps=0",
                      "scaling.resize_interval_s=600")
    summary = run_training(cfg)
    assert summary["status"] == "ok", summary.get("error")
    assert summary["attempts"] == 2 and summary["steps"] == STEPS
    run_dir = Path(summary["run_dir"])
    sizes = [r["world_size"] for r in read_jsonl(run_dir / "attempts.jsonl")]
    assert sizes[0] == 2 and sizes[1] in (1, 2)  # elastic: the restart takes what is free

    states = states_by_step(run_dir)
    # no periodic checkpoints: step 4 is the just-in-time one, step 9 the survivor's copy (#15)
    assert sorted(states) == [4, 9, STEPS]
    assert states[4]["run"]["world_size"] == 2
    assert max_difference(states[STEPS]["model"], reference.states[STEPS]["model"]) < ATOL

    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # each step once
    assert [r["attempt"] for r in train] == [1] * 9 + [2] * (STEPS - 9)  # resumed from the survivor's step 9
