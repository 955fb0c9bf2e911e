"""Optimizer construction and the warm-up + cosine learning-rate schedule.

Owns: turning `cfg.train` into a torch optimizer and an LR schedule object with
`state_dict()` / `load_state_dict()` (so the checkpointer just composes them).
Must not touch: distribution, data, Ray.

Why a tiny schedule class instead of `LambdaLR`: the learning rate is a pure function of
the optimizer step (nanoGPT's `get_lr(it)`), which makes resume exact and the schedule
unit-testable; `LambdaLR` cannot save its lambda and would silently restart the curve.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from raytrain_ddp.config import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    params = list(params)
    # Weight decay on matrices only: biases and norm gains are not decayed (nanoGPT, GPT-2).
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
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


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine to the floor."""
    min_lr = peak_lr * min_lr_ratio
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


class WarmupCosine:
    """Sets each param group's lr for the next step; `step()` advances one optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, peak_lr: float, warmup_steps: int,
                 total_steps: int, min_lr_ratio: float) -> None:
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.last_step = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, train: TrainConfig, total_steps: int) -> "WarmupCosine":
        return cls(optimizer, peak_lr=train.lr, warmup_steps=train.warmup_steps,
                   total_steps=total_steps, min_lr_ratio=train.min_lr_ratio)

    @property
    def lr(self) -> float:
        return lr_at(self.last_step, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio)

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
