"""Training metrics: per-step timing, the rank-0 JSONL sink, and the driver's progress.

Owns: what a line of `metrics.jsonl` holds and how it is written and read back; the
driver-side thread that tails the file and prints one line per log interval; the
`final_metrics` of `summary.json`.
Must not touch: torch.distributed, Ray, the model. The loop does the reductions and
hands plain numbers here.

Why our own file: Ray Train V2 keeps reported metrics only next to checkpoints, so the
history of a run lives in `metrics.jsonl`, written by rank 0 only (every rank's step
takes the same wall time: the gradient all-reduce synchronises them).

Train lines carry `step`, `epoch`, `loss`, `lr`, `samples_per_s`, `data_wait_fraction`,
`allreduce_calls`, `allreduce_bytes` (per optimizer step, averaged over the steps since
the previous line) and `nonfinite_steps` (cumulative). Validation lines carry `step`,
`epoch`, `val_loss` and, for classifiers, `val_accuracy`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

METRICS_FILE = "metrics.jsonl"


class StepMeter:
    """Accumulates wall time, data wait and all-reduce traffic between two log lines.

    A step's wall time runs from the end of the previous step to the end of this one,
    so it includes the time spent waiting for the next window of batches. Time between
    `pause()` and `resume()` (validation, checkpointing) counts towards nothing.
    `wait_seconds` and `comm` are the cumulative counters of the data iterator and the
    wrapper; the meter works with their differences.
    """

    def __init__(self, global_batch_size: int, wait_seconds: float = 0.0, comm: Optional[dict] = None) -> None:
        self.global_batch_size = global_batch_size
        self._last_end = time.perf_counter()
        self._excluded_wait = 0.0
        self._paused_wait: Optional[float] = None
        self._start_window(wait_seconds, comm)

    def _start_window(self, wait_seconds: float, comm: Optional[dict]) -> None:
        self._steps = 0
        self._seconds = 0.0
        self._wait_start = wait_seconds
        self._excluded_wait = 0.0
        self._comm_start = dict(comm or {})

    def step_done(self) -> None:
        now = time.perf_counter()
        self._seconds += now - self._last_end
        self._last_end = now
        self._steps += 1

    def pause(self, wait_seconds: float) -> None:
        self._paused_wait = wait_seconds

    def resume(self, wait_seconds: float) -> None:
        if self._paused_wait is not None:
            self._excluded_wait += wait_seconds - self._paused_wait
            self._paused_wait = None
        self._last_end = time.perf_counter()

    @property
    def steps(self) -> int:
        return self._steps

    def summarize(self, wait_seconds: float, comm: Optional[dict] = None) -> dict[str, float]:
        """Per-step averages since the previous call; starts a new window."""
        steps = max(1, self._steps)
        seconds = max(self._seconds, 1e-9)
        comm = dict(comm or {})
        waited = wait_seconds - self._wait_start - self._excluded_wait
        out = {
            "samples_per_s": self.global_batch_size * self._steps / seconds,
            "data_wait_fraction": min(1.0, max(0.0, waited / seconds)),
            "allreduce_calls": (comm.get("allreduce_calls", 0) - self._comm_start.get("allreduce_calls", 0)) / steps,
            "allreduce_bytes": (comm.get("allreduce_bytes", 0) - self._comm_start.get("allreduce_bytes", 0)) / steps,
        }
        self._start_window(wait_seconds, comm)
        return out


class MetricsWriter:
    """Appends one JSON object per line, flushed at once so the driver can tail it.

    Disabled (a no-op) on every rank but 0.
    """

    def __init__(self, path: os.PathLike | str, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=True)
        with open(self.path, "a") as handle:
            handle.write(line + "\n")
            handle.flush()

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run redoes those steps; keep one history)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)


def read_metrics(path: os.PathLike | str) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (or of RUN_DIR/metrics.jsonl)."""
    path = Path(path)
    return read_jsonl(path / METRICS_FILE if path.is_dir() else path)


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


def format_record(record: dict[str, Any], total_steps: Optional[int] = None) -> str:
    step = record.get("step", "?")
    width = len(str(total_steps)) if total_steps else 0
    where = f"step {step:>{width}}/{total_steps}" if total_steps else f"step {step}"
    where += f" | epoch {record.get('epoch', '?')}"
    if "val_loss" in record:
        text = f"{where} | val_loss {record['val_loss']:.4f}"
        if "val_accuracy" in record:
            text += f" | val_accuracy {100 * record['val_accuracy']:.2f}%"
        return text
    text = (f"{where} | loss {record.get('loss', float('nan')):.4f} | lr {record.get('lr', 0.0):.2e}"
            f" | {record.get('samples_per_s', 0.0):,.0f} samples/s"
            f" | data wait {100 * record.get('data_wait_fraction', 0.0):.0f}%")
    if record.get("nonfinite_steps"):
        text += f" | non-finite steps {record['nonfinite_steps']}"
    return text


class ProgressPrinter:
    """Driver side: tails `metrics.jsonl` in a thread and prints each new line.

    Starts after the lines already in the file (a resumed run prints only its own).
    """

    def __init__(self, path: os.PathLike | str, total_steps: Optional[int] = None,
                 out: TextIO = sys.stdout, poll_s: float = 0.5) -> None:
        self.path = Path(path)
        self.total_steps = total_steps
        self.out = out
        self.poll_s = poll_s
        self._offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-ddp-progress", daemon=True)

    def __enter__(self) -> "ProgressPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._drain()

    def _drain(self) -> None:
        for record in self._new_records():
            print(format_record(record, self.total_steps), file=self.out, flush=True)

    def _new_records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        size = self.path.stat().st_size
        if size < self._offset:  # rewritten by truncate_after on resume
            self._offset = 0
        with open(self.path) as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete, _, _ = chunk.rpartition("\n")
        if not complete:
            return
        self._offset += len(complete.encode()) + 1
        for line in complete.splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN / Infinity; read back by json.loads
    return value

