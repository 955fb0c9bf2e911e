"""What every benchmark section shares: timing statistics, sizes, and the rank launcher's defaults.

Owns: `Sizes` (the quick / full presets), `stats` (median and spread of a list of
timings), `run_ranks` (the package's launcher, `raytrain_ddp.ops.ranks`, with the
benchmarks' defaults) and small helpers. Must not touch: Ray, the training loop, files
outside the directories it is given.

The launcher is the one the tests use: loopback only, a free port, one deadline for the
group, ranks killed by pid on expiry, and each rank leaves with `os._exit` once its
answer is queued, so no process-group teardown can hang a benchmark.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from raytrain_ddp.ops import ranks as launch
from raytrain_ddp.ops.ranks import RankError, free_port

__all__ = ["Sizes", "FULL", "QUICK", "stats", "ratio", "run_ranks", "free_port", "RankError"]


@dataclass(frozen=True)
class Sizes:
    """How much of everything to run; `--quick` shrinks repetitions, never the models."""

    name: str
    rounds: int  # interleaved A/B rounds per strategy
    steps_per_round: int  # timed steps in each round (after one untimed warm-up step)
    warmup_steps: int  # untimed steps per strategy before the first round
    mlp_batch: int  # per-rank micro-batch of the MLP
    gpt_batch: int  # per-rank micro-batch of the tiny GPT (sequences)
    accum_steps: int  # optimizer steps per k in the accumulation section
    ray_steps: int  # timed steps in each ray_overhead run (after warm-up)
    ray_warmup: int
    ingest_rows: int
    ingest_passes: int
    train_steps: int  # optimizer steps of the real training run (data wait)
    parity_launches: int = 0  # strategies: launches of bucketed_25mb / torch_ddp / control (the #19 verdict)
    parity_rounds: int = 0  # rotated rounds in each of those launches


FULL = Sizes("full", rounds=12, steps_per_round=8, warmup_steps=3, mlp_batch=64, gpt_batch=16,
             accum_steps=4, ray_steps=60, ray_warmup=10, ingest_rows=65536, ingest_passes=5,
             train_steps=60, parity_launches=4, parity_rounds=20)
QUICK = Sizes("quick", rounds=3, steps_per_round=4, warmup_steps=2, mlp_batch=64, gpt_batch=16,
              accum_steps=2, ray_steps=20, ray_warmup=5, ingest_rows=16384, ingest_passes=2,
              train_steps=15, parity_launches=2, parity_rounds=6)


def stats(values: list[float]) -> dict[str, float]:
    """Median and spread; the median resists the odd step that another process delayed."""
    if not values:
        raise ValueError("no timings to summarise")
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "p25": quartiles[0],
        "p75": quartiles[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
              backend: str = "gloo", threads: int = 1) -> list[Any]:
    """`fn(world_rank, world_size, *args)` on every rank; results by rank, or `RankError`.

    One intra-op thread per rank by default: W ranks share this machine's cores, and more
    would time thread contention. A collective stuck for 120 s fails in the rank (and is
    reported with its traceback) well before the group's deadline kills it.
    """
    return launch.run_ranks(fn, world_size, *args, timeout_s=timeout_s, backend=backend, threads=threads,
                            pg_timeout_s=min(120.0, timeout_s))
