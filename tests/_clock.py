"""A fake clock for tests: a `time.perf_counter` / `time.monotonic` that moves only when told.

`clock()` reads it; `clock.sleep(dt)` (or `clock.now += dt`) moves it. Pass it where the code
under test takes a clock, or monkeypatch it over the module's `time` function.
"""

from __future__ import annotations


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt
