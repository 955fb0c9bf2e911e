"""What each strategy keeps per rank, what it sends, and what that costs in step time.

Owns: the `memory` section. Must not touch: Ray, data loading, the strategies themselves
(everything is read through public surfaces: parameters, gradients, the optimizer's
state and param groups, `comm_stats`).

How it is measured:
- One launch of W gloo ranks; per model (the articles' MLP and the tiny GPT) a copy of
  the same seeded model per strategy (`bucketed`, `zero1`, `fsdp`), AdamW, fp32.
- Bytes per rank after a synced step, each storage counted once: parameters (the
  module's, plus what the optimizer steps: zero1's slices are views into the same
  buffers), gradients (the module's plus the optimizer params' `.grad`: zero1's reduced
  chunk), optimizer state (`optimizer.state`; DTensors count their local shard). Taken on
  every rank; the table shows the largest.
- Wire bytes per optimizer step from `comm_stats` (one window of `k` micro-steps): the
  gradient sync (all-reduce or reduce-scatter) and the parameter all-gather, against
  theory: every gradient byte once, and for the sharded strategies every parameter byte
  once per all-gather.
- Step time (fwd+bwd over k micro-batches, clip, step) per strategy, rounds interleaved
  as in the `strategies` section; the median of the slowest rank per step.
- `fits`: from the measured bytes per parameter, whether each part is replicated (about
  its full size on every rank) or sharded (about 1/W), the largest fp32 AdamW model whose
  parameters + gradients + optimizer state fit one device of a given size at a given
  worker count. Activations and temporary buffers (fsdp's gathered units) are not in it.

Part of `raytrain-ddp bench`; alone: `python -m benchmarks.memory [--quick]`.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from raytrain_ddp.models import cross_entropy
from benchmarks.common import Sizes, run_ranks, stats
from benchmarks.strategies import build_model, make_batch
from raytrain_ddp.parallel import registry

STRATEGIES = (registry.DEFAULT,) + registry.SHARDED  # the default replicated one, then the sharded
MICRO_STEPS = 2
# The table's scenario: a device and a worker count people train on.
DEVICE_GB, FIT_WORKERS = 80, 8


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def resident_bytes(model, optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state held on this rank (each storage once)."""
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    params = list(model.module.parameters()) + stepped
    grads = [p.grad for p in params]
    state = [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optimizer": _storage_bytes(state)}


def memory_rank(world_rank: int, world_size: int, model_name: str, sizes: Sizes) -> dict[str, Any]:
    from raytrain_ddp.parallel import accumulation_window, wrap_model

    base = build_model(model_name)
    batch = (sizes.mlp_batch if model_name == "mlp" else sizes.gpt_batch) // MICRO_STEPS
    micro = [make_batch(base, model_name, batch, seed=3000 + 31 * world_rank + j, device=torch.device("cpu"))
             for j in range(MICRO_STEPS)]
    variants = []
    for strategy in STRATEGIES:
        model = wrap_model(copy.deepcopy(base), strategy, bucket_cap_mb=25.0)
        opt = model.make_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-4))
        variants.append((strategy, model, opt))

    def step(model, opt, keep_grads: bool = False) -> None:
        for (x, y), scale in accumulation_window(model, iter(micro), expected=MICRO_STEPS):
            (cross_entropy(model(x), y) * scale).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        if not keep_grads:
            opt.zero_grad(set_to_none=True)

    out: dict[str, Any] = {"params": sum(p.numel() for p in base.parameters()), "batch": batch * MICRO_STEPS,
                           "bytes": {}, "wire": {}, "times_ms": {s: [] for s in STRATEGIES}}
    for strategy, model, opt in variants:
        step(model, opt)  # warm-up; optimizer state exists from here on
        model.reset_comm_stats()
        step(model, opt, keep_grads=True)  # what a rank holds right after a step, gradients included
        out["bytes"][strategy] = resident_bytes(model, opt)
        comm = model.comm_stats
        out["wire"][strategy] = {k: comm.get(k, 0) for k in ("allreduce_calls", "allreduce_bytes",
                                                             "reduce_scatter_bytes", "all_gather_bytes")}
        opt.zero_grad(set_to_none=True)
    for r in range(sizes.rounds):
        shift = r % len(variants)
        for strategy, model, opt in variants[shift:] + variants[:shift]:
            dist.barrier()
            step(model, opt)
            for _ in range(sizes.steps_per_round):
                start = time.perf_counter()
                step(model, opt)
                out["times_ms"][strategy].append((time.perf_counter() - start) * 1e3)
    return out


def _kind(measured: float, full: float, world_size: int) -> str:
    """Replicated (about the full size) or sharded (about 1/W of it), from a measurement."""
    return "replicated" if measured > full * (1 + 1 / world_size) / 2 else "sharded"


def summarise(model_name: str, ranks: list[dict], world_size: int) -> dict[str, Any]:
    first = ranks[0]
    n_params = first["params"]
    full = 4 * n_params  # fp32
    rows: dict[str, Any] = {}
    for strategy in STRATEGIES:
        worst = {part: max(r["bytes"][strategy][part] for r in ranks) for part in ("params", "grads", "optimizer")}
        per_step = [max(r["times_ms"][strategy][i] for r in ranks) for i in range(len(first["times_ms"][strategy]))]
        wire = first["wire"][strategy]
        kinds = {"params": _kind(worst["params"], full, world_size),
                 "grads": _kind(worst["grads"], full, world_size),
                 "optimizer": _kind(worst["optimizer"], 2 * full, world_size)}
        per_param = {part: worst[part] / n_params for part in worst}
        at_fit = sum(b * (1 if kinds[part] == "replicated" else world_size / FIT_WORKERS)
                     for part, b in per_param.items())
        rows[strategy] = {
            "bytes_per_rank": worst, "total_mb": sum(worst.values()) / 2**20, "kinds": kinds,
            "bytes_per_param": per_param,
            "step_ms": stats(per_step),
            "wire": {**wire, "grad_sync_over_grad_bytes": wire["allreduce_bytes"] / full,
                     "all_gather_over_param_bytes": wire["all_gather_bytes"] / full},
            "fits_params": DEVICE_GB * 1e9 / at_fit,
        }
    buck = rows[registry.DEFAULT]["bytes_per_rank"]["optimizer"]
    for strategy in STRATEGIES:
        rows[strategy]["optimizer_share_of_bucketed"] = rows[strategy]["bytes_per_rank"]["optimizer"] / buck
    return {"model": model_name, "params": n_params, "per_rank_batch": first["batch"], "strategies": rows}


def run(sizes: Sizes, world_size: int = 2, models: tuple[str, ...] = ("mlp", "gpt"), log=print) -> dict[str, Any]:
    section: dict[str, Any] = {
        "world_size": world_size, "micro_steps": MICRO_STEPS, "optimizer": "AdamW", "dtype": "float32",
        "fit_device_gb": DEVICE_GB, "fit_workers": FIT_WORKERS,
        "note": (f"{world_size} gloo ranks x 1 thread; bytes per rank after a step (largest rank); "
                 f"fits: largest fp32 AdamW model whose parameters + gradients + optimizer state fit "
                 f"{DEVICE_GB} GB at {FIT_WORKERS} workers, from the measured bytes per parameter "
                 "(activations not included)"),
    }
    for name in models:
        log(f"  memory: {name} on {world_size} gloo ranks, strategies {list(STRATEGIES)} ...")
        ranks = run_ranks(memory_rank, world_size, name, sizes, timeout_s=600)
        section[name] = summarise(name, ranks, world_size)
    return section


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m benchmarks.memory [--quick] [--out PATH]`: this section alone."""
    import argparse
    import json
    from pathlib import Path

    from benchmarks import report
    from benchmarks.common import FULL, QUICK

    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (the --quick preset)")
    parser.add_argument("--out", default=None, help="also write the section's JSON here")
    args = parser.parse_args(argv)
    section = run(QUICK if args.quick else FULL, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.out:
        Path(args.out).write_text(json.dumps(section, indent=2, default=float) + "\n")
    print("\n".join(report._memory_tables(section)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
