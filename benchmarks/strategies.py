"""Step time of each data-parallel strategy against one process and against torch DDP.

Owns: the `strategies` section (and the GPU variant's wrapper-overhead rows). Must not
touch: Ray, data loading (each rank trains on one fixed batch, so only compute and
communication are timed).

How it is measured, and why:
- One launch of W gloo ranks holds every variant at once (the bare model, `naive`,
  `bucketed` at several bucket caps and with `bucket_cap_mb="auto"`, `native` (our wrapper
  around torch DDP, which adds a Python comm hook to count bytes) and `torch_ddp` (torch DDP
  as users run it: default bucket sizes, 25 MB with a 1 MB first bucket, and
  `gradient_as_bucket_view=True`; the reference)), each a copy of the same seeded model
  with its own optimizer. Rounds visit the variants round-robin, rotating the order each
  round, so slow drift of the machine (other processes, thermal) spreads over all of
  them instead of biasing whichever ran last.
- `single` is the bare model stepped by every rank at the same time with no
  communication: the same per-rank batch, the same thread count and the same contention
  for memory bandwidth as the distributed variants, so `variant - single` is what
  synchronisation costs.
- Warm-up steps are excluded; every step is timed on its own and the median with the
  interquartile range and min/max is reported. `bucketed_auto` warms up until its tuning
  has decided (about 20 synced steps), so its timed steps use the chosen layout.
- The #19 question, bucketed (25 MB, the default) against torch DDP, is asked separately
  (`parity`): `sizes.parity_launches` fresh launches of three variants only, bucketed,
  torch DDP and a second, identical torch DDP (the control), `sizes.parity_rounds`
  rotated rounds each. Two findings on this 2-core machine shaped it: per-step times
  spread by 2x, and a launch itself biases a comparison (two identical torch DDP copies
  in one launch came out 0.95-1.07 of each other, launch by launch), so no number of
  rounds inside one launch settles a 1-3 % question. Each launch gives a paired
  ratio; the verdict is their geometric mean with a t interval over launches, and the
  control's ratio shows what "no difference" looks like in the same runs.
- Exposed communication (`comm`): each wrapper's own `comm_stats` over the timed steps
  (`comm_s`, `exposed_comm_s`, see `parallel.base.WrappedModel`), per step, mean over
  ranks: how long gradient all-reduces were in flight, how much of it came after backward
  had finished, and the fraction backward hid. torch DDP has no such counter.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import Sizes, ratio, run_ranks, stats
from raytrain_ddp.models import MLP, TinyGPT, cross_entropy

# The articles' MLP and the config's default tiny GPT.
MLP_SHAPE = dict(in_features=1024, hidden_sizes=[1024, 1024, 256], num_classes=256)
GPT_SHAPE = dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4, dropout=0.0)
BUCKET_CAPS_MB = (1.0, 25.0, 100.0)
AUTO_WARMUP_LIMIT = 60  # synced steps bucketed_auto may take to decide (it needs about 20)
# the #19 launches' variants: bucketed as configured by default (shared memory between the
# ranks of one host, parallel.shm) and over gloo as torch DDP is, torch DDP twice
PARITY = ("bucketed_25mb", "bucketed_25mb_gloo", "torch_ddp", "torch_ddp_control")
PARITY_STEPS = 4  # timed steps per variant per parity round (after one untimed step)
# two-sided 95 % Student t quantiles by degrees of freedom (launches - 1)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def build_model(name: str, shape: Optional[dict] = None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(**(shape or MLP_SHAPE))
    if name == "gpt":
        return TinyGPT(**(shape or GPT_SHAPE))
    raise ValueError(f"model {name!r} is not one of 'mlp', 'gpt'")


def make_batch(model: nn.Module, name: str, batch: int, seed: int, device: torch.device) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        x = torch.randn(batch, first.in_features, generator=gen)
        out = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features
        y = torch.randint(0, out, (batch,), generator=gen)
    else:
        vocab, length = model.tok.num_embeddings, model.seq_len
        x = torch.randint(0, vocab, (batch, length), generator=gen)
        y = torch.randint(0, vocab, (batch, length), generator=gen)
    return x.to(device), y.to(device)


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def variant_specs(device: str, with_dp: bool) -> list[tuple[str, Optional[str], Any]]:
    specs: list[tuple[str, Optional[str], Any]] = [("single", None, 0.0), ("naive", "naive", 25.0)]
    specs += [(f"bucketed_{int(cap)}mb", "bucketed", cap) for cap in BUCKET_CAPS_MB]
    if device == "cpu":  # the same wrapper with its all-reduces through gloo (parallel.shm: false)
        specs.append(("bucketed_25mb_gloo", "bucketed_gloo", 25.0))
    specs.append(("bucketed_auto", "bucketed", "auto"))
    specs.append(("native", "native", 25.0))
    specs.append(("torch_ddp", "torch_ddp", 25.0))
    if with_dp:
        specs.append(("data_parallel", "dp", 0.0))
    return specs


def _wrap(base: nn.Module, strategy: Optional[str], cap: Any, device: torch.device) -> nn.Module:
    from raytrain_ddp.parallel import wrap_model

    module = copy.deepcopy(base).to(device)
    if strategy is None:
        return module
    if strategy == "dp":
        return nn.DataParallel(module)
    device_ids = [device.index or 0] if device.type == "cuda" and strategy in ("native", "torch_ddp") else None
    if strategy == "torch_ddp":  # the reference users compare against: no counting hook, and
        # torch's default buckets (an explicit bucket_cap_mb, even 25, drops its 1 MB first bucket)
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)
    if strategy == "bucketed_gloo":
        return wrap_model(module, "bucketed", bucket_cap_mb=cap, shm=False)
    return wrap_model(module, strategy, bucket_cap_mb=cap, device_ids=device_ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_setup(world_rank: int, model_name: str, sizes: Sizes, device_name: str,
                shape: Optional[dict]) -> tuple[torch.device, nn.Module, int, tuple]:
    """What every rank body starts from: its device, the seeded model and this rank's fixed batch."""
    device = torch.device(device_name, world_rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = build_model(model_name, shape)
    batch = sizes.mlp_batch if model_name == "mlp" else sizes.gpt_batch
    return device, base, batch, make_batch(base, model_name, batch, seed=1000 + world_rank, device=device)


def _step(model: nn.Module, opt: torch.optim.Optimizer, data: tuple) -> None:
    x, y = data
    opt.zero_grad(set_to_none=True)
    cross_entropy(model(x), y).backward()
    opt.step()


def _timed_rounds(variants: list[tuple[str, nn.Module, torch.optim.Optimizer]], data: tuple, rounds: int,
                  steps_per_round: int, device: torch.device,
                  comm: Optional[dict[str, dict[str, float]]] = None) -> dict[str, list[float]]:
    """Step times (ms) per variant over `rounds` rounds that visit every variant, the order
    rotated each round; each visit is one untimed step (caches, buckets) and then
    `steps_per_round` timed ones. With `comm`, each wrapper's comm_stats timing over the
    timed steps is added to it."""
    _sync(device)
    times: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for r in range(rounds):
        shift = r % len(variants)
        for label, model, opt in variants[shift:] + variants[:shift]:
            dist.barrier()
            _step(model, opt, data)
            _sync(device)
            before = dict(getattr(model, "comm_stats", {}))
            for _ in range(steps_per_round):
                start = time.perf_counter()
                _step(model, opt, data)
                _sync(device)
                times[label].append((time.perf_counter() - start) * 1e3)
            after = getattr(model, "comm_stats", {})
            if comm is not None and "comm_s" in after:
                acc = comm.setdefault(label, {"comm_s": 0.0, "exposed_comm_s": 0.0, "steps": 0})
                for key in ("comm_s", "exposed_comm_s"):
                    acc[key] += after[key] - before.get(key, 0.0)
                acc["steps"] += steps_per_round
    return times


def time_variants(world_rank: int, world_size: int, model_name: str, sizes: Sizes, device_name: str,
                  with_dp: bool, shape: Optional[dict] = None) -> dict[str, Any]:
    """Rank body: every variant, round-robin; returns step times (ms) per variant."""
    if sizes.name == "smoke":  # the test suite's preset: checks the code paths, so tune briefly
        from raytrain_ddp.parallel import tuning

        tuning.STEPS, tuning.ROUNDS = 4, 1  # this rank process only
    device, base, batch, data = _rank_setup(world_rank, model_name, sizes, device_name, shape)
    variants = []
    for label, strategy, cap in variant_specs(device_name, with_dp):
        model = _wrap(base, strategy, cap, device)
        variants.append((label, model, torch.optim.SGD(model.parameters(), lr=1e-3)))
    tuned: dict[str, Any] = {}
    for label, model, opt in variants:
        for _ in range(sizes.warmup_steps):
            _step(model, opt, data)
        auto = getattr(model, "bucket_cap_mb", None) == "auto" and world_size > 1
        for _ in range(AUTO_WARMUP_LIMIT if auto else 0):
            if model.tuning is not None:
                break
            _step(model, opt, data)  # the tuning steps (same count on every rank: they are collectives)
        if auto:
            tuned[label] = model.tuning
    comm: dict[str, dict[str, float]] = {}
    times = _timed_rounds(variants, data, sizes.rounds, sizes.steps_per_round, device, comm)
    return {"times_ms": times, "grad_bytes": grad_bytes(base), "comm": comm, "tuned": tuned,
            "params": sum(p.numel() for p in base.parameters()), "batch": batch,
            "threads": torch.get_num_threads()}


PAIRED = ("bucketed_25mb", "bucketed_25mb_gloo", "bucketed_auto", "native")  # each against torch_ddp, round by round


def paired_ratio(a: list[float], b: list[float], steps_per_round: int) -> float:
    """Median over rounds of (median of `a`'s steps in the round) / (the same of `b`).

    A round times every variant back to back, so a ratio within one round compares them
    under the same load; the median over rounds then ignores a round another process
    disturbed. The ratio of the overall medians (`ratios`) mixes rounds run at different
    loads: on this shared 2-core machine it moved by 5 % between runs of the same code."""
    n = min(len(a), len(b)) // steps_per_round
    if n == 0:
        return float("nan")
    per_round = [statistics.median(a[r * steps_per_round:(r + 1) * steps_per_round])
                 / statistics.median(b[r * steps_per_round:(r + 1) * steps_per_round]) for r in range(n)]
    return statistics.median(per_round)


def launch_interval(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high): the ratios of independent launches, with the 95 % t
    interval of their mean log. Interval (nan, nan) with one launch."""
    if len(ratios) < 2:  # the one launch's ratio itself (exp(log(r)) may differ from r in the last bit)
        return ratios[0], float("nan"), float("nan")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = _T95.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def time_parity(world_rank: int, world_size: int, model_name: str, sizes: Sizes, device_name: str,
                shape: Optional[dict] = None) -> dict[str, Any]:
    """Rank body of one #19 launch: bucketed_25mb (over gloo too, on CPU), torch DDP and an
    identical torch DDP, rotated round by round; step times (ms) per variant."""
    device, base, _, data = _rank_setup(world_rank, model_name, sizes, device_name, shape)
    specs = {label: (strategy, cap) for label, strategy, cap in variant_specs(device_name, with_dp=False)}
    specs["torch_ddp_control"] = specs["torch_ddp"]
    variants = []
    for label in (label for label in PARITY if label in specs):  # bucketed_25mb_gloo: CPU only
        model = _wrap(base, *specs[label], device)
        variants.append((label, model, torch.optim.SGD(model.parameters(), lr=1e-3)))
    for _, model, opt in variants:
        for _ in range(sizes.warmup_steps):
            _step(model, opt, data)
    return {"times_ms": _timed_rounds(variants, data, sizes.parity_rounds, PARITY_STEPS, device)}


def summarise_parity(launches: list[list[dict]]) -> dict[str, Any]:
    """Per launch the paired ratios bucketed / torch DDP (as configured by default, and over
    gloo where it ran) and control / torch DDP (slowest rank per step); over launches their
    geometric means with 95 % t intervals."""
    labels = list(launches[0][0]["times_ms"])
    ours, gloo, control, medians = [], [], [], {label: [] for label in labels}
    for rank_results in launches:
        per_step = _slowest_rank(rank_results, "times_ms")
        ours.append(paired_ratio(per_step["bucketed_25mb"], per_step["torch_ddp"], PARITY_STEPS))
        if "bucketed_25mb_gloo" in per_step:
            gloo.append(paired_ratio(per_step["bucketed_25mb_gloo"], per_step["torch_ddp"], PARITY_STEPS))
        control.append(paired_ratio(per_step["torch_ddp_control"], per_step["torch_ddp"], PARITY_STEPS))
        for label in labels:
            medians[label].append(statistics.median(per_step[label]))
    ratio, low, high = launch_interval(ours)
    c_ratio, c_low, c_high = launch_interval(control)
    extra: dict[str, Any] = {}
    if gloo:
        g_ratio, g_low, g_high = launch_interval(gloo)
        extra = {"gloo": g_ratio, "gloo_ci95": [g_low, g_high], "gloo_per_launch": gloo}
    return {"ratio": ratio, "ci95": [low, high], "per_launch": ours, **extra,
            "control": c_ratio, "control_ci95": [c_low, c_high], "control_per_launch": control,
            "launches": len(launches), "rounds_per_launch": len(launches[0][0]["times_ms"]["torch_ddp"]) // PARITY_STEPS,
            "steps_per_round": PARITY_STEPS,
            "step_ms": {label: statistics.median(v) for label, v in medians.items()}}


def _slowest_rank(rank_results: list[dict], key: str) -> dict[str, list[float]]:
    """Per variant, each step's time on the slowest rank (every rank waits for it in the all-reduce)."""
    return {label: [max(r[key][label][i] for r in rank_results) for i in range(len(steps))]
            for label, steps in rank_results[0][key].items()}


def summarise(model_name: str, rank_results: list[dict], world_size: int,
              steps_per_round: Optional[int] = None) -> dict[str, Any]:
    """Per-step time is the slowest rank's (every rank waits for it in the all-reduce).
    `steps_per_round` (the steps each round timed per variant, in order) adds `paired`."""
    per_step = _slowest_rank(rank_results, "times_ms")
    variants = {label: stats(values) for label, values in per_step.items()}
    med = {label: v["median"] for label, v in variants.items()}
    first = rank_results[0]
    out: dict[str, Any] = {
        "model": model_name, "world_size": world_size, "per_rank_batch": first["batch"],
        "threads_per_rank": first["threads"], "params": first["params"],
        "grad_mb": first["grad_bytes"] / 2**20,
        "step_ms": med,
        "spread_ms": variants,
        "ratios": {
            "bucketed_over_native": ratio(med["bucketed_25mb"], med["native"]),
            "bucketed_over_torch_ddp": ratio(med["bucketed_25mb"], med["torch_ddp"]),
            "native_over_torch_ddp": ratio(med["native"], med["torch_ddp"]),
            "best_bucketed_over_native": ratio(min(med[k] for k in med if k.startswith("bucketed")),
                                               med["native"]),
            "naive_over_bucketed": ratio(med["naive"], med["bucketed_25mb"]),
            "native_over_single": ratio(med["native"], med["single"]),
            "bucketed_over_single": ratio(med["bucketed_25mb"], med["single"]),
        },
    }
    if "bucketed_auto" in med:
        out["ratios"]["bucketed_auto_over_torch_ddp"] = ratio(med["bucketed_auto"], med["torch_ddp"])
    if "data_parallel" in med:
        out["ratios"]["data_parallel_over_native"] = ratio(med["data_parallel"], med["native"])
    if steps_per_round and "torch_ddp" in per_step:
        out["paired_over_torch_ddp"] = {label: paired_ratio(per_step[label], per_step["torch_ddp"], steps_per_round)
                                        for label in PAIRED if label in per_step}
    out["comm"] = comm_summary(rank_results)
    tuned = first.get("tuned", {}).get("bucketed_auto")
    if tuned is not None:
        out["auto"] = {"bucket_cap_mb": tuned["bucket_cap_mb"], "compress": tuned["compress"],
                       "buckets": tuned["buckets"], "tuning_steps": tuned["steps"], "ms": tuned["ms"],
                       "text": tuned["text"]}
    return out


def comm_summary(rank_results: list[dict]) -> dict[str, dict[str, float]]:
    """Per variant: ms of communication and of exposed communication per step (mean over
    ranks), and the fraction of communication backward hid."""
    out = {}
    for label in rank_results[0].get("comm", {}):
        rows = [r["comm"][label] for r in rank_results if label in r.get("comm", {})]
        steps = sum(row["steps"] for row in rows)
        comm = sum(row["comm_s"] for row in rows)
        exposed = sum(row["exposed_comm_s"] for row in rows)
        out[label] = {"comm_ms": 1e3 * comm / steps, "exposed_ms": 1e3 * exposed / steps,
                      "overlap_fraction": 1.0 - exposed / comm if comm > 0 else float("nan")}
    return out


def run(sizes: Sizes, device: str = "cpu", world_size: int = 2, models: tuple[str, ...] = ("mlp", "gpt"),
        shapes: Optional[dict[str, dict]] = None, backend: Optional[str] = None,
        with_dp: Optional[bool] = None, threads: Optional[int] = None, log=print) -> dict[str, Any]:
    """`device` is where ranks compute ("cpu" or "cuda"); DataParallel rows come with CUDA."""
    threads = threads or (1 if device == "cpu" else 4)
    backend = backend or ("gloo" if device == "cpu" else "nccl")
    with_dp = device == "cuda" if with_dp is None else with_dp
    section: dict[str, Any] = {
        "world_size": world_size, "backend": backend, "threads_per_rank": threads,
        "note": (f"{world_size} {backend} rank(s) x {threads} thread(s); 'single' = every rank steps the bare "
                 "model at the same time with no communication (same per-rank batch)"),
    }
    for name in models:
        log(f"  strategies: {name} on {world_size} {backend} rank(s) ...")
        shape = (shapes or {}).get(name)
        results = run_ranks(time_variants, world_size, name, sizes, device, with_dp, shape,
                            backend=backend, threads=threads, timeout_s=600)
        section[name] = summarise(name, results, world_size, sizes.steps_per_round)
        if sizes.parity_launches and world_size > 1:
            log(f"  strategies: {name}, bucketed / torch DDP in {sizes.parity_launches} launch(es) ...")
            launches = [run_ranks(time_parity, world_size, name, sizes, device, shape, backend=backend,
                                  threads=threads, timeout_s=600) for _ in range(sizes.parity_launches)]
            section[name]["parity"] = summarise_parity(launches)
    return section
