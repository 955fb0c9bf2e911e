"""What a launcher is: the one part of a fit that differs by how its ranks start (Lightning's
`_Launcher`, with the start it needs before the plan).

Owns: the `Launcher` Protocol, which every row of launch/table.py names an implementation of
(driver/launcher.py's `RayLauncher`, driver/local.py's `LocalLauncher`, driver/torchrun.py's
`TorchrunLauncher`). driver/fit.py calls them in its numbered steps: built (4; the CLI builds
one whose row says `early_start` before it imports torch), `start` (4), `run` (6), `close`
(after 7, whatever happened). Must not touch: the steps themselves (driver/fit.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from raytrain_ddp.driver.fit import Start
    from raytrain_ddp.driver.interrupt import Interrupt
    from raytrain_ddp.driver.stream import Recorder
    from raytrain_ddp.job import Job


class Launcher(Protocol):
    """Built with the config (`__init__(cfg)`: a launcher whose row says `early_start` starts
    its processes there)."""

    def start(self, start: "Start", given: Optional[dict[str, Any]]) -> tuple[Any, Any]:
        """What the ranks need before the plan: the data where they read it (`PreparedData`),
        Ray connected first where it uses Ray, and the mailbox their records come through."""

    def run(self, job: "Job", recorder: "Recorder", interrupt: "Interrupt") -> tuple[str, Optional[str]]:
        """The ranks started on `job` and waited for: (status, error). `interrupt.register` once
        they run (Ctrl-C then asks them to stop); a raised error is the fit's failure."""

    def close(self) -> None:
        """Everything it started stopped (idempotent): Ray, processes, temp dirs."""
