"""Waiting on the wrappers' collectives, and timing them.

Owns: `process_group_timeout_s` (the group's timeout, against the watch's), `wait_work` (an
async collective's wait that becomes a `CollectiveTimeoutError` naming the operation),
`CollectiveWatch` (one per process: CUDA collectives the step never waits on, named when
stuck), NCCL's flight-recorder dump, and the host-side timing of gradient all-reduces
(`CommClock`, `split_comm_time`, `comm_timing`). Must not touch: Ray, anything of ours
outside `parallel/`; only torch and torch.distributed.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from raytrain_ddp.parallel import torch_compat
from raytrain_ddp.parallel.errors import CollectiveTimeoutError


def process_group_timeout_s(collective_timeout_s: float, use_gpu: bool) -> int:
    """The timeout Ray Train gives the process group (`TorchConfig.timeout_s`).

    gloo: `parallel.collective_timeout_s` itself -- a gloo wait that outlives it raises
    `CollectiveTimeoutError` naming the operation. NCCL: above it (10%, at least 30 s):
    the step never waits on the host for a collective, so NCCL's watchdog enforces the
    timeout by ending the process, and the wrappers' watch (`CollectiveWatch`, below)
    must name the stuck collective first, at `collective_timeout_s`. With the two equal
    the watchdog and the name would race (Ray sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1).
    """
    if not use_gpu:
        return int(math.ceil(collective_timeout_s))
    return int(math.ceil(collective_timeout_s + max(30.0, 0.1 * collective_timeout_s)))


def split_comm_time(backward_end: float, spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(communication time, the part of it after `backward_end`) from (start, end) spans.

    Communication time is the length of the union of the spans (two all-reduces in flight
    at once count once); the exposed part is that union clipped to after backward ended.
    """
    comm = exposed = 0.0
    lo = hi = None
    for start, end in sorted(spans) + [(float("inf"), float("inf"))]:
        if hi is not None and start > hi:
            comm += hi - lo
            exposed += max(0.0, hi - max(lo, backward_end))
            lo = hi = None
        if hi is None:
            lo, hi = start, max(start, end)
        else:
            hi = max(hi, end)
    return comm, exposed


class CommClock:
    """When each gradient all-reduce of one backward was launched and completed (CPU/gloo).

    Completion is observed from the training thread, never from gloo's: `poll` (called by
    the gradient hooks while something is in flight, and when backward ends) stamps each
    work it finds complete, and after backward each `wait`'s return stamps the rest. A work
    that finished during backward is thus stamped at the next gradient hook (an upper bound
    of its end, at most one gradient later), which is hidden time either way; the exposed
    part is exact. A Python callback on the work's future would instead take the GIL on
    gloo's thread once per bucket, against the training thread: it measured ~1 ms of CPU
    per step on the bench's MLP (2 buckets), more than the rest of the wrapper's Python.
    On CUDA a work completes when the collective is queued on the stream, not when it ran,
    so host clocks cannot tell: the wrappers time only CPU tensors (`comm_timing(device)`);
    use torch.profiler on GPUs.
    """

    __slots__ = ("started", "ended", "works", "open")

    def __init__(self) -> None:
        self.started: list[float] = []
        self.ended: list[float] = []
        self.works: list = []
        self.open: list[int] = []  # slots launched and not yet seen complete

    def launched(self, work) -> None:
        self.open.append(len(self.works))
        self.works.append(work)
        self.started.append(time.perf_counter())
        self.ended.append(0.0)

    def poll(self) -> None:
        """Stamp, with the time now, every open work that has completed."""
        now, still = 0.0, []
        for slot in self.open:
            if self.works[slot].is_completed():
                self.ended[slot] = now = now or time.perf_counter()
            else:
                still.append(slot)
        self.open = still

    def spans(self) -> list[tuple[float, float]]:
        """Call after every work was waited for (and polled); an unstamped one reads as now."""
        now = time.perf_counter()
        return [(s, e if e else now) for s, e in zip(self.started, self.ended)]


def comm_timing(device: torch.device) -> bool:
    """Whether host clocks see when a collective on `device` ran (see `CommClock`)."""
    return device.type == "cpu"


# -- waiting on collectives --------------------------------------------------------------

def wait_work(work, what: Union[str, Callable[[], str]], timeout_s: Optional[float], world_rank: int,
              world_size: int, device: Optional[torch.device] = None) -> None:
    """Wait for an async collective; a timeout or failure becomes a `CollectiveTimeoutError`.

    `what` names the operation; a callable is called only if it fails (the name of a bucket
    costs string formatting, and a wait happens per bucket per step).

    CPU tensors (gloo): `work.wait(timeout)` blocks this thread until the collective
    completes or `timeout_s` passes, then raises the named error. `timeout_s=None` waits
    as long as the process group's own timeout (set at `init_process_group`) allows; a
    failure then is still reported with `what` in it.

    CUDA tensors (`device` on CUDA; NCCL): never a host wait. `work.wait()` without a
    timeout only makes the current CUDA stream wait for the collective and returns at
    once, as torch DDP's `fut.wait()` does, so the host keeps queueing work while the GPU
    computes. (`work.wait(timeout)` would block the host until the kernel finished: one
    host sync per bucket.) The timeout is then enforced without the host: `COLLECTIVES`,
    a watch thread, names a collective still unfinished after `timeout_s` (the named
    `CollectiveTimeoutError` text, on stderr and in the log, with NCCL's flight recorder
    dumped next to it where torch has one); NCCL's watchdog ends the process at the
    process group's timeout, which the launcher sets above `timeout_s` (so the name comes
    first).
    """
    stream = device is not None and device.type != "cpu"
    try:
        if timeout_s is None or stream:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo: RuntimeError("Operation timed out!"), DistBackendError, ...
        text = str(exc)
        if timeout_s is not None and "timed out" in text.lower():
            verdict = f"did not finish within {timeout_s:g}s"
        else:
            verdict = f"failed ({type(exc).__name__}: {text.strip().splitlines()[0] if text else ''})"
        raise CollectiveTimeoutError(_stuck_message(what, verdict, world_rank, world_size)) from exc
    if stream and timeout_s is not None:
        COLLECTIVES.track(work, what, timeout_s, world_rank, world_size, device=device)


def _stuck_message(what: Union[str, Callable[[], str]], verdict: str, world_rank: int, world_size: int) -> str:
    what = what() if callable(what) else what
    return (f"{what} {verdict} on rank {world_rank} of {world_size}; a peer rank probably died, "
            "hangs, or skipped this step (every rank must run the same synced backward passes)")


class _Tracked:
    __slots__ = ("deadline", "work", "what", "timeout_s", "world_rank", "world_size")

    def __init__(self, deadline, work, what, timeout_s, world_rank, world_size) -> None:
        self.deadline, self.work, self.what = deadline, work, what
        self.timeout_s, self.world_rank, self.world_size = timeout_s, world_rank, world_size


class CollectiveWatch:
    """Names a CUDA collective that outlives its timeout, without the step ever waiting on it.

    `track` (per bucket, on the training thread) appends the work and first drops those
    completed (collectives of one process group complete in launch order, so the oldest
    unfinished one is the stuck one; what is kept is what is in flight, at most a step's
    worth). A daemon thread, started at the first `track`, calls `check` every
    `poll_s`: the oldest unfinished work past its deadline is reported once, through
    `report` (default: stderr, the log, and NCCL's flight recorder dumped). `is_completed`
    on NCCL queries a CUDA event: it never blocks.

    The thread first makes the training thread's CUDA device its own (`thread_device`): a
    new thread starts on device 0, and its first `is_completed` (cudaEventQuery) would open
    a CUDA context there, ~0.5 GiB on GPU 0 for every local rank k > 0 of a node (issue #41).
    """

    def __init__(self, report: Optional[Callable[[str], None]] = None, poll_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._inflight: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._report = report or report_stuck_collective
        self._poll_s = poll_s
        self._clock = clock
        self.reported: list[str] = []

    def track(self, work, what: Union[str, Callable[[], str]], timeout_s: float, world_rank: int,
              world_size: int, device: Optional[torch.device] = None) -> None:
        with self._lock:
            self._drop_completed()
            self._inflight.append(_Tracked(self._clock() + timeout_s, work, what, timeout_s, world_rank, world_size))
            if self._thread is None and self._poll_s != 0:
                poll = self._poll_s or min(5.0, max(0.05, timeout_s / 20))
                self._thread = threading.Thread(target=self._run, args=(poll, thread_device(device)),
                                                name="raytrain-collective-watch", daemon=True)
                self._thread.start()

    def _drop_completed(self) -> None:
        while self._inflight and self._inflight[0].work.is_completed():
            self._inflight.popleft()

    def check(self) -> Optional[str]:
        """One look: the message for the oldest unfinished collective past its deadline (once)."""
        with self._lock:
            self._drop_completed()
            head = self._inflight[0] if self._inflight else None
            if head is None or self._clock() < head.deadline:
                return None
            self._inflight.popleft()  # reported once; the next one gets its own deadline
        message = _stuck_message(head.what, f"did not finish within {head.timeout_s:g}s", head.world_rank,
                                 head.world_size)
        message = f"{CollectiveTimeoutError.__name__}: {message}"
        self.reported.append(message)
        self._report(message)
        return message

    def _run(self, poll_s: float, device: Optional[torch.device] = None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        while True:
            time.sleep(poll_s)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watch must never take the worker down
                logging.getLogger(__name__).exception("collective watch")


def thread_device(device: Optional[torch.device]) -> Optional[torch.device]:
    """The CUDA device a helper thread must set before touching CUDA (None for CPU tensors).

    Called on the training thread: a `cuda` without an index means its current device.
    """
    if device is None or device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def report_stuck_collective(message: str) -> None:
    """Say which collective is stuck (stderr and the log), and dump NCCL's flight recorder."""
    dumped = dump_flight_recorder()
    text = message + (f" (NCCL flight recorder dumped to {dumped})" if dumped else "")
    print(text, file=sys.stderr, flush=True)
    logging.getLogger(__name__).error(text)


def dump_flight_recorder() -> Optional[str]:
    """NCCL's flight recorder (the last collectives, TORCH_NCCL_TRACE_BUFFER_SIZE of them) to a
    file next to where torch's own dump goes; None where torch or the build has none."""
    dump = torch_compat.nccl_trace_dump()
    if dump is None or not int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0):
        return None
    try:
        prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or os.path.join(tempfile.gettempdir(),
                                                                                   "nccl_trace_rank_")
        rank = dist.get_rank() if dist.is_initialized() else os.getpid()
        path = f"{prefix}{rank}_raytrain"
        with open(path, "wb") as f:
            f.write(dump())
        return path
    except Exception:  # noqa: BLE001 - the name is what matters; the dump is a bonus
        return None


COLLECTIVES = CollectiveWatch()  # one per process: every wrapper's CUDA collectives
