"""The worker half of `run.recovery: checkpoint` and `replica` (the recovery table: `recovery/table.py`).

Owns: what these modes do on a worker: resume like any attempt (`Checkpointer.resume`:
the newest valid checkpoint of the fit, a survivor's copy included), run each step as it
is (`step.train_step`), validate as it is (`step.validate`), wrap over torch's default group. Must not touch: the survivors'
copy itself (`replica.py`, chosen by `recovery.survivors_copy` in `state.py`).
`live.py`'s `LiveSession` is live's half, with the same members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from raytrain_ddp.worker.step import train_step, validate

if TYPE_CHECKING:
    from raytrain_ddp.job import Job
    from raytrain_ddp.worker.checkpointer import Checkpointer
    from raytrain_ddp.worker.context import Rank
    from raytrain_ddp.worker.hooks import Hooks
    from raytrain_ddp.worker.meter import RunLog
    from raytrain_ddp.worker.runtime import Runtime
    from raytrain_ddp.worker.state import TrainState


class Steady:
    """The loop's calls as they always were: no session between the loop and its step."""

    train_step = staticmethod(train_step)
    validate = staticmethod(validate)  # the epoch's validation, as it is

    def __init__(self, runtime: "Runtime") -> None:
        self.runtime = runtime

    @classmethod
    def for_worker(cls, job: "Job", runtime: "Runtime", entered: Optional[float] = None) -> "Steady":
        return cls(runtime)

    def wrapper_group(self) -> Any:
        """The wrapper's process group: torch's default one."""
        return None

    def resume(self, job: "Job", rank: "Rank", state: "TrainState", log: "RunLog", hooks: "Hooks",
               accumulation_steps: int) -> "Checkpointer":
        from raytrain_ddp.worker.checkpointer import Checkpointer

        return Checkpointer.resume(job, rank, state, log, hooks, accumulation_steps, self.runtime)

    def close(self) -> None:
        pass
