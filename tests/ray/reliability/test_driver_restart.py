"""The driver dies; the same command, run again, continues (issue #6, item 3).

The driver is the real `raytrain-ddp train` command in its own process group, joined to
the session's Ray instance (as a laptop driver joins a cluster). Once rank 1 has passed
the step-10 checkpoint (it parks at step 12 and reports its pid: test-only fault plan),
the same command is refused (exit 2, naming the running driver, issue #31), then the
whole driver process group is SIGKILLed. Ray then reaps the run's actors; the same
command line runs again, takes the dead driver's hold over and must continue from the
checkpoint, not start over.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _harness import TINY, tiny, train_lines, wait_for
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.driver.resume import ResumeError, resolve_resume
from raytrain_ddp.rundir import run_dir_of
from _hooks import ENABLE

pytestmark = pytest.mark.timeout(420)

CLI = Path(sys.executable).parent / "raytrain-ddp"


def _env(ray_address: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_DDP_")}
    env.update(RAY_ADDRESS=ray_address, PYTHONUNBUFFERED="1", **ENABLE, **extra)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_rerunning_the_same_command_after_the_driver_died_continues(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    command = [str(CLI), "train", str(TINY), f"run.storage_path={tmp_path}", "name=driverless",
               "train.epochs=1", "run.log_every_steps=1", "run.recovery=checkpoint"]  # the durable step-10 one
    pidfile = tmp_path / "rank1.pid"
    log = open(tmp_path / "first.log", "wb")
    first = subprocess.Popen(command, env=_env(address, RAYTRAIN_DDP_FAULT=f"rank=1,step=12,mode=hang,pidfile={pidfile}"),
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: pidfile.exists() or first.poll() is not None, 300, "the first driver to reach step 12")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        # The same command while the first runs (a retried CI job): refused before Ray, naming the holder.
        started = time.monotonic()
        second = subprocess.run(command, env=_env(address), capture_output=True, text=True, timeout=60)
        refused_s = time.monotonic() - started
        assert second.returncode == 2 and refused_s < 5, (refused_s, second.stdout + second.stderr)
        assert f"held by a running fit: host {socket.gethostname()}, pid {first.pid}, fit " in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "name=driverless-2" in second.stderr
    finally:
        _kill_group(first)  # the driver is gone: no summary, no goodbye
        log.close()
    killed = time.time()
    run_dir = tmp_path / "driverless"
    assert not (run_dir / "summary.json").exists()
    checkpoint_10 = ckpt.find_checkpoints(run_dir)[0]
    assert ckpt.read_manifest(checkpoint_10)["step"] == 10
    worker_pid = int(pidfile.read_text())
    # Ray reaps the dead driver's actors, the parked worker included (bounded wait)
    wait_for(lambda: not Path(f"/proc/{worker_pid}").exists(), 120, "the dead driver's worker to be reaped")

    again = subprocess.run(command, env=_env(address), capture_output=True, text=True, timeout=300)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["resumed_from"] == str(checkpoint_10), summary
    assert str(checkpoint_10) in out  # the printed plan says where it continues from
    lines = train_lines(run_dir)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, 23)), steps  # 11 and 12 were redone once, nothing before 10 was
    assert "taking over" in out and not (run_dir / "hold.json").exists()  # the dead driver's hold: taken, released
    print(f"driver SIGKILLed -> step 11 trained again: {lines[10]['time'] - killed:.1f} s")
    state = ckpt.load_checkpoint(ckpt.find_checkpoints(run_dir)[0])
    assert state["progress"]["step"] == 22

    # A new name starts fresh; asking the old name to start fresh is refused, not silently mixed.
    fresh = tiny(tmp_path, "another-name", "train.epochs=1")
    assert resolve_resume(fresh, run_dir_of(fresh)) is None and not run_dir_of(fresh).exists()
    with pytest.raises(ResumeError, match="already exists"):
        resolve_resume(tiny(tmp_path, "driverless", "run.resume=never"), run_dir)
