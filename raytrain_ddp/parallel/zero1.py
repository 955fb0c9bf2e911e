"""Strategy `zero1`: ZeRO stage 1 written from scratch -- the optimizer state is sharded over ranks.

Owns: how the flat parameter space is split into per-rank shards, the reduce-scatter of
gradient buckets during backward, the optimizer that steps this rank's shard only and
all-gathers the updated parameters (`ZeroOptimizer`), the global gradient norm, and the
consolidated optimizer state (saved in torch's own format, so any worker count and any
strategy resumes it). The gradient hooks, bucket order, pre-division and the unused /
frozen parameter rules are inherited from `bucketed.BucketedDDP` and `base.ScratchBase`.
Must not touch: Ray, the training loop, files. torch and torch.distributed only.

Layout. Trainable parameters are packed into buckets exactly as `bucketed` packs them
(reverse registration order, at most `bucket_cap_mb`). A bucket of n elements is padded
to N = W * ceil(n / W) and owns two flat buffers: the gradients (`param.grad` is a view
into it, as in bucketed) and the parameters themselves (`param.data` is a view into it,
so the all-gather lands in the module without a copy). Rank r owns chunk r, elements
[r*N/W, (r+1)*N/W), of every bucket: a contiguous 1/W of each bucket, hence 1/W of the
flat parameter space. (One contiguous range of the whole space would turn a bucket's
collective into reduces to the one or two ranks owning it, as DeepSpeed does; a chunk of
every bucket keeps each collective a balanced reduce-scatter, launched as the bucket
fills, overlapping the rest of backward.)

One optimizer step:
  backward  a full bucket starts an async reduce-scatter (SUM of gradients pre-divided by
            W, bf16 on the wire with compress="bf16"): rank r receives the averaged
            gradient of its chunk, in place, into that chunk of the gradient buffer (as
            with the all-gather, NCCL and gloo allow it). Nothing else is sent.
  clip      `clip_grad_norm_`: the norm of every rank's chunk, one all-reduce of a scalar:
            the global norm, the same on every rank (so is the non-finite verdict).
  step      the inner optimizer (built by the caller's factory: same class, groups and
            hyper-parameters) steps the slices of the parameters that fall in this rank's
            chunks; its state (AdamW's two moments, SGD's momentum) exists for 1/W of the
            parameters. Then every bucket's chunk is all-gathered into the parameter
            buffer (in place: the chunk is its own slot of the output, which NCCL and gloo
            both allow), so every replica holds the same updated weights.
Bytes per optimizer step: reduce-scatter = the (padded) gradient bytes, half with bf16;
all-gather = the (padded) parameter bytes. In a ring the two together move what one
all-reduce of the gradients moves: ZeRO-1 saves memory, not bandwidth.

After a synced backward `param.grad` holds the average only inside this rank's chunks;
elsewhere it holds this rank's own (pre-divided) contribution: only each chunk's owner
receives the reduced gradient. Build the optimizer with `wrapper.make_optimizer(factory)`
and clip with `wrapper.clip_grad_norm_(max_norm)`; the optimizer's `state_dict()` is a
collective (consolidated on rank 0). Clear the gradients after every optimizer step
(`optimizer.zero_grad()`, as the product's step does): gradients carried into the next
step's window would mix averaged and local values, so the next forward with grad
enabled raises instead. Changing `requires_grad` after the optimizer exists raises
`RequiresGradChangeError` (the shards would move under the optimizer's state).

World size 1: nothing is sharded or sent, and `make_optimizer` returns the factory's
optimizer as it is. The unused-parameter rule (`base.SoloUnusedCheck`), the check that
the optimizer holds the module's parameters, and the refusal of a `requires_grad` change
once the optimizer exists are made as at world size 2, so local mode fails where the
workers would; the rules of `ZeroOptimizer` itself (gradients cleared after `step()`,
no closure, no `add_param_group`, no step after an unsynced backward) are not, as there
is no `ZeroOptimizer` to enforce them.
"""

# Over 500 lines: the wrapper and its optimizer share one shard layout (_Shard, _Slice, padding).
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel import registry, torch_compat
from raytrain_ddp.parallel.collectives import collective
from raytrain_ddp.parallel.base import SHARD_STAT_KEYS, RequiresGradChangeError, describe_tensors
from raytrain_ddp.parallel.bucketed import BucketedDDP, _Bucket, assign_buckets

# torch 2.13 renamed the flat-tensor collectives; the old names serve torch < 2.13.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


@dataclass
class _Shard:
    """Rank r's chunk of one bucket: where it sits, and its slice of the parameter buffer."""

    params: torch.Tensor  # the bucket's flat parameter buffer, N elements (params are views)
    lo: int  # this rank's chunk: [lo, lo + size) of the bucket
    size: int
    grad: torch.Tensor  # the chunk of the gradient buffer: the reduce-scatter lands here (in place)

    @property
    def chunk(self) -> torch.Tensor:
        return self.params[self.lo:self.lo + self.size]


@dataclass
class _Slice:
    """The part of one parameter inside this rank's chunk: what the inner optimizer steps."""

    tensor: torch.Tensor  # a view into the bucket's parameter buffer (a leaf, no autograd)
    grad: torch.Tensor  # the matching view into the shard's reduced gradient
    param: nn.Parameter  # the module's parameter it belongs to
    start: int  # offset of the slice inside the flattened parameter
    bucket: int
    at: int  # offset of the slice inside this rank's chunk of the bucket
    index: int = -1  # the parameter's index in the factory optimizer's numbering


class Zero1DDP(BucketedDDP):
    """Bucketed gradients reduce-scattered; each rank steps 1/W of the parameters; all-gather."""

    strategy = registry.name_of(__name__)  # "zero1": the name is the registry's
    _transient = BucketedDDP._transient + ("_shards", "_slices", "_optimizer_ref")

    def __init__(self, module: nn.Module, process_group=None, *, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, compress: Optional[str] = None, verify_init: bool = False,
                 collective_timeout_s: Optional[float] = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False) -> None:
        if "auto" in (bucket_cap_mb, compress):
            raise ValueError("zero1: bucket_cap_mb / compress 'auto' (timed tuning) is for 'bucketed' only")
        self._optimizer_ref: Optional[weakref.ref] = None
        self._synced = False  # a reduce-scatter ran since the last optimizer step
        self._stale = False  # the optimizer stepped and the gradients were not cleared yet
        super().__init__(module, process_group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
                         compress=compress, verify_init=verify_init, collective_timeout_s=collective_timeout_s,
                         broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                         shm=False)  # reduce-scatter through the process group (shm all-reduces only)
        for key in SHARD_STAT_KEYS:
            self._stats.setdefault(key, 0)

    # -- layout ---------------------------------------------------------------------------
    def _build_buckets(self, cap_bytes: int) -> None:
        world, rank = self.world_size, self.world_rank
        self._views = [torch.empty(0)] * len(self._params)
        self._shards: list[_Shard] = []
        self._slices: list[_Slice] = []
        for b, members in enumerate(assign_buckets(self._params, cap_bytes, self._first_cap_bytes)):
            first = self._params[members[0]]
            numel = sum(self._params[i].numel() for i in members)
            chunk = -(-numel // world)  # ceil: the bucket is padded to world * chunk
            grads = torch.zeros(world * chunk, dtype=first.dtype, device=first.device)
            flat = torch.zeros(world * chunk, dtype=first.dtype, device=first.device)
            shard = _Shard(flat, rank * chunk, chunk, grads[rank * chunk:(rank + 1) * chunk])
            offset = 0
            with torch.no_grad():
                for i in members:
                    p = self._params[i]
                    view = grads[offset:offset + p.numel()].view_as(p)
                    if p.grad is not None:  # gradients accumulated so far move into the bucket
                        view.copy_(p.grad)
                        p.grad = view
                    self._views[i] = view
                    self._bucket_of[i] = b
                    flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[offset:offset + p.numel()].view_as(p)  # the all-gather lands here
                    lo, hi = max(offset, shard.lo), min(offset + p.numel(), shard.lo + chunk)
                    if lo < hi:
                        self._slices.append(_Slice(flat[lo:hi], shard.grad[lo - shard.lo:hi - shard.lo],
                                                   p, lo - offset, b, lo - shard.lo))
                    offset += p.numel()
            self._shards.append(shard)
            self._buckets.append(_Bucket(b, members, [self._names[i] for i in members], grads))

    def _follow_requires_grad(self) -> None:
        ref = getattr(self, "_optimizer_ref", None)  # transient: gone after unpickling
        if ref is not None and ref() is not None:
            names = [n for (n, p), was in zip(self.wrapped.named_parameters(), self._trainable)
                     if p.requires_grad != was]
            raise RequiresGradChangeError(
                f"requires_grad of parameter(s) {names} changed after the zero1 optimizer was built: "
                "its shards (and their optimizer state) would move. Freeze parameters before "
                "wrap_model / make_optimizer, or build a new optimizer after re-wrapping"
            )
        super()._follow_requires_grad()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._stale and torch.is_grad_enabled():
            if any(p.grad is not None for p in self._params):
                raise RuntimeError(
                    "zero1: the gradients of the last optimizer step were not cleared; call "
                    "optimizer.zero_grad() after optimizer.step() (gradients carried into the next "
                    "window would mix averaged and local values)"
                )
            self._stale = False
        return super().forward(*args, **kwargs)

    # -- backward: reduce-scatter instead of all-reduce ------------------------------------
    def _launch(self, bucket: _Bucket) -> None:
        for i in bucket.members:  # pre-divide (sum of means = mean) what the hook did not
            if not self._scaled[i]:
                self._views[i].div_(self.world_size)
        shard = self._shards[bucket.index]
        if bucket.index == 0 and not self._slices:  # the padding that carried the last flag: clean
            self.pad_slice()[1].zero_()
        send = bucket.buffer if self._wire_dtype is None else bucket.buffer.to(self._wire_dtype)
        out = shard.grad if self._wire_dtype is None else torch.empty(shard.size, dtype=self._wire_dtype,
                                                                      device=send.device)
        # Not timed (comm_s): gloo's reduce-scatter work has no future to stamp completion.
        work = reduce_scatter_flat(out, send, group=self._pg, async_op=True)
        self._count(send)  # allreduce_*: the gradient-sync collectives, comparable across strategies
        self._stats["reduce_scatter_calls"] += 1
        self._stats["reduce_scatter_bytes"] += send.numel() * send.element_size()
        self._works.append((bucket, work, out))

    def _finish(self) -> None:
        try:
            missing, pending = self._flush_remaining()
            n = len(self._buckets)
            for bucket, work, out in self._works:
                nbytes = bucket.buffer.numel() * (out.element_size())
                self._wait(work, f"reduce-scatter of bucket {bucket.index + 1}/{n} "
                                 f"({describe_tensors(bucket.names, nbytes)})")
                shard = self._shards[bucket.index]
                if out is not shard.grad:
                    shard.grad.copy_(out)
            unused = self._settle_unused(*pending)
            for i in missing:  # no gradient here: takes the average, unless no rank used it
                if i not in unused:
                    self._params[i].grad = self._views[i]
            self._agree_nonfinite()
            self._stats["syncs"] += 1
            self._synced = True
        finally:
            self._reset_backward()
            self._end_sync()

    def _agree_nonfinite(self) -> None:
        """Make a non-finite gradient on any rank's shard visible on every rank's shard.

        After the reduce-scatter each rank holds only its chunk of the averaged gradient,
        so an inf/NaN (an fp16 overflow) lands in one rank's chunk: a GradScaler's
        `unscale_` there finds it and `scaler.step` skips `optimizer.step()` -- and with it
        the parameter all-gather its peers are waiting in (a deadlock, and scales that
        drift apart in `update()`). torch's `ShardedGradScaler` all-reduces `found_inf` for
        this; we agree one level lower, so any scaler (torch's plain `GradScaler`, a
        user's own, none) sees the same verdict on every rank: the inf-norm of this rank's
        chunks is all-reduced (MAX, one scalar), and where it is non-finite every rank
        writes a NaN into one element of its first slice. All ranks then skip (or step)
        together, and `update()` backs the scale off identically. A tensor all the way:
        no host sync, and on CUDA the all-reduce is stream-ordered. Every rank takes part, also
        one whose chunks hold only padding: its flag lands there (`pad_slice`).
        """
        if not self._shards:  # no trainable parameter at all: the same on every rank
            return
        grads = [s.grad for s in self._shards]
        worst = torch.stack(torch_compat.foreach_norm(grads, math.inf)).amax().float()
        work = dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self._pg, async_op=True)
        self._stats["control_bytes"] += worst.element_size()
        self._wait(work, "all-reduce of the non-finite-gradient flag")
        first = self._slices[0].grad[:1] if self._slices else self.pad_slice()[1]
        # +0 where every chunk is finite (the value unchanged), NaN where some rank saw inf/NaN
        first.add_(torch.where(torch.isfinite(worst), 0.0, math.nan).to(first.dtype))

    def pad_slice(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(parameter, gradient) views of one padding element of this rank's first chunk: for a
        rank whose chunks hold no parameter, its optimizer steps this element (read by no
        parameter), so a GradScaler there checks the agreed flag and skips with its peers
        (`GradScaler.update` also refuses an optimizer with nothing checked)."""
        shard = self._shards[0]
        return shard.chunk[:1], shard.grad[:1]

    # -- the optimizer side ---------------------------------------------------------------
    def make_optimizer(self, factory: OptimizerFactory):
        """`factory(trainable parameters)` -> a torch optimizer; returned as a `ZeroOptimizer`
        that steps this rank's shard only (world size 1: the factory's optimizer as is, after
        the same checks: its tensors are the module's, and from now on a `requires_grad`
        change raises `RequiresGradChangeError` as it does at world size 2)."""
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        template = factory(params)
        if self.world_size == 1:
            _check_own(self, template)
            self._optimizer_ref = weakref.ref(template)
            return template
        optimizer = ZeroOptimizer(self, template)
        self._optimizer_ref = weakref.ref(optimizer)
        return optimizer

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shard (one scalar all-reduce); gradients are
        scaled as `torch.nn.utils.clip_grad_norm_` would scale the full, averaged ones."""
        if self.world_size == 1 or not self._shards:
            return torch.nn.utils.clip_grad_norm_([p for _, p in self._tracked], max_norm, norm_type)
        grads = [s.grad for s in self._shards]
        device = grads[0].device
        inf = math.isinf(norm_type)
        if inf:
            local = torch.stack([g.abs().max() for g in grads]).max()
        else:
            local = torch.stack([torch.linalg.vector_norm(g, norm_type) ** norm_type for g in grads]).sum()
        with collective("all-reduce of the gradient norm"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self._pg)
        total = local if inf else local ** (1.0 / norm_type)
        self._stats["control_bytes"] += local.element_size()
        if not math.isinf(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(device=device, dtype=g.dtype))
        return total

    def _all_gather_params(self) -> None:
        works = []
        for shard in self._shards:
            works.append(all_gather_flat(shard.params, shard.chunk, group=self._pg, async_op=True))
            self._stats["all_gather_calls"] += 1
            self._stats["all_gather_bytes"] += shard.params.numel() * shard.params.element_size()
        for b, work in enumerate(works):
            bucket = self._buckets[b]
            self._wait(work, f"all-gather of parameter bucket {b + 1}/{len(works)} "
                             f"({describe_tensors(bucket.names, self._shards[b].params.numel() * self._shards[b].params.element_size())})")


def _copy(value: Any) -> Any:
    """A tensor of its own (torch's `load_state_dict` adopts the tensors it is given, and a
    step counter shared with the caller's dict would count twice)."""
    return value.detach().clone() if torch.is_tensor(value) else value


def _elementwise(value: Any, numel: int) -> bool:
    """A per-element optimizer state (exp_avg, momentum_buffer), as opposed to `step`."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _check_own(wrapper: Zero1DDP, optimizer: torch.optim.Optimizer) -> None:
    """The factory's optimizer holds parameters of the wrapped module only (at every world
    size: the shards are cut from the module's parameters)."""
    own = {id(p) for p in wrapper.module.parameters()}
    foreign = {id(p) for g in optimizer.param_groups for p in g["params"]} - own
    if foreign:
        raise ValueError(
            f"the optimizer factory returned an optimizer over {len(foreign)} tensor(s) that are not "
            "parameters of the wrapped module; build it from the parameters it is given"
        )


class ZeroOptimizer:
    """The optimizer of a `zero1` wrapper: steps this rank's shard, then all-gathers.

    Quacks like the torch optimizer the factory built (`param_groups`, `state`, `step`,
    `zero_grad`, `state_dict`, `load_state_dict`), so LR schedules that set
    `group["lr"]` work unchanged; its `param_groups` hold this rank's slices.
    `state_dict()` is a collective: world rank 0 gets the whole optimizer's state in torch's
    format, numbered as the factory's optimizer numbers its parameters (so it loads into
    any strategy at any worker count), the other ranks `{}`; the full state is built on the
    CPU, one bucket at a time. `load_state_dict` takes that consolidated state (every rank
    passes it) and keeps this rank's part; no communication.
    """

    def __init__(self, wrapper: Zero1DDP, template: torch.optim.Optimizer) -> None:
        self._wrapper = wrapper
        numbering = {id(p): i for i, p in enumerate(itertools.chain.from_iterable(
            g["params"] for g in template.param_groups))}
        self._group_indices = [[numbering[id(p)] for p in g["params"]] for g in template.param_groups]
        self._numel = {numbering[id(p)]: p.numel() for g in template.param_groups for p in g["params"]}
        group_of = {numbering[id(p)]: gi for gi, g in enumerate(template.param_groups) for p in g["params"]}
        _check_own(wrapper, template)  # frozen ones have no slices: never stepped
        self._slices = [s for s in wrapper._slices if id(s.param) in numbering]
        for s in self._slices:
            s.index = numbering[id(s.param)]
        # Every parameter's index, not only those with a slice here: rank 0 consolidates the
        # state of parameters that lie wholly in other ranks' chunks too.
        self._index_of = numbering
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in template.param_groups]
        # Reuse the factory's object (its class, defaults and hooks); only its groups change.
        template.param_groups.clear()
        template.state.clear()
        self._group_slices = [[s for s in self._slices if group_of[s.index] == gi] for gi in range(len(hyper))]
        for h, slices in zip(hyper, self._group_slices):
            template.add_param_group({**h, "params": [s.tensor for s in slices]})
        self._padded = not self._slices and bool(wrapper._shards) and bool(template.param_groups)
        if self._padded:  # only padding here: see `Zero1DDP.pad_slice`
            pad, pad_grad = wrapper.pad_slice()
            pad.grad = pad_grad
            template.param_groups[0]["params"].append(pad)
        self._inner = template
        for s in self._slices:
            s.tensor.grad = s.grad

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Where the inner optimizer takes a GradScaler's `grad_scale` / `found_inf` (fused):
        no `.item()` of found_inf; the skip is on the device, and the all-gather runs on
        every rank either way (a skipped step gathers unchanged chunks)."""
        return bool(getattr(self._inner, "_step_supports_amp_scaling", False))

    # -- what a torch optimizer exposes ----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's slices."""
        return self._inner

    def __repr__(self) -> str:
        return f"ZeroOptimizer(rank {self._wrapper.world_rank} of {self._wrapper.world_size}, {self._inner!r})"

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError("zero1: build the optimizer with every group from the start (make_optimizer)")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if closure is not None:
            raise ValueError("zero1: optimizer.step(closure) is not supported")
        with_grad = [s.param.grad is not None for s in self._slices]
        if any(with_grad) and not self._wrapper._synced:
            raise RuntimeError(
                "zero1: optimizer.step() after a backward that did not synchronise (inside "
                "no_sync, or none at all): run the window's last backward outside no_sync first"
            )
        for s, has in zip(self._slices, with_grad):  # a parameter no rank used is not stepped
            s.tensor.grad = s.grad if has else None
        handed = [k for k in ("grad_scale", "found_inf") if k in self.__dict__]  # set by a GradScaler
        for key in handed:
            setattr(self._inner, key, self.__dict__[key])
        try:
            self._inner.step()
        finally:
            for key in handed:
                delattr(self._inner, key)
        self._wrapper._synced = False
        self._wrapper._stale = True
        self._wrapper._all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wrapper._stale = False
        for p in self._wrapper._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- checkpoints: consolidated ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        wrapper = self._wrapper
        pg, world = wrapper.process_group, wrapper.world_size
        mine: dict[int, dict[str, Any]] = {}  # index -> scalar entries, and the names of per-element ones
        for s in self._slices:
            entry = self._inner.state.get(s.tensor)
            if entry:
                mine.setdefault(s.index, {}).update(
                    {k: ("<elementwise>" if _elementwise(v, s.tensor.numel()) else _copy(v)) for k, v in entry.items()})
        everyone: list[Any] = [None] * world
        with collective("all-gather of the optimizer state's layout"):
            dist.all_gather_object(everyone, mine, group=pg)  # small: scalars and key names only
        merged: dict[int, dict[str, Any]] = {}
        for part in everyone:
            for index, entry in part.items():
                merged.setdefault(index, {}).update(entry)
        keys = sorted({k for e in merged.values() for k, v in e.items() if isinstance(v, str) and v == "<elementwise>"})
        by_bucket: dict[int, list[_Slice]] = {}
        for s in self._slices:
            by_bucket.setdefault(s.bucket, []).append(s)
        main = wrapper.world_rank == 0
        for b, shard in enumerate(wrapper._shards):
            for key in keys:
                chunk = torch.zeros_like(shard.grad)
                for s in by_bucket.get(b, []):
                    value = self._inner.state.get(s.tensor, {}).get(key)
                    if value is not None:
                        chunk[s.at:s.at + s.tensor.numel()].copy_(value)
                parts = [torch.empty_like(chunk) for _ in range(world)] if main else None
                dist.gather(chunk, parts, dst=dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
                if main:
                    full = torch.cat(parts).cpu()
                    self._cut(full, b, key, merged)
        if not main:
            return {}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(idx)}
                  for g, idx in zip(self._inner.param_groups, self._group_indices)]
        return {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": groups}

    def _cut(self, full: torch.Tensor, b: int, key: str, merged: dict[int, dict[str, Any]]) -> None:
        """Rank 0: the bucket-wide tensor of `key` -> one tensor per parameter that has it."""
        wrapper = self._wrapper
        offset = 0
        for i in wrapper._buckets[b].members:
            p = wrapper._params[i]
            entry = merged.get(self._index_of.get(id(p), -1))
            if entry is not None and isinstance(entry.get(key), str):
                entry[key] = full[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(self._group_indices) or any(
                len(g["params"]) != len(idx) for g, idx in zip(saved_groups, self._group_indices)):
            raise ValueError(
                f"optimizer state has parameter groups of sizes {[len(g['params']) for g in saved_groups]}, "
                f"this optimizer {[len(idx) for idx in self._group_indices]}: it was saved for another model "
                "or optimizer configuration"
            )
        saved_id = {mine: saved for g, idx in zip(saved_groups, self._group_indices)
                    for saved, mine in zip(g["params"], idx)}
        inner_state: dict[int, dict[str, Any]] = {}
        inner_groups = []
        position = 0
        for g, slices in zip(saved_groups, self._group_slices):
            ids = []
            for s in slices:
                entry = state["state"].get(saved_id[s.index])
                if entry:
                    n = self._numel[s.index]
                    inner_state[position] = {
                        k: (v.reshape(-1)[s.start:s.start + s.tensor.numel()].clone() if _elementwise(v, n) else _copy(v))
                        for k, v in entry.items()}
                ids.append(position)
                position += 1
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        if self._padded:  # the padding element's state starts afresh
            inner_groups[0]["params"].append(position)
        self._inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})

