"""torch's DistributedDataParallel behind our `WrappedModel` interface (strategy `native`).

Owns: building DDP with the options our config exposes (bucket_cap_mb, first_bucket_mb,
gradient_as_bucket_view=True, device_ids, bf16 compression, broadcast_buffers,
find_unused_parameters), a comm hook that counts what each bucket all-reduce sends and, on
CPU, times it (so `comm_stats` means the same for every strategy, `comm_s` and
`exposed_comm_s` included), and the checks that turn torch DDP's late errors and hangs
into an error naming the parameter.
Must not touch: Ray, optimizers, the training loop.

Behaviour without a process group: torch DDP cannot be built, and a single process has
nothing to synchronise, so `wrap_model(m, "native")` returns `LocalModel`, the module
behind the same interface: comm_stats stay 0, and it makes the checks that need no peer
(below) the way `NativeDDP` makes them, so one process refuses what the workers refuse.
With an initialised group of world size 1 (local mode), real DDP is used, with the same
checks as at world size 2 minus the agreement across ranks.

Where torch DDP alone would go wrong, and what we do instead:
- A trainable parameter with no gradient in a synced backward, without
  `find_unused_parameters`: torch returns unsynchronised gradients and fails one step
  later, or, if only some ranks left it unused, hangs the others until the process-group
  timeout. On the first synced backward (where a model that never uses a parameter shows
  it) we mark used parameters with our own hooks and, at the end of the backward, every
  rank agrees (one small all-reduce on a side group, since DDP's own group may hold a
  bucket that a rank never launched) and raises `UnusedParameterError` naming them. Then
  the hooks are removed: a Python call per parameter per backward is not worth paying for
  the rest of the run. A parameter left unused later (a data-dependent branch) gets torch's
  own check, at the next forward on the rank that left it, re-raised as
  `UnusedParameterError` with the parameter names in place of torch's indices. torch DDP
  makes that check at world size 1 too (its reducer runs with one rank), so a world of one
  gets the same two checks; the first needs no all-reduce there. `LocalModel`, without
  torch's reducer, checks every synced backward (`base.SoloUnusedCheck`).
- `requires_grad` changed after wrapping: DDP fixes its parameter set when it is built.
  Freezing is fine with `find_unused_parameters` (DDP then leaves grad None); without it,
  or when a parameter frozen at wrap time is unfrozen (DDP would never synchronise it),
  the next forward raises `RequiresGradChangeError` naming the parameter.

Timeouts: DDP waits for its buckets inside the autograd engine, where no per-wait
timeout can be set, so with `collective_timeout_s` (and no explicit `process_group`) DDP
gets a dedicated process group created with that timeout (`dist.new_group`): a bucket
all-reduce that does not finish in time fails there, and the counting hook re-raises it
as a `CollectiveTimeoutError` naming the bucket. DDP's autograd engine re-wraps errors, so
`loss.backward()` raises a RuntimeError whose message contains that text (the Python type
is not preserved through DDP's reducer). With an explicit `process_group`, its own timeout
applies. On NCCL the group's timeout is enforced by NCCL's watchdog, which aborts the
process (see `base.wait_work`).
"""

from __future__ import annotations

import functools
import inspect
import re
import time
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raytrain_ddp.parallel import registry, torch_compat
from raytrain_ddp.parallel.base import (
    CollectiveTimeoutError,
    RequiresGradChangeError,
    SoloUnusedCheck,
    UnusedParameterError,
    WrappedModel,
    _queue_callback,
    check_structure,
    comm_timing,
    describe_tensors,
    sync_initial_state,
    unused_message,
    wait_work,
)

_TORCH_FIRST_BUCKET_MB = 1.0  # dist._DEFAULT_FIRST_BUCKET_BYTES, torch DDP's default first bucket
_TORCH_CAP_MB = 25.0


def make_ddp(module: nn.Module, *, broadcast_buffers: bool = True, bucket_cap_mb: float = _TORCH_CAP_MB,
             first_bucket_mb: float = _TORCH_FIRST_BUCKET_MB, **options: Any) -> DistributedDataParallel:
    """torch DDP with our `broadcast_buffers` and bucket sizes, meaning what we mean by them.

    torch 2.13 renamed it `forward_sync_buffers` and deprecated `broadcast_buffers` (with a
    FutureWarning), but only the old `broadcast_buffers=False` also skips the buffer sync at
    construction, which is what ours means (and what the from-scratch strategies do).
    `verify` builds its torch DDP reference through here too, so both mean the same.

    Buckets: torch keeps its small first bucket (1 MiB) only when `bucket_cap_mb` is left
    unset; any explicit cap, even 25, makes every bucket that size. We pass the first bucket
    explicitly (`bucket_cap_mb_list=[first, cap]`, torch >= 2.13), so `first_bucket_mb`
    means the same here as in `bucketed`. Older torch: the defaults (25 / 1) leave the cap
    unset; other caps get no small first bucket.
    """
    if _HAS_CAP_LIST and first_bucket_mb < bucket_cap_mb:
        options["bucket_cap_mb_list"] = [first_bucket_mb, bucket_cap_mb]
    elif not (bucket_cap_mb == _TORCH_CAP_MB and first_bucket_mb == _TORCH_FIRST_BUCKET_MB):
        options["bucket_cap_mb"] = bucket_cap_mb
    if broadcast_buffers:
        if _HAS_FORWARD_SYNC:
            options["forward_sync_buffers"] = True
        return DistributedDataParallel(module, **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        return DistributedDataParallel(module, broadcast_buffers=False, **options)


_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__).parameters
_HAS_FORWARD_SYNC = "forward_sync_buffers" in _DDP_OPTIONS
_HAS_CAP_LIST = "bucket_cap_mb_list" in _DDP_OPTIONS
_REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def requires_grad_change(named: list[tuple[str, nn.Parameter]], at_wrap: list[bool],
                         find_unused_parameters: bool) -> None:
    """Raise `RequiresGradChangeError` for a change of `requires_grad` since wrapping that torch
    DDP cannot follow: unfreezing (it would never synchronise the parameter), or freezing
    without find_unused_parameters (it would wait for the gradient). A rank's own check: the
    same at every world size."""
    for (name, p), was in zip(named, at_wrap):
        if p.requires_grad and not was:
            raise RequiresGradChangeError(
                f"parameter '{name}' now has requires_grad=True but was frozen when the model "
                "was wrapped; strategy 'native' (torch DDP) fixes the synchronised parameters "
                "when it is built and would never synchronise it. Wrap the model again after "
                "unfreezing (wrap_model(wrapper.module, ...)), or use strategy 'bucketed' or "
                "'naive', which follow requires_grad changes"
            )
        if was and not p.requires_grad and not find_unused_parameters:
            raise RequiresGradChangeError(
                f"parameter '{name}' now has requires_grad=False (frozen after the model was "
                "wrapped); strategy 'native' (torch DDP) without find_unused_parameters expects "
                "a gradient for it in every step. Pass find_unused_parameters=True (config: "
                "parallel.find_unused_parameters: true), wrap the model again after freezing, "
                "or use strategy 'bucketed' or 'naive', which follow requires_grad changes"
            )


class LocalModel(WrappedModel):
    """One process without a process group: the module itself behind the shared interface.

    Nothing is sent, but `NativeDDP`'s checks that need no peer are made with its messages:
    a `requires_grad` change torch DDP cannot follow (`requires_grad_change`), and, without
    find_unused_parameters, a trainable parameter no gradient reached in a synced backward
    (`base.SoloUnusedCheck`, every synced backward). The checks across ranks cannot fail
    with one process and are not made.
    """

    strategy = registry.name_of(__name__)  # "native": the name is the registry's

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False) -> None:
        super().__init__(None, find_unused_parameters=find_unused_parameters)
        self.wrapped = module
        self._stats["buckets"] = 0
        self._named = list(module.named_parameters())
        self._at_wrap = [p.requires_grad for _, p in self._named]
        self._trainable = list(self._at_wrap)
        self._watch()

    def _watch(self) -> None:
        tracked = [(n, p) for (n, p), t in zip(self._named, self._at_wrap) if t]
        self._alone = (SoloUnusedCheck(self.strategy, tracked)
                       if tracked and not self.find_unused_parameters else None)

    @property
    def module(self) -> nn.Module:
        return self.wrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            now = [p.requires_grad for _, p in self._named]
            if now != self._trainable:
                requires_grad_change(self._named, self._at_wrap, self.find_unused_parameters)
                self._trainable = now  # frozen with find_unused_parameters: its grad stays None
        out = self.wrapped(*args, **kwargs)
        if self._alone is not None:
            self._alone.forwarded(torch.is_grad_enabled() and self._sync_enabled)
        return out

    def close(self) -> None:
        if self._alone is not None:
            self._alone.close()
            self._alone = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_alone"] = None  # hooks: rebuilt on load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._named = list(self.wrapped.named_parameters())  # the loaded module's own tensors
        self._watch()


class NativeDDP(WrappedModel):
    """torch DDP; comm_stats are counted by a comm hook around torch's own hooks."""

    strategy = registry.name_of(__name__)  # "native": the name is the registry's

    _module_path = "ddp.module."

    def __init__(self, module: nn.Module, process_group=None, *, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = _TORCH_FIRST_BUCKET_MB, compress: Optional[str] = None,
                 verify_init: bool = False,
                 device_ids: Optional[list] = None, collective_timeout_s: Optional[float] = None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False) -> None:
        if process_group is None and collective_timeout_s is not None:
            process_group = dist.new_group(timeout=timedelta(seconds=collective_timeout_s))
        super().__init__(process_group, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters)
        self.collective_timeout_s = collective_timeout_s
        if verify_init and self.world_size > 1:
            # DDP would silently broadcast; check first so differing ranks fail clearly.
            sync_initial_state(module, process_group, verify=True, buffers=broadcast_buffers,
                               world_size=self.world_size, world_rank=self.world_rank)
        elif self.world_size > 1:  # same clear error as the other strategies, on every rank
            check_structure(module, process_group, self.world_size, self.world_rank)
        self.ddp = make_ddp(
            module, device_ids=device_ids, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb, gradient_as_bucket_view=True,
            broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
        )
        self._inner_hook = default_hooks.bf16_compress_hook if compress == "bf16" else default_hooks.allreduce_hook
        self._wire_bytes = 2 if compress == "bf16" else None
        self._stats["buckets"] = None  # known after the first sync (DDP may rebuild buckets)
        self._calls_this_sync = 0
        params = list(module.parameters())
        self._timed = bool(params) and comm_timing(params[0].device)
        self._sync_clock: Optional[_SyncClock] = None
        self.ddp.register_comm_hook(state=process_group, hook=self._counting_hook)
        self._named = list(module.named_parameters())
        self._at_wrap = [p.requires_grad for _, p in self._named]  # what DDP synchronises
        self._trainable = list(self._at_wrap)
        self._track_unused()

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._check_requires_grad()
        if self._queued:  # a backward that raised never ran our callback
            self._end_backward()
        self._account_sync()
        if self.ddp.will_sync_module_buffers():  # DDP re-broadcasts buffers in its forward
            self._stats["broadcasts"] += 1
            self._stats["broadcast_bytes"] += sum(b.numel() * b.element_size() for b in self.ddp.modules_buffers)
        try:
            out = self.ddp(*args, **kwargs)
        except RuntimeError as exc:
            if _REDUCTION_UNFINISHED in str(exc):
                raise self._unused_from_torch(str(exc)) from exc
            raise
        if torch.is_grad_enabled() and self.ddp.require_backward_grad_sync:
            self._armed = True  # DDP prepared its reducer: the next backward syncs
        return out

    def no_sync(self):
        return self.ddp.no_sync()

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """The DDP module compiled, as torch documents: dynamo's DDPOptimizer splits the graph at
        DDP's bucket boundaries, so each bucket's all-reduce still overlaps backward."""
        first = torch_compat.ddp_first_bucket_bytes()
        if self.ddp.bucket_bytes_cap < first:
            raise ValueError(f"bucket_cap_mb={self.ddp.bucket_bytes_cap / 2**20:g} is below torch's first bucket "
                             f"({first / 2**20:g} MB), which torch.compile's DDPOptimizer "
                             "refuses: use a larger bucket_cap_mb with compile")
        self.ddp.compile(*args, **kwargs)

    @property
    def comm_stats(self) -> dict[str, Any]:
        self._account_sync()
        return super().comm_stats

    def reset_comm_stats(self) -> None:
        self._account_sync()
        super().reset_comm_stats()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a 'native' wrapper cannot be pickled (it holds process groups and torch DDP's "
                        "reducer); pickle wrapper.module or its state_dict() and wrap again")

    # -- requires_grad changes DDP cannot follow ---------------------------------------
    def _check_requires_grad(self) -> None:
        now = [p.requires_grad for _, p in self._named]
        if now == self._trainable:
            return
        requires_grad_change(self._named, self._at_wrap, self.find_unused_parameters)
        self._trainable = now  # frozen with find_unused_parameters: DDP leaves its grad None

    # -- unused parameters without find_unused_parameters --------------------------------
    def _track_unused(self) -> None:
        """Hooks for the first synced backward only (see the module docstring)."""
        self._armed = False
        self._queued = False
        self._tracked = [(n, p) for (n, p), t in zip(self._named, self._at_wrap) if t]
        self._used = bytearray(len(self._tracked))
        self._agreed = False
        self._handles = []
        if self.find_unused_parameters or not self._tracked:
            return
        if self.world_size > 1:
            # DDP's group may hold a bucket all-reduce that one rank never launched: agree elsewhere.
            ranks = dist.get_process_group_ranks(self._pg if self._pg is not None else dist.group.WORLD)
            self._side_pg = dist.new_group(ranks=ranks, use_local_synchronization=True)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                         for i, (_, p) in enumerate(self._tracked)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        if not self._armed:  # DDP only counts gradients of the synced backward itself
            return
        self._used[i] = 1
        if not self._queued:
            self._queued = True  # queued before DDP's finalize, which waits for every bucket
            _queue_callback(self._check_unused)

    def _end_backward(self) -> None:
        self._armed = self._queued = False
        self._used = bytearray(len(self._tracked))

    def _check_unused(self) -> None:
        try:
            unused = [i for i, u in enumerate(self._used) if not u]
            if not self._agreed and self.world_size == 1:  # this rank's view is the whole story
                self._agreed = True
                bad = {i: [self.world_rank] for i in unused}
            elif not self._agreed:
                counts = torch.zeros(self.world_size, len(self._used), dtype=torch.int32,
                                     device=self._tracked[0][1].device)
                counts[self.world_rank, unused] = 1
                work = dist.all_reduce(counts, group=self._side_pg, async_op=True)
                self._stats["control_bytes"] += counts.numel() * 4
                wait_work(work, "all-reduce of the used-parameter map", self.collective_timeout_s,
                          self.world_rank, self.world_size, counts.device)
                self._agreed = True
                per_rank = counts.tolist()
                bad = {i: [r for r in range(self.world_size) if per_rank[r][i]] for i in range(len(self._used))}
                bad = {i: ranks for i, ranks in bad.items() if ranks}
            else:
                bad = {i: [self.world_rank] for i in unused}
            if bad:
                raise UnusedParameterError(unused_message(
                    self.strategy, [self._tracked[i][0] for i in bad], list(bad.values())))
            self.close()  # checked on every rank; from now on torch's own check (see above)
        finally:
            self._end_backward()

    def _unused_from_torch(self, text: str) -> UnusedParameterError:
        """torch's "did not finish reduction" error, with parameter names for its indices."""
        match = re.search(r"did not receive grad for rank (\d+): ([\d ]+)", text)
        if not match:
            return UnusedParameterError(
                f"a trainable parameter got no gradient in the previous synchronised backward "
                f"(strategy 'native', find_unused_parameters=False; torch DDP: {text.splitlines()[0]}). "
                "Pass find_unused_parameters=True (config: parallel.find_unused_parameters: true)")
        rank, indices = int(match.group(1)), [int(i) for i in match.group(2).split()]
        names = [self._tracked[i][0] if i < len(self._tracked) else f"#{i}" for i in indices]
        return UnusedParameterError(unused_message(self.strategy, names, [[rank]] * len(names)))

    # -- timing: how much communication backward hid -------------------------------------
    def _backward_ended(self) -> None:
        clock = self._sync_clock
        if clock is not None and clock.backward_end is None:
            clock.backward_end = time.perf_counter()

    def _account_sync(self) -> None:
        """Add the last sync's times to comm_stats once every bucket of it has completed."""
        clock = self._sync_clock
        if clock is not None and clock.complete():
            self._sync_clock = None
            self._add_comm_time(clock.backward_end, clock.spans())

    def _counting_hook(self, state, bucket):  # no annotations: DDP checks them literally
        buffer = bucket.buffer()
        nbytes = buffer.numel() * (self._wire_bytes or buffer.element_size())
        index = bucket.index()
        names = self._param_names(bucket)
        self._stats["allreduce_calls"] += 1
        self._stats["allreduce_bytes"] += nbytes
        self._calls_this_sync += 1
        last = bucket.is_last()
        if last:
            self._stats["syncs"] += 1
            self._stats["buckets"] = self._calls_this_sync
            self._calls_this_sync = 0
        clock, slot = None, 0
        if self._timed:
            if index == 0:  # a new sync; DDP queues its finalize (the waiting) after this callback
                self._account_sync()
                self._sync_clock = _SyncClock()
                _queue_callback(self._backward_ended)
            clock = self._sync_clock
            slot = clock.launched(last) if clock is not None else 0
        fut = self._inner_hook(state, bucket)
        rank, world, timeout = self.world_rank, self.world_size, self.collective_timeout_s

        def check(done: torch.futures.Future):
            try:
                value = done.value()
                if clock is not None:
                    clock.completed(slot)
                return value
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


class _SyncClock:
    """One DDP sync's bucket launches and completions (completions stamped on gloo's thread)."""

    __slots__ = ("started", "ended", "expected", "backward_end")

    def __init__(self) -> None:
        self.started: list[float] = []
        self.ended: list[float] = []
        self.expected: Optional[int] = None  # known once the last bucket is launched
        self.backward_end: Optional[float] = None

    def launched(self, last: bool) -> int:
        self.started.append(time.perf_counter())
        self.ended.append(0.0)
        if last:
            self.expected = len(self.started)
        return len(self.started) - 1

    def completed(self, slot: int) -> None:
        self.ended[slot] = time.perf_counter()

    def complete(self) -> bool:
        return (self.backward_end is not None and self.expected is not None
                and all(self.ended[:self.expected]))

    def spans(self) -> list[tuple[float, float]]:
        return list(zip(self.started, self.ended))
