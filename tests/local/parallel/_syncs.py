"""Counting host syncs per training step on CPU (what would stall the host on CUDA).

`HostSyncCounter` is a `TorchDispatchMode` that counts, per step:
- `aten._local_scalar_dense`: what `.item()`, `float()`, `int()` and `bool()` of a tensor
  call -- on CUDA a device->host copy and a stream synchronisation each. Reads of the
  optimizer's `step` counters are not counted when torch keeps them on the host on CUDA
  too (non-fused, non-capturable optimizers: `host_ids`);
- `aten.lift_fresh`: a tensor built from host values (`torch.tensor(x, device=...)`): on
  CUDA a host->device copy from pageable memory, which waits for the host;
- `Tensor.tolist()`, which reads without dispatching (patched while counting).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncCounter(TorchDispatchMode):
    def __init__(self, host_ids: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.host_ids = host_ids
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.host_ids:
            self.counts["item"] += 1
        elif func is torch.ops.aten.lift_fresh.default:
            self.counts["from_host"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def counting(host_ids: frozenset[int] = frozenset()):
    counter = HostSyncCounter(host_ids)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.counts["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist


def host_step_counters(optimizer) -> frozenset[int]:
    """The optimizer's `step` tensors that live on the host by torch's design (CPU tensors of
    a non-fused, non-capturable optimizer: on CUDA they stay on the CPU as well)."""
    ids = set()
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if torch.is_tensor(step) and step.device.type == "cpu":
                ids.add(id(step))
    return frozenset(ids)
