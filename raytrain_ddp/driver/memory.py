"""Will the data fit? The driver's estimate of each worker's copy, before any worker starts.

Owns: the check that `data.sharding: exact` (every worker holds the whole training set,
so that the samples of step s do not depend on the worker count) fits in a worker's
share of its node's memory. Must not touch: reading data (`data/ray_datasets.py` hands over
the size), training.

With exact sharding a worker holds the Arrow blocks Ray Data hands over, the numpy views cut
from them, and the epoch's shuffled copy, so it needs about `EXACT_COPIES` x the data's
in-memory size (the measurement: docs/design.md#measurements-behind-the-code). A worker's share is the smallest alive node's memory (Ray's `memory` resource, what
Ray lets tasks use) divided by the workers that node would run (its CPUs over
`scaling.cpus_per_worker`, at most the run's worker count). Over it, the run stops with
one line naming `data.sharding=sharded` (each worker reads only its own chunks), instead
of a worker OOM-killed in the middle of its first epoch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

from raytrain_ddp.errors import UserError

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

EXACT_COPIES = 3.0
GiB = 1024 ** 3


def check_exact_fits(cfg: "Config", data_bytes: int, nodes: Optional[list[dict[str, Any]]] = None) -> None:
    """Raise a `UserError` when exact sharding's per-worker copy exceeds a worker's memory share.

    `nodes`: Ray's `ray.nodes()` (asked here when None); nothing is checked without them.
    """
    if cfg.data.sharding != "exact" or data_bytes <= 0:
        return
    share = worker_share(cfg, _alive(nodes))
    if share is None:
        return
    need = EXACT_COPIES * data_bytes
    if need <= share[0]:
        return
    memory, per_node = share[1], share[2]
    raise UserError(
        f"data.sharding=exact: the training data takes {data_bytes / GiB:.2f} GiB in memory and every worker "
        f"keeps about {EXACT_COPIES:g}x that ({need / GiB:.2f} GiB), more than a worker's share of its node's "
        f"memory ({share[0] / GiB:.2f} GiB: {per_node} worker(s) on a node with {memory / GiB:.2f} GiB for Ray); "
        "use data.sharding=sharded (each worker reads only its own chunks of every global batch), more nodes, "
        "or fewer workers per node (scaling.cpus_per_worker)")


def worker_share(cfg: "Config", nodes: list[dict[str, Any]]) -> Optional[tuple[float, float, int]]:
    """(bytes per worker, the node's memory, workers on it) on the smallest node that runs workers."""
    shares = []
    for node in nodes:
        resources = node.get("Resources", {})
        memory, cpus = float(resources.get("memory", 0.0)), float(resources.get("CPU", 0.0))
        if memory <= 0 or cpus < cfg.scaling.cpus_per_worker:
            continue  # a node no worker runs on
        per_node = max(1, min(cfg.scaling.max_workers, math.floor(cpus / cfg.scaling.cpus_per_worker)))
        shares.append((memory / per_node, memory, per_node))
    return min(shares) if shares else None


def _alive(nodes: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    if nodes is None:
        import ray

        nodes = ray.nodes() if ray.is_initialized() else []
    return [n for n in nodes if n.get("Alive", True)]
