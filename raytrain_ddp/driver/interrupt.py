"""Ctrl-C during a fit, whatever launches its ranks: they save the step they are at and stop.

Owns: the driver's one SIGINT handler during a fit (`Interrupt`; driver/fit.py installs it
for every launcher), on Ray installed in place of Ray Train's own
(`ray_compat.install_sigint_handler`), which would abort the controller and `sys.exit(0)`
silently, throwing away every step since the last checkpoint; and a caller's stop taken as
one Ctrl-C (`press_on`: a sweep's trial that Tune stops). Must not touch: what the workers
do when asked (`worker/preemption.py`), the summary (`fit.report`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator, Optional

from raytrain_ddp.ray_compat import abort_controller

STOP_WAIT_S = 30.0  # after a Ctrl-C, how long the workers get to save their step and stop


class Interrupt:
    """Ctrl-C from the placement wait to the end of `fit`: while the cluster has not placed
    the workers, the wait ends (`listen` installs the handler before it; Python's own
    KeyboardInterrupt was seen lost inside Ray's blocking calls, so the wait polls `fired`);
    once the ranks run (`register`), first a stop at the next step boundary, saved; then an abort.

    The first Ctrl-C asks the workers, through the mailbox, to save the step they are at
    and return (rank 0 polls about once a second: `worker/preemption.py`), so what was
    trained is kept; if they have not ended within `STOP_WAIT_S`, or on a second Ctrl-C,
    Ray Train's controller is aborted (what Ray's own handler does) and the run continues
    from its newest checkpoint. A third stops waiting for the workers at all. Ranks without a
    controller (this process, torchrun's) stop at once on the second: KeyboardInterrupt.
    """

    def __init__(self, mailbox: Any = None) -> None:
        self.mailbox = mailbox
        self.presses = 0
        self.controller: Any = None
        self.started = False  # the ranks run: a press asks them through the mailbox
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

    def register(self, controller: Any = None) -> None:
        """The ranks start: called by `TorchTrainer.fit` with its controller (`ray_compat.install_sigint_handler`),
        by a launcher without one (this process's or torchrun's ranks) with none."""
        self.controller, self.started = controller, True
        self.listen()
        if self.presses:  # Ctrl-C between the placement wait and now
            self._ask()

    def _ask(self) -> None:
        """The ranks are asked to save their step and stop (the mailbox holds it for ranks not started yet)."""
        if self.mailbox is not None:
            request = self.mailbox.request_stop
            getattr(request, "remote", request)()  # Ray's actor, or the mailbox of this process

    def _handle(self, signum: int, frame: Any) -> None:
        self.presses += 1
        if not self.started:  # no worker started yet: the placement wait sees `fired` and ends
            if self.presses == 1:
                print("raytrain-ddp: interrupted while waiting for the cluster to place the workers",
                      file=sys.stderr, flush=True)
            elif self.presses > 2:
                raise KeyboardInterrupt
            return
        if self.presses == 1 and self.mailbox is not None:
            print("raytrain-ddp: interrupted: the workers save the step they are at and stop "
                  "(Ctrl-C again to stop at once, from the newest checkpoint)", file=sys.stderr, flush=True)
            self._ask()
            if self.controller is not None:
                self._timer = threading.Timer(STOP_WAIT_S, self.abort)
                self._timer.daemon = True
                self._timer.start()
            return
        if self.presses > 2 or self.controller is None:
            raise KeyboardInterrupt  # stop waiting for the workers (ranks of this machine: stopped by their launcher)
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
            self._ask()
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


@contextlib.contextmanager
def press_on(stop: Optional[threading.Event], interrupt: Interrupt) -> Iterator[None]:
    """While the fit runs: once the caller's `stop` is set (from another thread), one Ctrl-C
    of our own (`Interrupt.press`)."""
    done = threading.Event()
    if stop is not None:
        threading.Thread(target=_press_on, args=(stop, done, interrupt), daemon=True, name="raytrain-ddp-stop").start()
    try:
        yield
    finally:
        done.set()


def _press_on(stop: threading.Event, done: threading.Event, interrupt: Interrupt) -> None:
    while not done.wait(0.25):
        if stop.is_set():
            interrupt.press()
            return
