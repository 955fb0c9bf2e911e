"""`train_loop_per_worker`: what every rank does, from first step to last checkpoint.

Owns: the order of events in training — step, log, checkpoint, and at each epoch end
validate and save (`run.validation: async`: save, then rank 0's thread validates what was
saved, `validator.py`); a failure that is a lost peer first leaves the last completed step
behind (`Checkpointer.last_step_on_peer_loss`, `replica.py`). Each component decides its own cadence (`RunLog` when to write a
line, `Checkpointer` when to save, `StepProfiler` which steps to trace: it wraps the
window iterator to see where a step starts and ends), so the story below is the whole story.
Must not touch: process-group setup (Ray Train's TorchConfig does it), data sharding
(`data/worker_data.py`), gradient synchronisation (`raytrain_ddp.parallel`), files.

Invariants the story relies on:
- Every rank runs the same number of optimizer steps per epoch (`WorkerData` guarantees
  it), so every collective and every `ray.train.report` is reached by all ranks.
- Everything that depends on the worker count (accumulation steps, each rank's slice
  of a global batch) is derived from the *actual* world size at every (re)start, so an
  elastic resize or a restart on fewer workers continues the same optimisation.
- An epoch advances when its windows are exhausted, not on a count: streaming shards
  can end a window or two before the estimate, and a stale position would skip steps of
  the next epoch. A run that stops mid-epoch (`train.max_steps`) keeps its position.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from raytrain_ddp.data.steps import total_steps as total_steps_of
from raytrain_ddp.data.worker_data import WorkerData
from raytrain_ddp.job import Job
from raytrain_ddp.recovery import table as recovery_table
from raytrain_ddp.worker.checkpointer import Checkpointer
from raytrain_ddp.worker.compiled import compile_wrapper
from raytrain_ddp.worker.runtime import RayTrainRuntime, Runtime
from raytrain_ddp.worker.hooks import Hooks, load_hooks
from raytrain_ddp.worker.failure import tell_driver
from raytrain_ddp.worker.meter import RunLog
from raytrain_ddp.worker.profiler import StepProfiler
from raytrain_ddp.worker.state import build_state, wrap
from raytrain_ddp.worker.step import NonFiniteAbort, train_step, validate
from raytrain_ddp.worker.validator import Validator
from raytrain_ddp.timeline import WorkerStamps
from raytrain_ddp.worker.optim import preload_optimizer_imports

if TYPE_CHECKING:
    from raytrain_ddp.config import Config
    from raytrain_ddp.worker.context import Rank


PARTS = recovery_table.WorkerParts(train_step, validate, Checkpointer, wrap, compile_wrapper)  # what a recovery half composes


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    job: Job = loop_config["job"]
    runtime = loop_config.get("runtime") or RayTrainRuntime(loop_config.get("shards"))  # a Ray Train worker, or local mode
    cfg, rank, hooks = job.cfg, runtime.rank(), load_hooks()
    hooks.on_start(rank)
    entered = time.time()  # the training function's start (a live newcomer says its timeline from here)
    # the run's recovery mode, this worker's half (recovery/table.py): it resumes, steps, and names the group
    recovery = recovery_table.worker_half(cfg).for_worker(job, runtime, PARTS, entered)
    stamps = WorkerStamps(rank.is_main, loop_config.get("startup_stamps"))  # the start-up timeline (timeline.py)
    preload_optimizer_imports()  # while the data loads (worker/optim.py)
    try:
        _train(job, cfg, rank, hooks, recovery, recovery.runtime, stamps)
    except Exception as exc:
        tell_driver(job.mailbox, exc, rank.world_rank)  # whole, and whether a retry can help (failure.py)
        raise
    finally:
        recovery.close()


def _train(job: Job, cfg: "Config", rank: "Rank", hooks: Hooks, recovery: recovery_table.WorkerRecovery,
           runtime: Runtime, stamps: WorkerStamps) -> None:
    data = WorkerData(cfg, job.spec, rank.world_rank, rank.world_size, rank.device, shards=runtime.shards())
    stamps.mark("data_ready")
    total_steps = total_steps_of(cfg, data.steps_per_epoch)  # as the driver computes it (data/steps.py)
    state = build_state(job, rank, total_steps, recovery.wrapper_group())
    log = RunLog(job, rank, state, data, total_steps)  # records this attempt
    validator = Validator(job, rank, state, data, log, hooks)  # run.validation: inline, or rank 0's thread
    stamps.mark("model_built")
    hooks.on_attempt(rank, log.attempt, state.module)
    checkpointer = recovery.resume(job, rank, state, log, hooks, data.accumulation_steps)
    stamps.mark("state_restored")
    if state.compiler:  # train.compile: torch's caches from an earlier attempt, fit or node (worker/compiled.py)
        state.compiler.use_cache(runtime.run_dir(job.run_dir), rank)
    progress = state.progress
    validator.revalidate(runtime.run_dir(job.run_dir), progress.step)  # async: what a crash left unvalidated
    profiler = StepProfiler(job, rank, state, total_steps)  # run.profile: a trace of a few steps
    with checkpointer.last_step_on_peer_loss():  # a worker dies: the survivors write the last step
        try:
            for epoch in range(progress.epoch, math.ceil(total_steps / data.steps_per_epoch)):
                if progress.step >= total_steps:  # resuming a finished run: nothing left to do
                    break
                for window in profiler.steps(data.train_windows(epoch, skip_steps=progress.steps_into_epoch)):
                    hooks.before_step(progress.step + 1)
                    result = recovery.train_step(state, window, data.accumulation_steps, cfg.train, rank)  # counts it
                    hooks.after_step(progress.step)
                    log.step(result, progress.epoch_ended(data.steps_per_epoch))  # the step's end (its time)
                    stamps.first_step_done(log.outbox, state.compiler.first_step_seconds(rank) if state.compiler else 0.0)
                    if progress.step >= total_steps:
                        break
                    if checkpointer.after_step(progress.epoch_ended(data.steps_per_epoch)):
                        return validator.close()  # the driver asked to stop (Ctrl-C), and this step is saved
                if progress.step < total_steps or progress.epoch_ended(data.steps_per_epoch):
                    progress.next_epoch(epoch)  # exhausted (see the invariants above)
                last, val = progress.step >= total_steps, {}
                if validator.inline:
                    with log.paused():
                        val = log.validation(recovery.validate(state, data, rank, job.spec))  # live: a loss skips it
                elif last:  # async: the final save carries the last validation's line
                    with log.paused():
                        val = validator.final(state, progress.step, log.epochs)
                if checkpointer.epoch_end_due(epoch, last=last):
                    saved = checkpointer.save({"loss": log.last_loss, **val})
                    if not last:
                        with log.paused():  # the hand-off is all the step loop waits for
                            validator.submit(saved, progress.step, log.epochs)
            validator.close()
        except NonFiniteAbort as exc:
            log.abort(str(exc))
