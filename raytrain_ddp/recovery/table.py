"""The recovery table: what each `run.recovery` value means, in one place (issue #42).

Owns: one row per mode (`checkpoint`, `replica`, `live`) with what it needs, the one place
`run.recovery`'s values are compared (`of`), and the two halves' types, each chosen once per
run and composed at construction (the shape of Ray Train's `FailurePolicy`: one decision each):
- `DriverRecovery` (`restart.py`, `live_driver.py`): what Ray Train is given -- the mode the
  run really gets (`resolve`: live falls back to replica where it cannot apply), the backend
  config, the workers' environment, the callbacks;
- `WorkerRecovery` (`steady.py`, `live.py`): how a worker group resumes, how a step runs and
  validates, over which group the wrapper all-reduces.
Must not touch: what the halves do. recovery/ imports neither `worker/` nor `driver/` (both
import this table): what a half composes from them is handed in (`WorkerParts`, the
launcher's own backend config and its start guard). A half is imported only when a run asks
for it (a driver half imports Ray, a worker half torch and torchft; this table imports neither).

The strategy table keeps one capability flag this table reads: `replicated` (every rank
holds the whole state after a step, so a survivor has what a restart or a newcomer needs).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, cast

from raytrain_ddp.launch import table as launchers
from raytrain_ddp.parallel import registry

if TYPE_CHECKING:
    from raytrain_ddp.config import Config
    from raytrain_ddp.job import Job


class DriverRecovery(Protocol):
    """Ray Train's side of a mode, for one run: `resolve` (the config the run really uses; live
    may fall back to replica, said in one line), then built on it, what Ray Train is given."""

    def __init__(self, cfg: "Config") -> None: ...
    @staticmethod
    def resolve(cfg: "Config", say: Callable[[str], None] = ...) -> "Config": ...
    def env(self) -> dict[str, str]: ...
    def torch_config(self, own: Any, guard: Callable[..., None]) -> Any:
        """The launcher's own backend config (`own`), or this mode's, starting groups through `guard`."""
    def callbacks(self) -> list[Any]: ...


class WorkerParts(NamedTuple):
    """What a worker half composes from the worker, handed in by the loop (`worker/loop.py`)."""

    train_step: Callable[..., Any]  # step.train_step
    validate: Callable[..., Any]  # step.validate
    checkpointer: Any  # the Checkpointer class: `resume(...)`, or built for a live newcomer
    wrap: Callable[..., Any]  # state.wrap(module, cfg, rank, group)
    compile_wrapper: Callable[..., Any]  # compiled.compile_wrapper(wrapper, cfg)


class WorkerRecovery(Protocol):
    """A worker's side of a mode: the loop resumes, steps and validates through it, and its
    wrapper runs on `wrapper_group()` (None: torch's default group)."""

    runtime: Any  # the worker's `Runtime`, as this mode lets the loop use it

    @classmethod
    def for_worker(cls, job: "Job", runtime: Any, parts: WorkerParts,
                   entered: Optional[float] = None) -> "WorkerRecovery": ...
    def wrapper_group(self) -> Any: ...
    def resume(self, job: "Job", rank: Any, state: Any, log: Any, hooks: Any, accumulation_steps: int) -> Any: ...
    def train_step(self, state: Any, window: list, accumulation_steps: int, train: Any, rank: Any) -> Any: ...
    def validate(self, state: Any, data: Any, rank: Any, spec: Any) -> dict[str, float]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Recovery:
    """One row of the table."""

    name: str  # the value of run.recovery
    survivors_copy: bool  # survivors of a replicated strategy write the last step (replica.py)
    live: bool  # survivors keep their processes; torchft replaces the lost worker (live.py)
    driver: str  # "module:class" of the driver half, in recovery/
    worker: str  # "module:class" of the worker half, in recovery/

    def load_driver(self) -> type[DriverRecovery]:
        return cast("type[DriverRecovery]", _load(self.driver))

    def load_worker(self) -> type[WorkerRecovery]:
        return cast("type[WorkerRecovery]", _load(self.worker))


_STEADY = "steady:Steady"
_TABLE = (
    Recovery("checkpoint", survivors_copy=False, live=False, driver="restart:Restart", worker=_STEADY),
    Recovery("replica", survivors_copy=True, live=False, driver="restart:SurvivorsCopy", worker=_STEADY),
    Recovery("live", survivors_copy=True, live=True, driver="live_driver:Live", worker="live:LiveSession"),
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


def driver_half(cfg: "Config") -> type[DriverRecovery]:
    """The driver half's class of the run's mode: `resolve(cfg)` first, then built on what it returned."""
    return of(cfg).load_driver()


def worker_half(cfg: "Config") -> type[WorkerRecovery]:
    """The worker half's class of the run's mode (where the launcher does not carry live out: the steady one)."""
    return (of(cfg) if is_live(cfg) or not of(cfg).live else MODES[FALLBACK]).load_worker()


def _load(name: str) -> type:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(f"raytrain_ddp.recovery.{module}"), attr)
