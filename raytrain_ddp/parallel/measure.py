"""Step-time measurement of the strategies, run inside each rank of a process group.

Owns: the timing protocol (what a "step" is, warm-up, round-robin interleaving, which
number is reported), so benchmarks elsewhere reuse one definition. Must not touch: Ray,
process launching (callers start the ranks: benchmarks/strategy_step_time.py, the bench
suite), files.

A step is forward + loss + backward (with the strategy's gradient sync) + optimizer step
+ zero_grad, on the same fixed batch. Strategies are interleaved round-robin (A B C A B C
...) so machine noise (other processes, frequency changes) hits all of them alike; every
step starts after a barrier so ranks begin together, and a step's time is the slowest
rank's (all-reduce MAX), because that is when the next step can start. Warm-up rounds are
excluded; the median of the remaining rounds is reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.parallel import wrap_model

NO_COMM = "none"  # the bare module, no wrapper: compute-only baseline
TORCH_DDP = "torch_ddp"  # torch DDP exactly as torch ships it (no counting comm hook): the bar


def articles_mlp(width: int = 1024, out: int = 256) -> nn.Module:
    """The articles' MLP: Linear 1024->1024, ReLU, 1024->1024, ReLU, 1024->256."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, out))


def time_strategies(
    strategies: list[str],
    *,
    batch_size: int = 64,
    warmup: int = 5,
    rounds: int = 30,
    bucket_cap_mb: float = 25.0,
    compress: Optional[str] = None,
    seed: int = 0,
    model_fn=articles_mlp,
) -> dict[str, dict[str, float]]:
    """Median step time (seconds) per strategy; call on every rank (or alone, for NO_COMM).

    `strategies`: names from STRATEGIES plus NO_COMM and TORCH_DDP (untouched torch DDP).

    Returns {strategy: {"median_s", "p10_s", "p90_s", "allreduce_calls_per_step",
    "allreduce_bytes_per_step"}}; the same on every rank.
    """
    distributed = dist.is_initialized()
    torch.manual_seed(seed)
    setups = {}
    for name in strategies:
        model = model_fn()
        if name == TORCH_DDP:
            model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
            if compress == "bf16":
                model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name != NO_COMM:
            model = wrap_model(model, name, bucket_cap_mb=bucket_cap_mb,
                               compress=compress if name != "naive" else None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        setups[name] = (model, opt)
    gen = torch.Generator().manual_seed(seed + (dist.get_rank() if distributed else 0))
    x = torch.randn(batch_size, 1024, generator=gen)
    y = torch.randint(0, 256, (batch_size,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    times: dict[str, list[float]] = {name: [] for name in strategies}
    for round_ in range(warmup + rounds):
        for name, (model, opt) in setups.items():
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(elapsed)
            if round_ == warmup - 1 and hasattr(model, "reset_comm_stats"):
                model.reset_comm_stats()

    result = {}
    for name, samples in times.items():
        t = torch.tensor(samples, dtype=torch.float64)
        if distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
        values = sorted(t.tolist())
        stats = getattr(setups[name][0], "comm_stats", {})  # torch_ddp / none: not counted
        result[name] = {
            "median_s": statistics.median(values),
            "p10_s": values[len(values) // 10],
            "p90_s": values[(len(values) * 9) // 10 - 1],
            "allreduce_calls_per_step": stats.get("allreduce_calls", 0) / rounds,
            "allreduce_bytes_per_step": stats.get("allreduce_bytes", 0) / rounds,
        }
    return result
