"""The run directory: every file name in it, and the JSONL records kept there.

Owns: the names of `<run.storage_path>/<name>/`'s files, where that directory is, and
reading/appending JSON-lines files (a torn last line, left by a killed writer, is
skipped). Must not touch: what a record means (the meter and the driver's console do),
checkpoint contents (`checkpoint.py`).

    config.yaml      the resolved config of the latest fit (driver)
    metrics.jsonl    one line per log interval and per validation (rank 0)
    attempts.jsonl   one line per worker-group start (rank 0)
    summary.json     the outcome, written when the fit ends (driver)
    abort.json       why every rank stopped together (non-finite policy; rank 0)
    checkpoint_*/    checkpoints (`checkpoint.py`), written by Ray Train's report
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
SUMMARY_FILE = "summary.json"
ABORT_FILE = "abort.json"
CHECKPOINT_PREFIX = "checkpoint_"


def run_dir_of(cfg: Any) -> Path:
    """`<run.storage_path>/<name>`, absolute."""
    return Path(cfg.run.storage_path).expanduser().resolve() / cfg.name


def read_jsonl(path: os.PathLike | str) -> list[dict[str, Any]]:
    """Every complete JSON object line; a torn last line (writer killed) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(path: os.PathLike | str) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (or of RUN_DIR/metrics.jsonl)."""
    path = Path(path)
    return read_jsonl(path / METRICS_FILE if path.is_dir() else path)


def append_jsonl(path: os.PathLike | str, record: dict[str, Any]) -> None:
    """Append one record as a line, flushed at once (the driver tails metrics.jsonl)."""
    line = json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=True)
    with open(path, "a") as handle:
        handle.write(line + "\n")
        handle.flush()


def rewrite_jsonl(path: os.PathLike | str, records: list[dict[str, Any]]) -> None:
    """Replace a JSONL file atomically (a reader sees the old or the new file, never half)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN / Infinity; read back by json.loads
    return value
