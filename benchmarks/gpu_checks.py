"""The GPU run's sections, one per child process (`benchmarks/gpu_run.py` starts them).

Owns: what each section of the one-GPU run measures, and its CPU stand-in (`--dry-run`,
tiny sizes, numbers meaningless):
- `ceilings`: the physical limits beside our figures: a bf16 matrix product (8192^3) and a
  device-to-device copy (1 GiB, bytes read + written);
- `strategies`, `gpt`: the wrapper-overhead and GPT bench at world size 1 (`strategies`,
  `gpu`): MFU counts 6N without the embeddings (`TinyGPT.flops_per_token`);
- `local`: local mode (`scaling.num_workers=0`, no Ray) through the CLI on CUDA: the
  quickstart with bucketed in fp32, native in bf16 with `run.profile`, a GPT in fp16 with
  checkpoints run twice (the second resumes), all under `torch.cuda.set_sync_debug_mode`
  counting host syncs (total / steps: start-up, evaluation and checkpoints included, so an
  upper bound of the steady step's count);
- `ranks`: two gloo ranks sharing one GPU with CUDA tensors: every strategy against torch
  DDP, the largest parameter difference after three steps;
- `compile`, `checkpointing`: `step_options` at world size 1 on the GPU: the GPT preset's eager
  and compiled (inductor) step per replicated strategy with the compile seconds; its peak
  memory (`max_memory_allocated`) and step time with and without activation checkpointing;
- `ingest`: Ray Data's wait in a 1-GPU run (needs Ray; `suite.run_cuda`'s section).
Must not touch: the sections' order and deadlines (gpu_run), the wrappers.

    python -m benchmarks.gpu_checks SECTION RESULT.json [--dry-run]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

SYNC_WARNING = "synchronizing CUDA operation"  # torch's text under set_sync_debug_mode("warn")


def _device(dry: bool) -> torch.device:
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Seconds per call, the mean of `reps` after `warmup` (synced before and after)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def ceilings(dry: bool) -> dict[str, Any]:
    from benchmarks.gpu import peak_flops

    device = _device(dry)
    n, dtype, nbytes = (256, torch.float32, 2**24) if dry else (8192, torch.bfloat16, 2**30)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_s = _timed(lambda: a @ b, device, 3, 10)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, 3, 10)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sheet = peak_flops(name)
    return {"figures": {f"{'bf16' if not dry else 'fp32'} matmul {n}^3, TFLOP/s": 2 * n**3 / matmul_s / 1e12,
                        "d2d copy, TB/s (read+written)": 2 * nbytes / copy_s / 1e12,
                        "data-sheet dense bf16, TFLOP/s": (sheet or float("nan")) / 1e12},
            "device_name": name}


def strategies(dry: bool) -> dict[str, Any]:
    from benchmarks import gpu, strategies as bench

    sizes = gpu.DRYRUN_SIZES if dry else gpu.GPU_SIZES
    section = bench.run(sizes, device="cpu" if dry else "cuda", world_size=1, models=("mlp",),
                        backend="gloo" if dry else "nccl", with_dp=False, threads=1 if dry else 4, log=print)
    figures = {}
    for label, value in section["mlp"]["step_ms"].items():
        median = value.get("median") if isinstance(value, dict) else value
        if isinstance(median, (int, float)):
            figures[f"mlp {label}, ms/step"] = float(median)
    section["figures"] = figures
    section["world_size_1_note"] = ("one rank: the wrappers register no hooks (nothing to all-reduce), so "
                                    "these rows are the wrapper's forward cost; DataParallel on one device is "
                                    "the module itself and is not run")
    return section


def gpt(dry: bool) -> dict[str, Any]:
    from benchmarks import gpu

    sizes, shape = (gpu.DRYRUN_SIZES, gpu.DRYRUN_GPT) if dry else (gpu.GPU_SIZES, gpu.GPU_GPT)
    section = gpu.gpt_section(sizes, shape, "cpu" if dry else "cuda", "gloo" if dry else "nccl", log=print)
    figures: dict[str, Any] = {"parameters, M": section["params"] / 1e6,
                               "model FLOPs per token, G": section["flops_per_token"] / 1e9}
    for label, v in section["variants"].items():
        figures[f"{label} tokens/s"] = v["tokens_per_s"]
        figures[f"{label} MFU (data sheet)"] = v["mfu"]
    section["figures"] = figures
    return section


def _train(args: list[str], root: Path) -> dict[str, Any]:
    """One local-mode run through the CLI in this process; its summary and the host syncs counted."""
    from raytrain_ddp.cli import main as cli

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            code = cli(["train", *args, f"run.storage_path={root}"])
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    name = next(a.split("=", 1)[1] for a in args if a.startswith("name="))
    summary = json.loads((root / name / "summary.json").read_text()) if (root / name / "summary.json").exists() else {}
    steps = int(summary.get("steps") or 0)
    return {"exit": code, "status": summary.get("status"), "steps": steps, "syncs": syncs,
            "syncs_per_step": syncs / steps if steps else float("nan"),
            "resumed_from": summary.get("resumed_from"), "elapsed_s": summary.get("elapsed_s")}


def local(dry: bool) -> dict[str, Any]:
    gpu = [] if dry else ["scaling.use_gpu=true"]
    steps = 4 if dry else 60
    quick = ["examples/configs/quickstart.yaml", "scaling.num_workers=0", f"train.max_steps={steps}", *gpu]
    gpt_model = (["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "data.synthetic.seq_len=16",
                  "data.synthetic.num_classes=64"] if dry else
                 ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "data.synthetic.seq_len=256",
                  "data.synthetic.num_classes=8192"])
    gpt_run = ["model.name=gpt", "data.source=synthetic", "scaling.num_workers=0", "train.global_batch_size=16",
               "train.micro_batch_size=8", "run.checkpoint_every_steps=2", "name=gpu-gpt",
               "train.precision=" + ("bf16" if dry else "fp16"), *gpt_model, *gpu]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-local-") as tmp:
        root = Path(tmp)
        runs["quickstart bucketed fp32"] = _train([*quick, "name=gpu-quick", "parallel.strategy=bucketed"], root)
        runs["native bf16 profiled"] = _train([*quick, "name=gpu-native", "parallel.strategy=native",
                                               "train.precision=bf16", "run.profile.start_step=3",
                                               "run.profile.steps=2"], root)
        runs["native bf16 profiled"]["trace"] = bool(list((root / "gpu-native").rglob("*.json*")))
        runs["gpt fp16 (1st)"] = _train([*gpt_run, f"train.max_steps={steps}"], root)
        runs["gpt fp16 (resumed)"] = _train([*gpt_run, f"train.max_steps={2 * steps}"], root)
    figures = {f"{k}: {'ok' if v['exit'] == 0 else 'exit ' + str(v['exit'])}, syncs/step": v["syncs_per_step"]
               for k, v in runs.items()}
    figures["gpt resumed from a checkpoint"] = bool(runs["gpt fp16 (resumed)"].get("resumed_from"))
    failed = [k for k, v in runs.items() if v["exit"] != 0]
    out: dict[str, Any] = {"runs": runs, "figures": figures,
                           "sync_note": "syncs counted by set_sync_debug_mode('warn') over the whole run, "
                                        "divided by its steps" + (" (CPU: none can occur)" if dry else "")}
    if failed:
        out["error"] = f"local runs failed: {failed}"
    return out


def _parity_rank(world_rank: int, world_size: int, dry: bool) -> dict[str, Any]:
    """Every strategy and torch DDP, 3 SGD steps on a seeded MLP; parameters at the end (CPU copies)."""
    from torch import nn

    from raytrain_ddp.parallel import registry, wrap_model

    device = _device(dry)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params: dict[str, Any] = {}
    for kind in ("torch_ddp", *registry.NAMES):
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)).to(device)
            if kind == "torch_ddp":
                wrapped = nn.parallel.DistributedDataParallel(model)
                opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
            else:
                wrapped = wrap_model(model, kind)
                opt = wrapped.make_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + world_rank)
                x, y = torch.randn(8, 32, generator=g).to(device), torch.randint(0, 10, (8,), generator=g).to(device)
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(wrapped(x), y).backward()
                opt.step()
            state = wrapped.module.state_dict()
            params[kind] = {_plain(k): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                            for k, v in state.items()}
        except Exception as exc:  # noqa: BLE001 - one strategy's failure is its row, not the section's
            params[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return params


def _plain(key: str) -> str:
    """A parameter's name without the wrappers' prefixes (`module.`, `wrapped.`, `_orig_mod.`)."""
    parts = key.split(".")
    while parts and parts[0] in ("module", "wrapped", "_orig_mod", "_fsdp_wrapped_module"):
        parts = parts[1:]
    return ".".join(parts)


def ranks(dry: bool) -> dict[str, Any]:
    from benchmarks.common import run_ranks

    per_rank = run_ranks(_parity_rank, 2, dry, backend="gloo", timeout_s=50 if dry else 55)
    ref = per_rank[0]["torch_ddp"]
    figures: dict[str, Any] = {}
    for kind in per_rank[0]:
        if kind == "torch_ddp":
            continue
        worst = 0.0
        for got in per_rank:
            if isinstance(got[kind], str) or isinstance(ref, str):
                worst = got[kind] if isinstance(got[kind], str) else f"torch DDP: {ref}"
                break
            if set(got[kind]) != set(ref):
                worst = f"parameter names differ: {sorted(set(got[kind]) ^ set(ref))[:4]}"
                break
            worst = max(worst, max(float((got[kind][k].double() - ref[k].double()).abs().max()) for k in ref))
        figures[f"{kind} vs torch DDP, max |param diff|"] = worst
    bad = [k for k, v in figures.items() if isinstance(v, str) or v > 1e-5]
    return {"figures": figures, "device": str(_device(dry)), "backend": "gloo", "world_size": 2,
            **({"error": f"differ or failed: {bad}"} if bad else {})}


def ingest(dry: bool) -> dict[str, Any]:
    from benchmarks import gpu, ingest as bench
    from benchmarks.session import start_ray

    import ray

    ray_init_s = start_ray(num_cpus=max(4, os.cpu_count() or 1), num_gpus=0 if dry else torch.cuda.device_count())
    try:
        sizes = gpu.DRYRUN_SIZES if dry else gpu.GPU_SIZES
        section = bench.run(sizes, device="cpu" if dry else "cuda", log=print, train_shardings=("streaming",),
                            workers=1, micro=16 if dry else 512)
    finally:
        ray.shutdown()
    section["ray_init_s"] = ray_init_s
    section["figures"] = {"ray init, s": ray_init_s}
    return section


def compile_section(dry: bool) -> dict[str, Any]:
    from benchmarks import gpu, step_options

    sizes = gpu.DRYRUN_SIZES if dry else gpu.GPU_SIZES
    section = step_options.run_compile(sizes, world_size=1, backend="aot_eager" if dry else "inductor",
                                       device=str(_device(dry)), shape=gpu.DRYRUN_GPT if dry else gpu.GPU_GPT,
                                       log=print)
    section["figures"] = {f"{x['strategy']} compiled / eager": x["compiled_over_eager"] for x in section["rows"]}
    section["figures"].update({f"{x['strategy']} compile s": x["compile_s"] for x in section["rows"]})
    return section


def checkpointing(dry: bool) -> dict[str, Any]:
    from benchmarks import gpu, step_options

    section = step_options.run_checkpointing(gpu.DRYRUN_SIZES if dry else gpu.GPU_SIZES, device=str(_device(dry)),
                                             shape=gpu.DRYRUN_GPT if dry else gpu.GPU_GPT, log=print)
    section["figures"] = {"activation checkpointing: memory with / without": section["memory_ratio"],
                          "activation checkpointing: step with / without": section["step_ratio"]}
    return section


SECTIONS = {"ceilings": ceilings, "strategies": strategies, "gpt": gpt, "local": local, "ranks": ranks,
            "ingest": ingest, "compile": compile_section, "checkpointing": checkpointing}


def main(argv: list[str]) -> int:
    name, result, dry = argv[0], Path(argv[1]), "--dry-run" in argv[2:]
    if dry:
        os.environ["RAYTRAIN_DDP_BENCH_CUDA_DRYRUN"] = "1"
    try:
        data = SECTIONS[name](dry)
    except Exception as exc:  # noqa: BLE001 - recorded; the parent runs the next section
        import traceback

        traceback.print_exc()
        data = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    result.write_text(json.dumps(data, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
