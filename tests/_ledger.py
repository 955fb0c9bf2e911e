"""The fault-sequence ledger's rule, shared: which rows each committed step trained on
(`RAYTRAIN_DDP_SAMPLE_LOG`, tests/_hooks.py), so "every sample once" is one
check across a kill, a Ctrl-C and a resume (tests/cluster/test_fault_sequences.py,
tests/ray/e2e/test_python_dataset.py)."""

from __future__ import annotations

import collections
import json
from pathlib import Path


def committed_rows(samples: Path) -> dict[int, list[str]]:
    """Step -> the rows its last execution trained on, every rank of that execution together.

    A rank's execution is its samples line (written after the step), or, for a rank killed
    between the step's exchange and that line (a lost node: the survivors commit the step),
    its pending lines of the step (one per forward, tests/_hooks.py), whichever is newer."""
    def read(pattern: str) -> list[tuple[str, dict]]:  # (file, line): a file is one process
        return [(f.name, json.loads(line)) for f in samples.glob(pattern) for line in f.read_text().splitlines()
                if line.strip()]

    lines = [line for _, line in read("samples-rank*.jsonl")]
    pending: dict[tuple, dict] = {}  # (step, rank, world, pid file, attempt) -> one execution's forwards
    for name, line in read("pending-rank*.jsonl"):
        key = (line["step"], line["rank"], line["world_size"], name, line["attempt"])
        run = pending.setdefault(key, {**line, "rows": []})
        run["rows"] += line["rows"]
        run["time"] = max(run["time"], line["time"])
    by_step: dict[int, list[dict]] = collections.defaultdict(list)
    for line in lines:
        by_step[line["step"]].append(line)
    out = {}
    for step, execs in by_step.items():
        newest = max(execs, key=lambda r: r["time"])
        world = newest["world_size"]
        rows = []
        for rank in range(world):  # each rank's newest execution of the step belongs to the last group
            mine = [r for r in execs if r["rank"] == rank and r["world_size"] == world]
            mine += [] if mine else [r for k, r in pending.items() if k[:3] == (step, rank, world)]
            rows += max(mine, key=lambda r: r["time"])["rows"] if mine else ["<missing rank>"]
        out[step] = sorted(rows)
    return out
