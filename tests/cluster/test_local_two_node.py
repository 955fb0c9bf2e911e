"""A real two-node Ray cluster on this machine (cluster/local-two-node.sh) running real training.

One cluster start for the module: the head (custom resource node_a) and a second node
(node_b), each with 3 logical CPUs, each in its own working and Ray temp directory. The
tiny config runs through the real CLI (`python -m raytrain_ddp train`, joining the
cluster via RAY_ADDRESS with token auth) with 2 workers of 2 CPUs each, so no node can
hold both: Ray must spread them. Ray's state API then says on which node each training
worker actor ran. Also checked: the jobs API refuses a request without the token, the
dashboard does not answer on the machine's routable address, a local run.storage_path
on this multi-node cluster is warned about, and `down` leaves none of the cluster's
processes behind.

Object storage (issue #12): a real S3-compatible server (moto, 127.0.0.1) is started
before the cluster, whose nodes get its endpoint and credentials in their environment
(as cloud nodes get an instance profile). A run with `run.storage_path=s3://...` trains
across both nodes, one worker is SIGKILLed mid-epoch, the survivor writes the last step
into the bucket and the run resumes there (`run.recovery=replica`), on the uninterrupted
run's trajectory; every metrics line, the attempts and the summary are in the bucket --
and nothing of the run on any local disk.

A node lost under `run.recovery=live` (issue #28): 2 workers of 1 CPU spread over the
nodes (`scaling.placement_strategy=SPREAD`), the second node SIGKILLed mid-epoch; the
survivor keeps its process and the lost worker is replaced on the head. It runs last, after
the elastic node-loss test, on the second node started again (`local-two-node.sh revive-node`).

Waiting for resources (issue #17): a worker no node can hold is reported while it waits,
ends as `unschedulable` at `scaling.placement_timeout_s`, is withdrawn on Ctrl-C, and
fails at once when the cluster publishes node types (as an autoscaler does) none of which
can hold it; nothing of the run is left waiting in the cluster afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _moto import s3_bucket
from raytrain_ddp import checkpoint as ckpt
from _two_node import follow_to_resume, two_node_env, wait_for_step
from raytrain_ddp.rundir import Location, read_jsonl, read_metrics
from _hooks import ENABLE

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "local-two-node.sh"


def _base_env() -> dict[str, str]:
    return two_node_env()


def _cluster_env(state: Path) -> dict[str, str]:
    return two_node_env(state)


def _alive_members(sid: int) -> list[str]:
    """Live processes of a node's session (Ray's workers each have a process group of their own)."""
    out = subprocess.run(["ps", "-eo", "sid=,stat=,pid=,comm="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[0] == str(sid) and not ln.split()[1].startswith("Z")]


BUCKET = "raytrain-two-node"
TINY_EPOCH_ACCURACY = 0.7967  # tiny.yaml, train.epochs=1, uninterrupted: val_accuracy 286 / 359


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto on 127.0.0.1; its endpoint and credentials are in this module's environment (and the cluster's)."""
    with s3_bucket(tmp_path_factory.mktemp("moto"), BUCKET) as env:
        yield env


def _up(env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """`local-two-node.sh up`; if it runs past `timeout_s` (each node start it retries counts),
    what it started is stopped by `down` on the state dir it named first."""
    try:
        return subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        said = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        started = re.search(r"local-two-node: state dir (\S+)", said)
        if started:
            subprocess.run([str(SCRIPT), "down", started.group(1)], env=_base_env(), capture_output=True,
                           text=True, timeout=120)
        pytest.fail(f"local-two-node.sh up did not finish in {timeout_s:.0f}s:\n{said[-4000:]}")


@pytest.fixture(scope="module")
def two_nodes(s3):
    # 120 s for the nodes each try; a start that hit Ray's 30 s limit is tried again (3 tries).
    up = _up({**_base_env(), **s3, "RT2N_UP_TIMEOUT_S": "120"}, timeout_s=330)
    assert up.returncode == 0, f"local-two-node.sh up failed:\n{up.stderr[-4000:]}"
    state = Path(up.stdout.strip().splitlines()[-1])
    pgids = [int((state / f"{n}.pgid").read_text()) for n in ("head", "node")]
    try:
        yield state
    finally:
        pgids.append(int((state / "node.pgid").read_text()))  # a revived second node (revive-node) has its own
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


# Two epochs of the tiny config over both nodes, uninterrupted: the first test checks where
# it ran, the node-loss test (the module's last) compares its final parameters with this one's.
ELASTIC = ("train.epochs=2", "run.log_every_steps=1", "scaling.cpus_per_worker=2", "scaling.num_workers=[1,2]",
           "run.resume=never")


def _reference_run(state: Path) -> subprocess.CompletedProcess:
    runs = state / "runs"
    if (runs / "tiny" / "summary.json").exists():
        return _reference_run.done  # type: ignore[attr-defined]
    train = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"), *ELASTIC,
         f"run.storage_path={runs}"],
        env=_cluster_env(state), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, f"training failed:\n{train.stdout[-3000:]}\n{train.stderr[-3000:]}"
    _reference_run.done = train  # type: ignore[attr-defined]
    return train


@pytest.mark.timeout(700)  # its setup starts the cluster (up to 330 s), its body the reference run
def test_training_spreads_over_both_nodes_and_completes(two_nodes):
    state = two_nodes
    env = _cluster_env(state)
    train = _reference_run(state)
    summary = json.loads((state / "runs" / "tiny" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers"] == 2 and summary["steps"] == 44
    assert "raytrain-ddp: status ok" in train.stdout
    assert train.stdout.count("[rank 0] attempt 1:") == 1, train.stdout  # once, though two nodes stream logs
    assert "\x1b[" not in train.stdout + train.stderr and "core_worker.cc" not in train.stderr  # quiet, no colour
    assert "is a local path, but the Ray cluster has 2 nodes" in train.stderr  # said, not silently scattered

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


@pytest.mark.timeout(400)
def test_run_in_a_bucket_survives_a_sigkilled_worker_and_leaves_everything_in_the_bucket(two_nodes, s3, tmp_path):
    state = two_nodes
    pidfile = tmp_path / "rank1.pid"
    env = {**_cluster_env(state), **s3, **ENABLE, "PYTHONUNBUFFERED": "1",
           # rank 1 finishes step 12 (checkpoint at 10, epoch = 22 steps), parks and reports its pid
           "RAYTRAIN_DDP_FAULT": f"rank=1,step=12,attempt=1,mode=hang,pidfile={pidfile}"}
    driver_cwd = tmp_path / "driver"
    driver_cwd.mkdir()
    storage = f"s3://{BUCKET}/runs"
    log = open(tmp_path / "train.log", "wb")
    train = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"), "name=tiny-s3",
         "train.epochs=1", "run.log_every_steps=1", "scaling.cpus_per_worker=2", f"run.storage_path={storage}",
         "run.resume=never"],
        env=env, cwd=driver_cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (pidfile.exists() and pidfile.read_text()) and train.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pidfile.exists(), (tmp_path / "train.log").read_text()[-4000:]
        os.kill(int(pidfile.read_text()), signal.SIGKILL)  # from outside, no warning, no cleanup
        train.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)  # the group this test started
            train.wait(timeout=30)
        log.close()
    out = (tmp_path / "train.log").read_text()
    assert train.returncode == 0, out[-4000:]

    run_dir = Location.parse(f"{storage}/tiny-s3")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["attempts"] == 2 and summary["steps"] == 22, summary
    assert summary["run_dir"] == run_dir.uri and summary["checkpoint"].startswith(f"{run_dir.uri}/checkpoint_")
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 23)), lines  # every line, each once
    attempts = [r for r in read_jsonl(run_dir / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    resumed = [(r["attempt"], r["world_size"], r["resumed_from"], r["resumed_step"]) for r in attempts]
    # The path this scenario takes (run.recovery=replica, bucketed, a survivor): rank 0's collective
    # fails as rank 1 dies, rank 0 writes step 12 to the bucket (#15) within Ray's stop of the group
    # (`GraceForSurvivors`), and attempt 2 resumes there; the durable checkpoint (step 10) is not used.
    assert resumed == [(1, 2, "scratch", 0), (2, 2, "replica", 12)], (resumed, out[-4000:])
    assert "written by surviving rank 0" in out and "falling back" not in out, out[-4000:]
    assert [r["attempt"] for r in lines] == [1] * 12 + [2] * 10
    assert all(isinstance(r["time"], float) and "checkpoint_blocked_s" in r for r in lines)
    (val,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]  # the epoch's end, once
    assert val["step"] == 22 and val["attempt"] == 2, val
    # on the uninterrupted run's trajectory: its accuracy after the epoch (286 of the 359 rows)
    final = summary["final_metrics"]["val_accuracy"]
    assert round(val["val_accuracy"], 4) == TINY_EPOCH_ACCURACY == round(final, 4), val
    assert (run_dir / "config.yaml").read_text().startswith("name: tiny-s3")
    state_22, where = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    assert state_22["progress"]["step"] == 22 and where.uri == summary["checkpoint"]

    # Nothing of the run on a local disk: not in the driver's cwd, not in either node's working
    # or temp directory (a URI mistaken for a local path would make a folder "s3:" there).
    files = {"metrics.jsonl", "attempts.jsonl", "summary.json", "config.yaml", "state.pt", "manifest.json", "s3:"}
    for root in (driver_cwd, state / "head", state / "node", state / "ray", state / "ray-node"):
        stray = [p for p in root.rglob("*") if p.name in files]
        assert not stray, stray


# ------------------------------------------------------------------ issue #17: waiting for resources

PLACEMENT_QUERY = r"""
import json, ray
from ray.util.state import list_actors
ray.init(logging_level="ERROR", log_to_driver=False)
groups = [g["state"] for g in ray.util.placement_group_table().values()]
alive = [a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
         if a.class_name in ("TrainController", "RayTrainWorker")]
print(json.dumps({"pending_or_created": [s for s in groups if s in ("PENDING", "CREATED")], "train_actors": alive}))
"""

# What an autoscaler publishes in the GCS: its node types (here: none bigger than 3 CPUs).
NODE_TYPES = r"""
import sys, ray, ray._raylet as r
from ray.core.generated import autoscaler_pb2
from ray.experimental import internal_kv
ray.init(logging_level="ERROR", log_to_driver=False)
key, ns = r.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), r.GCS_AUTOSCALER_STATE_NAMESPACE.encode()
if sys.argv[1] == "put":
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(name="cpu3", min_count=0, max_count=4)
    group.resources["CPU"] = 3
    internal_kv._internal_kv_put(key, config.SerializeToString(), overwrite=True, namespace=ns)
else:
    internal_kv._internal_kv_del(key, namespace=ns)
"""


def _placement_state(env: dict[str, str]) -> dict:
    q = subprocess.run([sys.executable, "-c", PLACEMENT_QUERY], env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr[-3000:]
    return json.loads(q.stdout.strip().splitlines()[-1])


def _train_cmd(runs: Path, name: str, *overrides: str) -> list[str]:
    # 4 CPUs per worker: each node has 3, so no node can ever hold one worker.
    return [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"), f"name={name}",
            "train.max_steps=5", "scaling.cpus_per_worker=4", f"run.storage_path={runs}", *overrides]


@pytest.mark.timeout(400)
def test_a_worker_no_node_can_hold_is_unschedulable_not_a_silent_wait(two_nodes, tmp_path):
    env, runs = _cluster_env(two_nodes), tmp_path / "runs"

    # 1. A fixed cluster (no autoscaler): status lines while waiting, then 'unschedulable' at the timeout.
    started = time.monotonic()
    done = subprocess.run(_train_cmd(runs, "toobig", "scaling.placement_timeout_s=12"), env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - started
    story = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 1, story
    waiting = [line for line in done.stdout.splitlines() if line.startswith("raytrain-ddp: waiting")]
    assert waiting and "{CPU: 4}" in waiting[0] and "scaling.cpus_per_worker" in waiting[0], story
    assert "2 nodes" in waiting[0] and "no autoscaler" in waiting[0] and "giving up at 12s" in waiting[0], story
    summary = json.loads((runs / "toobig" / "summary.json").read_text())
    assert summary["status"] == "unschedulable" and summary["steps"] == 0, summary
    assert "within 12s (scaling.placement_timeout_s)" in summary["error"] and "no node has CPU 4" in summary["error"]
    assert elapsed < 120, f"{elapsed:.0f}s"
    assert _placement_state(env) == {"pending_or_created": [], "train_actors": []}  # nothing left waiting

    # 2. Ctrl-C while waiting (no timeout): exit 130, and the request is withdrawn.
    proc = subprocess.Popen(_train_cmd(runs, "interrupted", "scaling.placement_timeout_s=0"), env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 180, ""
        while "raytrain-ddp: waiting" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
        assert "waiting without limit (scaling.placement_timeout_s=0)" in seen, seen[-3000:]
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)  # seen > 60 s once on a loaded CI machine
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack to stderr (cli.py)
            time.sleep(3)
            proc.kill()
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit 120 s after Ctrl-C; the driver's threads:\n{err[-8000:]}\n{out[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, f"{seen}{out}\n{err}"
    assert "interrupted while waiting for the cluster to place the workers" in err, err[-3000:]
    assert _placement_state(env) == {"pending_or_created": [], "train_actors": []}

    # 3. Node types published (as an autoscaler does) and none can hold a worker: fails at once.
    put = subprocess.run([sys.executable, "-c", NODE_TYPES, "put"], env=env, capture_output=True, text=True, timeout=120)
    assert put.returncode == 0, put.stderr[-3000:]
    try:
        started = time.monotonic()
        done = subprocess.run(_train_cmd(runs, "never", "scaling.placement_timeout_s=600"), env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=240)
        elapsed = time.monotonic() - started
    finally:
        subprocess.run([sys.executable, "-c", NODE_TYPES, "del"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((runs / "never" / "summary.json").read_text())
    assert summary["status"] == "unschedulable" and "no node type of this cluster can hold one worker" in summary["error"]
    assert "cpu3 {CPU: 3}" in summary["error"] and "raytrain-ddp: waiting" not in done.stdout
    assert elapsed < 120, f"{elapsed:.0f}s: not at once"


# ------------------------------------------------------------------ issue #15: a whole node lost
# Kills the second node: only the live node-loss test (which starts it again) comes after it.


@pytest.mark.timeout(400)
def test_a_lost_node_costs_at_most_one_step_and_the_run_goes_on_with_the_survivor(two_nodes, tmp_path):
    """Every process of the second node SIGKILLed mid-epoch (`local-two-node.sh kill-node`).

    The survivor writes the last completed step, the GCS declares the node dead within its
    health-check window (1 s x 3, set by local-two-node.sh as by the cluster files), the
    controller callback (recovery/node_loss.py) waits for that before the new group is sized
    (or finds it already declared, when Ray's health check came first; either is said),
    and the run goes on with one worker: <= 1 step redone, metrics 1..44 once, the same final
    parameters as the uninterrupted two-node run. Before the node-loss callback the new group
    was sized for both nodes and waited for Ray Train's 60 s start timeout (71 s measured).
    """
    state = two_nodes
    reference = state / "runs" / "tiny"
    _reference_run(state)
    runs = tmp_path / "runs"
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        train = subprocess.Popen(
            [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"), "name=lost",
             *ELASTIC, f"run.storage_path={runs}"],
            env={**_cluster_env(state), "PYTHONUNBUFFERED": "1"}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            metrics, deadline = runs / "lost" / "metrics.jsonl", time.monotonic() + 240
            seen = wait_for_step(metrics, train, 8, deadline)
            assert 8 <= seen < 44, log_path.read_text()[-4000:]
            killed_at = time.time()
            kill = subprocess.run([str(SCRIPT), "kill-node", str(state)], env=_base_env(), capture_output=True,
                                  text=True, timeout=60)
            assert kill.returncode == 0, kill.stderr
            last_before = follow_to_resume(metrics, train, seen, deadline)  # attempt 1's last completed step
            train.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if train.poll() is None:
                os.killpg(train.pid, signal.SIGKILL)  # the group this test started
                train.wait(timeout=30)
    out = log_path.read_text()
    assert train.returncode == 0, out[-4000:]
    assert not _alive_members(int((state / "node.pgid").read_text()))

    summary = json.loads((runs / "lost" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["attempts"] == 2 and summary["steps"] == 44, summary
    attempts = [r for r in read_jsonl(runs / "lost" / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    (first, second) = attempts
    assert (first["world_size"], second["world_size"]) == (2, 1), attempts
    lines = [r for r in read_metrics(runs / "lost" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 45)), lines  # every step once
    resumed = second["resumed_step"]
    assert resumed >= last_before - 1, (last_before, attempts)  # <= 1 completed step redone
    assert second["resumed_from"] == "replica" or resumed == last_before, attempts  # a checkpoint at the kill step
    if second["resumed_from"] == "replica":
        assert "written by surviving rank" in out, out[-4000:]
    # The loss is noticed and said, whichever of Ray's paths saw it first: the raylet does not
    # answer (and is waited for), or the GCS already declared it dead by its missed health checks.
    noticed = ("does not answer; waiting for Ray to declare it dead" in out) or ("was declared dead by Ray" in out)
    assert noticed and "1 node(s) declared dead after" in out, out[-4000:]
    back = min(r["time"] for r in lines if r["attempt"] == 2) - killed_at
    print(f"node lost at step ~{seen}: resumed at {resumed} ({second['resumed_from']}), "
          f"next trained step {back:.1f}s after the kill")
    assert back < 45, f"{back:.1f}s from the node loss to the next trained step (71 s before; target 20 s)"

    # The same optimisation as the uninterrupted run on both nodes (exact sharding, fp32).
    final, _ = ckpt.load_latest_valid(ckpt.find_checkpoints(Location.parse(str(runs / "lost"))))
    expected, _ = ckpt.load_latest_valid(ckpt.find_checkpoints(Location.parse(str(reference))))
    assert final["progress"]["step"] == expected["progress"]["step"] == 44
    for name, value in expected["model"].items():
        assert (final["model"][name] - value).abs().max().item() <= 1e-6, name


# ------------------------------------------------------------------ issue #28: a node lost, live recovery
# After the elastic node-loss test: it starts the second node again (`revive-node`) when that
# test left it dead. (Before it, the revived node was not yet in the cluster view Ray Data's
# autoscaling coordinator refreshes every 20 s, and the elastic run started with one worker.)

LIVE = ("train.epochs=2", "run.log_every_steps=1", "scaling.cpus_per_worker=1", "scaling.num_workers=2",
        "scaling.placement_strategy=SPREAD", "run.recovery=live", "run.resume=never")


@pytest.mark.timeout(400)
def test_live_recovery_replaces_a_lost_nodes_worker_on_the_capacity_left(two_nodes, s3, tmp_path):
    """`run.recovery=live`, 2 workers of 1 CPU spread over the two nodes; the second node is
    SIGKILLed mid-epoch. The survivor keeps its process and waits; once the GCS declares the
    node dead it moves the lost worker's placement-group bundle to the head (3 CPUs: room for
    both), Ray's controller starts the replacement there, and the survivor sends it the state:
    0 completed steps redone, every metrics line once, the reference run's final parameters.
    """
    state = two_nodes
    reference = state / "runs" / "tiny"
    _reference_run(state)
    if not _alive_members(int((state / "node.pgid").read_text())):  # the elastic node-loss test killed it
        revive = subprocess.run([str(SCRIPT), "revive-node", str(state)], env={**_base_env(), **s3},
                                capture_output=True, text=True, timeout=200)
        assert revive.returncode == 0, revive.stderr[-3000:]
    runs = tmp_path / "runs"
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        train = subprocess.Popen(
            [sys.executable, "-m", "raytrain_ddp", "train", str(REPO / "examples/configs/tiny.yaml"),
             "name=live-lost", *LIVE, f"run.storage_path={runs}"],
            env={**_cluster_env(state), "PYTHONUNBUFFERED": "1"}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            metrics, deadline = runs / "live-lost" / "metrics.jsonl", time.monotonic() + 300
            seen = wait_for_step(metrics, train, 8, deadline)
            assert 8 <= seen < 44, log_path.read_text()[-4000:]
            killed_at = time.time()
            kill = subprocess.run([str(SCRIPT), "kill-node", str(state)], env=_base_env(), capture_output=True,
                                  text=True, timeout=60)
            assert kill.returncode == 0, kill.stderr
            train.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if train.poll() is None:
                os.killpg(train.pid, signal.SIGKILL)  # the group this test started
                train.wait(timeout=30)
    out = log_path.read_text()
    assert train.returncode == 0, out[-4000:]

    summary = json.loads((runs / "live-lost" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 44, summary
    assert "falls back to run.recovery=replica" not in out, out[-4000:]
    replaced = re.findall(r"live: replacement rank (\d) continues at step (\d+)", out)
    assert len(replaced) == 1, out[-4000:]  # the lost node's worker, replaced once; the other kept its process
    lines = [r for r in read_metrics(runs / "live-lost" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 45)), lines  # every step once
    before, joined = [r["step"] for r in lines if r["time"] < killed_at], int(replaced[0][1])
    assert joined >= max(before), (replaced, before)  # 0 completed steps redone
    # The first step that needed the replacement (a step finished while kill-node ran may come after `killed_at`)
    back = next(r["time"] for r in lines if r["step"] == joined + 1) - killed_at
    print(f"live: node lost after step {max(before)}; rank {replaced[0][0]} replaced at step {joined}, "
          f"next trained step {back:.1f}s after the kill")
    print(next(line for line in out.splitlines() if "live: replacement rank" in line))
    assert back < 45, f"{back:.1f}s from the node loss to the next trained step (target 15 s: the bench's)"

    final, _ = ckpt.load_latest_valid(ckpt.find_checkpoints(Location.parse(str(runs / "live-lost"))))
    expected, _ = ckpt.load_latest_valid(ckpt.find_checkpoints(Location.parse(str(reference))))
    assert final["progress"]["step"] == expected["progress"]["step"] == 44
    for name, value in expected["model"].items():
        assert (final["model"][name] - value).abs().max().item() <= 1e-6, name
