"""The `sweep` section: the trial switch of `raytrain-ddp sweep` (#43).

Owns: one small sweep (the tiny MLP on digits, `TRIALS` trials of 1 worker, one at a
time, no early stopping, a metrics line every step) through `raytrain_ddp.sweep` and its
embedded Ray, and the figure read back from its trials' run directories: the trial
switch, from one trial's last metrics line to the next trial's first step line (Tune
starting the next trial's process, our fit's preamble -- data check, Ray Datasets, the
placement wait -- and Ray Train's worker group start). Must not touch: the sweep itself,
any directory but the temporary one it makes.

    .venv/bin/python -m benchmarks.sweep            # prints the JSON; docs: benchmarks/README.md
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

TRIALS = 3
CONFIG = {
    "name": "bench-sweep",
    "model": {"name": "mlp", "hidden_sizes": [32]},
    "data": {"source": "digits"},
    "train": {"epochs": 1, "global_batch_size": 64, "micro_batch_size": 64},
    "scaling": {"num_workers": 1},
    "run": {"log_every_steps": 1, "checkpoint_every_steps": 0},
    "sweep": {"space": {"train.lr": {"grid": [0.001, 0.003, 0.01][:TRIALS]}}, "search": "grid",
              "scheduler": "none", "max_concurrent_trials": 1},
}


def switches(trials_dir: Path) -> list[float]:
    """Seconds from each trial's last metrics line to the next (in time) trial's first step line."""
    spans = []
    for run_dir in sorted(p for p in trials_dir.iterdir() if p.is_dir()):
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r["time"] for r in lines if "loss" in r]
        if steps:
            spans.append((min(steps), max(r["time"] for r in lines)))
    spans.sort()
    return [round(nxt[0] - prev[1], 2) for prev, nxt in zip(spans, spans[1:])]


def run() -> dict[str, Any]:
    import raytrain_ddp

    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        config = {**CONFIG, "run": {**CONFIG["run"], "storage_path": tmp}}
        outcome = raytrain_ddp.sweep(config)
        gaps = switches(Path(tmp) / "bench-sweep" / "trials")
    return {"trials": outcome["trials"], "status": outcome["status"], "switch_s": gaps,
            "switch_s_median": statistics.median(gaps) if gaps else None,
            "placement_groups_left": outcome["placement_groups_left"], "sweep_elapsed_s": outcome["elapsed_s"]}


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(), indent=2))
    sys.exit(0)
