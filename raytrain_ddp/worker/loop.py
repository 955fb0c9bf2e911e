"""`train_loop_per_worker`: what every rank does, from first step to last checkpoint.

Owns: the order of events in training (accumulate, sync, clip, step, log, validate,
checkpoint) and the rule that every rank takes the same decision at the same step.
Must not touch: Ray's cluster APIs (only `ray.train.report` / `get_checkpoint` through
`worker.py`), process-group setup (Ray Train's TorchConfig does it), data sharding
(`WorkerData`), gradient synchronisation (`raytrain_ddp.parallel`).

Invariants the story relies on:
- Every rank runs the same number of optimizer steps per epoch (WorkerData guarantees
  it), so every collective and every `ray.train.report` is reached by all ranks.
- After the last backward of a window (outside `no_sync`) the wrapper has averaged the
  gradients, so the gradient norm, and therefore clipping, is the same on every rank.
- Non-finite losses differ per rank, so a finiteness flag is all-reduced together with
  the loss before `optimizer.step()`: all ranks skip (or abort) together.
- Only rank 0 writes files (metrics, attempts, checkpoints); `ray.train.report` is the
  barrier after a checkpoint.
- Everything that depends on the worker count (accumulation steps, each rank's slice
  of a global batch) is derived from the *actual* world size at every (re)start, so an
  elastic resize or a restart on fewer workers continues the same optimisation.
- The preemption poll (`PreemptionGuard`, see preemption.py) is a collective at step
  boundaries whose schedule and answer are agreed by all ranks; a just-in-time
  checkpoint is an ordinary checkpoint taken at that boundary.

Test-only fault injection: the environment variable `RAYTRAIN_DDP_FAULT` (see
`worker.FaultPlan`) kills or poisons one rank at one step of one attempt. It is read here
so end-to-end tests can exercise restarts; never set it in real runs.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.metrics import METRICS_FILE, MetricsWriter, StepMeter
from raytrain_ddp.preemption import PreemptionGuard
from raytrain_ddp.worker import (
    ABORT_FILE, FaultPlan, Job, Parts, Progress, Rank, all_ranks_agree, build_parts,
    find_resume_state, record_attempt, restore,
)


class NonFiniteAbort(Exception):
    """Raised inside the loop, caught at its top: every rank stops together, no restart."""


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    from raytrain_ddp.data import WorkerData

    job: Job = loop_config["job"]
    cfg = job.cfg
    rank = Rank.current()
    attempt = record_attempt(job, rank)
    fault = FaultPlan.from_env()

    data = WorkerData(cfg, job.spec, rank.world_rank, rank.world_size, rank.device)
    total_steps = cfg.train.max_steps or cfg.train.epochs * data.steps_per_epoch
    num_epochs = math.ceil(total_steps / data.steps_per_epoch)
    resumed = find_resume_state(job)
    parts = build_parts(cfg, job.spec, rank, total_steps, model_state=resumed[0]["model"] if resumed else None)
    progress = restore(parts, resumed[0], rank) if resumed else Progress()
    all_ranks_agree(progress.step, rank, "the step to resume from")

    writer = MetricsWriter(Path(job.run_dir) / METRICS_FILE, enabled=rank.is_main)
    writer.truncate_after(progress.step)  # steps past the checkpoint are redone: one history
    if rank.is_main:
        where = f"checkpoint {resumed[1]} (step {progress.step})" if resumed else "scratch"
        print(f"[rank 0] attempt {attempt}: {rank.world_size} workers on {rank.device}, "
              f"{data.accumulation_steps} micro-steps per optimizer step, starting from {where}", flush=True)
    meter = StepMeter(cfg.train.global_batch_size, data.wait_seconds, parts.wrapper.comm_stats)
    loss = math.nan
    guard = PreemptionGuard.for_worker(cfg, rank, attempt)  # spot reclaims: see preemption.py

    def checkpoint(metrics: dict) -> None:
        started = time.monotonic()  # the guard plans just-in-time saves with this duration
        _paused(meter, data, lambda: save_and_report(parts, progress, job, rank, metrics))
        guard.checkpoint_took(time.monotonic() - started)

    try:
        for epoch in range(progress.epoch, num_epochs):
            if progress.step >= total_steps:  # resuming a finished run: nothing left to do
                break
            epoch_done = True  # unless max_steps ends the run mid-epoch
            for window in data.train_windows(epoch, skip_steps=progress.steps_into_epoch):
                poison = fault.loss_poison(rank, progress.step + 1, attempt) if fault else 1.0
                lr = parts.scheduler.lr
                loss = train_step(parts, window, data.accumulation_steps, progress, cfg, rank, poison)
                progress.step += 1
                progress.steps_into_epoch += 1
                meter.step_done()
                if fault:
                    fault.after_step(rank, progress.step, attempt)

                last = progress.step >= total_steps
                if progress.step % cfg.run.log_every_steps == 0 or last or progress.steps_into_epoch == data.steps_per_epoch:
                    writer.write({"step": progress.step, "epoch": epoch + 1, "loss": loss,
                                  "lr": lr, "nonfinite_steps": progress.nonfinite_steps, "attempt": attempt,
                                  **meter.summarize(data.wait_seconds, parts.wrapper.comm_stats)})
                if last:
                    epoch_done = progress.steps_into_epoch >= data.steps_per_epoch
                    break
                every = cfg.run.checkpoint_every_steps
                periodic = bool(every) and progress.step % every == 0
                preempted = guard.after_step(progress.step)  # a collective: same answer on all ranks
                if (periodic or preempted) and progress.steps_into_epoch < data.steps_per_epoch:
                    checkpoint({"loss": loss, **({"preemption": 1} if preempted else {})})

            # Advance on exhaustion, not on a count: streaming shards can end a window or two
            # before the estimate, and a stale position would skip steps of the next epoch.
            if epoch_done:
                progress.epoch, progress.steps_into_epoch = epoch + 1, 0
            val = _paused(meter, data, lambda: validate(parts, data, rank, job.spec))
            if val:
                writer.write({"step": progress.step, "epoch": epoch + 1, **val})
            checkpoint({"loss": loss, **val})
            if progress.step >= total_steps:
                break
    except NonFiniteAbort as exc:
        writer.write({"step": progress.step + 1, "epoch": progress.epoch + 1, "loss": math.nan,
                      "lr": parts.scheduler.lr, "nonfinite_steps": progress.nonfinite_steps,
                      **meter.summarize(data.wait_seconds, parts.wrapper.comm_stats)})
        if rank.is_main:
            (Path(job.run_dir) / ABORT_FILE).write_text(json.dumps({"step": progress.step + 1, "reason": str(exc)}))
            print(f"[rank 0] aborting: {exc}", flush=True)


def train_step(parts: Parts, window: list, accumulation_steps: int, progress: Progress,
               cfg: Any, rank: Rank, poison: float = 1.0) -> float:
    """One optimizer step over a window of micro-batches; returns the loss mean over ranks."""
    from raytrain_ddp.parallel.accumulate import accumulation_window

    parts.module.train()
    local_loss = torch.zeros((), device=rank.device)
    for (x, y), loss_scale in accumulation_window(parts.wrapper, window, expected=accumulation_steps, partial="scale"):
        with parts.autocast():
            loss = parts.loss_fn(parts.wrapper(x), y) * poison
        parts.scaler.scale(loss * loss_scale).backward()  # the wrapper syncs on the last one
        local_loss += loss.detach().float() * loss_scale

    parts.scaler.unscale_(parts.optimizer)
    max_norm = cfg.train.clip_grad_norm or math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(parts.params, max_norm)
    # fp16: an overflowing gradient is the GradScaler's business (it skips and rescales).
    bad = not torch.isfinite(local_loss) or (not parts.scaler.is_enabled() and not torch.isfinite(grad_norm))
    flags = torch.stack([local_loss, torch.tensor(float(bad), device=rank.device)])
    dist.all_reduce(flags)  # same decision on every rank
    if flags[1] > 0:
        _skip_step(parts, progress, cfg)
    else:
        progress.consecutive_nonfinite = 0
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    return float(flags[0]) / rank.world_size


def _skip_step(parts: Parts, progress: Progress, cfg: Any) -> None:
    progress.nonfinite_steps += 1
    progress.consecutive_nonfinite += 1
    policy = cfg.train.nonfinite
    if policy.action == "abort" or progress.consecutive_nonfinite >= policy.max_consecutive:
        raise NonFiniteAbort(
            f"non-finite loss or gradient at step {progress.step + 1} "
            f"({progress.consecutive_nonfinite} in a row; train.nonfinite.action={policy.action}, "
            f"max_consecutive={policy.max_consecutive}); lower train.lr, set train.clip_grad_norm "
            "or use train.precision=fp32"
        )
    if parts.scaler.is_enabled():
        parts.scaler.update()


@torch.no_grad()
def validate(parts: Parts, data: Any, rank: Rank, spec: Any) -> dict[str, float]:
    """Loss (and accuracy) over the whole validation set, summed over ranks.

    Runs the bare module: ranks may hold different numbers of validation batches, and
    a wrapper's forward could take part in a collective.
    """
    parts.module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rank.device)  # loss sum, correct, count
    for x, y in data.val_batches():
        with parts.autocast():
            output = parts.module(x)
        n = y.numel()
        totals[0] += parts.loss_fn(output.float(), y).double() * n
        if spec.task == "classification":
            totals[1] += (output.argmax(dim=-1) == y).sum()
        totals[2] += n
    dist.all_reduce(totals)
    parts.module.train()
    if totals[2] == 0:
        return {}
    out = {"val_loss": float(totals[0] / totals[2])}
    if spec.task == "classification":
        out["val_accuracy"] = float(totals[1] / totals[2])
    return out


def save_and_report(parts: Parts, progress: Progress, job: Job, rank: Rank, metrics: dict) -> None:
    """Rank 0 writes the checkpoint; every rank reports (Ray's report is a barrier)."""
    import ray.train

    from raytrain_ddp.worker import training_state

    # The epoch position is in the name: a periodic save on a streaming epoch's last
    # window and the epoch-end save can share a step, and must not share a directory.
    name = (f"{ckpt.CHECKPOINT_PREFIX}{progress.step:08d}_e{progress.epoch}"
            f"s{progress.steps_into_epoch}_{job.fit_id[:8]}")
    with tempfile.TemporaryDirectory(prefix="raytrain_ddp_ckpt_") as tmp:
        checkpoint = None
        if rank.is_main:
            ckpt.save_checkpoint(tmp, training_state(parts, progress, job, rank))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": progress.step, "epoch": progress.epoch, **metrics},
                         checkpoint=checkpoint, checkpoint_dir_name=name)


def _paused(meter: StepMeter, data: Any, fn):
    meter.pause(data.wait_seconds)
    try:
        return fn()
    finally:
        meter.resume(data.wait_seconds)
