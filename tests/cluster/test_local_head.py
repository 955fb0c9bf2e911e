"""`cluster/local-head.sh`: a local head for `ray job submit`, stopped exactly (#45).

`start` brings up one node with token authentication and free ports; the real `ray job
submit` CLI reaches it with the head's token (RAY_AUTH_MODE=token) and runs a job on it;
`stop` leaves none of the head's processes alive (its whole session: the GCS, raylet,
dashboard, agents, workers) and removes its state directory. No address file lands in
/tmp/ray (others' `ray.init()` would join it).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from _two_node import two_node_env

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "local-head.sh"
ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")


def _alive_members(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,stat=,pid=,comm="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[0] == str(sid) and not ln.split()[1].startswith("Z")]


def _address_file() -> tuple[bool, float]:
    return (True, ADDRESS_FILE.stat().st_mtime) if ADDRESS_FILE.exists() else (False, 0.0)


def test_local_head_takes_a_job_submission_and_its_stop_leaves_nothing(tmp_path):
    before = _address_file()
    env = {**two_node_env(), "RT2N_UP_TIMEOUT_S": "240", "RT2N_HEAD_CPUS": "2"}
    up = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    state = Path(up.stdout.strip().splitlines()[-1])
    sid = int((state / "head.pgid").read_text())
    assert f"stop it with:     {SCRIPT} stop {state}" in up.stderr, up.stderr  # the docs' command (#57)
    assert (state / "env").read_text().startswith("# source this file to talk to the local one-node head\n")
    try:
        assert len(_alive_members(sid)) >= 3  # ray start, the GCS, the raylet, ...
        client = two_node_env(state)
        assert client["RAY_AUTH_MODE"] == "token" and Path(client["RAY_AUTH_TOKEN_PATH"]).exists()
        job = subprocess.run(["ray", "job", "submit", "--address", client["RT2N_DASHBOARD"], "--",
                              "python", "-c", "import ray; ray.init(); print('job ran on', len(ray.nodes()), 'node')"],
                             env=client, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert job.returncode == 0 and "job ran on 1 node" in job.stdout, job.stdout[-3000:] + job.stderr[-3000:]
        members = _alive_members(sid)
    finally:
        down = subprocess.run([str(SCRIPT), "stop", str(state)], env=env, capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while _alive_members(sid) and time.monotonic() < deadline:  # zombies are reaped by init
        time.sleep(0.2)
    assert not _alive_members(sid), (members, _alive_members(sid))
    assert not state.exists()
    assert _address_file() == before  # the head's address file stayed in its own temp dir
