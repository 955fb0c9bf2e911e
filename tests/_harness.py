"""Shared by the reliability tests: tiny configs, bounded background runs, metrics views.

Owns nothing of the product: only ways to start a run, wait for it with a deadline and
read what it left behind. Must not kill anything it did not start.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from raytrain_ddp.config import Config, load_config
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.rundir import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "tiny.yaml"


def tiny(storage: Path, name: str, *overrides: str) -> Config:
    """examples/configs/tiny.yaml: mlp on digits, 2 workers, 22 steps per epoch, checkpoint every 10."""
    return load_config(TINY, [f"run.storage_path={storage}", f"name={name}", *overrides])


class BackgroundRun:
    """`run_training(cfg)` in a thread, so the test can act on it while it runs."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.summary: Optional[dict[str, Any]] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name=f"run-{cfg.name}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self.summary = run_training(self.cfg)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The summary; fails the test (instead of hanging it) when the run outlives timeout_s."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"run {self.cfg.name!r} still running after {timeout_s}s: it hangs")
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.2,
             run: Optional[BackgroundRun] = None) -> Any:
    """Poll until `predicate()` is truthy; fail with `what` at the deadline (or if `run` ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if run is not None and not run.alive:
            raise AssertionError(f"run ended before {what}: {run.summary or run.error}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def train_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r]
