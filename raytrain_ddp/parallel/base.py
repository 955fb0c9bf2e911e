"""What every data-parallel strategy shares: the wrapper interface, start-up sync, errors.

Owns: `WrappedModel` (the one interface naive / bucketed / native implement, shaped like
Lightning Fabric's strategy: call it like the module, `.module` for the bare model,
`.no_sync()` to skip gradient sync, `.comm_stats` for what was sent), the rank-0
broadcast / `verify_init` check done at wrap time, and the errors the wrappers raise.
Must not touch: Ray, optimizers, data, checkpoints files. Only torch and torch.distributed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import zlib
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.errors import UserError

STRATEGIES = ("naive", "bucketed", "native")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish in time, or failed; the message names the operation.

    Usually a peer rank died, hangs, or skipped a step (ranks must run the same number
    of synced backward passes). Raised on the rank that was left waiting.
    """


class ModelMismatchError(UserError, RuntimeError):
    """Ranks hold different models (structure, or weights with verify_init=True)."""


class UnusedParameterError(UserError, RuntimeError):
    """A trainable parameter got no gradient in a synced backward, without find_unused_parameters."""


class RequiresGradChangeError(UserError, RuntimeError):
    """`requires_grad` changed after wrapping in a way the strategy cannot follow (native only)."""


_STAT_KEYS = ("allreduce_calls", "allreduce_bytes", "syncs", "broadcasts", "broadcast_bytes", "control_bytes")
TIMING_KEYS = ("comm_s", "exposed_comm_s")  # present only where the wrapper times its all-reduces


class WrappedModel(nn.Module):
    """Interface shared by the three strategies; the reference semantics are torch DDP's.

    - call it like the module; `.module` is the bare model (save `.module` or use
      `state_dict()`, which returns the bare module's keys, so checkpoints load into an
      unwrapped model and into every strategy alike; nested in a container, the keys are
      the container's prefix + the bare keys, and they load back through the container);
    - `.no_sync()`: torch DDP's rule, for every strategy: whether a backward synchronises is
      decided by its FORWARD. A forward run (with grad enabled) outside `no_sync()` makes
      the next backward sync, wherever that backward runs; a forward inside `no_sync()`
      means its backward only accumulates locally. Run forward and backward in the same
      context (as `accumulation_window` does) and the question never arises;
    - outside `no_sync()`, when `loss.backward()` returns every rank holds the same
      gradient, averaged over ranks, so `optimizer.step()` is safe right away;
    - buffers (BatchNorm running stats) are re-broadcast from rank 0 before a forward that
      follows a synced forward (`broadcast_buffers=True`, torch DDP's default and rule);
    - `.comm_stats` / `reset_comm_stats()` account for what was sent: `allreduce_calls`,
      `allreduce_bytes` (gradients only: per optimizer step exactly the trainable gradient
      bytes, half with bf16 compression), `syncs`, `buckets`, `broadcasts` and
      `broadcast_bytes` (the buffer broadcasts), `control_bytes` (the small agreement
      all-reduces: the used-parameter map, requires_grad changes). Where the wrapper can
      time its gradient all-reduces (naive, bucketed, native; on CPU/gloo, see
      `comm_timing`) also `comm_s` (seconds with at least one gradient all-reduce in
      flight) and `exposed_comm_s` (the part of it after backward had finished: what the
      step waited for); `comm_s - exposed_comm_s` was hidden behind backward.

    Build optimizers from `wrapper.parameters()` or `wrapper.module.parameters()` (same
    tensors); use `wrapper.module.named_parameters()` when names matter (the wrapper adds a
    prefix, as torch DDP does).
    """

    strategy: str = ""
    _module_path = "wrapped."  # where the bare module sits in the wrapper's own module tree

    def __init__(self, process_group: Optional[dist.ProcessGroup], *, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False) -> None:
        super().__init__()
        self._pg = process_group
        self._set_world()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self._sync_enabled = True
        self._stats: dict[str, Any] = {key: 0 for key in _STAT_KEYS}

    def _set_world(self) -> None:
        if self._pg is None and not dist.is_initialized():
            self.world_size, self.world_rank = 1, 0
        else:
            self.world_size = dist.get_world_size(self._pg)
            self.world_rank = dist.get_rank(self._pg)

    # -- the module -------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:  # overridden where the bare module sits elsewhere
        return self._modules["wrapped"]

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._pg

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # Nested in a container, `container.load_state_dict` walks the module tree and
        # reaches us with the container's prefix and our bare keys (what `state_dict()`
        # wrote): point those keys at where the bare module really sits, so they load.
        inner = prefix + self._module_path
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # -- sync control -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward passes inside do not sync their backward (it accumulates locally, sends nothing)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def comm_stats(self) -> dict[str, Any]:
        """Cumulative since wrap (or `reset_comm_stats`); see the class docstring for the keys."""
        return dict(self._stats)

    def close(self) -> None:
        """Stop synchronising (remove hooks). Called automatically when the module is re-wrapped."""

    # -- the optimizer: replicas hold it whole; sharded strategies (zero1, fsdp) override --
    def make_optimizer(self, factory: Callable[[list], torch.optim.Optimizer]) -> Any:
        """`factory(trainable parameters)`; a sharded strategy returns an optimizer that steps
        this rank's shard and whose `state_dict()` is consolidated (a collective)."""
        return factory([p for p in self.module.parameters() if p.requires_grad])

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Inside, `.module`'s forward runs on this rank alone and sends nothing, so ranks may
        run different numbers of forwards (validation). Replicas hold the full parameters
        already; fsdp gathers them on entry and frees them on exit (every rank must enter)."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the trainable gradients: the global norm,
        the same on every rank (sharded strategies combine the ranks' shards)."""
        return torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad],
                                              max_norm, norm_type)

    def reset_comm_stats(self) -> None:
        for key in _STAT_KEYS:
            self._stats[key] = 0
        for key in TIMING_KEYS:
            if key in self._stats:
                self._stats[key] = 0.0

    def _add_comm_time(self, backward_end: float, spans: list[tuple[float, float]]) -> None:
        """Account one synced backward's all-reduces: `spans` = (launched, completed) times."""
        comm, exposed = split_comm_time(backward_end, spans)
        self._stats["comm_s"] = self._stats.get("comm_s", 0.0) + comm
        self._stats["exposed_comm_s"] = self._stats.get("exposed_comm_s", 0.0) + exposed


def split_comm_time(backward_end: float, spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(communication time, the part of it after `backward_end`) from (start, end) spans.

    Communication time is the length of the union of the spans (two all-reduces in flight
    at once count once); the exposed part is that union clipped to after backward ended.
    """
    comm = exposed = 0.0
    lo = hi = None
    for start, end in sorted(spans) + [(float("inf"), float("inf"))]:
        if hi is not None and start > hi:
            comm += hi - lo
            exposed += max(0.0, hi - max(lo, backward_end))
            lo = hi = None
        if hi is None:
            lo, hi = start, max(start, end)
        else:
            hi = max(hi, end)
    return comm, exposed


class CommClock:
    """When each gradient all-reduce of one backward was launched and completed (CPU/gloo).

    Completion is observed from the training thread, never from gloo's: `poll` (called by
    the gradient hooks while something is in flight, and when backward ends) stamps each
    work it finds complete, and after backward each `wait`'s return stamps the rest. A work
    that finished during backward is thus stamped at the next gradient hook (an upper bound
    of its end, at most one gradient later), which is hidden time either way; the exposed
    part is exact. A Python callback on the work's future would instead take the GIL on
    gloo's thread once per bucket, against the training thread: it measured ~1 ms of CPU
    per step on the bench's MLP (2 buckets), more than the rest of the wrapper's Python.
    On CUDA a work completes when the collective is queued on the stream, not when it ran,
    so host clocks cannot tell: the wrappers time only CPU tensors (`comm_timing(device)`);
    use torch.profiler on GPUs.
    """

    __slots__ = ("started", "ended", "works", "open")

    def __init__(self) -> None:
        self.started: list[float] = []
        self.ended: list[float] = []
        self.works: list = []
        self.open: list[int] = []  # slots launched and not yet seen complete

    def launched(self, work) -> None:
        self.open.append(len(self.works))
        self.works.append(work)
        self.started.append(time.perf_counter())
        self.ended.append(0.0)

    def poll(self) -> None:
        """Stamp, with the time now, every open work that has completed."""
        now, still = 0.0, []
        for slot in self.open:
            if self.works[slot].is_completed():
                self.ended[slot] = now = now or time.perf_counter()
            else:
                still.append(slot)
        self.open = still

    def spans(self) -> list[tuple[float, float]]:
        """Call after every work was waited for (and polled); an unstamped one reads as now."""
        now = time.perf_counter()
        return [(s, e if e else now) for s, e in zip(self.started, self.ended)]


def comm_timing(device: torch.device) -> bool:
    """Whether host clocks see when a collective on `device` ran (see `CommClock`)."""
    return device.type == "cpu"


_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class ScratchBase(WrappedModel):
    """What naive and bucketed share, torch DDP's rules written out once.

    - Start-up: rank 0's parameters and buffers broadcast (or compared, `verify_init`).
    - Forward (torch's `_pre_forward`/`_post_forward`): re-broadcast rank 0's buffers when
      the previous forward was a synced one (the first forward too); a forward with grad
      enabled outside `no_sync` arms the next backward to sync. A change of `requires_grad`
      since the last forward is agreed across ranks (one small all-reduce, only then) and
      the hooks (and buckets) are rebuilt for the new trainable set: freezing or unfreezing
      mid-training behaves as in one process.
    - Backward: a hook per trainable parameter marks it used; the subclass syncs at the end
      of an armed backward, then `_settle_unused` applies torch's rule for parameters no
      gradient reached in the window: with find_unused_parameters they are all-reduced as
      zeros, and keep `grad=None` if no rank used them (an optimizer then skips them);
      without it, `UnusedParameterError` names them (every rank agrees on the first synced
      backward; later, the rank that saw it raises after finishing its all-reduces, so no
      peer is left waiting).
    - Pickling (as torch DDP: only on the default process group): hooks and buckets are
      dropped and rebuilt on load, without communication.
    """

    _transient: tuple[str, ...] = ("_handles",)  # rebuilt by `_attach`, never pickled
    # Set on every forward and backward, always plain Python values: assigned directly, as
    # nn.Module.__setattr__ (isinstance checks against Parameter, Module and buffers) costs
    # microseconds per assignment, many times per step. Subclasses extend the set.
    _plain_state: frozenset[str] = frozenset({"_queued", "_sync_armed", "_buffers_due", "_used"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._plain_state:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, module: nn.Module, process_group, *, verify_init: bool,
                 collective_timeout_s: Optional[float], broadcast_buffers: bool,
                 find_unused_parameters: bool) -> None:
        super().__init__(process_group, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters)
        self.wrapped = module
        self.collective_timeout_s = collective_timeout_s
        # where the gradients live: CUDA collectives are waited for with stream semantics
        self._device = next(module.parameters(), torch.empty(0)).device
        if self.world_size > 1:
            sync_initial_state(module, process_group, verify=verify_init, buffers=broadcast_buffers,
                               world_size=self.world_size, world_rank=self.world_rank)
        self._handles: list = []
        self._sync_armed = False  # torch's expect_autograd_hooks_: the next backward syncs
        self._buffers_due = True  # torch's require_forward_param_sync: broadcast before next forward
        self._unused_agreed = False  # the first synced backward checks unused params on every rank
        self._attach()

    @property
    def module(self) -> nn.Module:
        return self.wrapped

    # -- what hangs off the trainable parameters ----------------------------------------
    def _attach(self) -> None:
        """(Re)build hooks and buckets for the current trainable parameters; no communication."""
        self.close()
        self._all_params = list(self.wrapped.parameters())
        self._trainable = [p.requires_grad for p in self._all_params]
        self._tracked = self._order([(n, p) for n, p in self.wrapped.named_parameters() if p.requires_grad])
        self._used = bytearray(len(self._tracked))
        self._queued = False  # a sync callback is queued for the running backward
        self._build()

    def _order(self, named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """The order parameters are synced in (naive: registration order)."""
        return named

    def _build(self) -> None:
        """Subclass: register hooks (and buckets) for `self._tracked` when world_size > 1."""
        raise NotImplementedError

    def _abandon_backward(self) -> None:
        """A backward that raised never ran its callback: forget its partial state."""
        self._queued = False
        self._used = bytearray(len(self._tracked))

    def close(self) -> None:
        """Remove our gradient hooks: the module trains unsynchronised again (or can be re-wrapped)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward: torch DDP's pre/post-forward rules -----------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.world_size > 1:
            if self._queued:
                self._abandon_backward()
            if torch.is_grad_enabled() and [p.requires_grad for p in self._all_params] != self._trainable:
                self._follow_requires_grad()
            if self.broadcast_buffers and self._buffers_due:
                self._broadcast_buffers()
        out = self.wrapped(*args, **kwargs)
        synced = torch.is_grad_enabled() and self._sync_enabled
        self._sync_armed = self._sync_armed or synced  # disarmed only when the sync has run
        self._buffers_due = synced
        return out

    def _broadcast_buffers(self) -> None:
        nbytes = broadcast_coalesced(list(self.wrapped.buffers()), self._pg)
        if nbytes:
            self._stats["broadcasts"] += 1
            self._stats["broadcast_bytes"] += nbytes

    def _follow_requires_grad(self) -> None:
        flags = [p.requires_grad for p in self._all_params]
        counts = torch.tensor(flags, dtype=torch.int32, device=self._all_params[0].device)
        dist.all_reduce(counts, group=self._pg)
        self._stats["control_bytes"] += counts.numel() * 4
        names = [n for n, _ in self.wrapped.named_parameters()]
        split = [names[i] for i, c in enumerate(counts.tolist()) if 0 < c < self.world_size]
        if split:
            raise ModelMismatchError(
                f"requires_grad of parameter(s) {split} changed on some ranks only (rank "
                f"{self.world_rank} has requires_grad={[flags[names.index(n)] for n in split]}); "
                "freeze or unfreeze the same parameters on every rank"
            )
        self._attach()

    # -- backward: the end of a synced backward ----------------------------------------
    def _end_sync(self) -> None:
        self._queued = False
        self._sync_armed = False
        self._used = bytearray(len(self._tracked))

    def _start_unused_check(self):
        """Launch (async, after every gradient all-reduce, so all ranks issue the same
        sequence) what the unused-parameter rule needs; `_settle_unused` finishes it."""
        used = self._used
        device = self._tracked[0][1].device
        if self.find_unused_parameters:  # torch's local_used_map, summed over ranks
            counts = torch.tensor(list(used), dtype=torch.int32, device=device)
        elif not self._unused_agreed:  # once: who left what unused, so every rank can say it
            counts = torch.zeros(self.world_size, len(used), dtype=torch.int32, device=device)
            counts[self.world_rank] = 1 - torch.tensor(list(used), dtype=torch.int32, device=device)
        else:
            return None, None
        self._stats["control_bytes"] += counts.numel() * 4
        return counts, dist.all_reduce(counts, group=self._pg, async_op=True)

    def _settle_unused(self, counts, work) -> set[int]:
        """Indices of `_tracked` no rank used in this window (they keep grad None); without
        find_unused_parameters, raise `UnusedParameterError` naming any unused parameter."""
        if work is not None:
            self._wait(work, "all-reduce of the used-parameter map")
        if self.find_unused_parameters:
            return {i for i, c in enumerate(counts.tolist()) if c == 0}
        if counts is not None:
            self._unused_agreed = True
            per_rank = counts.tolist()
            bad = {i: [r for r in range(self.world_size) if per_rank[r][i]] for i in range(len(self._used))}
            bad = {i: ranks for i, ranks in bad.items() if ranks}
        else:  # later steps: this rank's own view, no extra collective
            bad = {i: [self.world_rank] for i, u in enumerate(self._used) if not u}
        if bad:
            raise UnusedParameterError(unused_message(self.strategy, [self._tracked[i][0] for i in bad],
                                                      list(bad.values())))
        return set()

    # -- helpers -------------------------------------------------------------------------
    def _wait(self, work, what: Union[str, Callable[[], str]]) -> None:
        wait_work(work, what, self.collective_timeout_s, self.world_rank, self.world_size, self._device)

    def _count(self, tensor: torch.Tensor) -> None:
        self._stats["allreduce_calls"] += 1
        self._stats["allreduce_bytes"] += tensor.numel() * tensor.element_size()

    def __getstate__(self) -> dict[str, Any]:
        if self._pg is not None:
            raise TypeError(
                f"a {self.strategy!r} wrapper on an explicit process_group cannot be pickled (a "
                "process group cannot); pickle wrapper.module or its state_dict() and wrap again"
            )
        state = dict(self.__dict__)
        for key in self._transient:
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._handles = []
        self._set_world()  # the default group of the process that loads it (world 1 without one)
        self._attach()


def unused_message(strategy: str, names: list[str], ranks: list[list[int]], limit: int = 6) -> str:
    shown = ", ".join(f"'{n}' on rank(s) {r}" for n, r in list(zip(names, ranks))[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (
        f"{len(names)} trainable parameter(s) got no gradient in a synchronised backward "
        f"(strategy {strategy!r}, find_unused_parameters=False): {shown}{more}. Without "
        "find_unused_parameters (the default, as in torch DDP) every trainable parameter must "
        "take part in the loss on every rank. Pass find_unused_parameters=True (config: "
        "parallel.find_unused_parameters: true) to let them be skipped (grad stays None where no "
        "rank used them, as in torch DDP), or freeze them with requires_grad_(False)."
    )


def broadcast_coalesced(tensors: list[torch.Tensor], pg) -> int:
    """Overwrite `tensors` with group rank 0's, one broadcast per (dtype, device); returns bytes.

    torch DDP's buffer sync (`_sync_buffers`): in place, without bumping version counters
    (a buffer saved for backward must not look modified).
    """
    if not tensors:
        return 0
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    nbytes = 0
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(tensors)):
        for group in groups.values():
            flat = torch._utils._flatten_dense_tensors([t.detach() for t in group])
            dist.broadcast(flat, src=src, group=pg)
            nbytes += flat.numel() * flat.element_size()
            for t, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                t.copy_(synced)
    return nbytes


# -- start-up: same structure everywhere, then rank 0's weights everywhere --------------

def _named_state(module: nn.Module, buffers: bool = True) -> list[tuple[str, str, torch.Tensor]]:
    """Parameters then buffers, in registration order: the order every rank broadcasts in."""
    items = [("parameter", n, p) for n, p in module.named_parameters()]
    if buffers:
        items += [("buffer", n, b) for n, b in module.named_buffers()]
    return items


def check_structure(module: nn.Module, pg, world_size: int, world_rank: int) -> None:
    """One tiny all-reduce so a rank with a different model fails clearly instead of hanging."""
    items = _named_state(module)
    device = items[0][2].device if items else torch.device("cpu")
    signature = ";".join(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}" for kind, name, t in items)
    crc = zlib.crc32(signature.encode())
    flags = torch.tensor([crc, -crc], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
    if flags[0].item() != crc or flags[1].item() != -crc:
        raise ModelMismatchError(
            f"the model's structure differs across ranks (rank {world_rank} of {world_size} has "
            f"{len(items)} parameters/buffers, signature crc32={crc}); every rank must build the "
            "same model (same names, shapes and dtypes) before wrap_model"
        )


def sync_initial_state(module: nn.Module, pg, *, verify: bool, world_size: int, world_rank: int,
                       buffers: bool = True) -> None:
    """Broadcast rank 0's parameters and buffers (verify=False), or check they already agree.

    `buffers=False` (torch DDP's broadcast_buffers=False) leaves each rank's buffers its own.

    With verify=True nothing is overwritten: every rank compares its tensors with rank 0's
    and a flag matrix is all-reduced, so every rank (not only the odd one out) raises the
    same `ModelMismatchError` naming the first differing tensor; no rank is left waiting.
    """
    items = _named_state(module, buffers)
    if not items:
        return
    device = items[0][2].device
    check_structure(module, pg, world_size, world_rank)
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    differs = torch.zeros(world_size, len(items), dtype=torch.int32, device=device)
    max_diff: dict[int, float] = {}
    with torch.no_grad():
        for i, (_, _, tensor) in enumerate(items):
            if not verify:
                dist.broadcast(tensor.data, src=src, group=pg)
                continue
            reference = tensor.detach().clone()
            dist.broadcast(reference, src=src, group=pg)
            if not torch.equal(reference, tensor.detach()):
                differs[world_rank, i] = 1
                if tensor.is_floating_point() and tensor.numel():
                    max_diff[i] = (reference - tensor.detach()).abs().max().item()
    if not verify:
        return
    dist.all_reduce(differs, group=pg)  # everyone learns every rank's verdict
    bad_items = differs.any(dim=0).nonzero()
    if bad_items.numel():
        i = int(bad_items[0])
        kind, name, _ = items[i]
        ranks = differs[:, i].nonzero().flatten().tolist()
        n_bad = bad_items.numel()
        here = f" (max abs difference on this rank: {max_diff[i]:g})" if i in max_diff else ""
        raise ModelMismatchError(
            f"model parameters are not the same on all processes: {kind} '{name}' on rank(s) "
            f"{ranks} differs from rank 0{here}; {n_bad} of {len(items)} tensors differ. "
            "Seed every rank identically before building the model (torch.manual_seed), or "
            "wrap with verify_init=False to broadcast rank 0's weights instead."
        )


# -- waiting on collectives --------------------------------------------------------------

def wait_work(work, what: Union[str, Callable[[], str]], timeout_s: Optional[float], world_rank: int,
              world_size: int, device: Optional[torch.device] = None) -> None:
    """Wait for an async collective; a timeout or failure becomes a `CollectiveTimeoutError`.

    `what` names the operation; a callable is called only if it fails (the name of a bucket
    costs string formatting, and a wait happens per bucket per step).

    CPU tensors (gloo): `work.wait(timeout)` blocks this thread until the collective
    completes or `timeout_s` passes, then raises the named error. `timeout_s=None` waits
    as long as the process group's own timeout (set at `init_process_group`) allows; a
    failure then is still reported with `what` in it.

    CUDA tensors (`device` on CUDA; NCCL): never a host wait. `work.wait()` without a
    timeout only makes the current CUDA stream wait for the collective and returns at
    once, as torch DDP's `fut.wait()` does, so the host keeps queueing work while the GPU
    computes. (`work.wait(timeout)` would block the host until the kernel finished: one
    host sync per bucket.) The timeout is then enforced without the host: `COLLECTIVES`,
    a watch thread, names a collective still unfinished after `timeout_s` (the named
    `CollectiveTimeoutError` text, on stderr and in the log, with NCCL's flight recorder
    dumped next to it where torch has one); NCCL's watchdog ends the process at the
    process group's timeout, which the launcher sets above `timeout_s` (so the name comes
    first).
    """
    stream = device is not None and device.type != "cpu"
    try:
        if timeout_s is None or stream:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo: RuntimeError("Operation timed out!"), DistBackendError, ...
        text = str(exc)
        if timeout_s is not None and "timed out" in text.lower():
            verdict = f"did not finish within {timeout_s:g}s"
        else:
            verdict = f"failed ({type(exc).__name__}: {text.strip().splitlines()[0] if text else ''})"
        raise CollectiveTimeoutError(_stuck_message(what, verdict, world_rank, world_size)) from exc
    if stream and timeout_s is not None:
        COLLECTIVES.track(work, what, timeout_s, world_rank, world_size)


def _stuck_message(what: Union[str, Callable[[], str]], verdict: str, world_rank: int, world_size: int) -> str:
    what = what() if callable(what) else what
    return (f"{what} {verdict} on rank {world_rank} of {world_size}; a peer rank probably died, "
            "hangs, or skipped this step (every rank must run the same synced backward passes)")


class _Tracked:
    __slots__ = ("deadline", "work", "what", "timeout_s", "world_rank", "world_size")

    def __init__(self, deadline, work, what, timeout_s, world_rank, world_size) -> None:
        self.deadline, self.work, self.what = deadline, work, what
        self.timeout_s, self.world_rank, self.world_size = timeout_s, world_rank, world_size


class CollectiveWatch:
    """Names a CUDA collective that outlives its timeout, without the step ever waiting on it.

    `track` (per bucket, on the training thread) appends the work and first drops those
    completed (collectives of one process group complete in launch order, so the oldest
    unfinished one is the stuck one; what is kept is what is in flight, at most a step's
    worth). A daemon thread, started at the first `track`, calls `check` every
    `poll_s`: the oldest unfinished work past its deadline is reported once, through
    `report` (default: stderr, the log, and NCCL's flight recorder dumped). `is_completed`
    on NCCL queries a CUDA event: it never blocks.
    """

    def __init__(self, report: Optional[Callable[[str], None]] = None, poll_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._inflight: collections.deque = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._report = report or report_stuck_collective
        self._poll_s = poll_s
        self._clock = clock
        self.reported: list[str] = []

    def track(self, work, what: Union[str, Callable[[], str]], timeout_s: float, world_rank: int,
              world_size: int) -> None:
        with self._lock:
            self._drop_completed()
            self._inflight.append(_Tracked(self._clock() + timeout_s, work, what, timeout_s, world_rank, world_size))
            if self._thread is None and self._poll_s != 0:
                poll = self._poll_s or min(5.0, max(0.05, timeout_s / 20))
                self._thread = threading.Thread(target=self._run, args=(poll,), name="raytrain-collective-watch",
                                                daemon=True)
                self._thread.start()

    def _drop_completed(self) -> None:
        while self._inflight and self._inflight[0].work.is_completed():
            self._inflight.popleft()

    def check(self) -> Optional[str]:
        """One look: the message for the oldest unfinished collective past its deadline (once)."""
        with self._lock:
            self._drop_completed()
            head = self._inflight[0] if self._inflight else None
            if head is None or self._clock() < head.deadline:
                return None
            self._inflight.popleft()  # reported once; the next one gets its own deadline
        message = _stuck_message(head.what, f"did not finish within {head.timeout_s:g}s", head.world_rank,
                                 head.world_size)
        message = f"{CollectiveTimeoutError.__name__}: {message}"
        self.reported.append(message)
        self._report(message)
        return message

    def _run(self, poll_s: float) -> None:
        while True:
            time.sleep(poll_s)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a watch must never take the worker down
                logging.getLogger(__name__).exception("collective watch")


def report_stuck_collective(message: str) -> None:
    """Say which collective is stuck (stderr and the log), and dump NCCL's flight recorder."""
    dumped = dump_flight_recorder()
    text = message + (f" (NCCL flight recorder dumped to {dumped})" if dumped else "")
    print(text, file=sys.stderr, flush=True)
    logging.getLogger(__name__).error(text)


def dump_flight_recorder() -> Optional[str]:
    """NCCL's flight recorder (the last collectives, TORCH_NCCL_TRACE_BUFFER_SIZE of them) to a
    file next to where torch's own dump goes; None where torch or the build has none."""
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None or not int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0):
        return None
    try:
        prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or os.path.join(tempfile.gettempdir(),
                                                                                   "nccl_trace_rank_")
        rank = dist.get_rank() if dist.is_initialized() else os.getpid()
        path = f"{prefix}{rank}_raytrain"
        with open(path, "wb") as f:
            f.write(dump())
        return path
    except Exception:  # noqa: BLE001 - the name is what matters; the dump is a bonus
        return None


COLLECTIVES = CollectiveWatch()  # one per process: every wrapper's CUDA collectives


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def describe_tensors(names: list[str], nbytes: int, limit: int = 3) -> str:
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{format_bytes(nbytes)}, params: {shown}"
