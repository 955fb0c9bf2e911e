"""torch's DistributedDataParallel behind our `WrappedModel` interface (strategy `native`).

Owns: building DDP with the options our config exposes (bucket_cap_mb,
gradient_as_bucket_view=True, device_ids, bf16 compression) and a comm hook that counts
what each bucket all-reduce sends, so `comm_stats` means the same for every strategy.
Must not touch: Ray, optimizers, the training loop.

Behaviour without a process group: torch DDP cannot be built, and a single process has
nothing to synchronise, so `wrap_model(m, "native")` returns a pass-through wrapper
(`LocalModel`) with the same interface: `no_sync()` is a no-op and comm_stats stay 0.
This is what a user running the same script on one CPU or GPU expects. With an
initialised group of world size 1, real DDP is used.

Timeouts: DDP waits for its buckets inside the autograd engine, where no per-wait
timeout can be set, so with `collective_timeout_s` (and no explicit `process_group`) DDP
gets a dedicated process group created with that timeout (`dist.new_group`): a bucket
all-reduce that does not finish in time fails there, and the counting hook re-raises it
as a `CollectiveTimeoutError` naming the bucket. DDP's autograd engine re-wraps errors, so
`loss.backward()` raises a RuntimeError whose message contains that text (the Python type
is not preserved through DDP's reducer). With an explicit `process_group`, its own timeout
applies.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raytrain_ddp.parallel.base import (
    CollectiveTimeoutError,
    WrappedModel,
    check_structure,
    describe_tensors,
    sync_initial_state,
)


class LocalModel(WrappedModel):
    """One process, nothing to synchronise: the module itself behind the shared interface."""

    strategy = "native"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(None)
        self.wrapped = module
        self._stats["buckets"] = 0

    @property
    def module(self) -> nn.Module:
        return self.wrapped


class NativeDDP(WrappedModel):
    """torch DDP; comm_stats are counted by a comm hook around torch's own hooks."""

    strategy = "native"

    def __init__(self, module: nn.Module, process_group=None, *, bucket_cap_mb: float = 25.0,
                 compress: Optional[str] = None, verify_init: bool = False,
                 device_ids: Optional[list] = None, collective_timeout_s: Optional[float] = None) -> None:
        if process_group is None and collective_timeout_s is not None:
            process_group = dist.new_group(timeout=timedelta(seconds=collective_timeout_s))
        super().__init__(process_group)
        self.collective_timeout_s = collective_timeout_s
        if verify_init and self.world_size > 1:
            # DDP would silently broadcast; check first so differing ranks fail clearly.
            sync_initial_state(module, process_group, verify=True,
                               world_size=self.world_size, world_rank=self.world_rank)
        elif self.world_size > 1:  # same clear error as the other strategies, on every rank
            check_structure(module, process_group, self.world_size, self.world_rank)
        self.ddp = DistributedDataParallel(
            module, device_ids=device_ids, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
        )
        self._inner_hook = default_hooks.bf16_compress_hook if compress == "bf16" else default_hooks.allreduce_hook
        self._wire_bytes = 2 if compress == "bf16" else None
        self._stats["buckets"] = None  # known after the first sync (DDP may rebuild buckets)
        self._calls_this_sync = 0
        self.ddp.register_comm_hook(state=process_group, hook=self._counting_hook)

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()

    def _counting_hook(self, state, bucket):  # no annotations: DDP checks them literally
        buffer = bucket.buffer()
        nbytes = buffer.numel() * (self._wire_bytes or buffer.element_size())
        index = bucket.index()
        names = self._param_names(bucket)
        self._stats["allreduce_calls"] += 1
        self._stats["allreduce_bytes"] += nbytes
        self._calls_this_sync += 1
        if bucket.is_last():
            self._stats["syncs"] += 1
            self._stats["buckets"] = self._calls_this_sync
            self._calls_this_sync = 0
        fut = self._inner_hook(state, bucket)
        rank, world, timeout = self.world_rank, self.world_size, self.collective_timeout_s

        def check(done: torch.futures.Future):
            try:
                return done.value()
            except Exception as exc:
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                cause = next((ln for ln in lines if "timed out" in ln.lower()), lines[0] if lines else "")
                cause = cause.replace("Got the following error when running the callback: ", "")
                within = f" within {timeout:g}s" if timeout is not None else ""
                raise CollectiveTimeoutError(
                    f"all-reduce of DDP bucket {index + 1} ({describe_tensors(names, nbytes)}) "
                    f"did not complete{within} on rank {rank} of {world} ({cause})"
                ) from exc

        return fut.then(check)

    def _param_names(self, bucket) -> list[str]:
        lookup = getattr(self, "_name_of", None)
        if lookup is None:
            lookup = self._name_of = {id(p): n for n, p in self.ddp.module.named_parameters()}
        return [lookup.get(id(p), "?") for p in bucket.parameters()]
