"""`raytrain-ddp verify`: can I trust the from-scratch wrappers with MY model? Measured, not claimed.

Owns: taking the model and a few real rows of a config's data, training a few steps on 2
local gloo ranks in float64 with every strategy and with torch's
`DistributedDataParallel` (same options), plus one process on all the rows, and printing
per strategy how far it is from torch DDP (gradients, parameters and buffers every step, on
every rank; the full model and optimizer state dicts, what a checkpoint saves, every step on
rank 0), from one process, what it sent, how long a step took and how much of its
communication backward hid (where the wrapper times it); exit 1 on any difference above
1e-9, naming the tensor. It takes every config `train` takes: the rows go through
`data.preprocess` and the driver's own checks (`driver/preflight.precheck`), batches are
built, fed to the model and scored by `batch.BatchFormat` as in training -- (x, y) or dict
batches (`data.inputs`), the user's loss, the model's own (`train.loss: model`) -- with the
built-in cross-entropy kept in float64. The sharded strategies (`parallel.registry.SHARDED`: zero1, fsdp) build
their optimizer through `wrapper.make_optimizer` (every wrapper offers it) and are compared
on parameters and buffers after every step, not gradients: zero1's `.grad` is averaged only
inside the rank's chunk, fsdp's are shards; fsdp's full parameters are read inside
`summon_full_params()` (its gathers there are not counted as sent). What they send is
reduce-scatter + all-gather bytes, shown against gradient + parameter bytes.
The rank side (each rank's runs) is `ops/verify_rank.py`; this module is the driver
side: the rows, the ranks' launch, the merged report and its table. Must not touch: Ray
(ranks come from `ops.ranks`, no cluster), the run directory, the wrappers themselves
(it only calls `wrap_model` and the wrappers' public methods).

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

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from raytrain_ddp.errors import UserError
from raytrain_ddp.ops.verify_rank import MICRO_STEPS, REFERENCE, ROWS_PER_MICRO, STEPS, WORLD, rank_main
from raytrain_ddp.parallel import registry

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

TOLERANCE = 1e-9


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
    compiled_graphs: Optional[int] = None  # train.compile: graphs torch compiled (rank 0); None: eager
    checkpointed: int = 0  # model.activation_checkpointing: submodules recomputed in backward

    def problems(self) -> list[str]:
        if self.error:
            return [f"{self.strategy}: {self.error}"]
        out = []
        if self.compiled_graphs == 0:
            out.append(f"{self.strategy}: train.compile is on but torch compiled no graph (it ran eagerly)")
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

    start = time.monotonic()
    path = None
    if isinstance(config, Config):
        cfg = config
    else:
        path = None if config is None else str(config)
        cfg = load_config(path, list(overrides or []))
    every = registry.NAMES
    kinds = tuple(strategies) or every
    unknown = sorted(set(kinds) - set(every))
    if unknown:
        raise UserError(f"verify: unknown strategies {unknown}; choose from {every}")
    columns, spec, source = _rows(cfg, path)
    job = dict(cfg=cfg, config_path=path, spec=spec, columns=columns, kinds=kinds)
    try:
        per_rank = run_ranks(rank_main, WORLD, job, timeout_s=timeout_s, pg_timeout_s=30, threads=1)
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


def _rows(cfg: "Config", config_path: Optional[str] = None) -> tuple[dict[str, np.ndarray], Any, str]:
    """A few real rows of the configured data (seeded choice), as the model's columns, and the
    spec the model is built from: what `train` would feed it, `data.preprocess` applied and,
    for dict batches (`data.inputs`), every column the preprocess returns."""
    from raytrain_ddp.data import sources
    from raytrain_ddp.data.columns import arrow_numpy, column_arrays, uses_own_data
    from raytrain_ddp.driver.preflight import precheck
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.user import resolve, run_preprocess

    if cfg.data.source not in ("digits", "synthetic", "parquet"):
        raise UserError(f"verify takes rows from data.source digits, synthetic or parquet, not "
                        f"data.source={cfg.data.source!r} (Ray Datasets given from Python): write a few "
                        "rows to parquet and verify with data.source=parquet")
    need = WORLD * MICRO_STEPS * ROWS_PER_MICRO * STEPS
    own = uses_own_data(cfg)
    cfg_code = resolve(cfg, config_path=config_path)[1]
    # the driver's own checks, each error naming its key; unused parameters are not refused
    # here: finding them (and naming the option to set) is part of verify's report
    checked = precheck(cfg, cfg_code, require_all_used=False)
    if checked.pipeline is not None:
        spec = checked.pipeline.spec
    elif cfg.data.source == "parquet":
        info = checked.parquet
        spec = DataSpec(info.task, tuple(sources.model_shape(cfg, info.feature_shape)), info.num_classes,
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
        features, labels = (sources.load_digits_arrays() if cfg.data.source == "digits"
                            else sources.synthetic_arrays(cfg))
        if checked.pipeline is None:
            shape, classes, task = sources.spec_from_arrays(cfg, features, labels)
            spec = DataSpec(task, tuple(shape), classes, len(features), 0, cfg.data.source)
        table = sources.arrays_table(features, labels, cfg.data)
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


def _merge(cfg: "Config", per_rank: list[dict], kinds: Sequence[str]) -> Report:
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
            f.compiled_graphs, f.checkpointed = runs[0]["compiled_graphs"], runs[0]["checkpointed"]
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


def _fmt_graphs(report: Report) -> str:
    """Graphs torch compiled per strategy (torch DDP, the reference, runs eagerly)."""
    eager = [f.strategy for f in report.findings if f.strategy not in (REFERENCE, *registry.COMPILERS)]
    return ("graphs " + ", ".join(f"{f.strategy} {f.compiled_graphs}" for f in report.findings
                                  if f.compiled_graphs is not None)
            + "; eager: torch DDP" + "".join(f", {k} (refused: {registry.COMPILE_REFUSAL})" for k in eager))


def _fmt_unused(unused: dict[str, list[int]], limit: int = 4) -> str:
    shown = ", ".join(f"{n} (rank {', '.join(map(str, r))})" for n, r in list(unused.items())[:limit])
    return shown + (f" and {len(unused) - limit} more" if len(unused) > limit else "")


def _fmt_names(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _render(cfg: "Config", path: Optional[str], report: Report, rank0: dict, source: str) -> list[str]:
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
        + (", compress off (bf16 is lossy by design)" if p.compress else "")
        + (f", compiled ({cfg.train.compile_backend}; {_fmt_graphs(report)})" if cfg.train.compile is not False else "")
        + (f", activation checkpointing {cfg.model.activation_checkpointing} "
           f"({max(f.checkpointed for f in report.findings)} modules)" if cfg.model.activation_checkpointing else ""),
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
    lines += [f"note: {n}" for n in report.notes] + _gather_notes(report)
    if report.ok:
        lines.append(f"verdict: OK, every strategy trains like torch DDP on this model ({report.seconds:.0f} s)")
    else:
        lines += [f"MISMATCH {problem}" for problem in report.problems]
        lines.append(f"verdict: FAILED ({len(report.problems)} problem(s); {report.seconds:.0f} s)")
    return lines


def _gather_notes(report: Report) -> list[str]:
    """Why a strategy that shards its parameters all-gathered more than their bytes per step."""
    notes = []
    for f in report.findings:
        gathers = (f.all_gather_bytes_per_step or 0.0) / report.param_bytes if report.param_bytes else 0.0
        shards_parameters = f.strategy in registry.SHARDED and registry.STRATEGIES[f.strategy].shards_parameters
        if not f.error and shards_parameters and gathers > 1.005:
            notes.append(f"note: {f.strategy} all-gathered {gathers:.2f}x the parameter bytes per step: FSDP2 gathers a "
                         f"unit before every forward ({MICRO_STEPS} micro-batches per step here) and non-root "
                         "units again in backward; zero1 gathers once, after the optimizer step")
    return notes
