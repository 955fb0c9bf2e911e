"""Size the restarted worker group after a node loss by the nodes that are left.

Owns: `NodeLossWatch`, a Ray Train controller callback (a DeveloperAPI, passed through
`RunConfig(callbacks=...)` by the launcher; it runs inside Ray Train's controller actor).
Must not touch: the training state -- it only delays Ray Train's sizing decision until
Ray knows which nodes are gone.

Why: when a node dies with a training worker on it, the survivors' collectives fail within
milliseconds (replica.py writes their copy of the last step) and Ray Train's
controller restarts the group about 2 s after the kill. Its elastic policy sizes the new
group from Ray Data's autoscaling coordinator, whose view of the cluster (a) still counts
the node until the GCS health check declares it dead and (b) is re-read only every 20 s.
Sized for the old cluster, the new group then waits for a placement group that no living
node can hold until Ray Train's worker-group start timeout (60 s), long after the kill
(the numbers: docs/reliability.md#node-loss).

What it does: at every other state it remembers which nodes are alive; when the controller
enters RESTARTING (or RESCHEDULING), a remembered node the GCS has declared dead since is
said as lost at once (Ray's health check noticed first), and it asks every node
the GCS still calls alive whether its raylet answers (a TCP connect to its node-manager
port, `PROBE_TIMEOUT_S`). Nodes that do not answer are being lost: it waits until the GCS
declares them dead (at most `DECLARE_TIMEOUT_S`; a node that answers again is no longer
waited for), then makes the coordinator re-read the cluster, so the decision that follows
counts only living nodes. A worker process that died on a living node costs one round of
connects (milliseconds) and no wait. How fast the GCS declares a node dead is Ray's
health-check setting, which the cluster files set (docs/reliability.md#node-loss).

Ray internals used, each guarded (a failure logs and leaves Ray's own behaviour), all in
`ray_compat.py`: the controller-callback base class and state names, the coordinator's
actor name and its `get_reserved_resources(requester, recompute=True)`.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from raytrain_ddp import ray_compat

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
DECLARE_TIMEOUT_S = 30.0
POLL_S = 0.2
REQUESTER = "raytrain-ddp:node-loss"


def raylet_answers(address: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if a TCP connection to the node's raylet (node-manager port) opens in time."""
    try:
        with socket.create_connection((address, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def unreachable_nodes(nodes: list[dict[str, Any]], probe: Callable[[str, int], bool] = raylet_answers) -> list[dict]:
    """The nodes the GCS calls alive whose raylet does not answer (probed concurrently)."""
    alive = [n for n in nodes if n.get("Alive") and n.get("NodeManagerPort")]
    if not alive:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(alive))) as pool:
        answers = list(pool.map(lambda n: probe(n["NodeManagerAddress"], n["NodeManagerPort"]), alive))
    return [n for n, ok in zip(alive, answers) if not ok]


def wait_until_declared(lost: list[dict[str, Any]], list_nodes: Callable[[], list[dict]],
                        probe: Callable[[str, int], bool] = raylet_answers, *,
                        timeout_s: float = DECLARE_TIMEOUT_S, poll_s: float = POLL_S,
                        clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep) -> tuple[set[str], set[str]]:
    """Wait until the GCS calls every node of `lost` dead, or it answers again, or the timeout.

    Returns (declared dead, still pending at the timeout), by node id.
    """
    pending = {n["NodeID"]: n for n in lost}
    declared: set[str] = set()
    deadline = clock() + timeout_s
    while pending and clock() < deadline:
        sleep(poll_s)
        alive = {n["NodeID"] for n in list_nodes() if n.get("Alive")}
        for node_id in list(pending):
            if node_id not in alive:
                declared.add(node_id)
                del pending[node_id]
            elif probe(pending[node_id]["NodeManagerAddress"], pending[node_id]["NodeManagerPort"]):
                del pending[node_id]  # it answers again: not lost after all
    return declared, set(pending)


class NodeLossWatch(ray_compat.controller_callback_base()):  # type: ignore[misc]
    """Before Ray Train sizes a restarted group, wait for lost nodes to be declared dead.

    A loss is noticed on either of Ray's paths and said either way: a node whose raylet does
    not answer (waited for here), or one the GCS already declared dead by its missed health
    checks before the restart (a node seen alive at an earlier state of this controller).
    """

    def __init__(self, timeout_s: float = DECLARE_TIMEOUT_S,
                 list_nodes: Callable[[], list[dict]] | None = None, mailbox: Any = None) -> None:
        self.timeout_s = timeout_s
        self.mailbox = mailbox  # the driver's: a declared loss names the restart's cause (goodput.py)
        self._list_nodes = list_nodes  # None: ray.nodes() of the controller's Ray
        self._seen_alive: set[str] = set()

    def _nodes(self) -> list[dict[str, Any]]:
        if self._list_nodes is not None:
            return self._list_nodes()
        import ray

        return ray.nodes() if ray.is_initialized() else []

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        try:
            if ray_compat.is_restart_state(current_state):
                self._settle()
            else:
                self._remember_alive()
        except Exception:  # noqa: BLE001 - never fail the controller: Ray's own path remains
            logger.warning("raytrain-ddp: could not check for lost nodes before the restart", exc_info=True)

    def _remember_alive(self) -> None:
        self._seen_alive = {n["NodeID"] for n in self._nodes() if n.get("Alive")}

    def _settle(self) -> None:
        started = time.monotonic()
        nodes = self._nodes()
        gone = [n for n in nodes if n["NodeID"] in self._seen_alive and not n.get("Alive")]
        lost = unreachable_nodes(nodes)
        if not lost and not gone:
            return
        if gone:
            print(f"raytrain-ddp: node {_names(gone)} was declared dead by Ray", flush=True)
        declared, pending = {n["NodeID"] for n in gone}, set()
        if lost:
            print(f"raytrain-ddp: node {_names(lost)} does not answer; waiting for Ray to declare it dead "
                  "before the new worker group is sized", flush=True)
            newly, pending = wait_until_declared(lost, self._nodes, timeout_s=self.timeout_s)
            declared |= newly
        if declared:
            refresh_coordinator()
            self._tell_driver()
        self._seen_alive -= declared
        print(f"raytrain-ddp: {len(declared)} node(s) declared dead"
              + (f", {len(pending)} still undecided" if pending else "")
              + f" after {time.monotonic() - started:.1f}s; sizing the new worker group", flush=True)


    def _tell_driver(self) -> None:
        """The restart that follows is a node loss: the driver's recorder writes it into the next
        attempt's line of attempts.jsonl (`cause`)."""
        if self.mailbox is None:
            return
        try:
            self.mailbox.put.remote({"kind": "fault", "attempt": 0, "seq": 0, "cause": "node lost", "time": time.time()})
        except Exception:  # noqa: BLE001 - a record of the cause never decides the restart
            pass


def _names(nodes: list[dict[str, Any]]) -> str:
    return ", ".join(f"{n['NodeManagerAddress']}:{n['NodeManagerPort']} ({n['NodeID'][:8]})" for n in nodes)


def refresh_coordinator(timeout_s: float = 5.0) -> bool:
    """Make Ray Data's autoscaling coordinator re-read the cluster's nodes now (see the docstring)."""
    return ray_compat.refresh_autoscaling_coordinator(REQUESTER, timeout_s)
