"""A worker group's start, as Ray Train's controller sees it: the start-up timeline's stamps
(`timeline.py`: when each group begins, when its actors are up, when its process group is
formed) and the retry of a start that a transient fault failed (issue #56).

Owns: `StartupStamps`, a Ray Train worker-group and controller callback (it runs in the
controller actor, which outlives every restart) that sends those times to the driver's
mailbox, and each failed start as an attempt; `StartHooks`, the hooks seam's call on each
worker before its process group forms (`worker/hooks.py`); `guarded_start`, what a backend's `on_start`
runs its process group's set-up under. Must not touch: the group itself (it only reads the
clock), what the set-up does.

Why a retry: the process group's port is picked by binding a free port and releasing it
(Ray's torch backend); anything that binds in between takes it, and torch's store then
cannot listen (EADDRINUSE) -- a fit beside other work (a sweep's trials, another user's run)
meets it. Such a start (`errors.start_fault`) is handed to Ray Train's own retry: raised as
its `WorkerGroupStartupFailedError`, which its failure policy answers with a new group
(new actors, a fresh port), outside `run.max_failures`; at most `START_TRIES` starts of a
fit end so, the last one's error ends the fit as before. The driver says each retry in one
line, and attempts.jsonl, the timeline and goodput count it (`stream.Recorder`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from raytrain_ddp import ray_compat
from raytrain_ddp.errors import START_TRIES, start_fault

START_FAULT = "the workers' start failed: "  # the message Ray Train carries to `StartupStamps`


def guarded_start(backend: Any, start: Callable[[], None], group: Any) -> None:
    """`start()` (a backend's set-up of `group`'s process group); a transient fault of it is raised
    as a retryable failed start (once the group is stopped), until `START_TRIES` starts failed so.
    `backend` keeps the count: Ray Train's controller holds one backend for the whole fit."""
    try:
        start()
    except Exception as exc:
        cause = start_fault(exc)
        failed = getattr(backend, "start_faults", 0) + 1
        if cause is None or failed >= START_TRIES:
            raise
        backend.start_faults = failed
        ray_compat.abandon_group(group)
        raise ray_compat.start_failed(START_FAULT + cause) from exc


class StartupStamps(ray_compat.worker_group_callback_base(),  # type: ignore[misc]
                    ray_compat.controller_callback_base()):
    """Sends `{"kind": "timeline", "source": "controller", "stamps": {...}}` per group start.

    Attempt 0, seq 0: the record stream passes it on as it comes (`stream.Reorder`); the
    driver's `Timeline` pairs the n-th group start with the n-th attempt rank 0 registers.
    A start that `guarded_start` handed back is registered here as an attempt of its own
    (`start_failed`: the cause), its stamps carrying `failed` (when Ray retries it)."""

    def __init__(self, mailbox: Any, fit_id: str = "") -> None:
        self.mailbox, self.fit_id = mailbox, fit_id
        self._stamps: dict[str, float] = {}
        self._workers = 0
        self._failed = 0

    def before_worker_group_start(self, worker_group_context: Any) -> None:
        self._stamps = {"begin": time.time()}
        self._workers = int(getattr(worker_group_context, "num_workers", 0))

    def before_init_train_context(self, workers: Any) -> dict[str, list[Any]]:
        self._stamps["workers_up"] = time.time()  # placed, and every actor's process up
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._stamps["process_group"] = time.time()  # Ray Train's TorchConfig ran on every worker
        self._send({"kind": "timeline", "source": "controller", "attempt": 0, "seq": 0, "stamps": dict(self._stamps)})

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        message = ray_compat.start_failure(current_state)
        if not message or not message.startswith(START_FAULT):
            return
        self._failed += 1
        now = time.time()
        stamps = {"begin": now, **self._stamps, "failed": now}
        self._stamps = {}
        self._send({"fit_id": self.fit_id, "world_size": self._workers, "time": now,
                    "start_failed": message[len(START_FAULT):], "try": self._failed, "tries": START_TRIES},
                   method="attempt")
        self._send({"kind": "timeline", "source": "controller", "attempt": 0, "seq": 0, "stamps": stamps})

    def _send(self, event: dict[str, Any], method: str = "put") -> None:
        try:
            getattr(self.mailbox, method).remote(event)
        except Exception:  # noqa: BLE001 - a record never decides a start
            pass


class StartHooks(ray_compat.worker_callback_base()):  # type: ignore[misc]
    """Ray Train worker callback: `Hooks.before_process_group` on each worker once its actor is up,
    before its process group forms (a test's fault plan takes the group's port there)."""

    def after_init_train_context(self) -> None:
        import ray.train

        from raytrain_ddp.worker.hooks import load_hooks

        load_hooks().before_process_group(ray.train.get_context().get_world_rank())
