"""Preemption: the guard's policy on a fake clock (the simulated spot reclaim end to end, on
Ray, is tests/ray/elastic/test_preemption_run.py).

The policy tests drive `PreemptionGuard` with a scripted signal source, wall clock and
step clock (world size 1, so nothing is all-reduced): when it polls, when it saves, when
it refuses because the checkpoint no longer fits.
"""

from __future__ import annotations

import pytest

from _hooks import PREEMPT_ENV as SIMULATE_ENV, SimulatedPreemption
from raytrain_ddp.worker.preemption import PreemptionGuard, Signal


class Script:
    """Fake clocks and a fake Ray: each step takes `step_s`; the signal is whatever is set."""

    def __init__(self, step_s: float = 0.1):
        self.now, self.step_s = 1_000.0, step_s
        self.signal = None
        self.polled_at: list[int] = []
        self.logs: list[str] = []

    def guard(self, **kw) -> PreemptionGuard:
        return PreemptionGuard(is_main=True, world_size=1, poll_interval_s=1.0, source=self.source,
                               clock=lambda: self.now, monotonic=lambda: self.now, log=self.logs.append, **kw)

    def source(self, step: int):
        self.polled_at.append(step)
        return self.signal

    def checkpoint(self, guard: PreemptionGuard, seconds: float) -> None:
        self.now += seconds
        guard.checkpoint_took(seconds)

    def run(self, guard: PreemptionGuard, steps: range) -> list[int]:
        saved = []
        for step in steps:
            self.now += self.step_s
            if guard.after_step(step):
                saved.append(step)
        return saved


@pytest.mark.timeout(30)
def test_polls_about_once_a_second_and_saves_once_per_signal_without_deadline():
    s = Script(step_s=0.1)
    guard = s.guard()
    assert s.run(guard, range(1, 32)) == []
    assert s.polled_at == [1, 11, 21, 31]  # first boundary, then every 1 s / 0.1 s per step
    s.signal = Signal(deadline_s=None, ranks=(1,))
    assert s.run(guard, range(32, 60)) == [41]  # next poll; no deadline: save at once, once
    assert s.polled_at[-2:] == [41, 51]
    s.signal = Signal(deadline_s=None, ranks=(1, 2))  # another node: answered again
    assert s.run(guard, range(60, 80)) == [61]
    assert any("ranks [1, 2]" in line and "checkpoint after step 61" in line for line in s.logs)


@pytest.mark.timeout(30)
def test_far_deadline_waits_until_near_then_saves():
    s = Script(step_s=0.1)
    guard = s.guard()
    s.run(guard, range(1, 3))
    s.checkpoint(guard, 2.0)  # margin = 2 x (2.0 + 1.0 + 0.1) = 6.2 s
    s.signal = Signal(deadline_s=s.now + 30.0, ranks=(1,))
    saved = s.run(guard, range(3, 400))
    assert len(saved) == 1
    left = 30.0 - (saved[0] - 2) * 0.1
    assert 5.0 <= left <= 6.2 + 1e-9  # saved when near, not at the first sight of the signal


@pytest.mark.timeout(30)
def test_checkpoint_that_no_longer_fits_is_not_attempted_unless_grace_covers_it():
    for grace, expect in ((0.0, []), (10.0, [11])):
        s = Script(step_s=0.1)
        guard = s.guard(grace_s=grace)
        s.run(guard, range(1, 3))
        s.checkpoint(guard, 5.0)
        s.signal = Signal(deadline_s=s.now + 2.0, ranks=(1,))  # 2 s left, a save takes 5 s
        assert s.run(guard, range(3, 40)) == expect
        if not expect:
            assert any("no just-in-time checkpoint" in line for line in s.logs)


@pytest.mark.timeout(30)
def test_simulated_signal_fires_in_its_attempt_from_its_step(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "step=4,attempt=1,ranks=1+3,deadline_s=30")
    sim = SimulatedPreemption.from_env()
    assert sim == SimulatedPreemption(step=4, attempt=1, ranks=(1, 3), deadline_s=30.0)
    real_calls = []
    poll = sim.source(attempt=1, real=lambda step: real_calls.append(step), clock=lambda: 500.0)
    assert poll(3) is None and poll(4) == poll(9) == Signal(530.0, (1, 3))
    assert real_calls == [3, 4, 9]  # the real (collective) call is always made
    assert sim.source(attempt=2, real=lambda step: None, clock=lambda: 0.0)(9) is None
    monkeypatch.setenv(SIMULATE_ENV, "attempt=1")
    with pytest.raises(ValueError, match="needs step="):
        SimulatedPreemption.from_env()
