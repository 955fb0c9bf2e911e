"""`bucket_cap_mb="auto"` (and `compress="auto"`): the layout picked from timed steps of the run.

Owns: the candidates, the order they are tried in over the first synced steps, and the one
decision every rank takes. Must not touch: gradients and buckets (the `bucketed` wrapper
applies each candidate's layout), Ray, the training loop.

Why measured and not derived: the best bucket size depends on the model (when backward
produces each gradient), the network (latency against bandwidth) and the machine (on CPU,
gloo's threads share the cores that run backward, so hiding communication can cost compute).
A layout changes only when bytes go on the wire, never the arithmetic, so the tuning steps
are ordinary training steps. bf16 on the wire is lossy: it is tried only when asked for
with `compress="auto"`, and kept only if it saves at least `BF16_MIN_GAIN` of the step.

Candidates: torch's default cap (25 MB) and caps that cut the model's gradient into about
2, 4, 8 and 16 buckets, one per distinct layout; each with bf16 on the wire if asked.

Schedule: one untimed warm-up sync, then rounds (about `STEPS` timed steps in all, at least
`ROUNDS` per candidate) that visit every candidate once, in an order rotated each round (slow drift of a shared machine spreads over all of them). A
candidate's time is its median over rounds of the synced backward: from its first gradient
to the moment every all-reduce had finished (forward, data and the optimizer do not depend
on the layout). The medians are summed over ranks (`collectives.sum_over_ranks`), so every
rank reads the same totals and picks the same candidate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional

from raytrain_ddp.parallel.collectives import sum_over_ranks

DEFAULT_CAP_MB = 25.0  # torch DDP's (and our) default: always a candidate, so auto cannot pick worse
SPLITS = (2, 4, 8, 16)  # the other candidates: the gradient cut into about this many buckets
MIN_CAP_MB, MAX_CAP_MB = 0.25, 100.0  # below: per-call latency dominates; above: nothing overlaps
STEPS = 18  # timed synced steps in all (split evenly over candidates, at least ROUNDS each)
ROUNDS = 3
BF16_MIN_GAIN = 0.03


def candidate_caps(grad_bytes: int) -> tuple[float, ...]:
    """Caps to try for a model with `grad_bytes` of gradients: the default, and caps that cut
    the gradient into 2..16 buckets (two significant digits, within MIN/MAX_CAP_MB)."""
    caps = {DEFAULT_CAP_MB}
    for n in SPLITS:
        mb = grad_bytes / n / 2**20
        if mb >= MIN_CAP_MB:
            caps.add(min(MAX_CAP_MB, float(f"{mb:.2g}")))
    return tuple(sorted(caps))


@dataclass(frozen=True)
class Candidate:
    cap_mb: float
    compress: Optional[str]
    buckets: int  # how many buckets this cap makes for the model

    @property
    def label(self) -> str:
        return f"{self.cap_mb:g} MB" + (" bf16" if self.compress else "")


def candidates(layout_of: Callable[[float], list], compressions: tuple[Optional[str], ...],
               caps_mb: tuple[float, ...]) -> list[Candidate]:
    """One candidate per distinct layout (`layout_of(cap_mb)`, the smallest cap that makes
    it) and wire format."""
    seen: dict[str, float] = {}
    layouts: list[tuple[float, int]] = []
    for cap in caps_mb:
        layout = layout_of(cap)
        key = repr(layout)
        if key not in seen:
            seen[key] = cap
            layouts.append((cap, len(layout)))
    return [Candidate(cap, c, n) for c in compressions for cap, n in layouts]


class AutoTuner:
    """Which candidate the next synced backward uses; records its time; decides once."""

    def __init__(self, options: list[Candidate], rounds: Optional[int] = None) -> None:
        self.options = options
        self.rounds = rounds or max(ROUNDS, STEPS // max(1, len(options)))
        rounds = self.rounds
        order = list(range(len(options)))
        self._plan = [0] + [i for r in range(rounds) for i in order[r % len(order):] + order[:r % len(order)]]
        self._times: list[list[float]] = [[] for _ in options]
        self._done = 0
        self.choice: Optional[Candidate] = options[0] if len(options) == 1 else None
        self.summary: Optional[dict[str, Any]] = None
        if self.choice is not None:
            self.summary = {"choice": self.choice, "ms": {}, "steps": 0,
                            "why": "every candidate size gives this model the same buckets"}

    @property
    def steps(self) -> int:
        """Synced steps the tuning takes (warm-up included); 0 when there is nothing to try."""
        return 0 if len(self.options) == 1 else len(self._plan)

    @property
    def current(self) -> Candidate:
        if self.choice is not None:
            return self.choice
        return self.options[self._plan[self._done]]

    def record(self, seconds: float, world_size: int = 1, group: Any = None, device: Any = None) -> Candidate:
        """The synced backward that used `current` took `seconds`; returns the candidate for
        the next one. On the last tuning step this is a collective (every rank calls it at
        the same synced step, as every rank runs the same synced backwards)."""
        if self.choice is not None:
            return self.choice
        if self._done > 0:  # the first one warms up
            self._times[self._plan[self._done]].append(seconds)
        self._done += 1
        if self._done < len(self._plan):
            return self.current
        medians = [statistics.median(t) for t in self._times]
        totals = sum_over_ranks(medians, device=device, group=group)
        best = min(range(len(totals)), key=lambda i: totals[i])
        plain = [i for i, c in enumerate(self.options) if c.compress is None]
        if self.options[best].compress is not None and plain:
            best_plain = min(plain, key=lambda i: totals[i])
            if totals[best] > (1.0 - BF16_MIN_GAIN) * totals[best_plain]:
                best = best_plain  # not worth the precision
        self.choice = self.options[best]
        self.summary = {"choice": self.choice, "steps": len(self._plan),
                        "ms": {c.label: 1e3 * totals[i] / world_size for i, c in enumerate(self.options)}}
        return self.choice

    def describe(self) -> str:
        """One line for the console: what was chosen, and what the others measured."""
        if self.summary is None:
            return f"tuning over {len(self.options)} candidates"
        choice = self.summary["choice"]
        head = f"{choice.label} ({choice.buckets} bucket{'s' if choice.buckets != 1 else ''})"
        if not self.summary["ms"]:
            return f"{head}: {self.summary['why']}"
        tried = ", ".join(f"{label} {ms:.2f}" for label, ms in self.summary["ms"].items())
        return (f"{head}; synced backward ms (median of {self.rounds}, mean over ranks) after "
                f"{self.summary['steps']} steps: {tried}")
