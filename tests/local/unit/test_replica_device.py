"""The survivor's copy on CUDA, as logic on a host without GPUs (docs/parallel.md, audit item 3).

Ray's shutdown thread never called `set_device`, so its current device is cuda:0 and its
current stream is that device's default stream. The copy must (1) build its side stream on
the replica's own device, (2) make that stream wait for the boundary's event only, and (3)
run every device read -- the tensor copies and `GradScaler.state_dict()`'s `.item()` --
with that stream current. torch.cuda's stream/event/device functions are faked and record
what they were asked; the copy runs on a thread of its own, as Ray's would.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from raytrain_ddp.recovery import replica
from raytrain_ddp.recovery.replica import LastStep, own_cuda_device

pytestmark = pytest.mark.timeout(30)


def test_own_cuda_device_is_the_replicas_device():
    cpu, k = torch.device("cpu"), torch.device("cuda", 3)
    assert own_cuda_device([cpu, cpu]) is None
    assert own_cuda_device([cpu, k, torch.device("cuda:3")]) == k  # buffers on the CPU are fine
    with pytest.raises(ValueError, match="several CUDA devices"):
        own_cuda_device([k, torch.device("cuda", 0)])


class _FakeCuda:
    """Per-thread current device and stream, as the CUDA runtime keeps them."""

    def __init__(self, monkeypatch) -> None:
        self.local = threading.local()
        self.log: list[tuple] = []
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device = torch.device(device) if device is not None else fake.current_device()
                self.waited: list = []
                fake.log.append(("stream", self.device))

            def wait_event(self, event):
                self.waited.append(event)

            def synchronize(self):
                fake.log.append(("synchronize", self.device))

        class Event:
            def record(self, stream=None):
                self.stream = stream

        @contextlib.contextmanager
        def device(d):
            before, self.local.device = self.current_device(), torch.device(d)
            try:
                yield
            finally:
                self.local.device = before

        @contextlib.contextmanager
        def stream(s):
            before, self.local.stream = getattr(self.local, "stream", None), s
            try:
                yield
            finally:
                self.local.stream = before

        self.Stream = Stream
        for name, value in (("Stream", Stream), ("Event", Event), ("device", device), ("stream", stream),
                            ("current_stream", lambda d=None: ("default stream", torch.device(d or "cuda:0")))):
            monkeypatch.setattr(torch.cuda, name, value)

    def current_device(self) -> torch.device:
        return getattr(self.local, "device", torch.device("cuda", 0))  # nobody called set_device

    def current_stream(self):
        return getattr(self.local, "stream", None) or ("default stream", self.current_device())


def test_the_copy_reads_on_a_side_stream_of_the_replicas_device(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(replica.ckpt, "capture_rng", lambda device=None: ("rng", device))
    module = torch.nn.Linear(2, 2)
    kept = LastStep(module)
    assert kept.device is None and kept.event is None  # CPU: no stream at all
    kept.device = torch.device("cuda", 3)  # as if the replica lived on local GPU 3
    kept.mark()
    assert kept.rng == ("rng", torch.device("cuda", 3))  # the RNG of its own device
    assert kept.event.stream == ("default stream", torch.device("cuda", 3))  # the step's stream

    seen: dict = {}

    class Scaler:  # GradScaler.state_dict() calls .item() on its scale: a read on the current stream
        def state_dict(self):
            seen["scaler_stream"] = fake.current_stream()
            seen["scaler_device"] = fake.current_device()
            return {"scale": 1024.0}

    def copy_from_rays_thread():
        with kept.reading():
            seen["state"] = Scaler().state_dict()
            seen["copy_stream"] = fake.current_stream()
        seen["after"] = fake.current_stream()

    thread = threading.Thread(target=copy_from_rays_thread)  # never called set_device
    thread.start()
    thread.join(10)
    side = seen["scaler_stream"]
    assert isinstance(side, fake.Stream) and side.device == torch.device("cuda", 3)  # not cuda:0
    assert side.waited == [kept.event]  # the boundary's kernels only
    assert seen["scaler_device"] == torch.device("cuda", 3) and seen["copy_stream"] is side
    assert seen["after"] == ("default stream", torch.device("cuda", 0))  # the thread's own state is back
    assert fake.log == [("stream", torch.device("cuda", 3)), ("synchronize", torch.device("cuda", 3))]
