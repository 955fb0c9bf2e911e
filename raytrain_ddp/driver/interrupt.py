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
    """Ctrl-C from the placement wait to the end of `fit`: while the cluster has not placed
    the workers, the wait ends (`listen` installs the handler before it; Python's own
    KeyboardInterrupt was seen lost inside Ray's blocking calls, so the wait polls `fired`);
    once `fit` runs, first a stop at the next step boundary, saved; then an abort.

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
        self._listening = False
        self._timer: Optional[threading.Timer] = None

    @property
    def fired(self) -> bool:
        return self.presses > 0

    def listen(self) -> None:
        """Take SIGINT from now on (before the placement wait); idempotent. Only the main
        thread can (a fit run from another thread, as Ray's own handler, takes none)."""
        if not self._listening and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._listening = True

    def register(self, controller: Any) -> None:
        """Called by `TorchTrainer.fit` with its controller (`ray_compat.install_sigint_handler`)."""
        self.controller = controller
        self.listen()
        if self.presses and self.mailbox is not None:  # Ctrl-C between the placement wait and now
            self.mailbox.request_stop.remote()

    def _handle(self, signum: int, frame: Any) -> None:
        self.presses += 1
        if self.controller is None:  # no worker started yet: the placement wait sees `fired` and ends
            if self.presses == 1:
                print("raytrain-ddp: interrupted while waiting for the cluster to place the workers",
                      file=sys.stderr, flush=True)
            elif self.presses > 2:
                raise KeyboardInterrupt
            return
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

    def press(self) -> None:
        """A Ctrl-C from elsewhere, once: a sweep's trial that Tune stops (sweep/trial.py)
        saves its step and stops as on the first Ctrl-C, giving back its workers. Ray hands
        no controller to a fit outside the main thread (a trial's), so the stop request then
        goes to the mailbox here: it holds it for workers not started yet."""
        if not self.presses and self.controller is None and self.mailbox is not None:
            self.presses = 1  # `fired`: a placement wait ends, as on a Ctrl-C (said by the sweep's report)
            self.mailbox.request_stop.remote()
        elif not self.presses:
            self._handle(signal.SIGINT, None)

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
        if self._listening:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._previous, self._listening = None, False
