"""Driver halves of `run.recovery: checkpoint` and `replica` (a `DriverRecovery` of `table.py`).

Owns: what Ray Train is given for these modes: the launcher's own backend (torch's, one
process group of all workers) and, for `replica`, the worker callback that lets a survivor
finish writing the last step before Ray stops it (`GraceForSurvivors`, waiting on
`replica.py`'s `CopyWindow`). Must not touch: the rest of the trainer, what the workers do.
Imported only by a fit on Ray (`table.driver_half`), so Ray's import here costs local mode nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from raytrain_ddp import ray_compat

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


class Restart:
    """`checkpoint`: a lost worker restarts the group from the newest durable checkpoint."""

    def __init__(self, cfg: "Config") -> None:
        self.cfg = cfg

    @staticmethod
    def resolve(cfg: "Config", say: Callable[[str], None] = print) -> "Config":
        """The config the run really uses: this mode always applies."""
        return cfg

    def env(self) -> dict[str, str]:
        return {}

    def torch_config(self, own: Any, guard: Callable[..., None]) -> Any:
        return own  # `driver/process_group.py`'s, started through the guard already

    def callbacks(self) -> list[Any]:
        return []


class SurvivorsCopy(Restart):
    """`replica`: as `checkpoint`, and Ray's stop of a survivor waits for its copy of the last step."""

    def callbacks(self) -> list[Any]:
        return [GraceForSurvivors()]


class GraceForSurvivors(ray_compat.worker_callback_base()):  # type: ignore[misc]
    """Ray Train worker callback: a worker being stopped first leaves its copy of the last step.

    Passed through `RunConfig(callbacks=...)`, which hands non-user callbacks to the workers;
    its base is Ray Train's `WorkerCallback`, a DeveloperAPI under `_internal` with no public
    name (`ray_compat.worker_callback_base`). Defined here, not beside `CopyWindow`: the
    controller unpickles it, and `replica.py` imports torch. The waits stay inside Ray's 5 s patience.
    """

    def __init__(self, start_s: float = 0.25, finish_s: float = 4.0) -> None:
        self.start_s, self.finish_s = start_s, finish_s

    def before_worker_shutdown(self) -> None:
        from raytrain_ddp.recovery.replica import WINDOW  # on a worker: its loop has it already

        WINDOW.on_shutdown(self.start_s, self.finish_s)
