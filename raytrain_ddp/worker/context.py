"""Who this worker is: its rank, world size and device, and a quiet console.

Owns: `Rank` (read once from Ray Train's context) and the worker console's log levels.
Must not touch: process-group setup (Ray Train's TorchConfig does it), training state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch


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

    def say(self, message: str) -> None:
        """Print on rank 0 only (worker output is streamed to the driver's console)."""
        if self.is_main:
            print(f"[rank 0] {message}", flush=True)


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
