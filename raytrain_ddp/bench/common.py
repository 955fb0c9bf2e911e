"""What every benchmark section shares: timing statistics, sizes, and gloo rank launching.

Owns: `Sizes` (the quick / full presets), `stats` (median and spread of a list of
timings), `run_ranks` (run one function on W gloo ranks on 127.0.0.1 with a hard
deadline) and small helpers. Must not touch: Ray, the training loop, files outside the
directories it is given.

Why a launcher of its own rather than tests/_spawn.py: the package must not import from
tests/. It follows the same rules: loopback only, a free port, one deadline for the
group, ranks killed by pid on expiry, and each rank leaves with `os._exit` once its
answer is queued, so no process-group teardown can hang a benchmark.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import statistics
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable


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


FULL = Sizes("full", rounds=5, steps_per_round=8, warmup_steps=3, mlp_batch=64, gpt_batch=16,
             accum_steps=4, ray_steps=60, ray_warmup=10, ingest_rows=65536, ingest_passes=3,
             train_steps=60)
QUICK = Sizes("quick", rounds=3, steps_per_round=4, warmup_steps=2, mlp_batch=64, gpt_batch=16,
              accum_steps=2, ray_steps=20, ray_warmup=5, ingest_rows=16384, ingest_passes=2,
              train_steps=15)


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankError(RuntimeError):
    """A benchmark rank raised or missed its deadline; the message carries its traceback."""


def _rank_main(fn, world_rank, world_size, port, args, backend, threads, out_q):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(world_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(world_rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=world_rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        payload = ("ok", pickle.dumps(fn(world_rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        payload = ("err", traceback.format_exc())
    out_q.put((world_rank,) + payload)
    out_q.close()
    out_q.join_thread()
    os._exit(0)


_CTX: dict[str, Any] = {}


def _context() -> Any:
    if "ctx" not in _CTX:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _CTX["ctx"] = ctx
    return _CTX["ctx"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
              backend: str = "gloo", threads: int = 1) -> list[Any]:
    """`fn(world_rank, world_size, *args)` on every rank; results by rank, or `RankError`."""
    ctx = _context()
    out_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, args, backend, threads, out_q))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, blob = out_q.get(timeout=0.5)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and out_q.empty():
                    break
                continue
            results[rank] = (status, blob)
            if status == "err":
                break  # peers will fail or hang on the dead rank; stop them all
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(3.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        out_q.close()
    errors = [blob for status, blob in results.values() if status == "err"]
    if errors:
        raise RankError(f"a benchmark rank of {fn.__name__} failed:\n{errors[0]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankError(f"ranks {missing} of {fn.__name__} did not finish within {timeout_s:.0f}s (killed)")
    return [pickle.loads(results[r][1]) for r in range(world_size)]
