"""Strategy `bucketed`: flat gradient buckets all-reduced during backward (written from scratch).

Owns: how bucketed packs gradients (flat buffers that `param.grad` are views into), when
each bucket goes on the wire, and what goes there. The rules it shares with naive (torch
DDP's forward-time sync decision, buffer broadcasts, unused and frozen parameters,
pickling) live in `base.ScratchBase`.
Must not touch: Ray, optimizers, the training loop. torch and torch.distributed only.

torch-reducer style. Parameters, in REVERSE registration order (roughly the order
backward produces their gradients), are packed per (dtype, device) into one flat buffer;
buckets are consecutive slices of it, cut as torch DDP cuts them (`assign_buckets`: a
bucket closes once it reaches `bucket_cap_mb`, the first one `first_bucket_mb`, 1 MiB by
default as in torch DDP, so communication starts early). `param.grad` is a view into the
flat buffer, so autograd accumulates straight into what is sent: no packing copy, and a new
layout (bucket_cap_mb="auto" tries several) only moves the slice boundaries. A
post-accumulate-grad hook marks a parameter ready; when every parameter of a bucket is
ready (and every earlier bucket has been launched; ranks must issue collectives in the same
order) an ASYNC all-reduce of the bucket starts at once, overlapping the rest of backward.
The callback at the end of backward launches whatever is left (a parameter no gradient
reached sends zeros, or its gradient from an earlier micro-step of the window) and waits
for everything. When every rank is on one host and the buckets are on CPU, each all-reduce
goes through shared memory rather than gloo (`shm.py`; `shm=False` turns it off), decided
by all ranks together at the first launch after a (re)build. On CPU each all-reduce is timed (`base.CommClock`): `comm_stats` gains
`comm_s` and `exposed_comm_s`, how much of the communication backward hid and how long
the step waited for the rest.

`bucket_cap_mb="auto"` (`parallel.bucket_cap_mb: auto`) times a few layouts on the first
synced steps of the run and keeps the fastest, the same on every rank (`tuning.py`);
`compress="auto"` also tries bf16 on the wire and keeps it only if it pays.
`wrapper.tuning` holds the decision once made.

`optimizer.zero_grad(set_to_none=True)` is supported and is the cheaper choice: autograd
then hands over a fresh gradient, which the hook copies into the bucket once, pre-divided by
the world size, and re-points `param.grad` at its bucket view (one pass, as torch DDP's
`mul_out`), instead of zeroing the bucket and accumulating into it. Later micro-steps of a
`no_sync` window accumulate straight into the bucket.

Move the module to its device before wrapping: buckets are allocated where the parameters
are (and rebuilt when the trainable set changes). World size 1 (or no process group)
builds no buckets and sends nothing; only the unused-parameter check's hooks remain
(`base.ScratchBase`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel import registry, torch_compat, tuning
from raytrain_ddp.parallel.shm import ShmExchange, open_exchange
from raytrain_ddp.parallel.base import CommClock, ScratchBase, _queue_callback, comm_timing, describe_tensors

_FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's dist._DEFAULT_FIRST_BUCKET_BYTES
# Up to this many elements a gradient is adopted with a plain copy and scaled with its
# bucket at launch (one `_foreach_mul_` for all of them): for small tensors Python's cost
# per op dominates (`torch.mul(out=)` ~9 us against `copy_` ~2 us), for large ones memory
# does, and mul-into-the-view reads and writes each byte once.
_SMALL_NUMEL = 16384


class _Bucket:
    __slots__ = ("index", "members", "names", "buffer", "nbytes", "flat", "lo", "hi")

    def __init__(self, index: int, members: list[int], names: list[str], buffer: torch.Tensor,
                 flat: int = 0, lo: int = 0, hi: int = -1) -> None:
        self.index, self.members, self.names, self.buffer = index, members, names, buffer
        self.nbytes = buffer.numel() * buffer.element_size()
        self.flat, self.lo, self.hi = flat, lo, hi  # buffer = flat buffer number `flat`, [lo:hi]


def assign_buckets(params: list[torch.Tensor], cap_bytes: int,
                   first_cap_bytes: int = _FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group parameter indices (already in the order to send them) into buckets.

    torch DDP's rule (`_compute_bucket_assignment_by_size`), so both strategies cut the same
    buckets: one open bucket per (dtype, device); each parameter joins it, and the bucket
    closes once it holds at least its limit (`first_cap_bytes` for the first bucket of a
    kind, then `cap_bytes`). The parameter that crosses the limit stays with the ones before
    it: in reverse registration order a layer's bias comes just before its (larger) weight,
    and backward produces both at once, so cutting between them would only make the next
    bucket, launched later, larger. Buckets are returned in the order of their first parameter.
    """
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    started: set[tuple] = set()
    done: list[list[int]] = []
    for i, p in enumerate(params):
        key = (p.dtype, p.device)
        if key not in open_:
            open_[key], sizes[key] = [], 0
        open_[key].append(i)
        sizes[key] += p.numel() * p.element_size()
        if sizes[key] >= (cap_bytes if key in started else min(cap_bytes, first_cap_bytes)):
            done.append(open_.pop(key))
            started.add(key)
    done.extend(open_.values())
    return sorted(done, key=lambda members: members[0])


class GpuSpan:
    """How long the GPU took from `start()` to `seconds()`, by CUDA events on the current
    stream: what `bucket_cap_mb: auto` compares on CUDA, where the host's clock measures
    only how long it took to enqueue the work. `seconds()` waits for the end event: a host
    sync, paid during the few tuning steps only."""

    def __init__(self, event: Any = None) -> None:
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._start: Any = None

    def start(self) -> None:
        self._start = self._event()
        self._start.record()

    def seconds(self) -> float:
        end = self._event()
        end.record()
        end.synchronize()
        return self._start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds


class BucketedDDP(ScratchBase):
    """Flat gradient buckets, all-reduced asynchronously as soon as they are full."""

    strategy = registry.name_of(__name__)  # "bucketed": the name is the registry's
    _transient = ("_handles", "_buckets", "_views", "_works", "_flats", "_clock", "_shm", "_gpu_tuning")
    _plain_state = ScratchBase._plain_state | {"_pending", "_ready", "_scaled", "_next", "_works", "_clock",
                                               "_backward_start", "_wire_dtype"}

    def __init__(self, module: nn.Module, process_group=None, *, bucket_cap_mb: Union[float, str] = 25.0,
                 first_bucket_mb: float = 1.0, compress: Optional[str] = None, verify_init: bool = False,
                 collective_timeout_s: Optional[float] = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, shm: bool = True) -> None:
        self.compress = compress
        self.shm = shm
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self._tuner: Optional[tuning.AutoTuner] = None
        self._wire_dtype = torch.bfloat16 if compress == "bf16" else None
        super().__init__(module, process_group, verify_init=verify_init,
                         collective_timeout_s=collective_timeout_s, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters)

    def _order(self, named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        return list(reversed(named))  # roughly the order backward produces gradients

    @property
    def tuning(self) -> Optional[dict[str, Any]]:
        """With bucket_cap_mb or compress "auto": once decided, {"bucket_cap_mb", "compress",
        "buckets", "steps", "ms" (candidate -> synced-backward ms), "text"}; else None."""
        tuner = self._tuner
        if tuner is None or tuner.summary is None:
            return None
        choice = tuner.summary["choice"]
        return {"bucket_cap_mb": choice.cap_mb, "compress": choice.compress, "buckets": choice.buckets,
                "steps": tuner.summary["steps"], "ms": dict(tuner.summary["ms"]), "text": tuner.describe()}

    def _build(self) -> None:
        self._names = [n for n, _ in self._tracked]
        self._params = [p for _, p in self._tracked]
        self._views: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._shm: Optional[ShmExchange] = None
        self._shm_due = False
        self._bucket_of: list[int] = [0] * len(self._params)
        self._timed = False
        if self.world_size > 1:
            cap_mb = self.bucket_cap_mb
            if "auto" in (self.bucket_cap_mb, self.compress):
                cap_mb = self._start_tuning()
            self._build_buckets(int(cap_mb * 2**20))
            self._shm_due = self.shm  # opened at the first launch (it communicates; _build may not)
            self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                             for i, p in enumerate(self._params)]
            self._timed = bool(self._params) and comm_timing(self._params[0].device)
        # bucket_cap_mb / compress "auto" on CUDA: host clocks see only the enqueue
        self._gpu_tuning = (GpuSpan() if self._tuner is not None and self._params
                            and self._params[0].device.type == "cuda" else None)
        self._stats["buckets"] = len(self._buckets)
        self._inv_world_size = 1.0 / self.world_size
        self._small = bytearray(p.numel() <= _SMALL_NUMEL for p in self._params)
        self._reset_backward()

    def _start_tuning(self) -> float:
        """The candidates for this trainable set (kept if already decided); the first one's cap."""
        if self._tuner is None or self._tuner.choice is None:
            grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
            caps = (tuning.candidate_caps(grad_bytes) if self.bucket_cap_mb == "auto"
                    else (float(self.bucket_cap_mb),))
            wires: tuple[Optional[str], ...] = (self.compress,)
            if self.compress == "auto":
                sixteen = any(p.dtype in (torch.float16, torch.bfloat16) for p in self._params)
                wires = (None,) if sixteen else (None, "bf16")
            self._tuner = tuning.AutoTuner(tuning.candidates(
                lambda cap: assign_buckets(self._params, int(cap * 2**20), self._first_cap_bytes), wires, caps))
        self._wire_dtype = torch.bfloat16 if self._tuner.current.compress == "bf16" else None
        return self._tuner.current.cap_mb

    @property
    def _first_cap_bytes(self) -> int:
        return int(self.first_bucket_mb * 2**20)

    def _build_buckets(self, cap_bytes: int) -> None:
        """One flat buffer per (dtype, device) in send order, `param.grad` views into it."""
        self._views = [torch.empty(0)] * len(self._params)
        self._offsets = [0] * len(self._params)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(self._params):
            groups.setdefault((p.dtype, p.device), []).append(i)
        self._flats: dict[tuple, torch.Tensor] = {}
        for (dtype, device), members in groups.items():
            flat = torch.zeros(sum(self._params[i].numel() for i in members), dtype=dtype, device=device)
            offset = 0
            for i in members:
                p = self._params[i]
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:  # gradients accumulated so far move into the flat buffer
                    view.copy_(p.grad)
                    p.grad = view
                self._views[i], self._offsets[i] = view, offset
                offset += p.numel()
            self._flats[(dtype, device)] = flat
        self._set_layout(cap_bytes)

    def _set_layout(self, cap_bytes: int) -> None:
        """Cut the flat buffers into buckets (between backwards only: no copy, no allocation)."""
        self._buckets = []
        keys = list(self._flats)
        for b, members in enumerate(assign_buckets(self._params, cap_bytes, self._first_cap_bytes)):
            first, last = self._params[members[0]], self._params[members[-1]]
            lo, hi = self._offsets[members[0]], self._offsets[members[-1]] + last.numel()
            for i in members:
                self._bucket_of[i] = b
            key = (first.dtype, first.device)
            self._buckets.append(_Bucket(b, members, [self._names[i] for i in members],
                                         self._flats[key][lo:hi], keys.index(key), lo, hi))
        self._stats["buckets"] = len(self._buckets)

    def _reset_backward(self) -> None:
        self._pending = [len(b.members) for b in self._buckets]
        self._ready = bytearray(len(self._params))
        self._scaled = bytearray(len(self._params))  # view already holds grad / world_size
        self._next = 0
        self._works: list[tuple[_Bucket, Any, torch.Tensor]] = []
        self._clock = CommClock()
        self._backward_start = 0.0

    def _abandon_backward(self) -> None:
        super()._abandon_backward()
        self._reset_backward()

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        view = self._views[i]
        self._used[i] = 1
        fresh = p.grad is not view  # first gradient after zero_grad(set_to_none=True)
        if not self._sync_armed:
            if fresh:  # accumulating locally (no_sync): adopt it unscaled
                view.copy_(p.grad)
                p.grad = view
            return
        if fresh:
            if self._small[i]:  # scaled with its bucket at launch (see _SMALL_NUMEL)
                view.copy_(p.grad)
            else:
                # Adopt and pre-divide in one pass over memory, as torch DDP's reducer does
                # (mul_out into the bucket view); a separate pass at launch would read and
                # write every gradient byte a second time.
                torch.mul(p.grad, self._inv_world_size, out=view)
                self._scaled[i] = 1
            p.grad = view
        if not self._queued:
            self._queued = True
            self._backward_start = time.perf_counter()
            if self._gpu_tuning is not None and self._tuner is not None and self._tuner.choice is None:
                self._gpu_tuning.start()
            _queue_callback(self._finish)
        if self._ready[i]:
            return
        if self._clock.open:
            self._clock.poll()
        self._ready[i] = 1
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0 and b == self._next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch in bucket order only: every rank must issue the same collectives in the same order.
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        # pre-divide (sum of means = mean) what the hook did not: one call for the bucket
        unscaled = [self._views[i] for i in bucket.members if not self._scaled[i]]
        if unscaled:
            torch_compat.foreach_mul_(unscaled, self._inv_world_size)
        if self._shm_due:
            self._open_shm()
        if self._shm is not None and self._wire_dtype is None:
            send = bucket.buffer
            work = self._shm.launch(bucket.flat, send, bucket.lo, bucket.hi)
        else:
            send = bucket.buffer if self._wire_dtype is None else bucket.buffer.to(self._wire_dtype)
            # The process group's own method: `dist.all_reduce`'s Python checks cost more than
            # the launch itself, once per bucket per step.
            work = (self._pg if self._pg is not None else dist.group.WORLD).allreduce([send])
        if self._timed:
            self._clock.launched(work)
        self._count(send)
        self._works.append((bucket, work, send))

    def _finish(self) -> None:
        backward_end = time.perf_counter()
        clock = self._clock
        try:
            clock.poll()  # what finished during backward was hidden
            missing, pending = self._flush_remaining()
            n = len(self._buckets)
            for bucket, work, send in self._works:
                self._wait(work, lambda bucket=bucket, send=send: (
                    f"all-reduce of bucket {bucket.index + 1}/{n} "
                    f"({describe_tensors(bucket.names, send.numel() * send.element_size())})"))
                if clock.open:
                    clock.poll()
                if send is not bucket.buffer:
                    bucket.buffer.copy_(send)
            if self._shm is not None:
                self._shm.synced()
            synced = time.perf_counter()
            if self._timed:
                self._add_comm_time(backward_end, clock.spans())
            unused = self._settle_unused(*pending)
            for i in missing:  # no gradient here: takes the average, unless no rank used it
                if i not in unused:
                    self._params[i].grad = self._views[i]
            self._stats["syncs"] += 1
            if self._tuner is not None and self._tuner.choice is None:
                if self._gpu_tuning is not None:  # the GPU's time, not the host's enqueue
                    self._next_candidate(self._gpu_tuning.seconds())
                else:
                    self._next_candidate(synced - (self._backward_start or backward_end))
        finally:
            self._reset_backward()
            self._end_sync()

    def _open_shm(self) -> None:
        """The first launch after a (re)build: every rank decides together whether this set of
        flat buffers goes through shared memory (`shm.open_exchange`); None means gloo."""
        self._shm_due = False
        self._shm = open_exchange(list(self._flats.values()), self._pg, self.world_rank, self.world_size,
                                  wait=self._wait)

    @property
    def transport(self) -> str:
        """What carries the gradient all-reduces: "shm" (shared memory, ranks on one host,
        CPU), "process_group" (gloo/NCCL), or "undecided" before the first synced backward."""
        if self._shm_due:
            return "undecided"
        return "shm" if self._shm is not None else "process_group"

    def _flush_remaining(self) -> tuple[list[int], tuple]:
        """End of backward: launch every bucket the hooks did not complete (parameters without a
        gradient take part as `_fill_missing` says), then the unused-parameter check. Returns
        the indices whose `.grad` is None and what `_settle_unused` takes."""
        missing = self._fill_missing()
        if self._next < len(self._buckets):
            for b in range(self._next, len(self._buckets)):
                self._pending[b] = 0
            self._launch_ready()
        return missing, self._start_unused_check()

    def _next_candidate(self, seconds: float) -> None:
        """Tuning: record this synced backward, then cut the buckets for the next candidate."""
        device = self._params[0].device if self._params else None
        candidate = self._tuner.record(seconds, self.world_size, group=self._pg, device=device)
        self._wire_dtype = torch.bfloat16 if candidate.compress == "bf16" else None
        self._set_layout(int(candidate.cap_mb * 2**20))

    def _fill_missing(self) -> list[int]:
        """Parameters the hooks did not mark ready take part as they are: their gradient from
        earlier in the window, or zeros. Returns those whose `.grad` is None."""
        missing = []
        for b in range(self._next, len(self._buckets)):
            for i in self._buckets[b].members:
                if self._ready[i]:
                    continue
                p, view = self._params[i], self._views[i]
                if p.grad is None:
                    view.zero_()
                    missing.append(i)
                elif p.grad is not view:
                    view.copy_(p.grad)
                    p.grad = view
        return missing
