"""What the embedded Ray instance of `raytrain-ddp train` exposes on the network (issue #6, item 9).

`launcher.connect_ray` starts Ray in a child process of its own session; the test lists
every listening TCP socket owned by that session (from /proc) and checks:

* no dashboard / Jobs HTTP API (the port that runs code on request) is started: the
  embedded instance serves no jobs (a `ray start` head's dashboard listens on 127.0.0.1
  only: tests/cluster/test_job_submit.py); nor the dashboard's head process or the
  autoscaler's monitor at all;
* every socket bound beyond loopback belongs to Ray's own services (GCS, raylet, core
  workers, agents, autoscaler monitor) -- none is opened by our code;
* those services refuse a client that lacks the token: the GCS refuses a driver, the
  runtime-env agent answers 401 (Ray 2.60 turns token authentication on by default).

Known limit, stated in the README (Security): Ray 2.60 binds its gRPC servers to all
interfaces and rewrites a node IP of 127.0.0.1 to the primary interface, so "loopback
only" cannot be promised for them; the token is what protects them.
Token refusal of `ray job submit` is tested in tests/cluster/test_job_submit.py.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _procs import in_session, listening_sockets, loopback

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[3]
DASHBOARD_PORT = 8265  # Ray's default dashboard port
RAY_SERVICES = ("gcs_server", "raylet", "ray::", "dashboard", "monitor.py", "log_monitor.py", "runtime_env")
RUNTIME_ENV_AGENT = "RuntimeEnvAgent"
CHECKED = ("gcs_server", "raylet", RUNTIME_ENV_AGENT)  # the services whose sockets the test judges

_EMBEDDED = """
import json, sys, ray
import ray._private.worker as ray_worker
from raytrain_ddp.config import load_config
from raytrain_ddp.driver.launcher import connect_ray
assert connect_ray(load_config(sys.argv[1], []))
print(json.dumps({"dashboard": ray_worker.get_dashboard_url(),
                  "gcs": ray.get_runtime_context().gcs_address}), flush=True)
sys.stdin.read()  # until the test closes stdin
ray.shutdown()
"""


def _listeners(session_id: int) -> list[tuple[str, int, str]]:
    """(address, port, command line) of every LISTEN socket of processes in `session_id`."""
    return [(addr, port, cmd) for addr, port, _, cmd in listening_sockets(in_session(session_id))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def _loopback(address: str) -> bool:
    return loopback(address)


def test_embedded_ray_exposes_only_loopback_http_and_token_protected_services(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", _EMBEDDED, str(REPO / "examples/configs/tiny.yaml")],
                            cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 150)
        assert ready, "embedded Ray did not start within 150s"
        info = json.loads(proc.stdout.readline())
        # Bounded wait until every service checked below listens (the agents bind after
        # ray.init returns); a snapshot without them would check nothing.
        deadline = time.monotonic() + 90
        while True:
            sockets = _listeners(proc.pid)
            missing = [name for name in CHECKED if not any(name in s[2] for s in sockets)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not missing, f"not listening after 90 s: {missing}; listening: {[(a, p, c[:80]) for a, p, c in sockets]}"
        # No dashboard / Jobs HTTP API at all: an embedded instance serves no jobs (launcher.connect_ray)
        assert not info["dashboard"], info["dashboard"]
        http = [s for s in sockets if s[1] == DASHBOARD_PORT]
        assert not http, f"something listens on the dashboard's port: {http}"
        # Nor the two processes Ray starts for a cluster (ray_compat.lean_local_node): the
        # dashboard's head process and the autoscaler's monitor
        commands = [_cmdline(pid) for pid in in_session(proc.pid)]
        cluster = [c for c in commands if "dashboard/dashboard.py" in c or "autoscaler/_private/monitor.py" in c]
        assert not cluster, cluster

        exposed = [s for s in sockets if not _loopback(s[0])]
        strangers = [s for s in exposed if not any(name in s[2] for name in RAY_SERVICES)]
        assert not strangers, f"non-Ray processes listen beyond loopback: {strangers}"

        # The runtime-env agent (HTTP, node IP) answers 401 without the token.
        agent = [s for s in sockets if RUNTIME_ENV_AGENT in s[2]]
        assert agent, sockets  # (the wait above found it)
        for addr, port, _ in agent:
            host = addr if addr not in ("0.0.0.0", "::") else info["gcs"].rsplit(":", 1)[0]
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"http://{host}:{port}/", timeout=10)
            assert refused.value.code == 401

        # The GCS (all interfaces) refuses a driver that has no token.
        home = tmp_path / "home"
        home.mkdir()
        no_token = {**env, "HOME": str(home), "RAY_AUTH_MODE": "disabled"}
        attempt = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={info['gcs']!r}); print('JOINED')"],
                                 env=no_token, capture_output=True, text=True, timeout=120)
        assert attempt.returncode != 0 and "JOINED" not in attempt.stdout, attempt.stdout + attempt.stderr[-2000:]
    finally:
        proc.stdin.close()  # the child shuts Ray down ...
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, 9)  # ... and whatever is left of the session it led is killed
        except ProcessLookupError:
            pass
