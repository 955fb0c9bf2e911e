"""Recovery from the survivors: when a worker dies, the others write the last completed step.

Owns: `LastStep`, a snapshot taken at every step boundary of what a step changes before
it completes (module buffers, RNG streams), and `write_last_step`, which a rank calls
when its step loop fails: it writes the state of the last completed step into the run
directory as a checkpoint of this fit. The restarted worker group resumes from it
because `checkpointer.find_resume_state` takes the newest valid checkpoint of the fit,
whoever wrote it. Must not touch: the durable-checkpoint cadence (`checkpointer.py`),
the file format (`checkpoint.py`), Ray's restart machinery (unchanged: same
`FailureConfig`, same restart).

Why the survivors hold what recovery needs: after every optimizer step every rank of a
replicated strategy (naive, bucketed, native) holds the same parameters and optimizer
state. A worker's death reaches every survivor as its next collective failing (gloo:
"Connection reset by peer", within milliseconds), and at that moment the survivor
still holds the last completed step: nothing in a step touches parameters, optimizer,
schedule or progress before the step's last collective (the gradient all-reduce and the
finiteness vote precede `optimizer.step()`, and no collective runs between it and
`TrainState.step_done`). Only what the step's forward passes already changed -- buffers
such as BatchNorm's running statistics, and the RNG streams -- is taken from the
boundary snapshot. So the restarted group redoes at most the step that was in flight.

Why not a copy held elsewhere (an actor on another node, as GEMINI keeps in-memory
checkpoints, or torchft's replica groups): it costs a copy of the whole state every
step -- model and optimizer, hundreds of MB for a model of 100 MB -- where the survivors
already have it. The price of this design is its window: Ray Train's controller notices
the dead worker at its next health poll (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, 2 s) and
then kills the survivors, so a survivor has about that long to write. What happens when:
- the failure lands mid-step: the survivors write the step before it; the step in flight
  is redone (once);
- it lands mid-upload of an asynchronous durable checkpoint: that upload is rank 0's and
  independent; the survivor's copy is another directory;
- a survivor dies (or is killed) while writing: its copy has no valid manifest (written
  last) and is skipped; another survivor's copy, or the newest durable checkpoint, is
  used, and the restarted group says which;
- no survivor (a single worker, every worker, the driver restarted): the newest durable
  checkpoint, said so on the console;
- NCCL: a dead peer does not fail a collective at once, only when
  `parallel.collective_timeout_s` expires, later than Ray's kill; on GPUs the survivors
  usually cannot write in time and recovery falls back to the durable checkpoint.
Sharded strategies (zero1, fsdp) hold no whole copy on any rank: they recover from
durable checkpoints only. `run.recovery: checkpoint` turns the survivors' copy off.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

import torch
from ray.train.v2._internal.execution.callback import WorkerCallback

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import CHECKPOINT_PREFIX, Location

REPLICATED = ("naive", "bucketed", "native")
REPLICA_ORIGIN = "replica"  # the manifest's "origin" of a survivor's copy: "replica:rank=<r>"
_COLLECTIVES, _WRAPPERS = "torch/distributed/", "raytrain_ddp/parallel/"


class CopyWindow:
    """Where the step loop (the training thread) and Ray's shutdown call (the actor's thread) meet.

    Ray Train stops a worker group by calling every worker's `shutdown()` and waiting
    up to 5 s for the calls before it kills the processes. `GraceForSurvivors` spends
    part of that wait on this worker's copy of the last step: it waits `start_s` for the
    step loop to fail (its collective may fail a moment after Ray's health poll noticed
    the dead peer) and then `finish_s` for a copy in progress. A loop that neither ends
    nor writes (blocked in an NCCL collective) costs `start_s`, nothing more.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = "training"  # -> "writing" -> "ended", or straight to "ended"

    def enter(self, state: str) -> None:
        with self._cond:
            self._state = state
            self._cond.notify_all()

    def wait(self, start_s: float, finish_s: float) -> str:
        with self._cond:
            self._cond.wait_for(lambda: self._state != "training", timeout=start_s)
            if self._state == "writing":
                self._cond.wait_for(lambda: self._state == "ended", timeout=finish_s)
            return self._state


# One per worker process: each attempt runs in new processes, and the step loop's thread
# and Ray's shutdown call share nothing else.
WINDOW = CopyWindow()


class GraceForSurvivors(WorkerCallback):
    """Ray Train worker callback: shutting a worker down waits for its copy of the last step.

    Passed through `RunConfig(callbacks=...)`, which hands non-user callbacks to the
    workers (a DeveloperAPI of Ray Train). Both waits stay inside Ray's 5 s patience.
    """

    def __init__(self, start_s: float = 1.0, finish_s: float = 3.5) -> None:
        self.start_s, self.finish_s = start_s, finish_s

    def before_worker_shutdown(self) -> None:
        WINDOW.wait(self.start_s, self.finish_s)


class LastStep:
    """Buffers and RNG streams as they were when the last step completed (`mark`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.buffers: list[torch.Tensor] = []
        self.rng: Optional[dict[str, Any]] = None
        self.mark()

    def mark(self) -> None:
        """At a step boundary: a few KB of RNG state, and a copy of the buffers (BatchNorm's statistics)."""
        self.rng = ckpt.rng_state()
        live = list(self.module.buffers())
        if len(live) != len(self.buffers):
            self.buffers = [b.detach().clone() for b in live]
            return
        for kept, buffer in zip(self.buffers, live):
            kept.copy_(buffer.detach())

    def put_back(self) -> None:
        """Return the buffers to the boundary (the failed step's forward passes moved them)."""
        with torch.no_grad():
            for kept, buffer in zip(self.buffers, self.module.buffers()):
                buffer.copy_(kept)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether a failure is a collective that lost its peer, not this rank's own fault.

    gloo and NCCL raise `RuntimeError` (torch's `DistError`s are subclasses) from a
    collective: raised in `torch.distributed`, or from a `Work.wait()` in our wrappers
    (`raytrain_ddp.parallel`). An error of the user's code, a non-finite abort or an
    interrupt is not a lost peer: this rank itself failed, and its state is the
    restarted group's concern only through the durable checkpoint.
    """
    if not isinstance(exc, RuntimeError) or isinstance(exc, UserError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any(_COLLECTIVES in frame.filename.replace(os.sep, "/") or _WRAPPERS in frame.filename.replace(os.sep, "/")
               for frame in frames)


def write_last_step(state: Any, run_dir: Location, fit_id: str, world_rank: int) -> tuple[Location, float]:
    """Write the last completed step of `state` (a `TrainState`) into `run_dir`; (where, seconds).

    Named like any checkpoint of the fit, with the writer's rank appended, so that
    survivors never write into one directory and the newest-valid lookup takes it.
    """
    started = time.perf_counter()
    progress = state.progress
    name = (f"{CHECKPOINT_PREFIX}{progress.step:08d}_e{progress.epoch}s{progress.steps_into_epoch}"
            f"_{fit_id[:8]}_r{world_rank}")
    target, origin = run_dir / name, f"{REPLICA_ORIGIN}:rank={world_rank}"
    if target.is_local:  # straight into place: every file atomic, the manifest last
        ckpt.save_checkpoint(target.local_path, state.last_step_state_dict(), origin=origin)
        return target, time.perf_counter() - started
    staging = tempfile.mkdtemp(prefix="raytrain_ddp_replica_")
    try:
        ckpt.save_checkpoint(staging, state.last_step_state_dict(), origin=origin)
        target.upload_from(staging)  # no set order: a copy cut short fails its manifest check
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, time.perf_counter() - started


def written_by_survivor(manifest: dict[str, Any]) -> Optional[int]:
    """The rank that wrote a survivor's copy, from its manifest; None for a durable checkpoint."""
    origin = str(manifest.get("origin") or "")
    if not origin.startswith(f"{REPLICA_ORIGIN}:rank="):
        return None
    return int(origin.rsplit("=", 1)[1])
