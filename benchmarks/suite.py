"""`raytrain-ddp bench`: run every section, write the JSON, the table and the PNG, print the tables.

Owns: the order of sections, presets (`--quick`, full, `--device cuda`) and when the Ray
instance the Ray sections share starts (`session` starts Ray, writes the `meta` block and
publishes the run: `benchmarks/results/<preset>-<date>.json`, `.md`, `.png` without --out).
Must not touch: how each section measures (see strategies / accumulation /
ray_overhead / checkpoint / ingest / recovery / gpu).

Sections (top-level JSON keys): `strategies`, `accumulation`, `memory` (bytes per rank,
wire bytes and step time of bucketed / zero1 / fsdp), `ray_overhead`,
`checkpoint` (how long a checkpoint holds the step loop, sync vs async upload), `ingest`,
`compile` (eager vs torch.compile per replicated strategy, and compile seconds, on the GPT preset),
`activation_checkpointing` (the GPT step's memory and time with and without it), `validation`
(the step loop's stall per validation, `run.validation` inline vs async, local mode),
`recovery` (a SIGKILLed worker: steps redone and seconds back to training; the replica's
per-step cost), `startup` (the first step, wall time and last step -> exit of the quickstart
beside torchrun + torch DDP and a bare TorchTrainer, issue #39) on CPU; on CUDA `strategies` (world size 1: wrapper overhead, plus DataParallel), `gpt`
(bf16 tokens/s, MFU) and `ingest` (Ray Data wait in a GPU training run). A failing
section is recorded as `{"error": ...}`, the others still run, and the exit status is 1.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.common import FULL, QUICK, Sizes
from benchmarks.session import log, meta, publish, results_path, start_ray
from raytrain_ddp.errors import UserError

SIZE_ENV = "RAYTRAIN_DDP_BENCH_SIZE"  # "smoke": the test suite's even smaller preset
SMOKE = Sizes("smoke", rounds=1, steps_per_round=3, warmup_steps=1, mlp_batch=16, gpt_batch=4,
              accum_steps=1, ray_steps=4, ray_warmup=1, ingest_rows=2048, ingest_passes=1,
              train_steps=5, parity_launches=1, parity_rounds=2)


def _section(results: dict, name: str, fn: Callable[[], dict]) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn()
        results[name]["section_s"] = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - record it, run the remaining sections
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        log(f"  {name}: FAILED:\n{traceback.format_exc()}")


def run_cpu(sizes: Sizes) -> dict[str, Any]:
    from benchmarks import (accumulation, checkpoint, ingest, memory, ray_overhead, recovery, startup, step_options,
                            strategies)

    results: dict[str, Any] = {}
    _section(results, "strategies", lambda: strategies.run(sizes, log=log))
    _section(results, "accumulation", lambda: accumulation.run(sizes, log=log))
    models = ("mlp",) if sizes.name == "smoke" else ("mlp", "gpt")
    _section(results, "memory", lambda: memory.run(sizes, models=models, log=log))
    # inductor's first compile takes ~40 s per graph here: the smoke preset checks the section with aot_eager
    backend = "aot_eager" if sizes.name == "smoke" else "inductor"
    _section(results, "compile", lambda: step_options.run_compile(sizes, backend=backend, log=log))
    _section(results, "activation_checkpointing", lambda: step_options.run_checkpointing(sizes, log=log))
    _section(results, "validation", lambda: step_options.run_validation(sizes, log=log))

    def on_ray(ray_init_s: float) -> None:
        rounds = 1 if sizes.name in ("quick", "smoke") else 2
        _section(results, "ray_overhead", lambda: ray_overhead.run(sizes, rounds=rounds, ray_init_s=ray_init_s, log=log))
        _section(results, "checkpoint", lambda: checkpoint.run(sizes, log=log))
        shardings = ("streaming", "exact") if sizes.name == "full" else ("streaming",)
        _section(results, "ingest", lambda: ingest.run(sizes, log=log, train_shardings=shardings))

    # Two workers + Ray Data's read tasks on 2 cores: more logical CPUs than cores, as the
    # launcher does, or Ray Data's tasks starve behind the training workers.
    _with_ray(results, ("ray_overhead", "checkpoint", "ingest"), lambda: start_ray(num_cpus=4), on_ray)
    # After the shared instance: each kill run starts the launcher's own embedded Ray (its
    # health-check settings are part of what is measured). The smoke preset keeps only the
    # in-process overhead: two runs with a restart each cost ~2 min here.
    _section(results, "recovery", lambda: recovery.run(sizes, log=log, with_kill=sizes.name != "smoke"))
    # Each system starts its own Ray (or none): after the shared instance, like recovery.
    _section(results, "startup", lambda: startup.run(sizes, log=log))
    return results


def run_cuda(dry: bool) -> dict[str, Any]:
    import torch

    from benchmarks import gpu, ingest, strategies

    sizes = gpu.DRYRUN_SIZES if dry else gpu.GPU_SIZES
    device = "cpu" if dry else "cuda"
    backend = "gloo" if dry else "nccl"
    results: dict[str, Any] = {}
    if dry:
        results["dry_run_note"] = f"{gpu.DRYRUN_ENV}=1: CUDA code paths run on the CPU; numbers are meaningless"
    _section(results, "strategies", lambda: strategies.run(
        sizes, device=device, world_size=1, backend=backend, with_dp=True, threads=1 if dry else 4, log=log))
    shape = gpu.DRYRUN_GPT if dry else gpu.GPU_GPT
    _section(results, "gpt", lambda: gpu.gpt_section(sizes, shape, device, backend, log=log))

    def on_ray(ray_init_s: float) -> None:
        _section(results, "ingest", lambda: ingest.run(
            sizes, device="cpu" if dry else "cuda", log=log, train_shardings=("streaming", "exact"), workers=1,
            micro=16 if dry else 512))
        results["ingest"]["ray_init_s"] = ray_init_s

    gpus = 0 if dry else torch.cuda.device_count()
    _with_ray(results, ("ingest",), lambda: start_ray(num_cpus=max(4, os.cpu_count() or 1), num_gpus=gpus), on_ray)
    return results


def _with_ray(results: dict, names: tuple[str, ...], start: Callable[[], float],
              body: Callable[[float], None]) -> None:
    """Run the sections that need a local Ray instance; if Ray cannot be imported or started,
    each of them records why and the suite goes on (the torch-only sections stand)."""
    try:
        import ray

        ray_init_s = start()
    except Exception as exc:  # noqa: BLE001 - ImportError, a failed ray.init: recorded, not fatal
        for name in names:
            results[name] = {"error": f"Ray unavailable: {type(exc).__name__}: {exc}"}
        log(f"  {', '.join(names)}: skipped, Ray unavailable ({type(exc).__name__}: {exc})")
        return
    try:
        body(ray_init_s)
    finally:
        ray.shutdown()


def default_out(preset: str) -> Path:
    """Where results go without --out: benchmarks/results/<preset>-<date>.json, never the current directory."""
    return results_path(preset)


def main(quick: bool, out: Optional[str], device: str) -> int:
    import torch

    from benchmarks import gpu, report

    dry = device == "cuda" and gpu.dry_run()
    if device == "cuda" and not dry and not torch.cuda.is_available():
        raise UserError(
            "bench --device cuda: no CUDA device is visible (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}); run it on a GPU host with a CUDA build of torch "
            "(benchmarks/gpu.sh), or use --device cpu"
        )
    if device == "cuda":
        preset = "cuda-dryrun" if dry else "cuda"
    else:
        preset = os.environ.get(SIZE_ENV) or ("quick" if quick else "full")
        if preset not in ("quick", "full", "smoke"):
            raise UserError(f"{SIZE_ENV}={preset!r} is not one of 'quick', 'full', 'smoke'")
    sizes = {"quick": QUICK, "full": FULL, "smoke": SMOKE}.get(preset, QUICK)
    out_path = Path(out) if out else default_out(preset)  # never the cwd by surprise
    out_path.parent.mkdir(parents=True, exist_ok=True)

    results: dict[str, Any] = {"meta": meta(preset, device)}
    log(f"raytrain-ddp bench: preset {preset}, device {device}; results -> {out_path}")
    started = time.perf_counter()
    results.update(run_cuda(dry) if device == "cuda" else run_cpu(sizes))
    results["meta"]["duration_s"] = time.perf_counter() - started
    results["meta"]["load_avg_at_end"] = list(os.getloadavg())
    results["targets"] = report.verdicts(results)
    table = report.markdown(results)
    md = publish(results, out_path, table)
    png = report.plot(results, out_path.with_suffix(".png"))
    print(table)
    log(f"wrote {out_path}, {md} and {png}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if failed:
        log(f"sections failed: {failed} (see 'error' in the JSON)")
        return 1
    return 0


if __name__ == "__main__":  # what `raytrain-ddp bench` runs, from the checkout
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description="every bench section")
    parser.add_argument("--quick", action="store_true", help="small sizes, ~2 minutes")
    parser.add_argument("--out", default=None, help="JSON results file (default: benchmarks/bench-<preset>.json)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    given = parser.parse_args()
    try:
        sys.exit(main(quick=given.quick, out=given.out, device=given.device))
    except UserError as exc:
        print(f"raytrain-ddp bench: error: {exc}", file=sys.stderr)
        sys.exit(2)

