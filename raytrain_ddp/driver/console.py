"""What the driver prints: the plan before training, progress while it runs, the summary after.

Owns: the console lines of `raytrain-ddp train` (derived numbers up front, nanoGPT-style;
one line per metrics record; the outcome), and `final_metrics` for `summary.json`.
Must not touch: Ray, training. Progress lines are printed as the records arrive from
the workers (`ProgressPrinter` is one of the sinks of `driver/stream.py`'s recorder),
not by reading a file back: the run directory may be a bucket.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, TextIO

from raytrain_ddp.config import Config


def print_plan(cfg: Config, spec: Any, run_dir: Path, steps_per_epoch: int, total_steps: int,
               resume: Any, params: Optional[int] = None) -> None:
    """The derived numbers, up front (nanoGPT-style): what one step means and how many.

    `resume`: the fit's `ResumePoint` (None: a fresh start); `params`: the model's parameter
    count when the driver already built it (a user model).
    """
    workers = cfg.scaling.max_workers
    k = cfg.accumulation_steps(workers)
    if params is None:
        params = parameter_count(cfg, spec)
    lines = [
        f"raytrain-ddp: run {cfg.name!r} -> {run_dir}",
        f"  data      {spec.source}: {spec.train_rows:,} train / {spec.val_rows:,} val rows, task {spec.task}",
        f"  model     {cfg.model.name}, {params:,} parameters, strategy {cfg.parallel.strategy}, "
        f"precision {cfg.train.precision}",
        f"  batch     global {cfg.train.global_batch_size} = {counted(workers, 'worker')} x micro "
        f"{cfg.train.micro_batch_size} x {counted(k, 'accumulation step')}",
        f"  schedule  {steps_per_epoch} steps/epoch, {total_steps} steps, lr {cfg.train.lr:g} "
        f"({describe_schedule(cfg.train)})",
        f"  resume    {_describe_resume(resume, total_steps)}",
    ]
    if cfg.scaling.elastic:
        lines[3] += f" (elastic {cfg.scaling.min_workers}-{workers} workers; accumulation re-derived on resize)"
    auto = [f"{key} auto" for key in ("bucket_cap_mb", "compress") if getattr(cfg.parallel, key) == "auto"]
    if auto:  # the numbers behind it: raytrain_ddp/parallel/tuning.py
        lines.insert(3, f"  parallel  {' and '.join(auto)}: the first ~20 synced steps time candidate "
                        "bucket layouts, the fastest is kept on every worker; rank 0 prints the choice")
    print("\n".join(lines), flush=True)


def describe_schedule(train: Any) -> str:
    """The schedule's real name and shape: `warmup 0, cosine to 0.1x`, `warmup 5, then constant`,
    or your function's import path."""
    if train.schedule == "constant":
        return f"warmup {train.warmup_steps}, then constant"
    if train.schedule in ("cosine", "linear"):
        return f"warmup {train.warmup_steps}, {train.schedule} to {train.min_lr_ratio:g}x"
    return f"your schedule {train.schedule}"


def parameter_count(cfg: Config, spec: Any) -> int:
    """The built-in model's parameter count, built on torch's meta device: shapes only, no
    memory and no initialisation (the plan is printed before any worker starts)."""
    import torch

    from raytrain_ddp.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg, spec).parameters())


def _describe_resume(resume: Any, total_steps: int) -> str:
    if resume is None or resume.checkpoint is None:
        return "fresh start"
    step = resume.step
    text = f"from {resume.checkpoint} (step {step})"
    if step >= total_steps:
        text += (f"; already at step {step} of {total_steps}: nothing to train "
                 "(raise train.epochs or train.max_steps to continue, or pick a new name)")
    return text


def counted(n: int, word: str) -> str:
    """`1 worker`, `2 workers`: a count with its noun in the right number."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def print_summary(summary: dict[str, Any]) -> None:
    fm = summary["final_metrics"]
    # the seconds are the fit's, from before the worker group starts to its end (not the steps alone)
    parts = [f"status {summary['status']}", counted(summary["steps"], "step"), f"{summary['epochs']:g} epochs",
             counted(summary["attempts"], "attempt"), f"{summary['elapsed_s']:.1f}s fit (worker start included)"]
    if "loss" in fm:
        parts.append(f"loss {fm['loss']:.4f}")
    parts += _val_parts(fm)
    if summary.get("goodput"):  # this fit's share of productive time, then the run's (goodput.py)
        parts.append(f"goodput {100 * summary['goodput']['fit']:.0f}% (run {100 * summary['goodput']['run']:.0f}%)")
    out = sys.stdout if summary["status"] == "ok" else sys.stderr
    print("raytrain-ddp: " + " | ".join(parts), file=out, flush=True)
    if summary["status"] == "interrupted":
        where = (f"the same command continues from step {summary.get('checkpoint_step')} "
                 f"(checkpoint {summary['checkpoint']})" if summary.get("checkpoint")
                 else "no checkpoint yet: the same command starts from the beginning")
        print(f"raytrain-ddp: interrupted at step {summary['steps']}; {where}", file=out, flush=True)
    if summary.get("error"):
        print(f"raytrain-ddp: error: {summary['error']}", file=out, flush=True)
    print(f"raytrain-ddp: run directory {summary['run_dir']}", flush=True)
    if summary.get("checkpoint"):
        print(f"raytrain-ddp: latest checkpoint {summary['checkpoint']}", flush=True)


def final_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last train line's values, overlaid with the last validation line's."""
    out: dict[str, Any] = {}
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if train:
        out.update(train[-1])
    if val:
        out.update({k: v for k, v in val[-1].items() if k.startswith("val_")})
    return out


def _val_parts(record: dict[str, Any]) -> list[str]:
    """`val_loss`, `val_accuracy` as a percentage, then the rest (`val_perplexity`, the
    user's `train.metrics`) in name order."""
    parts = [f"val_loss {record['val_loss']:.4f}"] if "val_loss" in record else []
    if "val_accuracy" in record:
        parts.append(f"val_accuracy {100 * record['val_accuracy']:.2f}%")
    for key in sorted(k for k in record if k.startswith("val_") and k not in ("val_loss", "val_accuracy")):
        if isinstance(record[key], (int, float)):
            parts.append(f"{key} {record[key]:.4g}")
    return parts


def format_record(record: dict[str, Any], total_steps: Optional[int] = None) -> str:
    step = record.get("step", "?")
    width = len(str(total_steps)) if total_steps else 0
    where = f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"
    epoch = record.get("epoch")
    where += f" | epoch {epoch:g}" if isinstance(epoch, (int, float)) else " | epoch ?"
    if "val_loss" in record:
        return f"{where} | " + " | ".join(_val_parts(record))
    text = (f"{where} | loss {record.get('loss', float('nan')):.4f} | lr {record.get('lr', 0.0):.2e}"
            f" | {record.get('samples_per_s', 0.0):,.0f} samples/s"
            f" | data wait {100 * record.get('data_wait_fraction', 0.0):.0f}%")
    if record.get("nonfinite_steps"):
        text += f" | non-finite steps {record['nonfinite_steps']}"
    return text


class ProgressPrinter:
    """Driver side: prints each metrics record as it arrives (a sink of the run's record stream)."""

    def __init__(self, total_steps: Optional[int] = None, out: Optional[TextIO] = None) -> None:
        self.total_steps = total_steps
        self.out = out if out is not None else sys.stdout  # at construction: honours redirect_stdout

    def record(self, record: dict[str, Any]) -> None:
        # One write per line: Ray's worker lines arrive on another thread (`ray_console`), and
        # print's separate write of the newline let one land between (seen in test_console).
        self.out.write(format_record(record, self.total_steps) + "\n")
        self.out.flush()

    def flush(self) -> None:
        pass

    def close(self, status: str) -> None:
        pass
