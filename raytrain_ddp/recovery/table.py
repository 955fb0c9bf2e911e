"""The recovery table: what each `run.recovery` value means, in one place (issue #42).

Owns: one row per mode (`checkpoint`, `replica`, `live`) with what it needs, and the one
place `run.recovery`'s values are compared (`of`). Each row names its two halves, chosen
once per run and composed at construction:
- the driver half (`driver/recovery.py`, `driver/live.py`): the mode the run really gets
  (`resolve`: live falls back to replica where it cannot apply), Ray Train's backend
  config, the workers' environment and Ray Train's callbacks;
- the worker half (`worker/recovery.py`, `worker/live.py`): how a worker group resumes,
  how a step runs (`train_step`) and over which group the wrapper all-reduces.
Must not touch: what the halves do. The halves are named by "module:attribute", as the
strategy table names its wrappers: a driver half imports Ray, a worker half torch and
torchft, and this table sits below both layers (`driver` -> `worker` -> `recovery`).

The strategy table keeps one capability flag this table reads: `replicated` (every rank
holds the whole state after a step, so a survivor has what a restart or a newcomer needs).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_ddp.launch import table as launchers
from raytrain_ddp.parallel import registry

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


@dataclass(frozen=True)
class Recovery:
    """One row of the table."""

    name: str  # the value of run.recovery
    survivors_copy: bool  # survivors of a replicated strategy write the last step (worker/replica.py)
    live: bool  # survivors keep their processes; torchft replaces the lost worker (worker/live.py)
    driver: str  # "module:attribute" of the driver half
    worker: str  # "module:attribute" of the worker half

    def load_driver(self) -> Any:
        return _load(self.driver)

    def load_worker(self) -> Any:
        return _load(self.worker)


_STEADY = "raytrain_ddp.worker.recovery:Steady"
_TABLE = (
    Recovery("checkpoint", survivors_copy=False, live=False,
             driver="raytrain_ddp.driver.recovery:Restart", worker=_STEADY),
    Recovery("replica", survivors_copy=True, live=False,
             driver="raytrain_ddp.driver.recovery:SurvivorsCopy", worker=_STEADY),
    Recovery("live", survivors_copy=True, live=True,
             driver="raytrain_ddp.driver.live:Live", worker="raytrain_ddp.worker.live:LiveSession"),
)
MODES: dict[str, Recovery] = {r.name: r for r in _TABLE}
NAMES: tuple[str, ...] = tuple(MODES)
FALLBACK = "replica"  # what live falls back to where it cannot apply


def of(cfg: "Config") -> Recovery:
    """The row of `cfg.run.recovery` (the one place its value is read)."""
    return MODES[cfg.run.recovery]


def is_live(cfg: "Config") -> bool:
    """Whether the run asks for live recovery and its launcher carries it out (Ray's; launch/table.py)."""
    return of(cfg).live and cfg.run.recovery in launchers.of(cfg).recovery


def survivors_copy(cfg: "Config") -> bool:
    """Whether the survivors keep a boundary snapshot and write the last step when a peer is lost."""
    return of(cfg).survivors_copy and registry.get(cfg.parallel.strategy).replicated


def live_refusal(strategy: str) -> str:
    """Why strategy `strategy` cannot recover live ("" when it can), as the rest of a config line."""
    if not registry.get(strategy).replicated:
        return "keeps 1/W of the state per rank, so no survivor holds what a replacement needs"
    return ""


def falling_back(cfg: "Config") -> "Config":
    """A copy of `cfg` whose recovery is `FALLBACK`."""
    fallback = cfg.model_copy(deep=True)
    fallback.run.recovery = FALLBACK
    return fallback


def driver_half(cfg: "Config") -> Any:
    """The driver half's class of the run's mode: `resolve(cfg)` first, then built on what it returned."""
    return of(cfg).load_driver()


def worker_half(cfg: "Config") -> Any:
    """The worker half's class of the run's mode (where the launcher does not carry live out: the steady one)."""
    return of(cfg).load_worker() if (is_live(cfg) or not of(cfg).live) else _load(_STEADY)


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
