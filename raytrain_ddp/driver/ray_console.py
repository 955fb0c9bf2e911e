"""What Ray may print on the console of `raytrain-ddp train`: by default, only our own lines.

Owns: the driver's share of Ray's output — its loggers' levels, the worker output Ray
streams to the driver, colour. Must not touch: what our lines say (`console.py`),
Ray's log files (everything stays in the session directory for `--verbose`-free
debugging: `ray logs`, the dashboard).

By default the console shows the plan, progress, the summary and real warnings:

* Worker output streamed by Ray (`log_to_driver`) is filtered: only lines our workers
  print for the user (`[rank 0] ...`, `raytrain-ddp...`) pass, once each (a two-node
  cluster delivered them twice), without Ray's coloured `(RayTrainWorker pid=...)`
  prefix. Everything else Ray's processes print — C++ `core_worker.cc` notices,
  deprecation warnings of Ray's own internals, a cleaner
  thread's traceback when several Ray instances share a machine — stays in Ray's logs.
  A failing run still says why: `fit` raises and the summary line carries the cause.
* Ray's informational warning that token authentication is on (it is, on purpose) is
  dropped; the warning that it is *off* is kept. So is Ray Data's "Progress bars
  disabled" (we disable them), in the driver as in the workers.
* Colour only on a terminal: with `--verbose` Ray's prefixes are left uncoloured when
  stdout is piped (`RAY_COLOR_PREFIX=0`).

A sweep's console (`quiet_sweep`) keeps only its plan line and its report: Tune's box and
hints and every trial's own lines stay in the logs and the trials' run directories.

`--verbose` (`RAYTRAIN_DDP_VERBOSE=1`) keeps Ray's own handler and INFO lines.

The filter sits on Ray's worker-output dispatcher, an internal interface reached through
`ray_compat.py`: if it is not there, Ray's own handler stays (nothing is lost).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from raytrain_ddp import ray_compat

VERBOSE_ENV = "RAYTRAIN_DDP_VERBOSE"
OUR_LINES = ("[rank ", "raytrain-ddp")
_TOKEN_ON = "Token authentication is enabled for this Ray cluster"
_PROGRESS_OFF = "Progress bars disabled"  # Ray Data's notice: we turned them off on purpose


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes")


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_TOKEN_ON)


class _DropProgressNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_PROGRESS_OFF)


def before_init() -> str:
    """Call before `ray.init`; returns the logging level to pass it."""
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if verbose():
        return "INFO"
    _drop_notices()
    return "WARNING"


def _drop_notices() -> None:
    """Ray's notices of what we set on purpose (token auth on, progress bars off) are dropped."""
    for logger, kind in ((ray_compat.token_notice_logger(), _DropTokenNotice),
                         (ray_compat.progress_notice_logger(), _DropProgressNotice)):
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


class WorkerLines:
    """Ray's worker-output handler, narrowed to our lines (printed once, no prefix);
    `ours`: the prefixes that pass (none: a sweep's, whose trials are said by its report)."""

    def __init__(self, ours: tuple[str, ...] = OUR_LINES) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.ours = ours

    def __call__(self, data: dict[str, Any]) -> None:
        for line in data.get("lines", []):
            text = str(line).rstrip()
            if not self.ours or not text.startswith(self.ours):
                continue
            with self._lock:
                if text in self._seen:
                    continue
                self._seen.add(text)
            out = sys.stderr if data.get("is_err") else sys.stdout
            out.write(text + "\n")  # one write: the progress lines are printed from another thread
            out.flush()


def after_init() -> None:
    """Call after `ray.init(log_to_driver=True)`, or on a Ray the caller started: swap Ray's
    worker-output handler for ours, and keep Ray Data's progress bars and INFO lines off the
    console (the Python API's console equals the CLI's, issue #30)."""
    if verbose():
        return
    import ray.data

    _drop_notices()
    ray.data.DataContext.get_current().enable_progress_bars = False
    for name in ("ray", "ray.data", "ray.train"):
        if logging.getLogger(name).getEffectiveLevel() < logging.WARNING:
            logging.getLogger(name).setLevel(logging.WARNING)
    ray_compat.replace_worker_output_handler("raytrain_ddp", WorkerLines())


# Tune's own console: its experiment box, "View detailed results", a TensorBoard hint into
# Ray's session directory (the new output engine prints them at any verbosity; the legacy
# one at verbose=0 prints nothing), and its "operation took 1.2 s" warnings.
TUNE_QUIET_ENV = {"RAY_AIR_NEW_OUTPUT": "0"}


def quiet_sweep() -> None:
    """A sweep's console is its plan line and its report: before `Tuner.fit` (after `ray.init`),
    Tune's lines and every trial's own output (its fit's plan, progress, summary) stay off it,
    and in Ray's logs and each trial's run directory. `--verbose` keeps them all."""
    if verbose():
        return
    for name, value in TUNE_QUIET_ENV.items():
        os.environ.setdefault(name, value)
    logging.getLogger("ray.tune").setLevel(logging.ERROR)
    ray_compat.replace_worker_output_handler("raytrain_ddp", WorkerLines(ours=()))
