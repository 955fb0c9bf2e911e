"""Strategy `naive`: one blocking all-reduce per gradient after backward (written from scratch).

Owns: when naive synchronises (a parameter hook queues a callback that runs when backward
ends) and what it sends: each gradient, in registration order, all-reduced and divided by
the world size (gloo has no AVG). The baseline the other strategies must beat.
Must not touch: Ray, optimizers, the training loop. torch and torch.distributed only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel.base import ScratchBase, _queue_callback, describe_tensors


class NaiveDDP(ScratchBase):
    """One all-reduce per gradient after backward; the baseline the other two must beat."""

    strategy = "naive"

    def __init__(self, module: nn.Module, process_group=None, *, verify_init: bool = False,
                 collective_timeout_s: Optional[float] = None) -> None:
        super().__init__(module, process_group, verify_init, collective_timeout_s)
        self._stats["buckets"] = len(self._named) if self.world_size > 1 else 0
        if self.world_size > 1:
            self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self._named]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._queued = False  # a backward that raised never ran its callback
        return self.wrapped(*args, **kwargs)

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._sync_enabled and not self._queued:
            self._queued = True
            _queue_callback(self._sync)

    def _sync(self) -> None:
        self._queued = False
        n = len(self._named)
        for i, (name, p) in enumerate(self._named):
            if p.grad is None:  # unused this step here, maybe not elsewhere: send zeros
                p.grad = torch.zeros_like(p)
            work = dist.all_reduce(p.grad, group=self._pg, async_op=True)
            self._count(p.grad)
            self._wait(work, f"all-reduce of gradient {i + 1}/{n} "
                             f"({describe_tensors([name], p.grad.numel() * p.grad.element_size())})")
            p.grad.div_(self.world_size)
        self._stats["syncs"] += 1
