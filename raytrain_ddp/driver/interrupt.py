"""Ctrl-C while `TorchTrainer.fit` runs: the workers save the step they are at and stop.

Owns: the driver's SIGINT handler during a fit (`Interrupt`), installed in place of Ray
Train's own (`ray_compat.install_sigint_handler`), which would abort the controller and
`sys.exit(0)` silently, throwing away every step since the last checkpoint. Must not
touch: what the workers do when asked (`worker/preemption.py`), the summary
(`launcher.report`).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Optional

from raytrain_ddp.ray_compat import abort_controller

STOP_WAIT_S = 30.0  # after a Ctrl-C, how long the workers get to save their step and stop


class Interrupt:
    """Ctrl-C while `fit` runs: first a stop at the next step boundary, saved; then an abort.

    The first Ctrl-C asks the workers, through the mailbox, to save the step they are at
    and return (rank 0 polls about once a second: `worker/preemption.py`), so what was
    trained is kept; if they have not ended within `STOP_WAIT_S`, or on a second Ctrl-C,
    Ray Train's controller is aborted (what Ray's own handler does) and the run continues
    from its newest checkpoint. A third stops waiting for the workers at all.
    """

    def __init__(self, mailbox: Any = None) -> None:
        self.mailbox = mailbox
        self.presses = 0
        self.controller: Any = None
        self._previous: Any = None
        self._timer: Optional[threading.Timer] = None

    @property
    def fired(self) -> bool:
        return self.presses > 0

    def register(self, controller: Any) -> None:
        self.controller = controller
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.presses += 1
        if self.presses == 1 and self.mailbox is not None:
            print("raytrain-ddp: interrupted: the workers save the step they are at and stop "
                  "(Ctrl-C again to stop at once, from the newest checkpoint)", file=sys.stderr, flush=True)
            self.mailbox.request_stop.remote()
            self._timer = threading.Timer(STOP_WAIT_S, self.abort)
            self._timer.daemon = True
            self._timer.start()
            return
        if self.presses > 2:
            raise KeyboardInterrupt  # stop waiting for the workers
        print("raytrain-ddp: interrupted: stopping the workers (Ctrl-C again to stop waiting)",
              file=sys.stderr, flush=True)
        self.abort()

    def abort(self) -> None:
        self.presses = max(self.presses, 1)
        if self.controller is not None:
            try:
                abort_controller(self.controller)  # the controller stops the workers, then exits
            except Exception:  # noqa: BLE001 - already gone
                pass

    def restore(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
