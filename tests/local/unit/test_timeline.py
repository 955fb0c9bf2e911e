"""The start-up timeline's arithmetic (`raytrain_ddp/timeline.py`), from made-up stamps: the
phases of each start add up to its time to the first step, a restart counts from its group's
start, a stamp that never came is a 0 s phase, and rank 0's stamps wait for the controller's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from raytrain_ddp.rundir import Location, SUMMARY_FILE
from _timeline import timeline_problems
from raytrain_ddp.timeline import ATTEMPT_PHASES, Timeline, WorkerStamps, format_timeline, process_start_time

pytestmark = pytest.mark.timeout(30)


def test_phases_add_up_per_start_and_a_restart_counts_from_its_group_start(tmp_path, monkeypatch):
    clock = iter([103.0, 105.0, 106.0, 141.0])
    monkeypatch.setattr("raytrain_ddp.timeline.time.time", lambda: next(clock))
    timeline = Timeline("f1", started=100.0, entered=101.0)  # the process's start; its imports end at 101 (#57)
    timeline.expects_controller = True
    for phase in ("cli", "ray", "datasets"):
        timeline.mark(phase)
    timeline.attach(Location.parse(tmp_path))
    worker = {"process_start": 107.0, "data_ready": 111.0, "model_built": 112.0, "state_restored": 112.0,
              "first_step": 112.5}
    timeline.worker(1, worker)  # before the controller's stamps: held
    assert not any(r["attempt"] == 1 for r in timeline.rows)
    timeline.controller({"begin": 106.5, "workers_up": 108.0, "process_group": 110.0})
    timeline.controller({"begin": 130.0, "workers_up": 131.0, "process_group": 132.0})
    timeline.worker(2, {"process_start": 120.0, "data_ready": 133.0, "model_built": 134.0,
                        "state_restored": 135.0, "first_step": 135.5})
    timeline.last_step(139.0)
    summary = {"fit_id": "f1", "status": "ok"}
    timeline.finish(Location.parse(tmp_path), summary)
    first, second = summary["startup"]["attempts"]
    assert first["to_first_step_s"] == 12.5 and sum(first["phases"].values()) == pytest.approx(12.5)
    assert first["phases"]["placed"] == 1.0 and first["phases"]["workers_up"] == 1.0  # to rank 0's process start
    assert second["to_first_step_s"] == 5.5 and second["phases"]["placed"] == 0.0  # a reused process
    assert summary["startup"]["shutdown_s"] == 2.0  # last step 139 -> end 141
    assert timeline_problems(tmp_path, summary, attempts=2) == []
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["startup"] == summary["startup"]
    assert format_timeline(summary["startup"])[0].startswith(
        "start-up, attempt 1: 12.50s to the first step = imports 1.00s | cli 2.00s")


def test_without_ray_the_missing_phases_are_zero_and_rank_0_sends_once():
    timeline = Timeline("f2", started=0.0)
    timeline.mark("cli")
    timeline.mark("ray", applies=False)
    timeline.mark("datasets", applies=False)
    sent = []

    class Outbox:
        def send(self, kind, **fields):
            sent.append((kind, fields))

    stamps = WorkerStamps(enabled=True)
    for phase in ("data_ready", "model_built", "state_restored"):
        stamps.mark(phase)
    stamps.first_step_done(Outbox())
    stamps.first_step_done(Outbox())  # later steps send nothing
    WorkerStamps(enabled=False).first_step_done(Outbox())  # nor other ranks
    assert len(sent) == 1 and sent[0][0] == "timeline" and sent[0][1]["source"] == "worker"
    timeline.worker(1, sent[0][1]["stamps"])  # not a Ray fit: written at once
    attempt = timeline.summary()["attempts"][0]
    assert list(attempt["phases"])[:1] == ["imports"] and list(attempt["phases"])[4:] == list(ATTEMPT_PHASES)
    assert attempt["phases"]["ray"] == attempt["phases"]["workers_up"] == 0.0
    assert process_start_time() is not None and process_start_time() <= stamps.stamps["data_ready"]


def test_a_process_start_is_the_moment_it_was_spawned_to_the_clock_tick():
    """The goodput report's wall and idle start at the CLI's process start: /proc/stat's
    whole-second `btime` put every start up to 1 s early (CI saw 0.73 s on both)."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        after = time.time()
        started = process_start_time(child.pid)
    finally:
        child.communicate(timeout=30)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert before - tick - 0.005 <= started <= after + 0.005, (before, started, after)
