"""The GPU preset: wrapper overhead at world size 1, tiny-GPT tokens/s and MFU in bf16.

Owns: the `gpt` section and the CUDA sizes. Must not touch: the CPU sections' code
paths beyond calling them with other sizes.

Why world size 1: one GPU has nothing to all-reduce, so any difference from the bare
model is pure wrapper cost (hooks, bucket copies, DDP's reducer) — what a user pays for
running the distributed script on one device. MFU = tokens/s x model FLOPs per token
(6N plus the attention term, `TinyGPT.flops_per_token`) / the device's dense bf16 peak.

`RAYTRAIN_DDP_BENCH_CUDA_DRYRUN=1` runs these code paths on the CPU (gloo, fp32 peak
unknown, tiny sizes) so they are exercised on machines without a GPU; its numbers mean
nothing and say so in the JSON.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch

from benchmarks.common import Sizes, stats

DRYRUN_ENV = "RAYTRAIN_DDP_BENCH_CUDA_DRYRUN"

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
             "L4": 121e12, "RTX 4090": 165.2e12}

GPU_SIZES = Sizes("cuda", rounds=5, steps_per_round=10, warmup_steps=5, mlp_batch=1024, gpt_batch=32,
                  accum_steps=4, ray_steps=60, ray_warmup=10, ingest_rows=131072, ingest_passes=3,
                  train_steps=100)
DRYRUN_SIZES = Sizes("cuda-dryrun", rounds=2, steps_per_round=2, warmup_steps=1, mlp_batch=16, gpt_batch=2,
                     accum_steps=1, ray_steps=5, ray_warmup=2, ingest_rows=4096, ingest_passes=1,
                     train_steps=10)
# A GPT large enough to keep an H200 busy: 107.8 M parameters (81.9 M in matrix products: MFU's N,
# `TinyGPT.flops_per_token`, leaves the embeddings out); the dry run's is tiny.
GPU_GPT = dict(vocab_size=32768, seq_len=1024, d_model=768, n_layers=8, n_heads=12, dropout=0.0)
DRYRUN_GPT = dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4, dropout=0.0)


def dry_run() -> bool:
    return os.environ.get(DRYRUN_ENV, "") not in ("", "0")


def peak_flops(device_name: str) -> Optional[float]:
    for key, value in PEAK_BF16.items():
        if key in device_name:
            return value
    return None


def gpt_rank(world_rank: int, world_size: int, sizes: Sizes, shape: dict, device_name: str) -> dict[str, Any]:
    """bf16 autocast step time of the bare GPT and of each wrapper around it (world size 1)."""
    import torch.distributed as dist

    from benchmarks.strategies import _sync, _wrap, build_model, make_batch
    from raytrain_ddp.models import cross_entropy

    device = torch.device(device_name, world_rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    base = build_model("gpt", shape)
    flops_per_token = base.flops_per_token()
    x, y = make_batch(base, "gpt", sizes.gpt_batch, seed=7 + world_rank, device=device)
    variants = [(label, _wrap(base, strategy, 25.0, device)) for label, strategy in
                (("bare", None), ("bucketed", "bucketed"), ("native", "native"))]
    opts = {label: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda")
            for label, m in variants}

    def step(label: str, model: torch.nn.Module) -> None:
        opts[label].zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
        cross_entropy(out, y).backward()
        opts[label].step()

    for label, model in variants:
        for _ in range(sizes.warmup_steps):
            step(label, model)
    _sync(device)
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for r in range(sizes.rounds):
        shift = r % len(variants)
        for label, model in variants[shift:] + variants[:shift]:
            dist.barrier()
            step(label, model)
            _sync(device)
            start = time.perf_counter()
            for _ in range(sizes.steps_per_round):
                step(label, model)
            _sync(device)
            times[label].append((time.perf_counter() - start) * 1e3 / sizes.steps_per_round)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    return {"times_ms": times, "flops_per_token": flops_per_token, "device_name": name,
            "params": sum(p.numel() for p in base.parameters()),
            "max_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0}


def gpt_section(sizes: Sizes, shape: dict, device_name: str, backend: str, log=print) -> dict[str, Any]:
    from benchmarks.common import run_ranks

    log(f"  gpt: bf16 tokens/s and MFU, d_model {shape['d_model']} x {shape['n_layers']} layers, "
        f"seq {shape['seq_len']} ...")
    (res,) = run_ranks(gpt_rank, 1, sizes, shape, device_name, backend=backend,
                       threads=1 if device_name == "cpu" else 4, timeout_s=420)
    tokens = sizes.gpt_batch * shape["seq_len"]
    peak = peak_flops(res["device_name"]) if device_name == "cuda" else None
    variants = {}
    for label, values in res["times_ms"].items():
        s = stats(values)
        tps = tokens / (s["median"] / 1e3)
        variants[label] = {"step_ms": s["median"], "spread_ms": s, "tokens_per_s": tps,
                           "mfu": tps * res["flops_per_token"] / peak if peak else float("nan")}
    bare = variants["bare"]["step_ms"]
    return {
        "device_name": res["device_name"], "precision": "bf16 autocast", "params": res["params"],
        "seq_len": shape["seq_len"], "batch": sizes.gpt_batch, "world_size": 1,
        "flops_per_token": res["flops_per_token"], "peak_flops": peak, "max_memory_gb": res["max_memory_gb"],
        "variants": variants,
        "wrapper_overhead": {k: v["step_ms"] / bare for k, v in variants.items() if k != "bare"},
    }
