"""Gradient accumulation savings: what each optimizer step sends, for k = 1, 2, 4, 8.

Owns: the `accumulation` section. Must not touch: Ray, data loading.

Counts come from the wrappers' own `comm_stats` (all-reduce calls and bytes), read
before and after every micro-step, so "calls on non-final micro-steps" is observed, not
inferred. The theoretical minimum is every gradient byte once per optimizer step (one
all-reduce payload of the whole gradient); bytes / minimum must be exactly 1.00 for
every k, and the non-final micro-steps (run under `no_sync`) must send nothing. Time per
sample shows the saving: the all-reduce is paid once per k micro-batches.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import Sizes, run_ranks, stats
from benchmarks.strategies import build_model, grad_bytes, make_batch
from raytrain_ddp.models import cross_entropy
from raytrain_ddp.parallel import registry

KS = (1, 2, 4, 8)
STRATEGIES = registry.REPLICATED
MICRO_BATCH = 16


def accumulate_rank(world_rank: int, world_size: int, sizes: Sizes) -> dict[str, Any]:
    from raytrain_ddp.parallel import accumulation_window, wrap_model

    base = build_model("mlp")
    minimum = grad_bytes(base)
    batches = [make_batch(base, "mlp", MICRO_BATCH, seed=2000 + 97 * world_rank + i, device=torch.device("cpu"))
               for i in range(max(KS))]
    rows = []
    for strategy in STRATEGIES:
        for k in KS:
            model = wrap_model(copy.deepcopy(base), strategy, bucket_cap_mb=25.0)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            calls, nbytes, nonfinal_calls, nonfinal_bytes, step_s = [], [], 0, 0, []
            for step in range(sizes.accum_steps + 1):  # step 0 is warm-up, not timed
                dist.barrier()
                before = model.comm_stats
                start = time.perf_counter()
                for i, ((x, y), scale) in enumerate(accumulation_window(model, batches[:k], expected=k,
                                                                       partial="scale")):
                    mid = model.comm_stats
                    (cross_entropy(model(x), y) * scale).backward()
                    after = model.comm_stats
                    if i < k - 1:
                        nonfinal_calls += after["allreduce_calls"] - mid["allreduce_calls"]
                        nonfinal_bytes += after["allreduce_bytes"] - mid["allreduce_bytes"]
                opt.step()
                opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                after = model.comm_stats
                if step == 0:
                    continue
                step_s.append(elapsed)
                calls.append(after["allreduce_calls"] - before["allreduce_calls"])
                nbytes.append(after["allreduce_bytes"] - before["allreduce_bytes"])
            steps = len(calls)
            rows.append({
                "strategy": strategy, "k": k, "micro_batch": MICRO_BATCH,
                "allreduce_calls_per_step": sum(calls) / steps,
                "allreduce_bytes_per_step": sum(nbytes) / steps,
                "min_bytes_per_step": minimum,
                "bytes_over_min": sum(nbytes) / steps / minimum,
                "nonfinal_calls": nonfinal_calls,
                "nonfinal_bytes": nonfinal_bytes,
                "step_ms": [s * 1e3 for s in step_s],
                "samples_per_step": k * MICRO_BATCH * world_size,
            })
    return {"rows": rows}


def run(sizes: Sizes, world_size: int = 2, log=print) -> dict[str, Any]:
    log(f"  accumulation: k in {list(KS)} x {list(STRATEGIES)} on {world_size} gloo ranks ...")
    results = run_ranks(accumulate_rank, world_size, sizes, timeout_s=600)
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        # Counts are per rank and identical on every rank; time is the slowest rank's.
        step_ms = [max(r["rows"][i]["step_ms"][j] for r in results) for j in range(len(row["step_ms"]))]
        timing = stats(step_ms)
        out = {key: value for key, value in row.items() if key != "step_ms"}
        out["nonfinal_calls"] = sum(r["rows"][i]["nonfinal_calls"] for r in results)
        out["nonfinal_bytes"] = sum(r["rows"][i]["nonfinal_bytes"] for r in results)
        out["step_ms"] = timing["median"]
        out["ms_per_sample"] = timing["median"] / row["samples_per_step"]
        out["step_spread_ms"] = timing
        rows.append(out)
    base = {r["strategy"]: r["ms_per_sample"] for r in rows if r["k"] == 1}
    for r in rows:
        r["time_per_sample_vs_k1"] = r["ms_per_sample"] / base[r["strategy"]]
    return {
        "model": "mlp", "world_size": world_size, "micro_batch": MICRO_BATCH, "ks": list(KS),
        "strategies": list(STRATEGIES), "min_bytes_note": "every gradient byte once per optimizer step",
        "rows": rows,
    }
