"""Per-rank setup for the training loop: everything `loop.py` needs before step one.

Owns: the `Job` handed from the driver to every worker, rank identity, building the
model / wrapper / optimizer / schedule / scaler, restoring from a checkpoint, the state
written into checkpoints, attempt bookkeeping and test-only fault injection.
Must not touch: Ray's cluster APIs (only `ray.train` context and checkpoints), the
driver, data loading internals (`WorkerData` owns those).

Why this lives outside `loop.py`: the loop should read like a story (step, log,
validate, checkpoint); construction and restore are the part that changes when a
strategy or a state field is added.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.envspec import read_env_spec
from raytrain_ddp.metrics import read_jsonl
from raytrain_ddp.schedule import WarmupCosine, build_optimizer

ATTEMPTS_FILE = "attempts.jsonl"
ABORT_FILE = "abort.json"
FAULT_ENV = "RAYTRAIN_DDP_FAULT"


@dataclass(frozen=True)
class Job:
    """What the driver decided, shipped to every worker in `train_loop_config`."""

    cfg: Config
    spec: Any  # raytrain_ddp.data.DataSpec
    run_dir: str
    fit_id: str  # one per `run_training` call; tells this fit's checkpoints from older ones
    resume_from: Optional[str] = None  # checkpoint chosen (and verified) by the driver



@dataclass(frozen=True)
class Rank:
    world_rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.world_rank == 0

    @classmethod
    def current(cls) -> "Rank":
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        quiet_worker_console()
        return cls(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(), ray.train.torch.get_device())


def quiet_worker_console() -> None:
    """Keep worker consoles (streamed to the driver) to warnings and our own prints.

    Ray Train's worker logging echoes every `print` a second time through the root
    logger and logs each `report` at INFO; the driver already prints progress from
    metrics.jsonl. Only console handlers are raised to WARNING: Ray's log files under
    the session directory keep everything.
    """
    for name in ("", "ray.train", "ray.data"):
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.WARNING)


@dataclass
class Progress:
    """Where training stands: `epoch` and `steps_into_epoch` locate the *next* step."""

    step: int = 0
    epoch: int = 0
    steps_into_epoch: int = 0
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0


@dataclass
class Parts:
    """The objects one optimizer step touches."""

    wrapper: Any
    optimizer: torch.optim.Optimizer
    scheduler: WarmupCosine
    scaler: torch.amp.GradScaler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    autocast: Callable[[], ContextManager]
    params: list = field(default_factory=list)

    @property
    def module(self) -> torch.nn.Module:
        return self.wrapper.module


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_parts(cfg: Config, spec: Any, rank: Rank, total_steps: int,
                model_state: Optional[dict] = None) -> Parts:
    from raytrain_ddp.models import build_model, loss_fn
    from raytrain_ddp.parallel import wrap_model

    # Same seed on every rank: identical initial weights even before the wrapper's
    # broadcast (and `parallel.verify_init` checks exactly that).
    seed_everything(cfg.train.seed)
    module = build_model(cfg, spec)
    if model_state is not None:
        module.load_state_dict(model_state)
    module = module.to(rank.device)
    wrapper = wrap_model(
        module, cfg.parallel.strategy,
        bucket_cap_mb=cfg.parallel.bucket_cap_mb,
        compress=cfg.parallel.compress,
        verify_init=cfg.parallel.verify_init,
        device_ids=[rank.device.index] if rank.device.type == "cuda" else None,
        collective_timeout_s=cfg.parallel.collective_timeout_s,
    )
    params = [p for p in wrapper.module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.train)
    scheduler = WarmupCosine.from_config(optimizer, cfg.train, total_steps)
    scaler = torch.amp.GradScaler(rank.device.type, enabled=cfg.train.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def autocast() -> ContextManager:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=rank.device.type, dtype=dtype)

    return Parts(wrapper, optimizer, scheduler, scaler, loss_fn(spec), autocast, params)


# ---------------------------------------------------------------- checkpoint state


def training_state(parts: Parts, progress: Progress, job: Job, rank: Rank) -> dict[str, Any]:
    return {
        "model": parts.module.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else {},
        "step": progress.step,
        "epoch": progress.epoch,
        "steps_into_epoch": progress.steps_into_epoch,
        "nonfinite_steps": progress.nonfinite_steps,
        "world_size": rank.world_size,
        "rng": ckpt.rng_state(),
        "config": job.cfg.to_yaml(),  # the launcher checks what a resume may change
        "fit_id": job.fit_id,
    }


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


def restore(parts: Parts, state: dict, rank: Rank) -> Progress:
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if parts.scaler.is_enabled() and state.get("scaler"):
        parts.scaler.load_state_dict(state["scaler"])
    if rank.is_main:
        ckpt.set_rng_state(state["rng"])
    else:  # only rank 0's stream was saved; the others restart theirs deterministically
        seed_everything(hash((int(state["step"]), rank.world_rank)) % 2**31)
    return Progress(step=int(state["step"]), epoch=int(state["epoch"]),
                    steps_into_epoch=int(state["steps_into_epoch"]),
                    nonfinite_steps=int(state.get("nonfinite_steps", 0)))


# ---------------------------------------------------------------- attempts and collectives


def record_attempt(job: Job, rank: Rank) -> int:
    """Rank 0 appends this worker-group start to attempts.jsonl; every rank learns the number."""
    number = torch.zeros(1, dtype=torch.int64, device=rank.device)
    if rank.is_main:
        path = Path(job.run_dir) / ATTEMPTS_FILE
        previous = sum(1 for r in read_jsonl(path) if r.get("fit_id") == job.fit_id)
        number[0] = previous + 1
        with open(path, "a") as handle:
            handle.write(json.dumps({"fit_id": job.fit_id, "attempt": previous + 1,
                                     "world_size": rank.world_size, "time": time.time()}) + "\n")
    dist.broadcast(number, src=0)
    return int(number.item())


def all_ranks_agree(value: int, rank: Rank, what: str) -> None:
    t = torch.tensor([value, -value], dtype=torch.int64, device=rank.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != -int(t[1]):
        raise RuntimeError(f"ranks disagree on {what}: min {-int(t[1])}, max {int(t[0])} (this rank: {value})")


def _fit_id_of(path: Path) -> Optional[str]:
    try:
        return ckpt.read_manifest(path).get("fit_id")
    except Exception:  # noqa: BLE001 - unreadable manifests are simply not ours
        return None


# ---------------------------------------------------------------- fault injection (tests only)


@dataclass(frozen=True)
class FaultPlan:
    """TEST-ONLY: `RAYTRAIN_DDP_FAULT="rank=1,step=3,attempt=1,mode=exit"`.

    After optimizer step `step` on rank `rank` during attempt `attempt` (`attempt=any`:
    every attempt), `exit` kills the process (`os._exit`, as a crashed node would), `raise`
    raises; `hang` stops that rank taking part in collectives (it sleeps until killed),
    first writing its pid to `pidfile=PATH` if given, so a test can SIGKILL it from
    outside; `nan` instead makes that rank's loss NaN for step `step` (exercises the
    non-finite path). Unset in real runs.
    """

    rank: int = 0
    step: int = -1
    attempt: int = 1  # 0: every attempt
    mode: str = "exit"
    pidfile: Optional[str] = None

    @classmethod
    def from_env(cls) -> Optional["FaultPlan"]:
        fields = read_env_spec(FAULT_ENV, required=("step",))
        if fields is None:
            return None
        attempt = fields.get("attempt", "1")
        plan = cls(rank=int(fields.get("rank", 0)), step=int(fields["step"]),
                   attempt=0 if attempt == "any" else int(attempt), mode=fields.get("mode", "exit"),
                   pidfile=fields.get("pidfile"))
        if plan.mode not in ("exit", "raise", "nan", "hang"):
            raise ValueError(f"{FAULT_ENV}: mode must be exit|raise|nan|hang, got {plan.mode!r}")
        return plan

    def hits(self, rank: Rank, step: int, attempt: int) -> bool:
        return (rank.world_rank == self.rank and step == self.step
                and self.attempt in (0, attempt))

    def loss_poison(self, rank: Rank, next_step: int, attempt: int) -> float:
        return math.nan if self.mode == "nan" and self.hits(rank, next_step, attempt) else 1.0

    def after_step(self, rank: Rank, step: int, attempt: int) -> None:
        if self.mode == "nan" or not self.hits(rank, step, attempt):
            return
        print(f"[fault injection] rank {rank.world_rank} {self.mode} after step {step}, attempt {attempt}", flush=True)
        if self.mode == "exit":
            os._exit(1)
        if self.mode == "hang":
            if self.pidfile:
                tmp = f"{self.pidfile}.tmp"
                Path(tmp).write_text(str(os.getpid()))
                os.replace(tmp, self.pidfile)
            while True:  # never returns: peers are left waiting in their next collective
                time.sleep(1)
        raise RuntimeError(f"injected fault on rank {rank.world_rank} after step {step} ({FAULT_ENV})")
