"""`raytrain-ddp plot RUN_DIR`: loss, validation and throughput curves to one PNG.

Owns: reading a run directory's `metrics.jsonl` (local, or in object storage through
`rundir.Location`) and drawing it. Must not touch: Ray,
torch, the training code. Uses matplotlib's Agg backend so it works on headless
machines and inside Ray jobs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import METRICS_FILE, Location, read_metrics


def plot_run(run_dir: os.PathLike | str, out: Optional[os.PathLike | str] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = Location.parse(run_dir)
    records = read_metrics(where / METRICS_FILE)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if not train and not val:
        raise UserError(f"{where / METRICS_FILE}: no metrics to plot (is {str(run_dir)!r} a run directory?)")
    # default: beside the metrics; for a run in object storage, <name>-curves.png here
    out = Path(out) if out else (where.local_path / "curves.png" if where.is_local else Path(f"{where.name}-curves.png"))

    has_acc = any("val_accuracy" in r for r in val)
    fig, axes = plt.subplots(1, 3 if has_acc else 2, figsize=(15 if has_acc else 10, 4))
    ax_loss, ax_tput = axes[0], axes[-1]
    dots = "o-" if len(train) < 20 else "-"  # a short run's few points must show (one alone draws no line)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], dots, label="train loss")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="loss")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    if has_acc:
        acc = [r for r in val if "val_accuracy" in r]
        axes[1].plot([r["step"] for r in acc], [100 * r["val_accuracy"] for r in acc], "o-", color="tab:green")
        axes[1].set(xlabel="optimizer step", ylabel="%", title="validation accuracy")
        axes[1].grid(alpha=0.3)
    ax_tput.plot([r["step"] for r in train], [r.get("samples_per_s", 0.0) for r in train], dots, color="tab:orange")
    ax_tput.set(xlabel="optimizer step", ylabel="samples / s", title="throughput (all workers)")
    ax_tput.set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(where.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
