"""When to save and where to start: the checkpoint cadence of one worker group.

Owns: restoring the state a worker group starts from; saving at the cadences a run
has — periodic (`run.checkpoint_every_steps`), just-in-time before a preemption
(`preemption.py` decides when), and at every epoch end, which is also the final save;
handing each checkpoint to `ray.train.report`. Must not touch: what a checkpoint holds
(`state.py`), the file format (`checkpoint.py`), training.

Why only rank 0 writes and every rank reports: all ranks hold identical state after a
step, and `ray.train.report` is a barrier, so no rank runs ahead of a checkpoint that is
not yet durable.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.job import Job
from raytrain_ddp.parallel.collectives import check_same
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.meter import RunLog
from raytrain_ddp.worker.preemption import PreemptionGuard
from raytrain_ddp.worker.state import TrainState


class Checkpointer:
    def __init__(self, job: Job, rank: Rank, state: TrainState, log: RunLog, hooks: Any) -> None:
        self.job, self.rank, self.state, self.log = job, rank, state, log
        self.every = job.cfg.run.checkpoint_every_steps
        self.guard = PreemptionGuard.for_worker(job.cfg, rank, hooks)  # spot reclaims

    def restore(self, accumulation_steps: int) -> None:
        """Load the newest valid checkpoint of this fit (or the driver's choice) into every component."""
        found = find_resume_state(self.job)
        if found is not None:
            self.state.load_state_dict(found[0])
        self.log.resumed_at(self.state.progress.step)
        check_same(self.state.progress.step, "the step to resume from", self.rank.device)
        where = f"checkpoint {found[1]} (step {self.state.progress.step})" if found else "scratch"
        self.rank.say(f"attempt {self.log.attempt}: {self.rank.world_size} workers on {self.rank.device}, "
                      f"{accumulation_steps} micro-steps per optimizer step, starting from {where}")

    def after_step(self, end_of_epoch: bool) -> None:
        """Periodic and just-in-time saves, at a step boundary that is not the run's last."""
        step = self.state.progress.step
        periodic = bool(self.every) and step % self.every == 0
        preempted = self.guard.after_step(step)  # a collective: the same answer on every rank
        # Never on an epoch's last step: the epoch-end save follows at the same step,
        # right after validation.
        if (periodic or preempted) and not end_of_epoch:
            self.save({"loss": self.log.last_loss, **({"preemption": 1} if preempted else {})})

    def save(self, metrics: dict[str, Any]) -> None:
        """Rank 0 writes the checkpoint; every rank reports (Ray's report is a barrier)."""
        import ray.train

        started = time.monotonic()
        progress = self.state.progress
        # The epoch position is in the name: a periodic save on a streaming epoch's last
        # window and the epoch-end save can share a step, and must not share a directory.
        name = (f"{ckpt.CHECKPOINT_PREFIX}{progress.step:08d}_e{progress.epoch}"
                f"s{progress.steps_into_epoch}_{self.job.fit_id[:8]}")
        with self.log.paused(), tempfile.TemporaryDirectory(prefix="raytrain_ddp_ckpt_") as tmp:
            checkpoint = None
            if self.rank.is_main:
                ckpt.save_checkpoint(tmp, self.state.state_dict())
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"step": progress.step, "epoch": progress.epoch, **metrics},
                             checkpoint=checkpoint, checkpoint_dir_name=name)
        self.guard.checkpoint_took(time.monotonic() - started)  # plans just-in-time saves


def find_resume_state(job: Job) -> Optional[tuple[dict, Path]]:
    """The state this worker group starts from, or None for a fresh start.

    First the checkpoints this fit reported (Ray hands the latest to a restarted
    group; older ones of this fit are the fallback if it is damaged), then the one the
    driver chose from `run.resume`. Checkpoints of earlier fits that Ray also offers
    (it reloads the run directory's snapshot when a name is re-run) are ignored here:
    the driver already applied `run.resume` to them.
    """
    import ray.train

    candidates: list[Path] = []
    offered = ray.train.get_checkpoint()
    if offered is not None and _fit_id_of(Path(offered.path)) == job.fit_id:
        candidates.append(Path(offered.path))
    candidates += [p for p in ckpt.find_checkpoints(job.run_dir)
                   if _fit_id_of(p) == job.fit_id and p not in candidates]
    if job.resume_from:
        candidates.append(Path(job.resume_from))
    return ckpt.load_latest_valid(candidates)


def _fit_id_of(path: Path) -> Optional[str]:
    try:
        return ckpt.read_manifest(path).get("fit_id")
    except Exception:  # noqa: BLE001 - unreadable manifests are simply not ours
        return None
