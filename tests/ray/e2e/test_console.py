"""What a user sees and keeps from real `raytrain-ddp train` runs (subprocesses, embedded Ray).

Two fits of the tiny config through the CLI, as a user would type them: the first
records a profile of three steps, the second resumes with more steps and another
learning rate, then the same command again has nothing to train. Checked: the console
holds only plan, progress, summary and real warning lines, without colour codes; the
trace is a Kineto/Chrome trace whose busiest operators include the all-reduce;
`run.num_to_keep` holds over both fits; `config.yaml` and `config-history.jsonl` say
what trained; "nothing to train" exits 3 before Ray and leaves the record alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.worker.profiler import summarize_trace

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"

PLAN = re.compile(r"^(raytrain-ddp: run '[\w.-]+' -> |  (data|model|batch|schedule|resume) {2,}\S)")
PROGRESS = re.compile(r"^(step +\d+/\d+ \| epoch [\d.]+ \| |\[rank 0\] (attempt \d+: |run\.profile: |gradients all-reduced ))")
SUMMARY = re.compile(r"^raytrain-ddp: (status ok \| |run directory |latest checkpoint )")
WARNING = re.compile(r"^raytrain-ddp: warning: ")


def _train(storage: Path, *overrides: str, timeout_s: float = 420) -> subprocess.CompletedProcess:
    # A user's environment: no Ray address, none of the test suite's hooks.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    return subprocess.run([sys.executable, "-m", "raytrain_ddp", "train", str(TINY), f"run.storage_path={storage}",
                           "train.max_steps=20", "run.checkpoint_every_steps=5", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def _unexpected_lines(done: subprocess.CompletedProcess) -> list[str]:
    lines = done.stdout.splitlines() + done.stderr.splitlines()
    return [line for line in lines if not any(p.match(line) for p in (PLAN, PROGRESS, SUMMARY, WARNING))]


def test_console_profile_and_run_record_over_two_fits(tmp_path):
    run_dir = tmp_path / "tiny"
    first = _train(tmp_path, "run.profile.start_step=5", "run.profile.steps=3")
    story = f"stdout:\n{first.stdout[-3000:]}\nstderr:\n{first.stderr[-3000:]}"
    assert first.returncode == 0, story
    assert _unexpected_lines(first) == [], story
    assert "\x1b[" not in first.stdout + first.stderr  # piped: no colour
    assert first.stderr == "", story  # nothing to warn about in a clean first run
    out = first.stdout.splitlines()
    assert sum(bool(PLAN.match(line)) for line in out) == 6 and out[0].startswith("raytrain-ddp: run 'tiny'")
    assert [line.split("|")[0].split()[1] for line in out if line.startswith("step ")] == ["5/20", "10/20", "15/20",
                                                                                          "20/20", "20/20"]
    assert sum(line.startswith("[rank 0] attempt 1:") for line in out) == 1  # once, not once per stream
    # bucketed on 2 CPU workers of one host: shared memory, said once
    assert [line for line in out if "gradients all-reduced" in line] == [
        "[rank 0] gradients all-reduced through shared memory: all 2 workers are on one host (parallel.shm)"]
    assert out[-3].startswith("raytrain-ddp: status ok | 20 steps")

    # The trace: Kineto's Chrome-trace JSON (what Perfetto and TensorBoard's profiler read).
    traces = sorted((run_dir / "profile").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank0_steps5-7.pt.trace.json"]
    trace = json.loads(traces[0].read_text())
    assert "schemaVersion" in trace and trace["traceEvents"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in events)
    assert sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep#")) == [
        "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]  # steps 5, 6, 7 after one warm-up step
    summary = summarize_trace(traces[0])
    assert summary["steps"] == 3 and summary["step"] > 0
    # the all-reduces: shared memory's copies and sums, and its barriers through gloo
    assert {"shm:all_reduce", "gloo:all_reduce"} <= {e["name"] for e in events}
    assert all(summary[k] > 0 for k in ("data", "forward", "backward", "all-reduce", "optimizer")), summary
    assert "| backward |" in (run_dir / "profile" / "summary.md").read_text()

    # Second fit: more steps, another learning rate (a real warning), and the checkpoints of
    # both fits counted together for run.num_to_keep=2.
    second = _train(tmp_path, "train.max_steps=30", "train.lr=0.005")
    story = f"stdout:\n{second.stdout[-3000:]}\nstderr:\n{second.stderr[-3000:]}"
    assert second.returncode == 0, story
    assert _unexpected_lines(second) == [], story
    assert second.stderr.startswith("raytrain-ddp: warning: resuming") and len(second.stderr.splitlines()) == 1
    kept = ckpt.find_checkpoints(run_dir)
    assert [int(ckpt.read_manifest(p)["step"]) for p in kept] == [30, 25], [p.name for p in kept]
    history = [json.loads(line) for line in (run_dir / "config-history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and history[1]["changed"] == {
        "run.profile.steps": [3, 0], "train.lr": [0.01, 0.005], "train.max_steps": [20, 30]}
    config = (run_dir / "config.yaml").read_text()
    assert "lr: 0.005" in config and "max_steps: 30" in config

    # The same command again: nothing to train, said before Ray starts, exit 3, record kept.
    started = time.monotonic()
    again = _train(tmp_path, "train.max_steps=30", "train.lr=0.001", timeout_s=60)
    assert again.returncode == 3, again.stderr
    assert len(again.stderr.splitlines()) == 1  # the error alone: no resume warning before it
    assert "nothing to train" in again.stderr and "train.max_steps=60" in again.stderr and "name=tiny-2" in again.stderr
    assert again.stdout == "" and time.monotonic() - started < 30
    assert (run_dir / "config.yaml").read_text() == config
