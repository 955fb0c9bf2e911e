"""How the wrappers wait for collectives on CUDA, and how the timeout is still enforced
(docs/parallel.md, "CUDA/NCCL path: audit", items 1-2), as logic on CPU.

- `wait_work` on a CUDA device never passes a timeout (on NCCL `work.wait(timeout)` blocks
  the host until the kernel finishes; `work.wait()` only makes the stream wait) and hands
  the work to the watch instead; on CPU (gloo) it waits with the timeout as before.
- `CollectiveWatch` names the oldest unfinished collective once its deadline passes, once,
  and forgets completed ones without being asked.
- The launcher gives NCCL's process group a timeout above ours (the name comes before the
  watchdog), gloo's stays ours; the flight recorder is switched on for GPU runs only.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_ddp.driver.launcher import nccl_env
from raytrain_ddp.parallel.watch import process_group_timeout_s
from raytrain_ddp.parallel import base, watch as watch_module
from raytrain_ddp.parallel.base import CollectiveTimeoutError, CollectiveWatch, wait_work
from _clock import FakeClock

pytestmark = pytest.mark.timeout(30)


class _Work:
    def __init__(self, done: bool = False, fail: str = "") -> None:
        self.done, self.fail = done, fail
        self.waits: list = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.fail:
            raise RuntimeError(self.fail)
        return True

    def is_completed(self) -> bool:
        return self.done


def test_cuda_waits_are_stream_waits_and_go_to_the_watch(monkeypatch):
    watch = CollectiveWatch(report=lambda message: None, poll_s=0)  # no thread: checked by hand
    monkeypatch.setattr(watch_module, "COLLECTIVES", watch)  # where wait_work finds it
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")

    work = _Work()
    wait_work(work, lambda: "all-reduce of bucket 2/3", 300.0, 1, 8, cuda)
    assert work.waits == [None]  # no timeout: the host is never blocked
    assert [t.work for t in watch._inflight] == [work]

    gloo = _Work()
    wait_work(gloo, "all-reduce of bucket 1/3", 300.0, 1, 8, cpu)
    assert len(gloo.waits) == 1 and gloo.waits[0].total_seconds() == 300.0  # gloo unchanged
    assert len(watch._inflight) == 1

    unwatched = _Work()
    wait_work(unwatched, "x", None, 1, 8, cuda)  # no timeout asked: nothing to watch
    assert unwatched.waits == [None] and len(watch._inflight) == 1

    with pytest.raises(CollectiveTimeoutError, match=r"all-reduce of bucket 3/3 failed .*NCCL error.* rank 1 of 8"):
        wait_work(_Work(fail="NCCL error: remote process exited"), "all-reduce of bucket 3/3", 300.0, 1, 8, cuda)


def test_the_watch_names_the_oldest_unfinished_collective_once():
    said: list[str] = []
    clock = FakeClock(100.0)
    watch = CollectiveWatch(report=said.append, poll_s=0, clock=clock)
    first, second, third = _Work(), _Work(), _Work()
    watch.track(first, "all-reduce of bucket 1/2", 10.0, 3, 4)
    watch.track(second, lambda: "all-reduce of bucket 2/2 (1.0 MB, params: fc.weight)", 10.0, 3, 4)
    clock.now += 5
    assert watch.check() is None  # in time
    first.done = True
    clock.now += 6  # second is 11 s old
    message = watch.check()
    assert message == said[0] and len(said) == 1
    assert message.startswith("CollectiveTimeoutError: all-reduce of bucket 2/2 (1.0 MB, params: fc.weight) "
                              "did not finish within 10s on rank 3 of 4")
    assert watch.check() is None and len(said) == 1  # said once
    second.done = True
    watch.track(third, "all-gather of parameter bucket 1/1", 10.0, 3, 4)  # completed ones are dropped
    assert [t.work for t in watch._inflight] == [third]


def test_the_watch_thread_reports_without_the_training_thread(monkeypatch):
    import threading

    said = threading.Event()
    watch = CollectiveWatch(report=lambda message: said.set(), poll_s=0.01)
    watch.track(_Work(), "all-reduce of bucket 1/1", 0.05, 0, 2)
    assert said.wait(5), "the watch thread never reported the stuck collective"


def test_process_group_timeout_is_above_ours_on_nccl_only():
    assert process_group_timeout_s(300.0, use_gpu=False) == 300  # gloo: ours, named by the wait
    assert process_group_timeout_s(0.5, use_gpu=False) == 1
    assert process_group_timeout_s(300.0, use_gpu=True) == 330  # NCCL: 10% later...
    assert process_group_timeout_s(60.0, use_gpu=True) == 90  # ...and at least 30 s
    assert process_group_timeout_s(1000.0, use_gpu=True) == 1100
    assert nccl_env(False, {}) == {}
    assert nccl_env(True, {}) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_env(True, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"


def test_no_timed_wait_outside_the_cpu_branch():
    """The step path's only collective `wait(timeout=...)` is `wait_work`'s CPU branch (shm.py's is
    a barrier of CPU shared memory, never a CUDA collective)."""
    import inspect
    from pathlib import Path

    package = Path(base.__file__).parent
    hits = [(f.name, n) for f in sorted(package.glob("*.py"))
            for n, line in enumerate(f.read_text().splitlines(), 1) if ".wait(timeout=" in line]
    assert sorted({name for name, _ in hits}) == ["shm.py", "watch.py"] and len(hits) == 2, hits
    source = inspect.getsource(wait_work)
    assert "if timeout_s is None or stream:" in source


def test_auto_tuning_on_cuda_times_the_gpu_not_the_enqueue():
    """bucket_cap_mb: auto compares synced backwards; on CUDA by events (audit item 7)."""
    from raytrain_ddp.parallel.bucketed import GpuSpan

    log: list[str] = []

    class _Event:
        def __init__(self) -> None:
            self.at = None

        def record(self) -> None:
            self.at = 10.0 if not log else 35.0  # GPU milliseconds when the stream reaches it
            log.append("record")

        def synchronize(self) -> None:
            log.append("synchronize")

        def elapsed_time(self, end) -> float:
            return end.at - self.at

    span = GpuSpan(event=_Event)
    span.start()
    assert span.seconds() == pytest.approx(0.025) and log == ["record", "record", "synchronize"]


def test_the_watch_thread_sets_the_ranks_cuda_device_first(monkeypatch):
    """Issue #41 item 2: a new thread starts on CUDA device 0, so a watch that queried events
    without `set_device` opened a context on GPU 0 for every local rank k > 0."""
    import threading

    calls: list[tuple[str, object]] = []
    checked = threading.Event()
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))

    class _Seen(_Work):
        def is_completed(self) -> bool:
            if threading.current_thread().name == "raytrain-collective-watch":
                checked.set()
            return False

    watch = CollectiveWatch(report=lambda message: None, poll_s=0.01)
    watch.track(_Seen(), "all-reduce of bucket 1/1", 60.0, 3, 4, device=torch.device("cuda", 3))
    assert checked.wait(5), "the watch thread never looked at the work"
    assert calls == [("raytrain-collective-watch", torch.device("cuda", 3))]  # before its first query
    assert watch_module.thread_device(None) is None and watch_module.thread_device(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert watch_module.thread_device(torch.device("cuda")) == torch.device("cuda", 5)
