"""Signals from outside the loop: Ray's preemption notice and the driver's Ctrl-C.

Owns: the policy that turns Ray Train's preemption signal into "checkpoint at this step
boundary", the driver's stop request (Ctrl-C) into "checkpoint here and stop", and how
often both are polled.
Must not touch: checkpoint files (the loop saves), Ray's controller or FailureConfig
(the launcher maps `run.max_preemption_failures` / `run.preemption_grace_s`), the step.

What Ray gives us (Ray 2.60, `ray.train.get_preemption_info()`): a per-worker-group
watcher actor polls Ray Core's draining nodes every 5 s and marks every worker when a
node of ours is being drained; `get_preemption_info()` then returns a `PreemptionInfo`
(deadline in epoch ms or None, the preempted node -> ranks map). The call is a
*collective*: every rank must make it the same number of times, and it is a round trip
to Ray's synchronisation actor that waits for all ranks (milliseconds, not
microseconds). Calling it after every step of a fast model would cost more than the
step, and the answer only changes every 5 s anyway. So:

* It is polled at step boundaries about every `POLL_INTERVAL_S` seconds, counted in
  steps: at each poll the ranks agree (one MAX all-reduce of three floats) on the
  seconds per step, the duration of the last checkpoint and rank 0's wall clock, and
  derive the step of the next poll from them. Every rank computes the same numbers, so
  every rank polls at the same steps and takes the same decision; nothing time-based is
  decided locally.
* On a signal with a deadline, the checkpoint is taken when the deadline is *near*:
  when the time left is within `2 x (last checkpoint time + poll interval + step time)`,
  so training goes on until shortly before the node is reclaimed (Ray restarts the group
  at the deadline, and everything after the just-in-time checkpoint is redone). If even
  the last checkpoint's duration no longer fits before the deadline plus
  `run.preemption_grace_s`, no checkpoint is attempted (the run falls back to its latest
  periodic checkpoint) and rank 0 says so. Without a deadline (Ray then restarts 120 s
  after it noticed) the checkpoint is taken at once.
* Each distinct signal is answered once; a changed one (another node, an earlier
  deadline) is answered again.
* Until the first checkpoint of an attempt, its duration is unknown and taken as zero.
* The driver's Ctrl-C (issue #25) rides on the same poll: rank 0 asks the driver's
  mailbox (`stop_source`, a round trip of a millisecond or so), its answer is a fourth
  value of the same MAX all-reduce, and from then on every boundary answers "save and
  stop" (`stopping`) until the loop has saved one that is not an epoch's last (that one
  is saved after validation). So a Ctrl-C stops about a poll interval later, with the
  step it stopped at in storage: nothing trained is thrown away.

Tests replace the signal through the hooks object (`Hooks.preemption_source`; see
`tests/_hooks.py`), which may also poll every step so the checkpoint step is
deterministic.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from raytrain_ddp.parallel.collectives import max_over_ranks

if TYPE_CHECKING:
    from raytrain_ddp.config import Config
    from raytrain_ddp.worker.context import Rank
    from raytrain_ddp.worker.hooks import Hooks

POLL_INTERVAL_S = 1.0
MAX_STEPS_BETWEEN_POLLS = 1000


@dataclass(frozen=True)
class Signal:
    """Ray's PreemptionInfo, reduced to what the policy needs (and hashable)."""

    deadline_s: Optional[float]  # epoch seconds; None: Ray did not say
    ranks: tuple[int, ...]


Source = Callable[[int], Optional[Signal]]  # step -> signal; a collective: all ranks call it


def ray_source(step: int) -> Optional[Signal]:
    """Ask Ray Train (a barrier over all ranks; the same answer on every rank)."""
    import ray.train

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    deadline = info.deadline_ms / 1000.0 if info.deadline_ms else None
    return Signal(deadline, tuple(info.preempted_ranks))


class PreemptionGuard:
    """Call `after_step(step)` on every rank at every step boundary; True means save now.

    `checkpoint_took(seconds)` after every checkpoint (periodic ones included) keeps the
    estimate of how long the next one takes current.
    """

    def __init__(self, *, is_main: bool, world_size: int, grace_s: float = 0.0,
                 poll_interval_s: float = POLL_INTERVAL_S, source: Source = ray_source,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 agree: Optional[Callable[[Sequence[float]], list[float]]] = None,
                 device: Optional[torch.device] = None,
                 stop_source: Callable[[], bool] = lambda: False,
                 log: Callable[[str], None] = lambda msg: print(msg, flush=True)) -> None:
        self.is_main, self.world_size = is_main, world_size
        self.grace_s, self.poll_interval_s = grace_s, poll_interval_s
        self.source, self.clock, self.monotonic = source, clock, monotonic
        self.stop_source = stop_source
        self.stopping = False  # the driver asked to stop: every boundary from now on saves
        self.agree = agree or (lambda values: max_over_ranks(values, device))
        self.log = log
        self.next_poll: Optional[int] = None  # first boundary seen: poll there
        self.checkpoint_s = 0.0
        self.answered: Optional[Signal] = None
        self.polls = 0
        self._mark, self._steps, self._paused_s = monotonic(), 0, 0.0

    @classmethod
    def for_worker(cls, cfg: "Config", rank: "Rank", hooks: "Hooks", stop_source: Callable[[], bool] = lambda: False,
                   real: Source = ray_source,
                   agree: Optional[Callable[[Sequence[float]], list[float]]] = None) -> "PreemptionGuard":
        """The loop's guard: Ray's signal (`real`: none in local mode), unless the hooks object
        replaces it (tests); `agree` as the constructor's."""
        source, interval = hooks.preemption_source(real) or (real, POLL_INTERVAL_S)
        return cls(is_main=rank.is_main, world_size=rank.world_size, grace_s=cfg.run.preemption_grace_s,
                   poll_interval_s=interval, source=source, device=rank.device, stop_source=stop_source,
                   agree=agree)

    def checkpoint_took(self, seconds: float) -> None:
        self.checkpoint_s = seconds
        self._paused_s += seconds

    def after_step(self, step: int) -> bool:
        self._steps += 1
        if self.stopping:
            return True
        if self.next_poll is not None and step < self.next_poll:
            return False
        return self._poll(step)

    def _poll(self, step: int) -> bool:
        self.polls += 1
        signal = self.source(step)
        now_mono = self.monotonic()
        per_step = max(0.0, now_mono - self._mark - self._paused_s) / max(1, self._steps)
        stop = 1.0 if self.is_main and self.stop_source() else 0.0
        per_step, checkpoint_s, now, stop = self.agree(
            [per_step, self.checkpoint_s, self.clock() if self.is_main else 0.0, stop])
        self._mark, self._steps, self._paused_s = now_mono, 0, 0.0
        every = self.poll_interval_s / per_step if per_step > 0 else 1.0
        self.next_poll = step + min(MAX_STEPS_BETWEEN_POLLS, max(1, math.ceil(every)))
        if stop > 0:
            self.stopping = True  # the checkpointer says where it stopped
            return True
        if signal is None or signal == self.answered:
            return False
        if signal.deadline_s is None:
            return self._answer(signal, step, "no deadline given: checkpoint now")
        left = signal.deadline_s - now
        if left + self.grace_s < checkpoint_s:
            self.answered = signal
            if self.is_main:
                self.log(f"[rank 0] preemption of ranks {list(signal.ranks)} in {left:.1f}s "
                         f"(+{self.grace_s:g}s grace): the last checkpoint took {checkpoint_s:.1f}s, "
                         "no just-in-time checkpoint; the run resumes from its latest checkpoint")
            return False
        margin = 2.0 * (checkpoint_s + self.poll_interval_s + per_step)
        if left <= margin:
            return self._answer(signal, step, f"deadline in {left:.1f}s")
        if per_step > 0:  # not near yet: make sure a poll lands before it is
            self.next_poll = min(self.next_poll, step + max(1, math.floor((left - margin) / per_step)))
        return False

    def _answer(self, signal: Signal, step: int, why: str) -> bool:
        self.answered = signal
        if self.is_main:
            self.log(f"[rank 0] preemption of ranks {list(signal.ranks)} signalled ({why}): "
                     f"checkpoint after step {step}")
        return True
