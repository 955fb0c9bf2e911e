"""`run.validation: async`: each epoch's validation, from the checkpoint the loop just saved,
on a thread of rank 0, off the training path.

Owns: a second copy of the model on rank 0's device (built once, never wrapped or compiled),
the hand-off (the saved model state copied into it: the loop's whole stall at a validation
point), the thread that validates every row of the validation set with it
(`step.validate(alone=True)`: no collective, so the training's process group is never used
from a second thread), and the line it sends (`RunLog.validated`, at the checkpoint's step,
with `validation_s` the loop's stall and `validation_async_s` the thread's seconds).
Must not touch: the step, what a checkpoint holds and when it is saved (`checkpointer.py`), files.

Rules:
- One validation at a time: a hand-off first waits for the one before (the wait is stall),
  so at most one is unfinished and the copy is all it holds.
- A run's end waits for its last validation: at the run's last step the loop validates
  before the final save (`final`), so the final checkpoint carries the last line
  (`RunLog.lines_to_save`: a driver killed after it loses none); a Ctrl-C stop waits in `close`.
- A resumed worker group validates the newest epoch-end checkpoint at or before its start
  again (`revalidate`): a crash during a validation left it undone. Validated twice, one
  checkpoint gives the same figures, and the driver keeps one line per step (`driver/stream.py`).
  Older epochs' checkpoints are not looked at: one validation at a time means a crash
  leaves at most the newest undone.
- The training trajectory is the inline run's: the copy is built under `torch.random.fork_rng`.
- On CUDA the thread validates on a side stream that waits for the copy (an event): the
  step's kernels never queue behind validation's.

Why not Ray Train's `ValidationConfig` (Ray 2.51+, `ray.train.report(..., validation=True)`):
read in Ray 2.60's `ValidationManager`, it starts a validation only once the controller has
registered the checkpoint (after the asynchronous upload and a controller poll), as a Ray
task (one CPU by default) in a new process that must build the model and read the
validation set every time, competing with the workers for a full cluster's slots and never
on the device that holds the model; the metrics it returns stay beside the checkpoint in
the controller, not in our record stream (the task would still have to send the val line to
the mailbox); it re-queues an unfinished validation only from the controller's own snapshot;
and local mode and `scaling.launcher=torchrun` have no controller at all. Rank 0's thread
already has the model, the device and the validation rows, starts at once, and works the
same under every launcher.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.step import validate

if TYPE_CHECKING:
    from raytrain_ddp.data.worker_data import WorkerData
    from raytrain_ddp.job import Job
    from raytrain_ddp.rundir import Location
    from raytrain_ddp.worker.hooks import Hooks
    from raytrain_ddp.worker.meter import RunLog
    from raytrain_ddp.worker.state import TrainState

EPOCH_END = re.compile(r"_e(\d+)s0_")  # an epoch-end save's name (`Checkpointer.save`)


@dataclass
class _Copy:
    """What `step.validate` reads of a `TrainState`: the validator's own bare module."""

    module: torch.nn.Module
    autocast: Callable[[], ContextManager]
    batch: Any
    broadcast_buffers = False

    def __post_init__(self) -> None:
        self.wrapper = self  # `state.wrapper.module` and `state.module` are the same module here

    def summon_full_params(self) -> ContextManager:
        return contextlib.nullcontext()


class Validator:
    """`inline`: the loop validates as it always did. Otherwise rank 0 hands each epoch-end
    checkpoint's model to its thread (`submit`); the other ranks' calls do nothing."""

    def __init__(self, job: "Job", rank: Rank, state: "TrainState", data: "WorkerData", log: "RunLog",
                 hooks: Optional["Hooks"] = None) -> None:
        self.inline = job.cfg.run.validation != "async"
        self.data, self.log, self.spec = data, log, job.spec
        self.rank = Rank(0, 1, 0, rank.device)  # the thread validates alone
        self._copy: Optional[_Copy] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._last: dict[str, float] = {}  # the newest validation's figures (rank 0)
        if self.inline or not rank.is_main or not job.spec.val_rows:
            return
        from raytrain_ddp.user import UserCode

        cuda = rank.device.type == "cuda"
        with torch.random.fork_rng(devices=[rank.device] if cuda else []):  # the trajectory stays the inline run's
            module = UserCode.for_job(job).build_model(job.cfg, job.spec).to(rank.device)
        self._copy = _Copy(module.eval(), state.autocast, state.batch)
        if hooks is not None:
            hooks.on_validator(module)
        self._stream = torch.cuda.Stream(rank.device) if cuda else None
        next(iter(data.val_batches(share=(0, 1))), None)  # the rows are read now (start-up), not on the thread

    def submit(self, model_state: Optional[dict[str, Any]], step: int, epochs: float, waited: bool = False) -> None:
        """Rank 0: the saved model into the copy, validated on the thread. The loop's stall is
        this call (and the previous validation's rest, if it is still running); `waited`: the
        loop waits for this validation too (`final`), so all of it is stall."""
        if self._copy is None or model_state is None:
            return
        began = time.perf_counter()
        self._join()
        self.log.outbox.send("validating", step=step)  # the driver's trackers wait for its line
        self._copy.module.load_state_dict(model_state)
        copied = torch.cuda.Event() if self._stream is not None else None
        if copied is not None:
            copied.record()  # the copy, on the loop's stream: the side stream waits for it
        self._start(lambda: (step, epochs), time.perf_counter() - began, copied, waited)

    def final(self, state: "TrainState", step: int, epochs: float) -> dict[str, float]:
        """The run's last step, on every rank (a sharded model is gathered: a collective):
        validated before the final save, which then carries the line. Rank 0 returns the figures."""
        model_state = state.wrapper.state_dict()
        self.submit(model_state, step, epochs, waited=True)
        self._join()
        return self._last

    def revalidate(self, run_dir: "Location", resumed_step: int) -> None:
        """Rank 0 of a resumed group: the newest epoch-end checkpoint at or before
        `resumed_step`, validated again on the thread (read from storage there)."""
        if self._copy is None or resumed_step <= 0:
            return

        def load() -> Optional[tuple[int, float]]:
            ends = [c for c in ckpt.find_checkpoints(run_dir) if EPOCH_END.search(c.name)]
            found = ckpt.load_latest_valid(c for c in ends if int(ckpt.read_manifest(c).get("step", -1)) <= resumed_step)
            if found is None:
                return None
            self._copy.module.load_state_dict(found[0]["model"])
            return int(found[0]["progress"]["step"]), float(found[0]["progress"]["epoch"])

        self._join()
        self._start(load, 0.0, None)

    def close(self) -> None:
        """The run's end (or a stop): wait for the last validation, so its line is sent."""
        if self._copy is not None:
            self._join()

    def _start(self, which: Callable[[], Optional[tuple[int, float]]], stall_s: float,
               copied: Optional[Any], waited: bool = False) -> None:
        self._last = {}
        self._thread = threading.Thread(target=self._run, args=(which, stall_s, copied, waited),
                                        name="raytrain-ddp-validator", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        """Wait for the running validation; its error is the run's (raised on the loop's thread)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self, which: Callable[[], Optional[tuple[int, float]]], stall_s: float, copied: Optional[Any],
             waited: bool) -> None:
        began = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack:
                if self._stream is not None:
                    torch.cuda.set_device(self.rank.device)
                    stack.enter_context(torch.cuda.stream(self._stream))
                    if copied is not None:
                        self._stream.wait_event(copied)
                at = which()
                if at is None:
                    return
                self._last = validate(self._copy, self.data, self.rank, self.spec, alone=True)
        except BaseException as exc:  # noqa: BLE001 - raised on the loop's thread at the next hand-off
            self._error = exc
            return
        took = time.perf_counter() - began
        self.log.validated(*at, self._last, stall_s=stall_s + took * waited, async_s=took * (not waited))
