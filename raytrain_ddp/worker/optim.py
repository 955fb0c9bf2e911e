"""The optimizer and the learning-rate schedule: the built-ins, or the user's own.

Owns: turning `cfg.train` (and the user's `train.optimizer` / `train.schedule` functions,
`raytrain_ddp.user`) into a torch optimizer and a schedule object with `lr`, `step()`,
`state_dict()` / `load_state_dict()` (so the checkpointer just composes them).
Must not touch: distribution, data, Ray.

Why a tiny schedule class for the built-ins instead of `LambdaLR`: the learning rate is a
pure function of the optimizer step (nanoGPT's `get_lr(it)`), which makes resume exact
and the schedule unit-testable; `LambdaLR` cannot save its lambda and would silently
restart the curve. A user's schedule is a torch `LRScheduler` built by the user's
function for the run's total steps: it is rebuilt at every (re)start for the current
total, and only its position (`last_epoch`, torch's own state) comes from the
checkpoint, so a resume that changes the total stretches it as the built-ins stretch.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
from typing import TYPE_CHECKING, Any, Iterable

import torch

from raytrain_ddp.config import TrainConfig

if TYPE_CHECKING:
    from raytrain_ddp.config import Config
    from raytrain_ddp.user import UserCode


OPTIMIZER_IMPORTS = ("torch._dynamo",)  # what torch's first Optimizer imports (add_param_group)


def preload_optimizer_imports() -> None:
    """Import what the first optimizer imports on a background thread, so that it loads while
    this rank waits for its data instead of after (`torch._dynamo`; its cost: docs/design.md,
    "Measurements behind the code"). Python's import lock makes the optimizer's own import
    wait for this one, never load it twice."""
    missing = [name for name in OPTIMIZER_IMPORTS if name not in sys.modules]
    if missing:
        threading.Thread(target=lambda: [importlib.import_module(name) for name in missing],
                         name="raytrain-ddp-preload", daemon=True).start()


def build_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    """A built-in optimizer (`train.optimizer`: adamw, sgd) over `params`."""
    params = [p for p in params if p.requires_grad]
    if train.no_decay:  # weight decay on matrices only: biases and norm gains are not decayed (nanoGPT, GPT-2)
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": train.weight_decay}]
    groups = [g for g in groups if g["params"]]
    kernel = optimizer_kernel(params)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, **kernel)
    return torch.optim.AdamW(groups, lr=train.lr, **kernel)


def optimizer_kernel(params: list) -> dict[str, bool]:
    """`fused=True` when every parameter is a floating CUDA tensor: one kernel per step, its
    step counters on the device (the default keeps them on the host and reads each with
    `.item()`), and a GradScaler hands it `found_inf` instead of reading it on the host.
    On CPU torch's default (the per-tensor loop; `foreach` has no CPU kernels of its own)."""
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
          shape: str = "cosine") -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then `shape` down to the floor."""
    min_lr = peak_lr * min_lr_ratio
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if shape == "constant":
        return peak_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    if shape == "linear":
        return peak_lr - progress * (peak_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


class WarmupCosine:
    """A built-in schedule (`train.schedule`: cosine, linear, constant): sets each param
    group's lr for the next step; `step()` advances one optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, peak_lr: float, warmup_steps: int,
                 total_steps: int, min_lr_ratio: float, shape: str = "cosine") -> None:
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.shape = shape
        self.last_step = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int) -> "WarmupCosine":
        return cls(optimizer, peak_lr=train.lr, warmup_steps=train.warmup_steps,
                   total_steps=total_steps, min_lr_ratio=train.min_lr_ratio, shape=train.schedule)

    @property
    def lr(self) -> float:
        return lr_at(self.last_step, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio, shape=self.shape)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # total_steps comes from the current config: resuming with more epochs stretches
        # the remaining curve instead of leaving the LR pinned at the old floor.
        self.last_step = int(state["last_step"])
        self._apply()


class UserSchedule:
    """The user's `train.schedule` (a torch `LRScheduler`, `UserCode.build_schedule`), stepped once
    per optimizer step; `lr` is the first group's rate for the next step."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler
        self.optimizer = scheduler.optimizer

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        # Only the position: the function's closures (LambdaLR's lambdas) are rebuilt from code.
        return {"last_epoch": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay the schedule to the saved position (what its `step()` calls would have set)."""
        import warnings

        target = int(state["last_epoch"])
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore", UserWarning)
            while self.scheduler.last_epoch < target:
                self.scheduler.step()


def build_schedule(optimizer: Any, cfg: "Config", total_steps: int, code: "UserCode") -> Any:
    """The user's schedule (`code`: `raytrain_ddp.user.UserCode`) or a built-in one."""
    if code.schedule is None:
        return WarmupCosine.from_config(optimizer, cfg.train, total_steps)
    # zero1 / fsdp hand out a wrapper over a torch optimizer whose param_groups it shares:
    # torch's schedulers insist on the torch optimizer itself.
    return UserSchedule(code.build_schedule(cfg, getattr(optimizer, "inner", optimizer), total_steps))
