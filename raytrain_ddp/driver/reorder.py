"""The record stream's order: rank 0's events back in the order it sent them (`Reorder`).

Owns: holding an event back until every earlier one of its attempt was applied, and
giving up on a gap after `GAP_TIMEOUT_S`. Must not touch: what the events mean
(`driver/stream.py`'s `Recorder` applies them). Split from stream.py for its length.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

logger = logging.getLogger("raytrain_ddp.driver.stream")  # its warnings read as the stream's

GAP_TIMEOUT_S = 5.0  # an event missing this long is taken as lost: what waited behind it goes on


class Reorder:
    """Puts events back into the order rank 0 sent them, across `take`s.

    An attempt's events are numbered 1, 2, ... (its `attempt` event, made by the mailbox
    itself, is 0). `push` returns what can be applied now: the events that continue the
    attempt's sequence, and none past a gap. A gap that stays open `gap_timeout_s` (an
    event lost with its sender) releases what waited, in order; so does a newer attempt
    (nothing of the old one can still be on its way) and `release_all` at the end.
    Events of an attempt older than the newest pass straight through.
    """

    def __init__(self, gap_timeout_s: float = GAP_TIMEOUT_S, clock: Any = time.monotonic) -> None:
        self.gap_timeout_s, self._clock = gap_timeout_s, clock
        self.attempt = 0  # the newest attempt seen
        self._next = 1  # the seq of its next event
        self._held: dict[int, dict[str, Any]] = {}
        self._gap_since: Optional[float] = None

    def push(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ready: list[dict[str, Any]] = []
        for event in sorted(events, key=lambda e: (e.get("attempt", 0), e.get("seq", 0))):
            attempt, seq = int(event.get("attempt", 0)), int(event.get("seq", 0))
            if attempt > self.attempt:  # a new worker group: the old one sends nothing more
                ready += self.release_all()
                self.attempt, self._next = attempt, 1
            if attempt < self.attempt or seq < self._next:
                ready.append(event)
            else:
                self._held[seq] = event
        before = self._next
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        if not self._held:
            self._gap_since = None
        elif self._gap_since is None or self._next != before:  # a gap opened, or the old one closed on a new one
            self._gap_since = self._clock()
        return ready + self.overdue()

    def overdue(self) -> list[dict[str, Any]]:
        """What waited behind a gap open longer than `gap_timeout_s` (else nothing)."""
        if self._gap_since is None or self._clock() - self._gap_since < self.gap_timeout_s:
            return []
        logger.warning("record stream: event %d of attempt %d never arrived; going on without it",
                       self._next, self.attempt)
        return self.release_all()

    def release_all(self) -> list[dict[str, Any]]:
        """Everything held, in order, gaps skipped."""
        ordered = [self._held[seq] for seq in sorted(self._held)]
        if ordered:
            self._next = max(self._held) + 1
        self._held, self._gap_since = {}, None
        return ordered
