"""Strategy `naive`: one blocking all-reduce per gradient after backward (written from scratch).

Owns: what naive sends and when: a hook per trainable parameter marks it used and, in a
synced backward (decided by the forward, as in torch DDP), queues one callback that runs
when backward ends and all-reduces each gradient in registration order, then divides by
the world size (gloo has no AVG). The baseline the other strategies must beat: all of its
communication is exposed (`comm_stats`: `exposed_comm_s` = `comm_s`).
Must not touch: Ray, optimizers, the training loop. torch and torch.distributed only.
The rules it shares with bucketed (buffers, unused and frozen parameters, pickling) live
in `base.ScratchBase`.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel import registry
from raytrain_ddp.parallel.base import ScratchBase, _queue_callback, comm_timing, describe_tensors


class NaiveDDP(ScratchBase):
    """One all-reduce per gradient after backward; the baseline the other strategies must beat."""

    strategy = registry.name_of(__name__)  # "naive": the name is the registry's

    def __init__(self, module: nn.Module, process_group=None, *, verify_init: bool = False,
                 collective_timeout_s: Optional[float] = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False) -> None:
        super().__init__(module, process_group, verify_init=verify_init,
                         collective_timeout_s=collective_timeout_s, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters)

    def _build(self) -> None:
        self._stats["buckets"] = len(self._tracked) if self.world_size > 1 else 0
        if self.world_size > 1:
            self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                             for i, (_, p) in enumerate(self._tracked)]

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        self._used[i] = 1
        if self._sync_armed and not self._queued:
            self._queued = True
            _queue_callback(self._sync)

    def _sync(self) -> None:
        backward_end = time.perf_counter()
        try:
            n = len(self._tracked)
            reduced, spans = [], []
            for i, (name, p) in enumerate(self._tracked):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)  # unused here: zeros
                start = time.perf_counter()
                work = dist.all_reduce(grad, group=self._pg, async_op=True)
                self._count(grad)
                self._wait(work, f"all-reduce of gradient {i + 1}/{n} "
                                 f"({describe_tensors([name], grad.numel() * grad.element_size())})")
                spans.append((start, time.perf_counter()))
                reduced.append(grad.div_(self.world_size))
            if self._tracked and comm_timing(self._tracked[0][1].device):
                self._add_comm_time(backward_end, spans)  # all after backward: nothing hidden
            unused = self._settle_unused(*self._start_unused_check())
            for i, (_, p) in enumerate(self._tracked):
                if p.grad is None and i not in unused:  # used elsewhere: takes the average
                    p.grad = reduced[i]
            self._stats["syncs"] += 1
        finally:
            self._end_sync()
