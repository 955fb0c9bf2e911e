"""Driver halves of `run.recovery: checkpoint` and `replica` (the recovery table: `recovery/table.py`).

Owns: what Ray Train is given for these modes: torch's own backend (`TorchConfig`'s, through
`driver/process_group.py`: one process group of all workers) and, for `replica`, the callback that lets a survivor finish
writing the last step before Ray stops it (`GraceForSurvivors`, waiting on `worker/replica.py`'s
`CopyWindow`).
Must not touch: the rest of the trainer (`launcher.py`), what the workers do.
`driver/live.py` holds live's half, with the same four members.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

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

    def torch_config(self, timeout_s: int) -> Any:
        from raytrain_ddp.driver.process_group import ProcessGroupConfig  # TorchConfig's, torch-free class

        return ProcessGroupConfig(backend="nccl" if self.cfg.scaling.use_gpu else "gloo", timeout_s=timeout_s)

    def callbacks(self) -> list[Any]:
        return []


class SurvivorsCopy(Restart):
    """`replica`: as `checkpoint`, and Ray's stop of a survivor waits for its copy of the last step."""

    def callbacks(self) -> list[Any]:
        return [_grace_for_survivors()()]


@functools.cache  # one class: what pickling finds by name (`__getattr__`) is the class it pickled
def _grace_for_survivors() -> type:
    """`GraceForSurvivors`, built on first use: its base is Ray Train's (`ray_compat`), and
    importing Ray costs local mode, which never uses it, about a second. Defined here, not
    beside `CopyWindow` in `worker/replica.py`: the controller unpickles it, and that module
    imports torch (`driver/process_group.py` says why the controller should not)."""
    from raytrain_ddp import ray_compat

    class GraceForSurvivors(ray_compat.worker_callback_base()):  # type: ignore[misc]
        """Ray Train worker callback: a worker being stopped first leaves its copy of the last step.

        Passed through `RunConfig(callbacks=...)`, which hands non-user callbacks to the
        workers (a DeveloperAPI of Ray Train). The waits stay inside Ray's 5 s patience.
        """

        def __init__(self, start_s: float = 0.25, finish_s: float = 4.0) -> None:
            self.start_s, self.finish_s = start_s, finish_s

        def before_worker_shutdown(self) -> None:
            from raytrain_ddp.worker.replica import WINDOW  # on a worker: its loop has it already

            WINDOW.on_shutdown(self.start_s, self.finish_s)

    GraceForSurvivors.__qualname__ = "GraceForSurvivors"  # pickled by reference: this module's attribute
    return GraceForSurvivors


def __getattr__(name: str) -> Any:
    if name == "GraceForSurvivors":  # unpickling it (the controller, the workers)
        return _grace_for_survivors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
