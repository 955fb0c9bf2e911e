"""Everything a checkpoint holds, as components that each own `state_dict` / `load_state_dict`.

Owns: building the model (the user's factory or a built-in, its activations checkpointed,
wrapped by `raytrain_ddp.parallel` and compiled as `worker/compiled.py` says), the batch format with its loss, optimizer, LR schedule, grad
scaler and autocast for one rank; `Progress` (the step and the data position in
the epoch); the RNG streams; and the checkpoint's shape, `{name: component.state_dict()}`
plus a `run` record (world size, config, fit id).
Must not touch: when to save (`checkpointer.py`), files (`checkpoint.py`), Ray.

Why the model loads through `.module` after wrapping: every strategy keeps the module's
parameters in place (the from-scratch wrappers only hook their gradients), so loading
into `wrapper.module` is loading into what trains; every rank loads the same checkpoint,
and the wrapper's broadcast of rank 0's weights at wrap time changes nothing after it.
"""

from __future__ import annotations

import contextlib
import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import numpy as np
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.batch import BatchFormat
from raytrain_ddp.job import Job
from raytrain_ddp.models import checkpoint_activations
from raytrain_ddp.worker.compiled import compile_wrapper
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.optim import build_optimizer, build_schedule
from raytrain_ddp.recovery import table as recovery_table
from raytrain_ddp.recovery.replica import LastStep

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


@dataclass
class Progress:
    """Where training stands: `epoch` and `steps_into_epoch` locate the *next* step."""

    step: int = 0
    epoch: int = 0
    steps_into_epoch: int = 0
    nonfinite_steps: int = 0
    consecutive_nonfinite: int = 0  # not saved: a resume starts a fresh streak

    def step_done(self) -> None:
        self.step += 1
        self.steps_into_epoch += 1

    def epoch_ended(self, steps_per_epoch: int) -> bool:
        return self.steps_into_epoch >= steps_per_epoch

    def next_epoch(self, epoch: int) -> None:
        self.epoch, self.steps_into_epoch = epoch + 1, 0

    def epochs_done(self, steps_per_epoch: int) -> float:
        """Epochs trained, fractions included (4 of 50 steps: 0.08): the one way every line,
        the console and summary.json count epochs (the checkpoint name `e0s4` says the same)."""
        return round(self.epoch + self.steps_into_epoch / max(1, steps_per_epoch), 4)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "steps_into_epoch": self.steps_into_epoch,
                "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.steps_into_epoch = int(state["steps_into_epoch"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))


@dataclass
class RngStreams:
    """Python / numpy / torch RNGs. Only rank 0's streams are saved; on load the other
    ranks reseed from (step, rank), so a resumed run is deterministic at any size."""

    rank: Rank
    progress: Progress

    def state_dict(self) -> dict[str, Any]:
        return ckpt.rng_state(cuda_device=self.rank.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rank.is_main:
            ckpt.set_rng_state(state, cuda_device=self.rank.device)
        else:
            seed_everything(hash((self.progress.step, self.rank.world_rank)) % 2**31)


@dataclass
class TrainState:
    """The objects one optimizer step touches, and what a checkpoint saves of them."""

    wrapper: Any
    optimizer: torch.optim.Optimizer
    schedule: Any  # optim.WarmupCosine, or optim.UserSchedule
    scaler: torch.amp.GradScaler
    batch: BatchFormat  # how a batch reaches the model and the loss (`raytrain_ddp.batch`)
    autocast: Callable[[], ContextManager]
    progress: Progress = field(default_factory=Progress)
    rng: Any = None
    run: dict = field(default_factory=dict)  # world size, config and fit id, for the driver
    last_step: Optional[LastStep] = None  # run.recovery=replica: what a survivor writes (replica.py)
    compiler: Any = None  # train.compile: what torch compiled, and how long it took (worker/compiled.py)
    lock: threading.Lock = field(default_factory=threading.Lock)  # see `updating`

    @property
    def module(self) -> torch.nn.Module:
        return self.wrapper.module

    def components(self) -> dict[str, Any]:
        """Loaded in this order: `rng` reseeds from the loaded progress."""
        # Through the wrapper: a sharded strategy (zero1, fsdp) consolidates its state here.
        parts = {"model": self.wrapper, "optimizer": self.optimizer, "schedule": self.schedule,
                 "progress": self.progress, "rng": self.rng}
        if self.scaler.is_enabled():  # fp16 only; a GradScaler refuses an empty state
            parts["scaler"] = self.scaler
        return parts

    def state_dict(self) -> dict[str, Any]:
        return {**{name: part.state_dict() for name, part in self.components().items()}, "run": dict(self.run)}

    def step_done(self) -> None:
        """An optimizer step completed: count it, and keep its boundary for a survivor's copy."""
        self.progress.step_done()
        if self.last_step is not None:
            self.last_step.mark()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around everything that moves parameters, optimizer, schedule and step count together."""
        with self.lock:
            yield

    def last_step_state_dict(self, timeout_s: float = 2.0) -> Optional[dict[str, Any]]:
        """The state at the last completed step, from this rank alone (no collective); None
        if an optimizer step held the update lock for `timeout_s`.

        Safe while a step is part-way (its forward passes ran, or its collective failed)
        and from another thread: buffers and RNG come from the boundary snapshot, and
        parameters, optimizer, schedule and progress move only under `updating()`.
        """
        if not self.lock.acquire(timeout=timeout_s):
            return None
        try:
            with self.last_step.reading():  # CUDA: a side stream on this worker's device
                state = self.state_dict()  # GradScaler.state_dict() reads its scale (.item()) here
                state["model"] = self.last_step.with_buffers(state["model"])
                state["rng"] = ckpt.rng_state(self.last_step.rng)
                return self.last_step.on_cpu(state)
        finally:
            self.lock.release()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self.components().items():
            if name in state and state[name]:
                part.load_state_dict(state[name])
        if self.last_step is not None:
            self.last_step.mark()  # the loaded state is the boundary now


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def wrap(module: torch.nn.Module, cfg: "Config", rank: Rank, process_group: Any = None) -> Any:
    """`module` wrapped for `cfg.parallel`. `process_group`: run.recovery=live's reconfigurable
    group (recovery/live.py), which also re-wraps with this after each reconfiguration (shared
    memory works there too: its barrier is the group's all-reduce, so a dead peer fails it
    at once, and every re-wrap opens fresh segments with the new members)."""
    from raytrain_ddp.parallel import wrap_model

    return wrap_model(
        module, cfg.parallel.strategy,
        bucket_cap_mb=cfg.parallel.bucket_cap_mb,
        first_bucket_mb=cfg.parallel.first_bucket_mb,
        compress=cfg.parallel.compress,
        verify_init=cfg.parallel.verify_init,
        process_group=process_group,
        device_ids=[rank.device.index] if rank.device.type == "cuda" else None,
        collective_timeout_s=cfg.parallel.collective_timeout_s,
        param_dtype={"bf16": torch.bfloat16}.get(cfg.train.precision),  # fsdp's mixed precision
        broadcast_buffers=cfg.parallel.broadcast_buffers,
        find_unused_parameters=cfg.parallel.find_unused_parameters,
        shm=cfg.parallel.shm,
    )


def build_state(job: Job, rank: Rank, total_steps: int, process_group: Any = None) -> TrainState:
    from raytrain_ddp.user import UserCode

    cfg, code = job.cfg, UserCode.for_job(job)
    if rank.device.type == "cuda":  # this worker's device is the current one, on every thread
        torch.cuda.set_device(rank.device)  # that asks (RNG state, side streams, NCCL)
    # Same seed on every rank: identical initial weights even before the wrapper's
    # broadcast (and `parallel.verify_init` checks exactly that).
    seed_everything(cfg.train.seed)
    module = code.build_model(cfg, job.spec).to(rank.device)
    checkpoint_activations(module, cfg.model.activation_checkpointing)
    wrapper = wrap(module, cfg, rank, process_group)
    compiler = compile_wrapper(wrapper, cfg)
    optimizer = wrapper.make_optimizer(lambda trainable: build_optimizer(trainable, cfg.train)
                                       if code.optimizer is None else code.build_optimizer(cfg, wrapper.module))
    schedule = build_schedule(optimizer, cfg, total_steps, code)
    scaler = torch.amp.GradScaler(rank.device.type, enabled=cfg.train.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)

    def autocast() -> ContextManager:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=rank.device.type, dtype=dtype)

    progress = Progress()
    survivors_copy = recovery_table.survivors_copy(cfg)  # replica and live, replicated strategies
    return TrainState(wrapper, optimizer, schedule, scaler, code.batch_format(cfg), autocast,
                      progress=progress, rng=RngStreams(rank, progress),
                      run={"world_size": rank.world_size, "config": cfg.to_yaml(), "fit_id": job.fit_id,
                           "spec": job.spec.state_dict()},
                      last_step=LastStep(wrapper.module) if survivors_copy else None, compiler=compiler)

