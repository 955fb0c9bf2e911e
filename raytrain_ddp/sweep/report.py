"""`raytrain-ddp sweep --report DIR`: the trials ranked, their curves, the best trial's config.

Owns: reading a sweep directory (each trial's run directory under `trials/`: its
`trial.json`, `config.yaml`, `metrics.jsonl`, `summary.json`; the sweep's `sweep.json`),
the table (trial, its drawn values, best metric, steps, status), `curves.png` (every
trial's validation curve) and `best.yaml` (the best finished trial's config, named
`<sweep>-best` and stored where the sweep's config stores runs: `train` takes it as it
is and trains the same trajectory). Must not touch: Ray, Tune (it reads files only).

A trial's status: finished (its fit ended ok), failed (its fit failed, or Tune's error,
with why), stopped early (neither, in a sweep that ended: ASHA stopped it, or the
time budget; its trial.json says at which step), unfinished (the sweep was interrupted:
the same command continues it).
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import yaml

from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, Location, read_metrics
from raytrain_ddp.sweep.trial import TRIAL_FILE, TRIALS_DIR

BEST_FILE = "best.yaml"
CURVES_FILE = "curves.png"
SWEEP_FILE = "sweep.json"


def _json(loc: Location) -> dict[str, Any]:
    return json.loads(loc.read_text()) if loc.exists() else {}


def read_trials(where: Location, metric: str, mode: str) -> list[dict[str, Any]]:
    """One row per trial directory, ranked best first (trials without the metric last)."""
    outcome = _json(where / SWEEP_FILE)
    rows = []
    for run_dir, info in (where / TRIALS_DIR).children():
        if info.type.name != "Directory" or not (run_dir / TRIAL_FILE).exists():
            continue
        trial = _json(run_dir / TRIAL_FILE)
        summary = _json(run_dir / SUMMARY_FILE)
        lines = read_metrics(run_dir / METRICS_FILE)
        curve = [(int(r["step"]), float(r[metric])) for r in lines if metric in r and "val_loss" in r]
        values = [v for _, v in curve if not math.isnan(v)]
        best = (min if mode == "min" else max)(values) if values else None
        steps = max((int(r.get("step", 0)) for r in lines), default=0)
        rows.append({"trial": trial.get("trial_id", run_dir.name), "values": trial.get("values", {}),
                     "best": best, "final": summary.get("final_metrics", {}).get(metric), "steps": steps,
                     "status": _status(trial, summary, outcome), "curve": curve, "run_dir": run_dir})
    sign = 1 if mode == "min" else -1
    rows.sort(key=lambda r: (r["best"] is None, sign * (r["best"] or 0.0)))
    return rows


def _status(trial: dict[str, Any], summary: dict[str, Any], outcome: dict[str, Any]) -> str:
    if summary.get("status") == "ok":
        return "finished"
    error = trial.get("error") or outcome.get("errors", {}).get(trial.get("trial_id", ""))
    if summary.get("status") in ("failed", "aborted", "unschedulable") or error:
        return f"failed: {summary.get('error') or error or summary.get('status')}"
    if outcome.get("status") == "finished":
        return "stopped early"  # ASHA or the time budget (trial.json's stopped_at_step says where)
    return "unfinished"


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def named(row: dict[str, Any]) -> str:
    """A trial by its drawn values (`lr=0.003, hidden_sizes=[64]`; its id when it drew none)."""
    values = row["values"]
    short = {key: key.rsplit(".", 1)[-1] for key in values}
    if len(set(short.values())) < len(short):  # two keys end alike: their full names
        short = {key: key for key in values}
    return ", ".join(f"{short[key]}={_shown(values[key])}" for key in sorted(values)) or row["trial"]


def table(rows: list[dict[str, Any]], metric: str) -> str:
    keys = sorted({k for r in rows for k in r["values"]})
    head = ["#", "trial", *keys, f"best {metric}", "steps", "status"]
    body = [[str(i + 1), r["trial"], *(_shown(r["values"].get(k, "")) for k in keys),
             "-" if r["best"] is None else f"{r['best']:.4f}", str(r["steps"]), r["status"]]
            for i, r in enumerate(rows)]
    widths = [max(len(row[c]) for row in [head, *body]) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *body])


def plot(rows: list[dict[str, Any]], metric: str, out: Location) -> None:
    """Every trial's validation curve (metric against step) in one picture."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row["curve"]:
            steps, values = zip(*row["curve"])
            ax.plot(steps, values, marker="o", markersize=3, label=f"{named(row)} ({row['status'][:14]})")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{len(rows)} trials")
    if any(row["curve"] for row in rows):
        ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    with out.fs.open_output_stream(out.path) as stream:
        stream.write(buf.getvalue())


def best_config(where: Location, rows: list[dict[str, Any]]) -> Optional[Location]:
    """best.yaml: the best finished trial's config, as `train` takes it (None: none finished)."""
    best = next((r for r in rows if r["status"] == "finished" and r["best"] is not None), None)
    if best is None:
        return None
    data = yaml.safe_load((best["run_dir"] / CONFIG_FILE).read_text())
    data["name"] = f"{where.name}-best"
    data["run"]["storage_path"] = str(where.parent)
    data["run"]["resume"] = None
    out = where / BEST_FILE
    out.write_text(f"# the best trial of sweep {where.name!r}: {best['trial']} ({best['values']})\n"
                   + yaml.safe_dump(data, sort_keys=False))
    return out


def print_report(where: Location, metric: Optional[str] = None, mode: Optional[str] = None) -> list[dict[str, Any]]:
    """Print the table, write curves.png and best.yaml; the rows, ranked."""
    if not (where / TRIALS_DIR).exists():
        raise UserError(f"{where} is not a sweep directory (it has no {TRIALS_DIR}/)")
    outcome = _json(where / SWEEP_FILE)
    metric, mode = metric or outcome.get("metric", "val_loss"), mode or outcome.get("mode", "min")
    rows = read_trials(where, metric, mode)
    print(table(rows, metric))
    if outcome:
        print(f"raytrain-ddp: sweep {outcome.get('status')}: {len(rows)} trials, "
              f"{sum(r['status'] == 'finished' for r in rows)} finished, "
              f"{sum(r['status'] == 'stopped early' for r in rows)} stopped early "
              f"({'; '.join(named(r) for r in rows if r['status'] == 'stopped early') or 'none'}), "
              f"{sum(r['status'].startswith('failed') for r in rows)} failed; "
              f"placement groups left: {outcome.get('placement_groups_left')}"
              + (f" ({outcome['placement_groups_removed']} removed by the sweep)" if outcome.get("placement_groups_removed") else "")
              + ("; run the same command to continue it" if outcome.get("status") == "interrupted" else ""))
    plot(rows, metric, where / CURVES_FILE)
    print(f"wrote {where / CURVES_FILE}")
    if (best := best_config(where, rows)) is not None:
        print(f"wrote {best} (train it: raytrain-ddp train {best})")
    return rows
