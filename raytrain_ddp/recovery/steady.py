"""The worker half of `run.recovery: checkpoint` and `replica` (a `WorkerRecovery` of `table.py`).

Owns: what these modes do on a worker: resume like any attempt (`Checkpointer.resume`: the
newest valid checkpoint of the fit, a survivor's copy included), each step and validation as
they are, the wrapper over torch's default group. Must not touch: the survivors' copy itself
(`replica.py`, chosen by `table.survivors_copy` in `worker/state.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from raytrain_ddp.job import Job
    from raytrain_ddp.recovery.table import WorkerParts


class Steady:
    """The loop's calls as they always were: no session between the loop and its step."""

    train_step: Callable[..., Any]  # the worker's own `step.train_step`
    validate: Callable[..., Any]  # the worker's own `step.validate`: the epoch's validation, as it is

    def __init__(self, runtime: Any, parts: "WorkerParts") -> None:
        self.runtime, self.parts = runtime, parts
        self.train_step, self.validate = parts.train_step, parts.validate

    @classmethod
    def for_worker(cls, job: "Job", runtime: Any, parts: "WorkerParts", entered: Optional[float] = None) -> "Steady":
        return cls(runtime, parts)

    def wrapper_group(self) -> Any:
        """The wrapper's process group: torch's default one."""
        return None

    def resume(self, job: "Job", rank: Any, state: Any, log: Any, hooks: Any, accumulation_steps: int) -> Any:
        return self.parts.checkpointer.resume(job, rank, state, log, hooks, accumulation_steps, self.runtime)

    def close(self) -> None:
        pass
