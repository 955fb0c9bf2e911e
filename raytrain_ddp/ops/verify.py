"""`raytrain-ddp verify`: can I trust the from-scratch wrappers with MY model? Measured, not claimed.

Owns: taking the model and a few real rows of a config's data, training a few steps on 2
local gloo ranks in float64 with every strategy and with torch's
`DistributedDataParallel` (same options), plus one process on all the rows, and printing
per strategy how far it is from torch DDP (gradients, parameters and buffers every step, on
every rank; the full model and optimizer state dicts, what a checkpoint saves, every step on
rank 0), from one process, what it sent, how long a step took and how much of its
communication backward hid (where the wrapper times it); exit 1 on any difference above
1e-9, naming the tensor. It takes every config `train` takes: the rows go through
`data.preprocess` and the driver's own checks (`driver/datasets.precheck`), batches are
built, fed to the model and scored by `batch.BatchFormat` as in training -- (x, y) or dict
batches (`data.inputs`), the user's loss, the model's own (`train.loss: model`) -- with the
built-in cross-entropy kept in float64. The sharded strategies (`SHARDED_STRATEGIES`: zero1, fsdp) build
their optimizer through `wrapper.make_optimizer` (every wrapper offers it) and are compared
on parameters and buffers after every step, not gradients: zero1's `.grad` is averaged only
inside the rank's chunk, fsdp's are shards; fsdp's full parameters are read inside
`summon_full_params()` (its gathers there are not counted as sent). What they send is
reduce-scatter + all-gather bytes, shown against gradient + parameter bytes.
Must not touch: Ray (ranks come from `ops.ranks`, no cluster), the run directory, the
wrappers themselves (it only calls `wrap_model` and the wrappers' public methods).

    raytrain-ddp verify examples/configs/quickstart.yaml [key=value ...]
    raytrain_ddp.ops.verify.verify("examples/configs/quickstart.yaml")   # the same, from Python

Why this shape: float64 leaves rounding near 1e-16, so 1e-9 separates "same arithmetic in
another order" from a real difference; gradients are compared at every step because
Adam-type optimizers hide a gradient that is off by a constant factor; each run gets a
fresh process group so one failing strategy cannot derail the next; dropout draws are
seeded per (step, micro-step, rank) so every run sees the same masks. One process is the
reference only where it can be: BatchNorm's statistics are per rank under DDP, and
dropout masks depend on the batch layout, so with either the one-process column is "n/a".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from raytrain_ddp.errors import UserError

STEPS, MICRO_STEPS, ROWS_PER_MICRO, WORLD = 3, 2, 4, 2
TOLERANCE = 1e-9
REFERENCE = "torch"  # torch.nn.parallel.DistributedDataParallel, same options


@dataclass
class Finding:
    """One strategy's numbers (worst over ranks and steps)."""

    strategy: str
    error: Optional[str] = None
    grad: Optional[tuple[float, str]] = (0.0, "")  # max |grad - torch DDP's| over steps and ranks,
    # where; None: sharded, gradients are not comparable (parameters are, every step)
    param: tuple[float, str] = (0.0, "")
    buffer: tuple[float, str] = (0.0, "")
    state: tuple[float, str] = (0.0, "")  # the full model + optimizer state dicts (a checkpoint's), rank 0
    single: Optional[tuple[float, str]] = None  # max |param - one process's|; None: not comparable
    allreduce_bytes_per_step: float = 0.0
    broadcast_bytes_per_step: float = 0.0
    all_gather_bytes_per_step: Optional[float] = None  # sharded: parameter all-gathers (allreduce_*: reduce-scatters)
    ms_per_step: float = 0.0
    comm_ms_per_step: Optional[float] = None  # gradient all-reduces in flight (where the wrapper times them)
    exposed_ms_per_step: Optional[float] = None  # ... of which after backward had finished

    def problems(self) -> list[str]:
        if self.error:
            return [f"{self.strategy}: {self.error}"]
        out = []
        for what, found in (("gradient", self.grad), ("parameter", self.param), ("buffer", self.buffer),
                            ("state-dict entry", self.state)):
            diff, where = found or (0.0, "")
            if not diff <= TOLERANCE:
                out.append(f"{self.strategy}: {what} '{where}' differs from torch DDP by {diff:.3g}")
        if self.single is not None and not self.single[0] <= TOLERANCE:
            out.append(f"{self.strategy}: parameter '{self.single[1]}' differs from one process by "
                       f"{self.single[0]:.3g}")
        return out


@dataclass
class Report:
    """What `verify` found; `ok` is the exit status's source."""

    findings: list[Finding]
    grad_bytes: int
    param_bytes: int
    frozen: list[str]
    tied: list[list[str]]
    unused: dict[str, list[int]]  # parameter -> ranks where it got no gradient in step 1
    find_unused: bool = False  # parallel.find_unused_parameters as configured
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        out = [p for f in self.findings for p in f.problems()]
        if self.unused and not self.find_unused:
            out.insert(0, "parameters that get no gradient in a step: " + _fmt_unused(self.unused) +
                       "; with parallel.find_unused_parameters=false every strategy stops the run at "
                       "step 1 naming them (torch DDP alone would fail a step later, or hang): set "
                       "parallel.find_unused_parameters=true (verified here with it on)")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems


# -- driver side ---------------------------------------------------------------------------

def verify(config: Any = None, overrides: Optional[Sequence[str]] = None, *, strategies: Sequence[str] = (),
           out: Callable[[str], None] = print, timeout_s: float = 120.0) -> Report:
    """Verify every strategy, replicated and sharded (or `strategies`), on the model and data
    of `config` (a path, a loaded `Config`, or None for the defaults, plus `key=value`
    overrides); print the table through `out` and return the `Report` (`report.ok`,
    `report.problems`)."""
    from raytrain_ddp.config import Config, load_config
    from raytrain_ddp.ops.ranks import RankError, run_ranks
    from raytrain_ddp.parallel import SHARDED_STRATEGIES, STRATEGIES

    start = time.monotonic()
    path = None
    if isinstance(config, Config):
        cfg = config
    else:
        path = None if config is None else str(config)
        cfg = load_config(path, list(overrides or []))
    every = STRATEGIES + SHARDED_STRATEGIES
    kinds = tuple(strategies) or every
    unknown = sorted(set(kinds) - set(every))
    if unknown:
        raise UserError(f"verify: unknown strategies {unknown}; choose from {every}")
    columns, spec, source = _rows(cfg, path)
    job = dict(cfg=cfg, config_path=path, spec=spec, columns=columns, kinds=kinds)
    try:
        per_rank = run_ranks(_rank_main, WORLD, job, timeout_s=timeout_s, pg_timeout_s=30, threads=1)
    except RankError as exc:
        raise UserError(f"verify: the ranks did not finish: {exc}") from None
    report = _merge(cfg, per_rank, kinds)
    report.seconds = time.monotonic() - start
    for line in _render(cfg, path, report, per_rank[0], source):
        out(line)
    return report


def main(config: Optional[str], overrides: Sequence[str]) -> int:
    """The CLI: print the table; exit 0 when every strategy matches, 1 otherwise."""
    # The rank launcher's exit handshake can make torch's C++ layer log a harmless
    # "Connection reset by peer" warning; keep the table readable.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return 0 if verify(config, overrides).ok else 1


def _rows(cfg: Any, config_path: Optional[str] = None) -> tuple[dict[str, np.ndarray], Any, str]:
    """A few real rows of the configured data (seeded choice), as the model's columns, and the
    spec the model is built from: what `train` would feed it, `data.preprocess` applied and,
    for dict batches (`data.inputs`), every column the preprocess returns."""
    from raytrain_ddp.driver import datasets
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.user import resolve, run_preprocess, uses_own_data
    from raytrain_ddp.worker.shard import arrow_numpy, column_arrays

    if cfg.data.source not in ("digits", "synthetic", "parquet"):
        raise UserError(f"verify takes rows from data.source digits, synthetic or parquet, not "
                        f"data.source={cfg.data.source!r} (Ray Datasets given from Python): write a few "
                        "rows to parquet and verify with data.source=parquet")
    need = WORLD * MICRO_STEPS * ROWS_PER_MICRO * STEPS
    own = uses_own_data(cfg)
    cfg_code = resolve(cfg, config_path=config_path)[1]
    checked = datasets.precheck(cfg, cfg_code)  # the driver's own checks, each error naming its key
    if checked.pipeline is not None:
        spec = checked.pipeline.spec
    elif cfg.data.source == "parquet":
        info = checked.parquet
        spec = DataSpec(info.task, tuple(datasets._model_shape(cfg, info.feature_shape)), info.num_classes,
                        info.rows, 0, str(cfg.data.path))
    source = f"parquet {cfg.data.path}" if cfg.data.source == "parquet" else cfg.data.source
    if cfg.data.preprocess:
        source += f", data.preprocess {cfg.data.preprocess}"
    batches = []
    if cfg.data.source == "parquet":
        names = None if own else [cfg.data.features, cfg.data.label]
        raw = (table for file in checked.parquet.files
               for table in _parquet_tables(file, names))
    else:
        features, labels = (datasets.load_digits_arrays() if cfg.data.source == "digits"
                            else datasets.synthetic_arrays(cfg))
        if checked.pipeline is None:
            shape, classes, task = datasets._spec_from_arrays(cfg, features, labels)
            spec = DataSpec(task, tuple(shape), classes, len(features), 0, cfg.data.source)
        table = datasets._table(features, labels, cfg.data)
        raw = (table.slice(i, 256) for i in range(0, table.num_rows, 256))
    rows = 0
    for table in raw:
        batch = arrow_numpy(table)
        if cfg_code.preprocess:
            batch = run_preprocess(cfg, cfg_code.preprocess, batch)
        batches.append(batch)
        rows += len(next(iter(batch.values())))
        if rows >= need and cfg.data.source == "parquet":
            break
    if rows < need:
        raise UserError(f"verify needs {need} rows of {source}, found {rows}")
    batch = {name: np.concatenate([np.asarray(b[name]) for b in batches]) for name in batches[0]}
    arrays = column_arrays(batch, cfg, spec)
    order = np.random.default_rng(cfg.train.seed).permutation(rows)[:need]
    return {name: a[order] for name, a in arrays.items()}, spec, source


def _parquet_tables(file: str, columns: Optional[list[str]], rows: int = 64):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for record_batch in pq.ParquetFile(file).iter_batches(batch_size=rows, columns=columns):
        yield pa.Table.from_batches([record_batch])


def _merge(cfg: Any, per_rank: list[dict], kinds: Sequence[str]) -> Report:
    findings = []
    for kind in (REFERENCE, *kinds):
        f = Finding(kind)
        runs = [r["runs"][kind] for r in per_rank]
        errors = [f"rank {i}: {run['error']}" for i, run in enumerate(runs) if run.get("error")]
        if errors:
            f.error = "; ".join(errors)
        else:
            for key in ("grad", "param", "buffer", "state"):
                found = [run[key] for run in runs if run[key] is not None]
                f.__dict__[key] = max(found, key=lambda d: d[0]) if found else None
            singles = [run["single"] for run in runs]
            f.single = None if any(s is None for s in singles) else max(singles, key=lambda d: d[0])
            f.allreduce_bytes_per_step = runs[0]["allreduce_bytes"] / STEPS
            f.broadcast_bytes_per_step = runs[0]["broadcast_bytes"] / STEPS
            if runs[0]["all_gather_bytes"] is not None:
                f.allreduce_bytes_per_step = runs[0]["reduce_scatter_bytes"] / STEPS
                f.all_gather_bytes_per_step = runs[0]["all_gather_bytes"] / STEPS
            f.ms_per_step = max(run["ms"] for run in runs)
            if all(run.get("comm_s") is not None for run in runs):  # mean over ranks
                f.comm_ms_per_step = 1e3 * sum(run["comm_s"] for run in runs) / len(runs) / STEPS
                f.exposed_ms_per_step = 1e3 * sum(run["exposed_comm_s"] for run in runs) / len(runs) / STEPS
        findings.append(f)
    facts = per_rank[0]["facts"]
    unused: dict[str, list[int]] = {}
    for rank, r in enumerate(per_rank):
        for name in r["facts"]["unused"]:
            unused.setdefault(name, []).append(rank)
    report = Report(findings, facts["grad_bytes"], facts["param_bytes"], facts["frozen"], facts["tied"], unused,
                    notes=list(facts["notes"]))
    report.find_unused = cfg.parallel.find_unused_parameters
    return report


def _comm_columns(f: Finding) -> str:
    if f.comm_ms_per_step is None:
        return f"{'-':>7} {'-':>7} {'-':>6}"
    comm, exposed = f.comm_ms_per_step, f.exposed_ms_per_step or 0.0
    hidden = f"{1.0 - exposed / comm:.0%}" if comm > 0 else "-"
    return f"{comm:>7.2f} {exposed:>7.2f} {hidden:>6}"


def _fmt_unused(unused: dict[str, list[int]], limit: int = 4) -> str:
    shown = ", ".join(f"{n} (rank {', '.join(map(str, r))})" for n, r in list(unused.items())[:limit])
    return shown + (f" and {len(unused) - limit} more" if len(unused) > limit else "")


def _fmt_names(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _render(cfg: Any, path: Optional[str], report: Report, rank0: dict, source: str) -> list[str]:
    facts = rank0["facts"]
    p = cfg.parallel
    lines = [
        f"raytrain-ddp verify: {path or '(defaults)'}: every strategy against torch DDP and one process",
        f"  model     {cfg.model.name}, {facts['n_params']:,} parameters in {facts['n_tensors']} tensors, "
        f"{facts['n_buffers']} buffers ({facts['buffer_bytes']:,} B); float64 here",
        f"  data      {source}: {WORLD} gloo ranks x {MICRO_STEPS} micro-batches x {ROWS_PER_MICRO} rows "
        f"x {STEPS} steps, {cfg.train.optimizer} lr {cfg.train.lr:g}",
        f"  options   bucket_cap_mb {p.bucket_cap_mb if p.bucket_cap_mb == 'auto' else format(p.bucket_cap_mb, 'g')} "
        f"(first {p.first_bucket_mb:g}), broadcast_buffers {str(p.broadcast_buffers).lower()}, "
        f"find_unused_parameters {str(report.find_unused or bool(report.unused)).lower()}"
        + (", compress off (bf16 is lossy by design)" if p.compress else ""),
        f"  found     unused: {_fmt_unused(report.unused) if report.unused else 'none'} | "
        f"frozen: {_fmt_names(report.frozen)} | tied: "
        + ("; ".join(" = ".join(group) for group in report.tied) if report.tied else "none"),
        "",
        f"{'strategy':<9} {'grad diff':>9} {'param diff':>10} {'buffer diff':>11} {'state diff':>10} {'vs 1 proc':>9}  "
        f"{'sent B/step':>17} {'/ theory':>8}  {'bcast B/step':>12} {'ms/step':>7} "
        f"{'comm ms':>7} {'exposed':>7} {'hidden':>6}",
    ]
    for f in report.findings:
        name = "torch DDP" if f.strategy == REFERENCE else f.strategy
        if f.error:
            lines.append(f"{name:<9} ERROR {f.error}")
            continue
        ref = f.strategy == REFERENCE
        single = "n/a" if f.single is None else f"{f.single[0]:.1e}"
        grad = "(ref)" if ref else "-" if f.grad is None else f"{f.grad[0]:.1e}"
        sent, theory = f.allreduce_bytes_per_step, report.grad_bytes
        if f.all_gather_bytes_per_step is not None:  # sharded: reduce-scatter + all-gather
            sent, theory = sent + f.all_gather_bytes_per_step, theory + report.param_bytes
        ratio = sent / theory if theory else 0.0
        lines.append(
            f"{name:<9} {grad:>9} {'(ref)' if ref else f'{f.param[0]:.1e}':>10} "
            f"{'(ref)' if ref else f'{f.buffer[0]:.1e}':>11} "
            f"{'(ref)' if ref else f'{f.state[0]:.1e}':>10} {single:>9}  "
            f"{sent:>17,.0f} {ratio:>7.2f}x  {f.broadcast_bytes_per_step:>12,.0f} "
            f"{f.ms_per_step:>7.1f} {_comm_columns(f)}"
        )
    lines.append(f"(gradient bytes per step: {report.grad_bytes:,}, parameter bytes: {report.param_bytes:,}; "
                 "theory: all-reduce = gradient bytes; sharded (grad diff '-': compared on parameters "
                 "every step): reduce-scatter + all-gather = gradient + parameter bytes; "
                 f"diffs: max |a - b| over {WORLD} ranks and every step; state diff: the full model and optimizer "
                 "state dicts a checkpoint saves (zero1 / fsdp gather theirs to rank 0), after every step; "
                 f"tolerance {TOLERANCE:g}; comm ms: gradient "
                 "all-reduces in flight per step, exposed: the part after backward had finished, "
                 "hidden: the fraction backward hid; mean over ranks, '-' where not timed)")
    lines += [f"note: {n}" for n in report.notes]
    for f in report.findings:
        gathers = (f.all_gather_bytes_per_step or 0.0) / report.param_bytes if report.param_bytes else 0.0
        if not f.error and f.strategy == "fsdp" and gathers > 1.005:
            lines.append(f"note: fsdp all-gathered {gathers:.2f}x the parameter bytes per step: FSDP2 gathers a "
                         f"unit before every forward ({MICRO_STEPS} micro-batches per step here) and non-root "
                         "units again in backward; zero1 gathers once, after the optimizer step")
    if report.ok:
        lines.append(f"verdict: OK, every strategy trains like torch DDP on this model ({report.seconds:.0f} s)")
    else:
        lines += [f"MISMATCH {problem}" for problem in report.problems]
        lines.append(f"verdict: FAILED ({len(report.problems)} problem(s); {report.seconds:.0f} s)")
    return lines


# -- rank side -----------------------------------------------------------------------------

def _rank_main(world_rank: int, world_size: int, job: dict) -> dict:
    import torch
    from raytrain_ddp.parallel import SHARDED_STRATEGIES

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
            continue
        stats = run["stats"]
        results[kind] = {
            "grad": None if run["grads"] is None else
            max((_max_diff(g, rg) for g, rg in zip(run["grads"], ref["grads"])), key=lambda d: d[0]),
            "param": _worst(run["steps"], ref["steps"], "params"),
            "buffer": _worst(run["steps"], ref["steps"], "buffers"),
            "state": None if world_rank != 0 else  # the full state dicts are rank 0's
            max((_state_diff(a, b) for a, b in zip(run["full"], ref["full"])), key=lambda d: d[0]),
            "single": None if single is None else _max_diff(run["steps"][-1]["params"], single),
            "reduce_scatter_bytes": stats.get("reduce_scatter_bytes", 0),
            "all_gather_bytes": stats.get("all_gather_bytes") if kind in SHARDED_STRATEGIES else None,
            "allreduce_bytes": stats.get("allreduce_bytes", 0),
            "broadcast_bytes": stats.get("broadcast_bytes", 0),
            "comm_s": stats.get("comm_s"),
            "exposed_comm_s": stats.get("exposed_comm_s"),
            "ms": run["ms"],
        }
    if not facts["single_ok"]:
        facts["notes"].append(facts.pop("single_why"))
    return {"runs": results, "facts": facts}


def _loss(logits, y):
    """Mean cross-entropy in float64 (the training loss upcasts to fp32; here nothing rounds)."""
    import torch.nn.functional as F

    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return F.cross_entropy(logits, y)


def _optimizer(cfg: Any, params):
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


def _single(cfg: Any, build, micro, whole, loss_of, world_size: int) -> dict:
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


def _run(kind: str, build, micro, loss_of, world_rank: int, cfg: Any, find_unused: bool) -> dict:
    """Train STEPS steps with one strategy (or torch DDP) on a fresh group; its state after each."""
    import torch.distributed as dist
    from raytrain_ddp.parallel import SHARDED_STRATEGIES, wrap_model
    from raytrain_ddp.parallel.native import make_ddp

    p = cfg.parallel
    # "auto" is bucketed's alone (it tries layouts while training: exercised here too); torch
    # DDP and the other strategies get the default cap. A layout never changes the arithmetic.
    cap = p.bucket_cap_mb if p.bucket_cap_mb != "auto" or kind == "bucketed" else 25.0
    pg = dist.new_group()  # a run that fails cannot derail the next one's collectives
    try:
        module = build()
        if kind == REFERENCE:
            model = make_ddp(module, process_group=pg, bucket_cap_mb=cap, first_bucket_mb=p.first_bucket_mb,
                             broadcast_buffers=p.broadcast_buffers, find_unused_parameters=find_unused)
        else:
            model = wrap_model(module, kind, process_group=pg, bucket_cap_mb=cap, first_bucket_mb=p.first_bucket_mb,
                               broadcast_buffers=p.broadcast_buffers, find_unused_parameters=find_unused,
                               collective_timeout_s=20, shm=p.shm)
        sharded = kind in SHARDED_STRATEGIES
        if kind == REFERENCE:
            opt = _optimizer(cfg, model.parameters())
        else:  # every wrapper builds it; a sharded one steps this rank's shard
            opt = model.make_optimizer(lambda params: _optimizer(cfg, params))
        grads, steps, full, times, broadcast_bytes, summon_bytes = [], [], [], [], 0, 0
        not_training: dict[str, int] = {}  # what reading the full state dicts sent
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        for step in range(STEPS):
            start = time.perf_counter()
            for j in range(MICRO_STEPS):
                batch = micro(step, j, world_rank)
                _seed_forward(step, j, world_rank)
                if kind == REFERENCE and model.will_sync_module_buffers():
                    broadcast_bytes += buffer_bytes
                with model.no_sync() if j < MICRO_STEPS - 1 else contextlib.nullcontext():
                    (loss_of(model, batch) / MICRO_STEPS).backward()
            if not sharded:
                grads.append({n: (q.grad.detach().clone() if q.grad is not None else None)
                              for n, q in module.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            if kind == "fsdp":  # full parameters (a gather, not part of training: not counted)
                before = model.comm_stats.get("all_gather_bytes", 0)
                with model.summon_full_params():
                    steps.append(_state(module))
                summon_bytes += model.comm_stats.get("all_gather_bytes", 0) - before
            else:
                steps.append(_state(module))
            before = dict(model.comm_stats) if kind != REFERENCE else {}
            full.append(_full_state(model if kind != REFERENCE else module, opt, module))
            for key, value in (dict(model.comm_stats) if kind != REFERENCE else {}).items():
                if isinstance(value, int) and key in before:  # its gathers are verify's, not training's
                    not_training[key] = not_training.get(key, 0) + value - before[key]
        out = {"steps": steps, "full": full, "grads": None if sharded else grads, "ms": statistics.median(times) * 1e3}
        out["stats"] = {} if kind == REFERENCE else dict(model.comm_stats)
        if summon_bytes:
            out["stats"]["all_gather_bytes"] -= summon_bytes
        for key, value in not_training.items():
            out["stats"][key] -= value
        if kind == REFERENCE:  # torch DDP all-reduces every trainable gradient once per sync
            out["stats"] = {"allreduce_bytes": _torch_bytes(module) * STEPS, "broadcast_bytes": broadcast_bytes}
        return out
    except Exception as exc:  # noqa: BLE001 - reported in the table, named
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}


def _torch_bytes(module) -> int:
    return sum(q.numel() * q.element_size() for q in module.parameters() if q.requires_grad)


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
        d = (t.double() - u.double()).abs().max().item() if t.numel() else 0.0
        if d != d or d > worst[0]:
            worst = (float("inf") if d != d else d, name)
    return worst
