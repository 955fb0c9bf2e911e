"""Embedded Ray next to a stale address file, and Ctrl-C (issue #12): one real CLI run shows both.

`raytrain-ddp train` runs with Ray's temp dir (RAY_TMPDIR) holding the address file a
killed `ray start` leaves behind (`ray_current_cluster`, pointing nowhere). Before #12
`ray.init(num_cpus=...)` read it and died with a ValueError traceback; the embedded
start now ignores it (`address="local"`) and trains. Once training is past a
checkpoint, the test sends SIGINT to the CLI process alone (as a terminal's Ctrl-C
reaches the driver). The CLI must say where it stopped and how to continue, write
summary.json with status `interrupted`, exit 130 and leave none of the processes it
started behind (Ray's included). The stale file is left as it was: Ray wrote none.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _procs import descendants as _descendants, stat as _stat
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.rundir import read_metrics

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"
CLI = Path(sys.executable).parent / "raytrain-ddp"
STALE = "127.0.0.1:1\n"


def _alive(proc: tuple[int, str]) -> bool:
    """Still running, and the same process (pid and start time), not a reused pid."""
    fields = _stat(proc[0])
    return len(fields) > 19 and fields[19] == proc[1] and fields[0] != "Z"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigint")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtsig-", dir="/tmp"))  # short: Ray's unix sockets live under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(STALE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONUNBUFFERED="1")
    run_dir = tmp / "runs" / "sigint"
    log = open(tmp / "train.log", "wb")
    proc = subprocess.Popen([str(CLI), "train", str(TINY), f"run.storage_path={tmp / 'runs'}", "name=sigint",
                             "train.epochs=100", "run.log_every_steps=1", "run.checkpoint_every_steps=5"],
                            env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    started: list[tuple[int, str]] = []  # (pid, start time)
    try:
        deadline = time.monotonic() + 200
        while proc.poll() is None and time.monotonic() < deadline:
            steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
            if steps and steps[-1] >= 12 and ckpt.find_checkpoints(run_dir):
                break
            time.sleep(0.3)
        assert proc.poll() is None, (tmp / "train.log").read_text()[-4000:]
        started = [(pid, f[19]) for pid in _descendants(proc.pid) if len(f := _stat(pid)) > 19]  # Ray's too
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        gone_by = time.monotonic() + 60
        while any(_alive(p) for p in started) and time.monotonic() < gone_by:
            time.sleep(0.5)
        left = [p for p in started if _alive(p)]
        yield proc.returncode, (tmp / "train.log").read_text(), run_dir, ray_tmp, started, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait(timeout=30)
        for process in started:  # only processes the CLI started, by pid
            if _alive(process):
                os.kill(process[0], signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)  # the stale address file goes with it


def test_a_stale_ray_address_file_is_no_traceback(interrupted):
    code, out, run_dir, ray_tmp, _, _ = interrupted
    assert "Traceback" not in out and "ValueError" not in out, out[-4000:]
    assert "joining" not in out  # embedded: its own instance, not the address in the file
    assert (ray_tmp / "ray" / "ray_current_cluster").read_text() == STALE  # untouched, and no new one
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r][:3] == [1, 2, 3]


def test_ctrl_c_writes_the_summary_says_how_to_continue_and_leaves_no_process(interrupted):
    code, out, run_dir, _, started, left = interrupted
    assert code == 130, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] >= 12, summary
    state, latest = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    # the workers saved the step they were at and stopped (#25): nothing trained is thrown away
    assert summary["checkpoint"] == str(latest) and state["progress"]["step"] == summary["steps"]
    assert summary["checkpoint_step"] == summary["steps"]
    assert f"stopped after step {summary['steps']} as the driver asked (Ctrl-C)" in out, out[-3000:]
    assert (f"raytrain-ddp: interrupted at step {summary['steps']}; the same command continues from "
            f"step {summary['steps']} (checkpoint {summary['checkpoint']})") in out, out[-3000:]
    assert "Traceback" not in out and not (run_dir / "hold.json").exists()  # the run's hold released
    assert len(started) > 3 and not left, [(pid, _stat(pid)[:2]) for pid, _ in left]


def test_interrupted_run_leaves_at_most_two_staging_copies_behind(interrupted):
    """Before: checkpoints every 5 steps of the tiny run outpaced Ray's background uploads, and
    every pending one kept its staging copy in the temp dir: 177 were left by one interrupt."""
    _, out, run_dir, _, _, _ = interrupted
    fit = json.loads((run_dir / "summary.json").read_text())["fit_id"]
    left = []
    for staging in Path(tempfile.gettempdir()).glob("raytrain_ddp_ckpt_*"):
        try:
            if ckpt.read_manifest(staging).get("fit_id") == fit:
                left.append(staging)
        except Exception:  # noqa: BLE001 - another test's half-written or foreign directory
            continue
    for staging in left:  # this run's, left on purpose by the interrupt: clean up
        shutil.rmtree(staging, ignore_errors=True)
    assert len(left) <= 2, f"{len(left)} staging copies of fit {fit} left in {tempfile.gettempdir()}"
