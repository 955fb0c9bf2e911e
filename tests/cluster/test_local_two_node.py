"""A real two-node Ray cluster on this machine (cluster/local-two-node.sh) running real training.

One cluster start for the module: the head (custom resource node_a) and a second node
(node_b), each with 3 logical CPUs. The tiny config runs through the real CLI
(`python -m raytrain_ddp train`, joining the cluster via RAY_ADDRESS with token auth)
with 2 workers of 2 CPUs each, so no node can hold both: Ray must spread them. Ray's
state API then says on which node each training worker actor ran. Also checked: the
jobs API refuses a request without the token, the dashboard does not answer on the
machine's routable address, and `down` leaves none of the cluster's processes behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "local-two-node.sh"
VENV_BIN = Path(sys.executable).parent


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_", "RT2N_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _cluster_env(state: Path) -> dict[str, str]:
    env = _base_env()
    for line in (state / "env").read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value
    return env


def _alive_members(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,comm="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[0] == str(pgid) and not ln.split()[1].startswith("Z")]


@pytest.fixture(scope="module")
def two_nodes():
    up = subprocess.run([str(SCRIPT), "up"], env={**_base_env(), "RT2N_UP_TIMEOUT_S": "120"},
                        capture_output=True, text=True, timeout=200)
    assert up.returncode == 0, f"local-two-node.sh up failed:\n{up.stderr[-4000:]}"
    state = Path(up.stdout.strip().splitlines()[-1])
    pgids = [int((state / f"{n}.pgid").read_text()) for n in ("head", "node")]
    try:
        yield state
    finally:
        down = subprocess.run([str(SCRIPT), "down", str(state)], env=_base_env(),
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert not state.exists()
        leftovers = [m for g in pgids for m in _alive_members(g)]
        assert not leftovers, f"processes left after down: {leftovers}"


QUERY = r"""
import json, ray
from ray.util.state import list_actors
ray.init(logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: {"ip": n["NodeManagerAddress"], "alive": n["Alive"],
         "tag": "node_a" if "node_a" in n["Resources"] else "node_b" if "node_b" in n["Resources"] else None}
         for n in ray.nodes()}
workers = [a.node_id for a in list_actors(filters=[("class_name", "=", "RayTrainWorker")], detail=True, limit=1000)]
print(json.dumps({"nodes": nodes, "workers": workers}))
"""


@pytest.mark.timeout(400)
def test_training_spreads_over_both_nodes_and_completes(two_nodes):
    state = two_nodes
    env = _cluster_env(state)
    runs = state / "runs"
    train = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"),
         "train.max_steps=10", "scaling.cpus_per_worker=2", f"run.storage_path={runs}", "run.resume=never"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, f"training failed:\n{train.stdout[-3000:]}\n{train.stderr[-3000:]}"
    summary = json.loads((runs / "tiny" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers"] == 2 and summary["steps"] == 10
    assert "raytrain-ddp: status ok" in train.stdout

    q = subprocess.run([sys.executable, "-c", QUERY], env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr[-3000:]
    info = json.loads(q.stdout.strip().splitlines()[-1])
    nodes, workers = info["nodes"], info["workers"]
    assert sorted(n["tag"] for n in nodes.values()) == ["node_a", "node_b"]
    assert all(n["alive"] for n in nodes.values())
    # one training worker on each node: the head (node_a) and the second node (node_b)
    assert len(workers) == 2, workers
    assert sorted(nodes[w]["tag"] for w in workers) == ["node_a", "node_b"]

    # The jobs API needs the token, and the dashboard listens on loopback only.
    dashboard = env["RT2N_DASHBOARD"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=30)
    assert refused.value.code in (401, 403)
    token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(f"{dashboard}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as ok:
        assert ok.status == 200
    routable = next(iter(nodes.values()))["ip"]
    if routable != "127.0.0.1":
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((routable, int(dashboard.rsplit(":", 1)[1]))) != 0
