"""What `train.compile`, `model.activation_checkpointing` and `run.validation: async` buy (issue #55).

The GPT preset: `strategies.GPT_SHAPE` on the CPU, `gpu.GPU_GPT` on a GPU (`gpu_checks`).

Owns: the `compile` section (per replicated strategy on gloo ranks: the eager step beside the
compiled one, and the seconds compiling took: the backend's, `CompileClock`, and the first
step's wall time; with inductor, `warm`: the first compiled step again in new processes whose
disk cache is empty, loading the compile-cache.bin the cold run saved, as a restart on a new
node does, and `cache_saves_s`, cold first step less warm) and the `activation_checkpointing` section (one process: a step's
activation memory and time with and without checkpointing the blocks). Must not touch: Ray,
the wrappers' internals (it calls `wrap_model`, `WrappedModel.compile` and
`models.checkpoint_activations`, as training does). The `validation` section trains one
small run in local mode twice, `run.validation` inline and async, and reads the stall per
validation from its metrics lines (`python -m benchmarks.step_options` runs it alone).

Memory: on CUDA the step's peak allocation (`torch.cuda.max_memory_allocated`, parameters and
optimizer state included); on the CPU, which keeps no such counter, the bytes autograd kept
for backward at the end of the forward (`saved_tensors_hooks`), what checkpointing removes.
Targets (issue #55): compiled native <= 1.05x eager; checkpointed peak <= 0.6x, step <= 1.4x;
async validation's stall <= 2x a steady step.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from benchmarks.common import Sizes, run_ranks, stats
from benchmarks.strategies import build_model, make_batch
from raytrain_ddp.models import checkpoint_activations, cross_entropy
from raytrain_ddp.parallel import registry

STRATEGIES = tuple(s for s in registry.REPLICATED if s in registry.COMPILERS)


def _steps(model: Any, batch: tuple, steps: int) -> list[float]:
    """Seconds of each forward + backward + SGD step (the first, warm-up or compiling, included)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if batch[0].is_cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def compile_rank(world_rank: int, world_size: int, sizes: Sizes, backend: str, device: str,
                 shape: Optional[dict], strategies: tuple[str, ...], cache_root: str,
                 keys: tuple[str, ...] = ("eager", "compiled")) -> dict[str, Any]:
    """`keys`: eager and compiled (cold: an empty disk cache; rank by rank, its compile-cache.bin
    saved under `cache_root` as rank 0's is in the run directory), or `warm` alone: fresh
    processes, as a restart on a new node, loading that file before the first compiled step."""
    import os

    import torch.distributed as dist

    from raytrain_ddp.parallel import torch_compat, wrap_model
    from raytrain_ddp.rundir import Location
    from raytrain_ddp.worker.compiled import CompileClock
    from raytrain_ddp.worker.context import Rank

    dev = torch.device(device)
    batch = make_batch(build_model("gpt", shape), "gpt", sizes.gpt_batch, seed=11 + world_rank, device=dev)
    rows = []
    steps = sizes.warmup_steps + sizes.steps_per_round * sizes.rounds
    for strategy in strategies:
        row: dict[str, Any] = {"strategy": strategy}
        run_dir = f"{cache_root}/{strategy}/rank{world_rank}"
        for key in keys:
            torch.compiler.reset()  # each compiled run pays its own compilation
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{run_dir}/{key}-disk"  # the node's disk cache: empty
            model = wrap_model(build_model("gpt", shape).to(dev), strategy)
            clock, rank = (CompileClock(backend, None) if key != "eager" else None), Rank(0, 1, 0, dev)
            if clock is not None:
                clock.use_cache(Location.parse(run_dir), rank)  # as the loop does before its first step
                model.compile(backend=clock)
            hits = torch_compat.compile_cache_hits()
            dist.barrier()
            times = _steps(model, batch, 1 + steps if key != "warm" else 1)
            row[f"{key}_first_step_s"] = times[0]
            row[f"{key}_step_ms"] = [t * 1e3 for t in times[1 + sizes.warmup_steps:]]
            if clock is not None:
                clock.first_step_seconds(rank)  # rank 0's save (here every rank's, to its own directory)
                prefix = "warm_" if key == "warm" else ""
                row[f"{prefix}backend_compile_s"], row[f"{prefix}graphs"] = clock.seconds, clock.graphs
                row[f"{prefix}cache_hits"] = torch_compat.compile_cache_hits() - hits
            model.close()
        rows.append(row)
    return {"rows": rows}


def run_compile(sizes: Sizes, world_size: int = 2, backend: str = "inductor", device: str = "cpu",
                shape: Optional[dict] = None, strategies: tuple[str, ...] = STRATEGIES, log=print) -> dict[str, Any]:
    log(f"  compile: eager vs torch.compile ({backend}) of the gpt preset, {list(strategies)} "
        f"on {world_size} gloo ranks ...")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache_root:
        args = (compile_rank, world_size, sizes, backend, device, shape, strategies, cache_root)
        group = {"timeout_s": 1200, "backend": "nccl" if device.startswith("cuda") else "gloo"}
        results = run_ranks(*args, **group)
        if backend == "inductor":  # only inductor fills torch's caches: then a restart, in new processes
            for mine, warm in zip(results, run_ranks(*args, ("warm",), **group)):
                for row, again in zip(mine["rows"], warm["rows"]):
                    row.update({k: v for k, v in again.items() if k.startswith("warm_")})
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        out = {"strategy": row["strategy"], "graphs": row["graphs"]}
        for key in ("eager", "compiled"):
            slowest = [max(r["rows"][i][f"{key}_step_ms"][j] for r in results)
                       for j in range(len(row[f"{key}_step_ms"]))]
            out[f"{key}_step_ms"] = stats(slowest)["median"]
            out[f"{key}_first_step_s"] = max(r["rows"][i][f"{key}_first_step_s"] for r in results)
        out["compiled_over_eager"] = out["compiled_step_ms"] / out["eager_step_ms"]
        out["backend_compile_s"] = max(r["rows"][i]["backend_compile_s"] for r in results)
        # what compiling added to the first step (tracing, the backend, a lazy backward compile)
        out["compile_s"] = out["compiled_first_step_s"] - out["eager_first_step_s"]
        if "warm_first_step_s" in row:  # a restart on a new node: torch's caches from the run directory
            out["warm_first_step_s"] = max(r["rows"][i]["warm_first_step_s"] for r in results)
            out["warm_backend_compile_s"] = max(r["rows"][i]["warm_backend_compile_s"] for r in results)
            out["warm_cache_hits"] = min(r["rows"][i]["warm_cache_hits"] for r in results)
            out["cache_saves_s"] = out["compiled_first_step_s"] - out["warm_first_step_s"]
        rows.append(out)
    return {"model": "gpt", "backend": backend, "world_size": world_size, "device": device, "rows": rows,
            "target": "native compiled <= 1.05x eager"}


def run_checkpointing(sizes: Sizes, device: str = "cpu", shape: Optional[dict] = None, log=print) -> dict[str, Any]:
    log("  activation_checkpointing: the gpt preset's step, blocks checkpointed or not ...")
    dev = torch.device(device)
    steps = sizes.warmup_steps + sizes.steps_per_round * sizes.rounds
    out: dict[str, Any] = {"model": "gpt", "device": device, "micro_batch": sizes.gpt_batch}
    for label, targets in (("plain", None), ("checkpointed", "auto")):
        torch.manual_seed(0)
        model = build_model("gpt", shape).to(dev)
        checkpoint_activations(model, targets)
        batch = make_batch(model, "gpt", sizes.gpt_batch, seed=5, device=dev)
        times = _steps(model, batch, 1 + steps)
        kept = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[0] += t.numel() * t.element_size()
            return t

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        out[label] = {"step_ms": stats([t * 1e3 for t in times[1 + sizes.warmup_steps:]])["median"],
                      "saved_for_backward_bytes": kept[0],
                      "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
    plain, ckpt = out["plain"], out["checkpointed"]
    memory = "peak_bytes" if dev.type == "cuda" else "saved_for_backward_bytes"
    out["memory_measure"] = memory
    out["memory_ratio"] = ckpt[memory] / plain[memory]
    out["step_ratio"] = ckpt["step_ms"] / plain["step_ms"]
    out["targets"] = "memory_ratio <= 0.6, step_ratio <= 1.4"
    return out


VALIDATION_RUN = ["scaling.num_workers=0", "model.name=mlp", "model.hidden_sizes=[512]", "data.source=synthetic",
                  "data.synthetic.feature_dim=1024", "data.val_fraction=0.5",
                  "train.global_batch_size=64", "train.micro_batch_size=64", "run.log_every_steps=1",
                  "run.checkpoint_every_steps=0", "run.loggers=[jsonl]"]


def run_validation(sizes: Sizes, log=print) -> dict[str, Any]:
    """`run.validation`, inline vs async: the step loop's stall at each validation point (the
    lines' `validation_s`) against a steady step, the same run (local mode: one process, no Ray)
    trained both ways, every epoch's validation but the last (which async waits for). Also what
    async costs beside the loop: the validator thread's seconds (`validation_async_s`) and the
    steps that ran while it validated (they share this machine's cores)."""
    import tempfile

    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.rundir import read_metrics

    epochs, rows = 2 + sizes.rounds, 12288 if sizes.rounds > 1 else 2048  # the smoke preset: a check only
    log(f"  validation: inline vs async, mlp on {rows // 2:,} synthetic val rows, {epochs} epochs in local mode ...")
    out: dict[str, Any] = {"epochs": epochs, "overrides": [*VALIDATION_RUN, f"data.synthetic.rows={rows}"]}
    with tempfile.TemporaryDirectory(prefix="bench-validation-") as tmp:
        for mode in ("inline", "async"):
            cfg = load_config(None, [*out["overrides"], f"train.epochs={epochs}", f"run.storage_path={tmp}",
                                     f"name={mode}", f"run.validation={mode}"])
            done = run_training(cfg)
            assert done["status"] == "ok", done.get("error")
            lines = read_metrics(f"{tmp}/{mode}/metrics.jsonl")
            train = [r for r in lines if "loss" in r]
            val = [r for r in lines if "val_loss" in r][:-1]  # the last: the run waits for it either way
            step_ms = [1e3 * r["steps_s"] / r["window_steps"] for r in train if r.get("window_steps")]
            row = {"steady_step_ms": stats(step_ms)["median"],
                   "stall_ms": stats([1e3 * r["validation_s"] for r in val])["median"],
                   "val": [{k: v for k, v in r.items() if k.startswith("val_")} for r in val]}
            row["stall_over_step"] = row["stall_ms"] / row["steady_step_ms"]
            if mode == "async":
                row["validator_ms"] = stats([1e3 * r["validation_async_s"] for r in val])["median"]
                during = [1e3 * r["steps_s"] / r["window_steps"] for r in train for v in val
                          if v["time"] - v["validation_async_s"] <= r["time"] <= v["time"] and r.get("window_steps")]
                row["step_ms_while_validating"] = stats(during)["median"] if during else None
            out[mode] = row
    out["val_identical"] = out["inline"].pop("val") == out["async"].pop("val")
    out["target"] = "async stall_over_step <= 2"
    return out


def validation_table(section: dict[str, Any]) -> list[str]:
    lines = ["| validation | steady step ms | stall per validation ms | stall / step | validator ms | "
             "step ms while validating |", "|---|---:|---:|---:|---:|---:|"]
    for mode in ("inline", "async"):
        r = section[mode]
        extra = (f"{r['validator_ms']:.1f} | {r['step_ms_while_validating'] or float('nan'):.2f}"
                 if mode == "async" else "- | -")
        lines.append(f"| {mode} | {r['steady_step_ms']:.2f} | {r['stall_ms']:.2f} | {r['stall_over_step']:.2f} | {extra} |")
    lines.append(f"\nval metrics identical inline and async: {section['val_identical']}; target: {section['target']}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m benchmarks.step_options [--section compile|activation_checkpointing]`: the
    validation (or compile, or activation checkpointing) section alone, published under benchmarks/results/."""
    import argparse
    import os
    import sys
    from pathlib import Path

    from benchmarks.common import FULL, QUICK
    from benchmarks.session import log, meta, publish, results_path

    parser = argparse.ArgumentParser(description="run.validation inline vs async: the step loop's stall; "
                                     "or train.compile's section, cold and cache-loaded first steps")
    parser.add_argument("--quick", action="store_true", help="fewer epochs (steps)")
    parser.add_argument("--section", choices=("validation", "compile", "activation_checkpointing"),
                        default="validation")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="compile: which, comma-separated")
    parser.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/<section>-<date>.json)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else results_path(args.section)
    started = time.perf_counter()
    sizes = QUICK if args.quick else FULL
    results: dict[str, Any] = {"meta": meta("quick" if args.quick else "full", "cpu")}
    if args.section == "compile":
        from benchmarks.report import _step_option_tables

        results["compile"] = run_compile(sizes, strategies=tuple(args.strategies.split(",")), log=log)
        table = "\n".join(_step_option_tables(results["compile"]))
    elif args.section == "activation_checkpointing":
        from benchmarks.report import _step_option_tables

        results["activation_checkpointing"] = run_checkpointing(sizes, log=log)
        table = "\n".join(_step_option_tables(results["activation_checkpointing"]))
    else:
        results["validation"] = run_validation(sizes, log=log)
        table = "\n".join(["**Validation** (the step loop's stall per validation, inline vs async)", "",
                           *validation_table(results["validation"])])
    results["meta"]["duration_s"] = time.perf_counter() - started
    results["meta"]["load_avg_at_end"] = list(os.getloadavg())
    md = publish(results, out, table)
    print(table)
    log(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
