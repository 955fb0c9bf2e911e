"""The controller's stamps of the start-up timeline (`timeline.py`): when each worker group
begins, when its actors are up, when its process group is formed.

Owns: `StartupStamps`, a Ray Train worker-group callback (it runs in the controller actor,
which outlives every restart) that sends those times to the driver's mailbox. Must not
touch: the group itself (it only reads the clock).
"""

from __future__ import annotations

import time
from typing import Any

from raytrain_ddp import ray_compat


class StartupStamps(ray_compat.worker_group_callback_base()):  # type: ignore[misc]
    """Sends `{"kind": "timeline", "source": "controller", "stamps": {...}}` per group start.

    Attempt 0, seq 0: the record stream passes it on as it comes (`stream.Reorder`); the
    driver's `Timeline` pairs the n-th group start with the n-th attempt rank 0 registers."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox
        self._stamps: dict[str, float] = {}

    def before_worker_group_start(self, worker_group_context: Any) -> None:
        self._stamps = {"begin": time.time()}

    def before_init_train_context(self, workers: Any) -> dict[str, list[Any]]:
        self._stamps["workers_up"] = time.time()  # placed, and every actor's process up
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._stamps["process_group"] = time.time()  # Ray Train's TorchConfig ran on every worker
        try:
            self.mailbox.put.remote({"kind": "timeline", "source": "controller", "attempt": 0, "seq": 0,
                                     "stamps": dict(self._stamps)})
        except Exception:  # noqa: BLE001 - a timeline stamp never decides a start
            pass
