"""`raytrain-ddp verify`, rank side: each of the 2 gloo ranks trains every strategy and torch DDP.

Owns: the run's shape (`STEPS` x `MICRO_STEPS` micro-batches of `ROWS_PER_MICRO` rows on
`WORLD` ranks), building each rank's float64 model and micro-batches from the rows the
driver side sent, training one strategy (or torch DDP, `REFERENCE`) on a fresh process
group (compiled and with activation checkpointing where the config says, as training
applies them; torch DDP stays eager), and the per-rank differences the driver side (`ops/verify.py`) merges and prints.
Which strategies tune their layout or shard their parameters comes from
`parallel/registry.py`. Must not touch: Ray, the run directory, the wrappers' internals.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_ddp.parallel import registry

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

STEPS, MICRO_STEPS, ROWS_PER_MICRO, WORLD = 3, 2, 4, 2
REFERENCE = "torch"  # torch.nn.parallel.DistributedDataParallel, same options


def rank_main(world_rank: int, world_size: int, job: dict) -> dict:
    """One rank: the probe's facts, one process's result, then every strategy against torch DDP."""
    cfg = job["cfg"]
    build, micro, loss_of, whole = _inputs(job, world_size)
    probe = build()
    facts = _facts(probe, [micro(0, j, world_rank) for j in range(MICRO_STEPS)], loss_of)
    find_unused = cfg.parallel.find_unused_parameters
    unused_anywhere = _any_rank(bool(facts["unused"]))
    single = _single(cfg, build, micro, whole, loss_of, world_size) if facts["single_ok"] else None
    runs = {}
    for kind in (REFERENCE, *job["kinds"]):
        runs[kind] = _run(kind, build, micro, loss_of, world_rank, cfg, find_unused or unused_anywhere)
    ref = runs[REFERENCE]
    results = {}
    for kind, run in runs.items():
        if "error" in run or "error" in ref:
            results[kind] = {"error": run.get("error") or f"torch DDP failed: {ref['error']}"}
        else:
            results[kind] = _compare(kind, run, ref, single, world_rank)
    if not facts["single_ok"]:
        facts["notes"].append(facts.pop("single_why"))
    return {"runs": results, "facts": facts}


def _inputs(job: dict, world_size: int) -> tuple:
    """(build, micro, loss_of, whole): the model, the micro-batches, the loss, as `train` has them."""
    import torch

    from raytrain_ddp.user import resolve
    from raytrain_ddp.worker.step import logits_of

    cfg, spec = job["cfg"], job["spec"]
    code = resolve(cfg, config_path=job["config_path"])[1]
    fmt = code.batch_format(cfg)  # (x, y) or dict batches, the user's loss or the model's: as `train`
    columns = {}
    for name, array in job["columns"].items():
        t = torch.from_numpy(np.ascontiguousarray(array))
        columns[name] = t.double() if t.is_floating_point() else t

    def build():
        torch.manual_seed(cfg.train.seed)
        return code.build_model(cfg, spec).double()

    def micro(step: int, j: int, rank: int):
        lo = ((step * MICRO_STEPS + j) * world_size + rank) * ROWS_PER_MICRO
        return fmt.assemble({name: t[lo:lo + ROWS_PER_MICRO] for name, t in columns.items()})

    def loss_of(model, batch):
        output = fmt.forward(model, batch)
        if fmt.user_loss is None and fmt.loss_name == "cross_entropy":
            return _loss(logits_of(output), fmt.target(batch))  # float64 throughout (train's upcasts to fp32)
        return fmt.loss(output, batch)

    def whole(parts):
        """Micro-batches as one batch (one process's view of a step)."""
        if fmt.is_dict:
            return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return build, micro, loss_of, whole


def _compare(kind: str, run: dict, ref: dict, single: Any, world_rank: int) -> dict:
    """One strategy's run against torch DDP's (and one process's), on this rank."""
    stats = run["stats"]
    sharded = kind in registry.SHARDED
    return {
        "grad": None if run["grads"] is None else
        max((_max_diff(g, rg) for g, rg in zip(run["grads"], ref["grads"])), key=lambda d: d[0]),
        "param": _worst(run["steps"], ref["steps"], "params"),
        "buffer": _worst(run["steps"], ref["steps"], "buffers"),
        "state": None if world_rank != 0 else  # the full state dicts are rank 0's
        max((_state_diff(a, b) for a, b in zip(run["full"], ref["full"])), key=lambda d: d[0]),
        "single": None if single is None else _max_diff(run["steps"][-1]["params"], single),
        "reduce_scatter_bytes": stats.get("reduce_scatter_bytes", 0),
        "all_gather_bytes": stats.get("all_gather_bytes") if sharded else None,
        "allreduce_bytes": stats.get("allreduce_bytes", 0),
        "broadcast_bytes": stats.get("broadcast_bytes", 0),
        "comm_s": stats.get("comm_s"),
        "exposed_comm_s": stats.get("exposed_comm_s"),
        "ms": run["ms"],
        "compiled_graphs": run["compiled_graphs"],
        "checkpointed": run["checkpointed"],
    }


def _loss(logits, y):
    """Mean cross-entropy in float64 (the training loss upcasts to fp32; here nothing rounds)."""
    import torch.nn.functional as F

    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return F.cross_entropy(logits, y)


def _optimizer(cfg: "Config", params):
    import torch

    if cfg.train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.train.lr, momentum=cfg.train.momentum,
                               weight_decay=cfg.train.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def _seed_forward(step: int, j: int, rank: int) -> None:
    import torch

    torch.manual_seed(1_000_003 * step + 1009 * j + rank)  # same dropout masks in every run


def _facts(model, batches, loss_of) -> dict:
    """Frozen, tied and (on this rank, step 1) unused parameters; whether one process compares."""
    from torch import nn

    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for batch in batches:
        loss_of(model, batch).backward()
    named = list(model.named_parameters())
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
                    for m in model.modules())
    dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    buffers = list(model.buffers())
    why = ("one process is not a reference for this model (" +
           ("BatchNorm statistics are per rank under DDP" if batchnorm else
            "dropout masks depend on how rows are batched") + "); torch DDP is") if batchnorm or dropout else ""
    return {
        "n_params": sum(p.numel() for _, p in named), "n_tensors": len(named),
        "grad_bytes": sum(p.numel() * p.element_size() for _, p in named if p.requires_grad),
        "param_bytes": sum(p.numel() * p.element_size() for _, p in named),
        "n_buffers": len(buffers), "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "frozen": [n for n, p in named if not p.requires_grad],
        "tied": [group for group in names_of.values() if len(group) > 1],
        "unused": [n for n, p in named if p.requires_grad and p.grad is None],
        "single_ok": not (batchnorm or dropout), "single_why": why, "notes": [],
    }


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t)
    return bool(t.item())


def _single(cfg: "Config", build, micro, whole, loss_of, world_size: int) -> dict:
    """One process: every rank's micro-batches of a step in one mean-loss batch."""
    model = build()
    opt = _optimizer(cfg, model.parameters())
    for step in range(STEPS):
        parts = [micro(step, j, r) for r in range(world_size) for j in range(MICRO_STEPS)]
        loss_of(model, whole(parts)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _state(model)["params"]


def _worst(steps: list[dict], ref_steps: list[dict], key: str) -> tuple[float, str]:
    return max((_max_diff(s[key], r[key]) for s, r in zip(steps, ref_steps)), key=lambda d: d[0])


def _wrap(kind: str, module, pg, cfg: "Config", find_unused: bool, counts: dict):
    """(model, optimizer): torch DDP for `REFERENCE`, else `wrap_model` with the config's options.
    torch DDP's all-reduced bytes are counted into `counts["allreduce"]` by a comm hook (then its
    default all-reduce), as the wrappers count theirs, rather than computed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from raytrain_ddp.parallel import wrap_model
    from raytrain_ddp.parallel.native import make_ddp

    p = cfg.parallel
    # "auto" is for the strategies that tune (they try layouts while training: exercised here
    # too); torch DDP and the others get the default cap. A layout never changes the arithmetic.
    cap = p.bucket_cap_mb if p.bucket_cap_mb != "auto" or kind in registry.TUNERS else 25.0
    if kind == REFERENCE:
        model = make_ddp(module, process_group=pg, bucket_cap_mb=cap, first_bucket_mb=p.first_bucket_mb,
                         broadcast_buffers=p.broadcast_buffers, find_unused_parameters=find_unused)

        def counted(state: dict, bucket):
            state["allreduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(pg, bucket)

        model.register_comm_hook(counts, counted)
        return model, _optimizer(cfg, model.parameters())
    model = wrap_model(module, kind, process_group=pg, bucket_cap_mb=cap, first_bucket_mb=p.first_bucket_mb,
                       broadcast_buffers=p.broadcast_buffers, find_unused_parameters=find_unused,
                       collective_timeout_s=20, shm=p.shm)
    # every wrapper builds it; a sharded one steps this rank's shard
    return model, model.make_optimizer(lambda params: _optimizer(cfg, params))


def _run(kind: str, build, micro, loss_of, world_rank: int, cfg: "Config", find_unused: bool) -> dict:
    """Train STEPS steps with one strategy (or torch DDP) on a fresh group; its state after each."""
    import torch.distributed as dist

    from raytrain_ddp.models import checkpoint_activations
    from raytrain_ddp.worker.compiled import compile_wrapper

    pg = dist.new_group()  # a run that fails cannot derail the next one's collectives
    try:
        module = build()
        ref, sharded = kind == REFERENCE, kind in registry.SHARDED
        # train.compile and model.activation_checkpointing as training applies them; torch DDP stays eager
        checkpointed = 0 if ref else checkpoint_activations(module, cfg.model.activation_checkpointing)
        counts = {"allreduce": 0, "broadcast": 0, "summon": 0, "not_training": {}}  # the last: reading full state dicts
        model, opt = _wrap(kind, module, pg, cfg, find_unused, counts)
        compiler = None if ref or kind not in registry.COMPILERS else compile_wrapper(model, cfg)
        gathers = not ref and registry.STRATEGIES[kind].shards_parameters
        grads, steps, full, times = [], [], [], []
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        for step in range(STEPS):
            start = time.perf_counter()
            for j in range(MICRO_STEPS):
                batch = micro(step, j, world_rank)
                _seed_forward(step, j, world_rank)
                if ref and model.will_sync_module_buffers():
                    counts["broadcast"] += buffer_bytes
                with model.no_sync() if j < MICRO_STEPS - 1 else contextlib.nullcontext():
                    (loss_of(model, batch) / MICRO_STEPS).backward()
            if not sharded:
                grads.append({n: (q.grad.detach().clone() if q.grad is not None else None)
                              for n, q in module.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            _record(model, module, opt, ref, gathers, steps, full, counts)
        out = {"steps": steps, "full": full, "grads": None if sharded else grads, "ms": statistics.median(times) * 1e3}
        out["stats"] = _sent(model, ref, counts)
        out.update(compiled_graphs=None if compiler is None else compiler.graphs, checkpointed=checkpointed)
        return out
    except Exception as exc:  # noqa: BLE001 - reported in the table, named
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}


def _record(model, module, opt, ref: bool, gathers: bool, steps: list, full: list, counts: dict) -> None:
    """The state after a step: parameters and buffers, and the full state dicts (what a
    checkpoint saves); what reading them sent is counted apart from training's bytes."""
    if gathers:  # full parameters (a gather, not part of training: not counted)
        before = model.comm_stats.get("all_gather_bytes", 0)
        with model.summon_full_params():
            steps.append(_state(module))
        counts["summon"] += model.comm_stats.get("all_gather_bytes", 0) - before
    else:
        steps.append(_state(module))
    before = dict(model.comm_stats) if not ref else {}
    full.append(_full_state(model if not ref else module, opt, module))
    not_training = counts["not_training"]
    for key, value in (dict(model.comm_stats) if not ref else {}).items():
        if isinstance(value, int) and key in before:  # its gathers are verify's, not training's
            not_training[key] = not_training.get(key, 0) + value - before[key]


def _sent(model, ref: bool, counts: dict) -> dict:
    """What training sent: the wrapper's comm_stats less verify's own reads; torch DDP's counted (`_wrap`)."""
    if ref:
        return {"allreduce_bytes": counts["allreduce"], "broadcast_bytes": counts["broadcast"]}
    stats = dict(model.comm_stats)
    if counts["summon"]:
        stats["all_gather_bytes"] -= counts["summon"]
    for key, value in counts["not_training"].items():
        stats[key] -= value
    return stats


def _state(module) -> dict:
    return {"params": {n: q.detach().clone() for n, q in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()}}


def _full_state(model, opt, module) -> dict:
    """What a checkpoint saves of model and optimizer, flat: `name` and `name: <state key>`
    (a collective for zero1 / fsdp, whose full state lands on rank 0; gathers not counted)."""
    import torch

    # Copies: torch's state dicts hold the live tensors, which the next step moves.
    out = {name: t.detach().clone() for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    names = [name for name, _ in module.named_parameters()]
    state = opt.state_dict().get("state", {})
    for index, entry in state.items():
        where = names[index] if isinstance(index, int) and index < len(names) else str(index)
        for key, value in entry.items():
            out[f"{where}: optimizer {key}"] = (value.detach().clone() if isinstance(value, torch.Tensor)
                                                else torch.tensor(float(value)))
    return out


def _state_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest |a - b| over the entries of two flat state dicts; an entry only one has: infinite."""
    for name in sorted(set(a) ^ set(b)):
        return float("inf"), f"{name} (in {'this strategy' if name in a else 'torch DDP'}'s state dict only)"
    return _max_diff(a, b)


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest |a - b| over same-named tensors (None vs a tensor: infinite), and where."""
    worst: tuple[float, str] = (0.0, "")
    for name, t in a.items():
        u = b.get(name)
        if t is None and u is None:
            continue
        if t is None or u is None:
            return float("inf"), f"{name} (grad None in one, not the other)"
        if t.shape != u.shape:
            return float("inf"), f"{name} (shape {tuple(t.shape)} vs {tuple(u.shape)})"
        t, u = t.double(), u.double()
        d = (t - u).abs().masked_fill(t == u, 0.0).max().item() if t.numel() else 0.0  # -inf == -inf (a mask)
        if d != d or d > worst[0]:
            worst = (float("inf") if d != d else d, name)
    return worst
