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

import contextlib
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.errors import UserError
from raytrain_ddp.parallel.errors import CollectiveTimeoutError, PeerLost, RanksDisagreeError
from raytrain_ddp.rundir import CHECKPOINT_PREFIX, Location

REPLICA_ORIGIN = "replica"  # the manifest's "origin" of a survivor's copy: "replica:rank=<r>"
_COLLECTIVES, _WRAPPERS = "torch/distributed/", "raytrain_ddp/parallel/"


class CopyWindow:
    """Where the step loop (the training thread) and Ray's shutdown call (the actor's thread) meet.

    Ray Train stops a worker group by calling every worker's `shutdown()` and waiting
    up to 5 s for the calls before it kills the processes. `GraceForSurvivors` spends
    that wait on this worker's copy of the last step. It waits `start_s` for the step
    loop to end or to start its own copy (gloo fails the loop's collective within
    milliseconds of a peer's death); then `finish_s` for a copy in progress. A loop
    still "training" after `start_s` is blocked -- in a Ray barrier (a checkpoint
    report, the preemption poll), in an NCCL collective that will only time out -- or
    still computing a forward pass: the attached writer then copies the last step from
    Ray's thread (`Checkpointer.write_copy` takes the state's update lock, so it never
    reads a half-applied optimizer step).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = "training"  # -> "writing" -> "ended", or straight to "ended"
        self._writer: Optional[Callable[[str], None]] = None

    def attach(self, writer: Callable[[str], None]) -> None:
        self._writer = writer

    def enter(self, state: str) -> None:
        with self._cond:
            self._state = state
            self._cond.notify_all()

    def on_shutdown(self, start_s: float, finish_s: float) -> str:
        with self._cond:
            self._cond.wait_for(lambda: self._state != "training", timeout=start_s)
            if self._state == "writing":
                self._cond.wait_for(lambda: self._state == "ended", timeout=finish_s)
            state, writer = self._state, self._writer
        if state == "training" and writer is not None:
            writer("Ray is stopping the worker group while this rank's step loop is blocked or busy")
        return state


# One per worker process: each attempt runs in new processes, and the step loop's thread
# and Ray's shutdown call share nothing else.
WINDOW = CopyWindow()


class LastStep:
    """Buffers and RNG streams as they were when the last step completed (`mark`).

    On CUDA an event recorded at the boundary lets a copy taken from another thread
    wait for the step's kernels only, not for a collective queued after them (`reading`).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.device = own_cuda_device(t.device for t in (*module.parameters(), *module.buffers()))
        self.buffers: dict[str, torch.Tensor] = {}
        self.rng: Optional[tuple[Any, ...]] = None  # `checkpoint.capture_rng()`: storable only when written
        self.event: Optional[Any] = None
        self.mark()

    def mark(self) -> None:
        """At a step boundary (cheap: the buffers' size): the RNG states as the libraries
        give them, and a copy of the buffers (BatchNorm's statistics)."""
        self.rng = ckpt.capture_rng(self.device)
        live = dict(self.module.named_buffers())
        if live.keys() != self.buffers.keys():
            self.buffers = {name: b.detach().clone() for name, b in live.items()}
        else:
            for name, buffer in live.items():
                self.buffers[name].copy_(buffer.detach())
        if self.device is not None:  # on the stream the step's kernels ran on (the training thread's)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.device))

    def with_buffers(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The live module's `model_state` with the boundary's buffers (no live tensor is touched)."""
        return {name: self.buffers.get(name, value) for name, value in model_state.items()}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around everything a copy reads from the device, on any thread (Ray's shutdown thread
        never called `set_device`): on CUDA, a side stream *on the module's device* that waits
        for the boundary's event only. Every device read inside -- `on_cpu`'s copies, and the
        `.item()` of `GradScaler.state_dict()` -- runs on it, so none queues behind the
        training thread's stream, which waits for a collective that may never finish.
        (A stream built without the device lands on the thread's current device, cuda:0, and
        a copy of a cuda:k tensor then runs on cuda:k's current stream: the stuck one.)
        """
        if self.device is None or self.event is None:
            yield
            return
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_event(self.event)
            with torch.cuda.stream(stream):
                yield
            stream.synchronize()

    def on_cpu(self, tree: Any) -> Any:
        """Every tensor of `tree` copied to the CPU (inside `reading()` on CUDA)."""
        if self.device is None:
            return map_tensors(tree, lambda t: t.detach().clone())
        return map_tensors(tree, lambda t: t.detach().to("cpu", copy=True))


def own_cuda_device(devices: Iterable[torch.device]) -> Optional[torch.device]:
    """The CUDA device a replica's tensors live on (None: CPU only). One worker, one device:
    a module spread over several GPUs is not a data-parallel replica we can copy."""
    found = {torch.device(d) for d in devices if torch.device(d).type == "cuda"}
    if len(found) > 1:
        raise ValueError(f"the module's tensors are on several CUDA devices {sorted(map(str, found))}; "
                         "a data-parallel worker holds its replica on one device")
    (device,) = found or {None}
    if device is not None and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def is_peer_loss(exc: BaseException) -> bool:
    """Whether a failure is a collective that lost its peer, not this rank's own fault.

    Our code raises `PeerLost` where it meets a failed collective (`parallel/errors.py`):
    the wrappers' waits and their synchronous collectives, torch DDP's comm hook, the
    agreement helpers. An error of the user's code, a non-finite abort, ranks that disagree
    (`RanksDisagreeError`) or an interrupt is not a lost peer: this rank itself failed,
    and its state is the restarted group's concern only through the durable checkpoint.
    Two failures reach us without our type, and are recognised by where they come from
    (kept, with their tests, until torch passes the type through):
    - torch DDP (`native`) waits for its buckets inside autograd, whose engine re-raises
      our hook's `PeerLost` as a plain `RuntimeError` carrying its text;
    - a collective torch itself calls outside our wrappers raises from `torch.distributed`.
    """
    if not isinstance(exc, RuntimeError) or isinstance(exc, UserError):
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, PeerLost):
            return True
        if isinstance(seen, RanksDisagreeError):
            return False  # the collective succeeded; raised from parallel/, but this rank's own fault
        seen = seen.__cause__ or seen.__context__
    if any(f"{name}: " in str(exc) for name in (PeerLost.__name__, CollectiveTimeoutError.__name__)):
        return True  # re-raised by autograd's engine
    frames = traceback.extract_tb(exc.__traceback__)
    return any(_COLLECTIVES in frame.filename.replace(os.sep, "/") or _WRAPPERS in frame.filename.replace(os.sep, "/")
               for frame in frames)


def write_last_step(state: dict[str, Any], run_dir: Location, fit_id: str, world_rank: int,
                    lines: Optional[list[dict[str, Any]]] = None) -> tuple[Location, float]:
    """Write `state` (`TrainState.last_step_state_dict()`) into `run_dir`; (where, seconds).

    Named like any checkpoint of the fit, with the writer's rank appended, so that
    survivors never write into one directory and the newest-valid lookup takes it.
    `lines`: the step's metrics lines, kept in the manifest -- when the lost worker was
    rank 0, its last line may have died with it, and the restarted group hands these on.
    """
    started = time.perf_counter()
    progress = state["progress"]
    name = (f"{CHECKPOINT_PREFIX}{progress['step']:08d}_e{progress['epoch']}s{progress['steps_into_epoch']}"
            f"_{fit_id[:8]}_r{world_rank}")
    target, origin = run_dir / name, f"{REPLICA_ORIGIN}:rank={world_rank}"
    if target.is_local:  # straight into place: every file atomic, the manifest last
        ckpt.save_checkpoint(target.local_path, state, origin=origin, lines=lines)
        return target, time.perf_counter() - started
    staging = tempfile.mkdtemp(prefix="raytrain_ddp_replica_")
    try:
        ckpt.save_checkpoint(staging, state, origin=origin, lines=lines)
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
