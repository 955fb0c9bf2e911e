"""The goodput report's arithmetic on synthetic run directories whose every second is known.

A run of three fits is written as the driver and rank 0 write it (timeline.jsonl,
config-history.jsonl, attempts.jsonl, metrics.jsonl): fit 1 loses a worker at step 8
(resumed from the checkpoint of step 5: steps 6-8 redone), then is stopped by Ctrl-C at
step 12; 10 s later fit 2 resumes and its driver is killed after step 16 (checkpoint at
15); fit 3 resumes from step 15 and finishes at step 20. Every bucket is checked against
the numbers the fixture put in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raytrain_ddp import goodput
from raytrain_ddp.goodput import format_table, report, young_interval_steps
from raytrain_ddp.rundir import JsonlFile, Location

pytestmark = pytest.mark.timeout(60)

STEP = 1.0  # seconds per step
WAIT = 0.1  # data wait fraction
STALL = 0.2  # seconds per save


class RunWriter:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics: list[dict] = []
        self.attempts: list[dict] = []
        self.timeline: list[dict] = []
        self.history: list[dict] = []

    def fit(self, fit: str, t: float, phases: dict[str, float]) -> float:
        self.history.append({"fit_id": fit, "time": t + 1.0})
        self.timeline.append({"fit": fit, "attempt": None, "phase": "fit_start", "t": t, "seconds": 0.0})
        for name, seconds in phases.items():
            t += seconds
            self.timeline.append({"fit": fit, "attempt": None if name in goodput.FIT_PHASES else 1,
                                  "phase": name, "t": t, "seconds": seconds})
        return t

    def end(self, fit: str, t: float, status: str) -> None:
        self.timeline.append({"fit": fit, "attempt": None, "phase": "fit_end", "t": t, "seconds": 0, "status": status})

    def attempt(self, fit: str, number: int, t: float, resumed: int, save_every: int, first: int, last: int,
                start: float) -> float:
        """Steps first..last from `start`, a line each; a save every `save_every` steps. Returns the end."""
        dropped = [r for r in self.metrics if r["step"] > resumed]
        record = {"fit_id": fit, "world_size": 2, "time": t, "attempt": number, "resumed_step": resumed}
        if dropped:
            record.update(redone_steps=len(dropped), redone_s=sum(r["steps_s"] for r in dropped),
                          redone_until=max(r["time"] for r in dropped))
        self.metrics = [r for r in self.metrics if r["step"] <= resumed]
        self.attempts.append(record)
        now, blocked = start, 0.0
        for step in range(first, last + 1):
            now += STEP
            self.metrics.append({"step": step, "time": now, "loss": 1.0, "steps_s": STEP, "window_steps": 1,
                                 "data_wait_fraction": WAIT, "exposed_comm_ms": 50.0,
                                 "checkpoint_blocked_s": blocked, "attempt": number})
            blocked = 0.0
            if step % save_every == 0:
                now += STALL
                blocked = STALL
                record["checkpoints"] = record.get("checkpoints", 0) + 1
                record["checkpoint_blocked_s"] = record.get("checkpoint_blocked_s", 0.0) + STALL
        return now

    def write(self) -> None:
        for name, records in (("metrics.jsonl", self.metrics), ("attempts.jsonl", self.attempts),
                              ("timeline.jsonl", self.timeline), ("config-history.jsonl", self.history)):
            out = JsonlFile(Location.parse(self.dir / name))
            out.append(records)
            out.flush()


@pytest.fixture
def three_fits(tmp_path):
    w = RunWriter(tmp_path / "run")
    phases = {"cli": 1.0, "ray": 2.0, "datasets": 1.0, "placed": 0.5, "workers_up": 1.5,
              "process_group": 0.2, "data_ready": 0.3, "model_built": 0.4, "state_restored": 0.1}
    t0 = 1000.0
    ready = w.fit("a" * 32, t0, phases)  # 7 s of phases
    first_start = ready + 0.5  # 0.5 s more before the first step began
    end1 = w.attempt("a" * 32, 1, ready - 3.0, 0, 5, 1, 8, first_start)  # killed after step 8
    lost_at = end1
    start2 = lost_at + 6.0  # 6 s to recover
    end2 = w.attempt("a" * 32, 2, lost_at + 4.0, 5, 5, 6, 12, start2)  # Ctrl-C saves step 12 (no: 12 % 5)
    fit1_end = end2 + 1.5
    w.end("a" * 32, fit1_end, "interrupted")
    t2 = fit1_end + 10.0  # the pause
    ready2 = w.fit("b" * 32, t2, {"cli": 1.0, "ray": 2.0})
    end3 = w.attempt("b" * 32, 1, ready2, 12, 15, 13, 16, ready2 + 1.0)  # killed driver: no fit_end
    t3 = end3 + 20.0
    ready3 = w.fit("c" * 32, t3, {"cli": 1.0, "compile": 0.5}) - 0.5  # train.compile: inside its first step
    end4 = w.attempt("c" * 32, 1, ready3, 15, 100, 16, 20, ready3 + 2.0)
    w.end("c" * 32, end4 + 0.5, "ok")
    w.write()
    return w.dir, {"t0": t0, "end": end4 + 0.5, "first_start": first_start, "lost_at": lost_at, "start2": start2,
                   "idle": 10.0 + 20.0, "ctrl_c_end": fit1_end, "driver_killed_end": end3}


def test_buckets_add_up_and_match_what_was_put_in(three_fits):
    run_dir, truth = three_fits
    rep = report(run_dir)
    b = rep["buckets"]
    wall = truth["end"] - truth["t0"]
    assert rep["wall_s"] == pytest.approx(wall) and sum(b.values()) == pytest.approx(wall)
    kept_steps = 20
    assert b["productive"] == pytest.approx(kept_steps * STEP * (1 - WAIT) - kept_steps * 0.05 - 0.5)  # fit 3 compiled
    assert b["data_wait"] == pytest.approx(kept_steps * STEP * WAIT)
    assert b["exposed_comm"] == pytest.approx(kept_steps * 0.05)
    # redone: steps 6-8 of fit 1 (resumed at 5), step 16 of fit 2 (fit 3 resumed at 15)
    assert b["redone"] == pytest.approx(4 * STEP)
    assert b["idle"] == pytest.approx(truth["idle"])
    assert b["recovery"] == pytest.approx(6.0)
    # saves: 5 (attempt 1), 10 (attempt 2), 15 (fit 2)
    assert b["checkpoint_stall"] == pytest.approx(3 * STALL)
    assert b["other"] == pytest.approx(0.0, abs=1e-6)
    assert rep["startup_phases"]["first_step"] == pytest.approx(0.5 + 1.0 + 2.0)
    assert rep["startup_phases"]["ray"] == pytest.approx(2.0 * 3 - 2.0)  # fits 1 and 2 name it
    assert rep["startup_phases"]["compile"] == pytest.approx(0.5)  # start-up's, out of the steps' time
    assert rep["goodput"] == pytest.approx(b["productive"] / wall)


def test_interruptions_are_named_and_timed(three_fits):
    run_dir, truth = three_fits
    rep = report(run_dir)
    causes = [(e["cause"], e["attempt"]) for e in rep["interruptions"]]
    assert causes == [("worker lost", 2), ("Ctrl-C", None), ("driver killed", None)]
    assert rep["by_cause"] == {"worker lost": 1, "Ctrl-C": 1, "driver killed": 1}
    worker, ctrl_c, killed = rep["interruptions"]
    assert worker["recovery_s"] == pytest.approx(6.0) and worker["redone_s"] == pytest.approx(3 * STEP)
    assert ctrl_c["at"] == pytest.approx(truth["ctrl_c_end"]) and killed["redone_s"] == pytest.approx(STEP)
    assert killed["at"] == pytest.approx(truth["driver_killed_end"])
    held = rep["wall_s"] - rep["buckets"]["idle"]
    assert rep["mtbi_s"] == pytest.approx(held / 3)
    assert rep["mttr_s"] == pytest.approx((6.0 + ctrl_c["recovery_s"] + killed["recovery_s"]) / 3)
    assert [f["status"] for f in rep["fits"]] == ["interrupted", "driver killed", "ok"]
    for fit in rep["fits"]:
        assert fit["total_s"] == pytest.approx(fit["end"] - fit["start"])
    text = format_table(rep)
    assert "goodput" in text and "driver killed 1" in text and "worker lost 1" in text


def test_the_current_fit_ends_now(three_fits):
    """The summary line is printed before the fit's end is written: `current` gives it."""
    run_dir, truth = three_fits
    rep = report(run_dir, current={"fit_id": "c" * 32, "end": truth["end"] + 5.0, "status": "ok"})
    assert rep["wall_s"] == pytest.approx(truth["end"] + 5.0 - truth["t0"])
    assert rep["fits"][-1]["buckets"]["shutdown"] == pytest.approx(5.5)


def test_without_a_timeline_config_history_starts_each_fit(three_fits):
    run_dir, _ = three_fits
    (run_dir / "timeline.jsonl").unlink()
    rep = report(run_dir)
    assert sum(rep["buckets"].values()) == pytest.approx(rep["wall_s"])
    assert rep["buckets"]["redone"] == pytest.approx(4 * STEP)
    assert [e["cause"] for e in rep["interruptions"]][0] == "worker lost"


def test_the_cli_prints_json_a_table_and_draws(three_fits, capsys):
    from raytrain_ddp.cli import main

    run_dir, _ = three_fits
    assert main(["goodput", str(run_dir), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures["buckets"]) == set(goodput.BUCKETS) and 0 < figures["goodput"] < 1
    assert main(["goodput", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "productive" in out and (run_dir / "goodput.png").stat().st_size > 5000
    assert main(["goodput", str(run_dir / "nothing")]) == 2


def test_young_interval_in_steps():
    # sqrt(2 * 600 s * 0.3 s) = 18.97 s at 0.5 s a step: 38 steps
    assert young_interval_steps(600.0, 0.3, 0.5) == round(math.sqrt(2 * 600 * 0.3) / 0.5) == 38
    assert young_interval_steps(1.0, 0.0, 0.5) == 1 and young_interval_steps(600.0, 0.3, 0.0) == 1


def test_auto_plans_with_the_expected_mtbf_until_one_is_observed(tmp_path):
    """No interruption yet: run.expected_mtbf_s and the stall and step time the run measured."""
    from raytrain_ddp.goodput import auto_interval, cadence_inputs

    w = RunWriter(tmp_path / "calm")
    ready = w.fit("d" * 32, 1000.0, {"cli": 1.0})
    w.attempt("d" * 32, 1, ready, 0, 4, 1, 12, ready + 1.0)  # 3 saves of STALL, 12 steps of STEP
    w.write()
    inputs = cadence_inputs(w.dir, expected_mtbf_s=900.0, fit_id="d" * 32)  # the fit asking runs
    assert inputs["mtbf_from"] == "run.expected_mtbf_s" and inputs["mtbf_s"] == 900.0
    assert inputs["save_stall_s"] == pytest.approx(STALL) and inputs["step_s"] == pytest.approx(STEP)
    steps, why = auto_interval(inputs)
    assert abs(steps - math.sqrt(2 * 900.0 * STALL) / STEP) <= 1 and f"every {steps} steps" in why
    assert "run.expected_mtbf_s" in why
    none, probing = auto_interval({**inputs, "save_stall_s": None})
    assert none is None and "no save measured" in probing


def test_auto_is_a_config_value(tmp_path):
    from raytrain_ddp.config import ConfigError, load_config

    cfg = load_config(None, ["run.checkpoint_every_steps=auto", "run.expected_mtbf_s=120"])
    assert cfg.run.checkpoint_every_steps == "auto" and cfg.run.expected_mtbf_s == 120
    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        load_config(None, ["run.checkpoint_every_steps=often"])


def test_the_recorder_keeps_each_attempts_saves_and_what_a_resume_threw_away(tmp_path):
    """attempts.jsonl: the saves' count and stall per attempt; the dropped lines' cost on the resuming
    one; a node loss the controller declared, on the attempt after it."""
    from raytrain_ddp.driver.stream import Recorder

    fit = "e" * 32
    recorder = Recorder(Location.parse(tmp_path), fit, [])
    line = {"epoch": 1, "loss": 1.0, "lr": 0.1, "steps_s": 0.5, "window_steps": 1}
    recorder.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": fit, "attempt": 1, "time": 1.0}},
                     *[{"kind": "metrics", "attempt": 1, "seq": s, "record": {**line, "step": s, "time": 10.0 + s}}
                       for s in (1, 2, 3, 4)],
                     {"kind": "checkpoint", "attempt": 1, "seq": 5, "step": 2, "name": "c2", "blocked_s": 0.25}])
    recorder.handle([{"kind": "attempt", "attempt": 2, "seq": 0, "record": {"fit_id": fit, "attempt": 2, "time": 20.0}},
                     {"kind": "resumed", "attempt": 2, "seq": 1, "step": 2}])
    recorder.handle([{"kind": "fault", "attempt": 0, "seq": 0, "cause": "node lost", "time": 30.0}])  # node_loss.py
    recorder.handle([{"kind": "attempt", "attempt": 3, "seq": 0, "record": {"fit_id": fit, "attempt": 3, "time": 40.0}}])
    recorder.stop()
    first, second, third = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert third["cause"] == "node lost" and "cause" not in second
    assert first["checkpoints"] == 1 and first["checkpoint_blocked_s"] == pytest.approx(0.25)
    assert second["resumed_step"] == 2 and second["redone_steps"] == 2
    assert second["redone_s"] == pytest.approx(1.0) and second["redone_until"] == pytest.approx(14.0)


def test_a_restart_after_a_just_in_time_save_is_a_preemption(tmp_path):
    w = RunWriter(tmp_path / "spot")
    ready = w.fit("f" * 32, 1000.0, {"cli": 1.0})
    end = w.attempt("f" * 32, 1, ready, 0, 3, 1, 6, ready + 1.0)
    w.attempts[-1]["preempted"] = True  # the recorder's mark of a save before a preemption
    end = w.attempt("f" * 32, 2, end + 2.0, 6, 3, 7, 9, end + 4.0)
    w.end("f" * 32, end + 1.0, "ok")
    w.write()
    rep = report(w.dir)
    assert [e["cause"] for e in rep["interruptions"]] == ["preemption"] and rep["buckets"]["redone"] == 0
    assert rep["interruptions"][0]["recovery_s"] == pytest.approx(4.0)
