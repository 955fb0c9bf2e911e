"""What both recovery benches share (`recovery.py`: replica and checkpoint; `live_recovery.py`:
live): the quickstart they train, and killing one live Ray Train worker from outside.

Must not touch: the product (ops sits above it).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart.yaml"
_BUNDLE = re.compile(r"_group_(\d+)_")


def _kill_a_worker() -> dict[str, Any]:
    """SIGKILL one live RayTrainWorker (rank 1 if its bundle says so); {pid, rank, time}. The
    state API needs the instance's dashboard: the run's config sets `run.dashboard=true`."""
    import ray
    from ray.util.state import list_actors

    # This run's instance by its address: without one the state API looks for Ray
    # processes on the machine and refuses when it finds another instance too.
    actors = list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                         filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    workers = []
    for actor in actors:
        pid = int(getattr(actor, "pid", 0) or 0)
        if pid <= 0:
            continue
        bundles = [int(m.group(1)) for key in (getattr(actor, "required_resources", None) or {})
                   if (m := _BUNDLE.search(key))]
        workers.append((bundles[0] if bundles else None, pid))
    if not workers:
        raise RuntimeError("no live RayTrainWorker found through ray.util.state.list_actors")
    ranked = [w for w in workers if w[0] is not None and w[0] > 0]
    rank, pid = (ranked or workers)[0]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return {"pid": pid, "rank": rank, "time": killed_at, "workers_seen": len(workers)}
