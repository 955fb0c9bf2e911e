"""The two-node local cluster (`cluster/local-two-node.sh`) for the tests that need one, and for the
bench's node-loss runs (`benchmarks/recovery.py` imports it from here: the helper is test
machinery, kept outside the package).

Owns: the cluster's environment, `up`/`down` around a block, and following a run's metrics
across a kill. Must not touch: what the tests or the bench assert or measure.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

CLUSTER_SCRIPT = Path(__file__).resolve().parents[1] / "cluster" / "local-two-node.sh"


def two_node_env(state: Optional[Path] = None) -> dict[str, str]:
    """The environment for `cluster/local-two-node.sh` and its clients: this process's, without
    any Ray, raytrain-ddp or script settings, this Python's bin first on PATH; with `state`
    (`up`'s state directory), the cluster's own exports (RAY_ADDRESS, the token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_", "RT2N_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for line in (state / "env").read_text().splitlines() if state is not None else []:
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value
    return env


@contextlib.contextmanager
def two_node_cluster(timeout_s: float = 400.0) -> Iterator[Path]:
    """`local-two-node.sh up` in this process's environment (a bucket's endpoint reaches the
    nodes), yielding its state dir; `down` at the end stops exactly what `up` and `revive-node`
    started, also when `up` gave up after starting something (the dir it named first)."""
    up = subprocess.run([str(CLUSTER_SCRIPT), "up"], env={**two_node_env(), "RT2N_UP_TIMEOUT_S": "120"},
                        capture_output=True, text=True, timeout=timeout_s)
    said = re.search(r"local-two-node: state dir (\S+)", up.stderr)
    state = Path(up.stdout.strip().splitlines()[-1]) if up.returncode == 0 else Path(said.group(1)) if said else None
    try:
        if up.returncode != 0:
            raise RuntimeError(f"local-two-node.sh up failed: {up.stderr[-3000:]}")
        yield state
    finally:
        if state is not None:
            subprocess.run([str(CLUSTER_SCRIPT), "down", str(state)], env=two_node_env(), capture_output=True,
                           timeout=120)


def last_logged_step(metrics: Path) -> int:
    """The newest step of a train line in `metrics.jsonl` (0 before the first)."""
    from raytrain_ddp.rundir import read_metrics

    return max([r["step"] for r in read_metrics(metrics) if "loss" in r], default=0) if metrics.exists() else 0


def wait_for_step(metrics: Path, proc: Any, step: int, deadline: float, poll_s: float = 0.05) -> int:
    """Poll until a train line of `step` (or later) is logged, `proc` ends, or `deadline`
    (time.monotonic); returns the newest step seen."""
    seen = 0
    while seen < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)
        seen = last_logged_step(metrics)
    return seen


def follow_to_resume(metrics: Path, proc: Any, seen: int, deadline: float, poll_s: float = 0.05) -> int:
    """After a kill: the last step attempt 1 completed, followed until attempt 2 logs a line.

    The driver drops attempt 1's lines past the resume step once attempt 2 says where it
    resumed, so that step is seen only live. `seen`: the newest step logged before the kill.
    """
    from raytrain_ddp.rundir import read_metrics

    last = seen
    while proc.poll() is None and time.monotonic() < deadline:
        rows = [r for r in read_metrics(metrics) if "loss" in r]
        last = max([last] + [r["step"] for r in rows if r["attempt"] == 1])
        if any(r["attempt"] > 1 for r in rows):
            break
        time.sleep(poll_s)
    return last
