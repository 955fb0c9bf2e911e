"""What every data-parallel strategy shares: the wrapper interface and the scratch base.

Owns: `WrappedModel` (the one interface every strategy implements, shaped like Lightning
Fabric's strategy: call it like the module, `.module` for the bare model, `.no_sync()` to
skip gradient sync, `.comm_stats` for what was sent) and `ScratchBase` (what the
from-scratch strategies share: hooks, unused-parameter checks, requires_grad changes,
pickling). Its neighbours: `errors.py` (the errors), `startup.py` (the rank-0 broadcast /
`verify_init` check done at wrap time), `watch.py` (waiting on and timing collectives);
their names are re-exported here. Must not touch: Ray, optimizers, data, checkpoint
files, anything of ours outside `parallel/`. Only torch and torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel.errors import (  # noqa: F401 - re-exported: `from ...base import` keeps working
    CollectiveTimeoutError,
    ModelMismatchError,
    RequiresGradChangeError,
    UnusedParameterError,
)
from raytrain_ddp.parallel import torch_compat
from raytrain_ddp.parallel import registry
from raytrain_ddp.parallel.collectives import collective
from raytrain_ddp.parallel.startup import broadcast_coalesced, check_structure, sync_initial_state  # noqa: F401
from raytrain_ddp.parallel.watch import (  # noqa: F401
    CollectiveWatch,
    CommClock,
    comm_timing,
    split_comm_time,
    wait_work,
)


_STAT_KEYS = ("allreduce_calls", "allreduce_bytes", "syncs", "broadcasts", "broadcast_bytes", "control_bytes")
TIMING_KEYS = ("comm_s", "exposed_comm_s")  # present only where the wrapper times its all-reduces
SHARD_STAT_KEYS = ("reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls", "all_gather_bytes")  # sharded only


class WrappedModel(nn.Module):
    """Interface shared by every strategy; the reference semantics are torch DDP's.

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

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """`torch.compile` (its keywords) applied where this strategy needs it, in place: here the
        bare module (names and hooks unchanged). The gradient hooks of the from-scratch
        strategies run in autograd's AccumulateGrad, outside the compiled backward: their
        syncs start once that backward has produced every gradient (no overlap with it), and
        are exactly as without compile (`raytrain-ddp verify -o train.compile=true`)."""
        self.module.compile(*args, **kwargs)

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
        for key in (*_STAT_KEYS, *TIMING_KEYS, *SHARD_STAT_KEYS):
            if key in self._stats:
                self._stats[key] = type(self._stats[key])()  # 0 or 0.0

    def _add_comm_time(self, backward_end: float, spans: list[tuple[float, float]]) -> None:
        """Account one synced backward's all-reduces: `spans` = (launched, completed) times."""
        comm, exposed = split_comm_time(backward_end, spans)
        self._stats["comm_s"] = self._stats.get("comm_s", 0.0) + comm
        self._stats["exposed_comm_s"] = self._stats.get("exposed_comm_s", 0.0) + exposed


_queue_callback = torch_compat.autograd_queue_callback()


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
    - World size 1 (local mode, no process group): nothing is sent, but the checks that need
      no peer are made as at world size 2, with the same message, so a bug found in one
      process is the bug the workers report: a trainable parameter no gradient reached in a
      synced backward (`SoloUnusedCheck`, at the end of that backward, every step) and a
      `requires_grad` change (followed, or refused where the strategy refuses it, e.g. zero1
      after its optimizer exists). The checks across ranks (the same structure, the same
      initial weights with verify_init, the same requires_grad change on every rank) cannot
      fail with one rank and are not made.
    - Pickling (as torch DDP: only on the default process group): hooks and buckets are
      dropped and rebuilt on load, without communication.
    """

    _transient: tuple[str, ...] = ("_handles", "_alone")  # rebuilt by `_attach`, never pickled
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
        # world size 1: no hooks of `_build`; the unused-parameter rule still holds
        self._alone = (SoloUnusedCheck(self.strategy, self._tracked)
                       if self.world_size == 1 and not self.find_unused_parameters and self._tracked else None)

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
        alone = self.__dict__.get("_alone")
        if alone is not None:
            alone.close()
            self._alone = None

    # -- forward: torch DDP's pre/post-forward rules -----------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._queued:
            self._abandon_backward()
        if torch.is_grad_enabled() and [p.requires_grad for p in self._all_params] != self._trainable:
            self._follow_requires_grad()
        if self.world_size > 1 and self.broadcast_buffers and self._buffers_due:
            self._broadcast_buffers()
        out = self.wrapped(*args, **kwargs)
        synced = torch.is_grad_enabled() and self._sync_enabled
        if self._alone is not None:
            self._alone.forwarded(synced)
        self._sync_armed = self._sync_armed or synced  # disarmed only when the sync has run
        self._buffers_due = synced
        return out

    def _broadcast_buffers(self) -> None:
        nbytes = broadcast_coalesced(list(self.wrapped.buffers()), self._pg)
        if nbytes:
            self._stats["broadcasts"] += 1
            self._stats["broadcast_bytes"] += nbytes

    def _follow_requires_grad(self) -> None:
        """Rebuild for the new trainable set; first, at world size > 1, every rank must have
        made the same change (one small all-reduce; with one rank there is nobody to differ)."""
        if self.world_size > 1:
            self._agree_requires_grad()
        self._attach()

    def _agree_requires_grad(self) -> None:
        flags = [p.requires_grad for p in self._all_params]
        counts = torch.tensor(flags, dtype=torch.int32, device=self._all_params[0].device)
        with collective("all-reduce of requires_grad"):
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


class SoloUnusedCheck:
    """World size 1: torch DDP's unused-parameter rule with nobody to agree with.

    Without find_unused_parameters a trainable parameter that no gradient reached in the
    window of a synced backward is an error at world size 2 (`ScratchBase._settle_unused`,
    native's first-step check); with one rank the wrappers send nothing, so this makes the
    same check alone, with the same message (`unused_message`, rank 0), and no collective. A
    post-accumulate-grad hook per parameter marks it used in every backward of the window
    (no_sync micro-steps too, as the synchronising hooks do); the forward says whether its
    backward is synced (`forwarded`), and at the end of that backward an unmarked parameter
    raises `UnusedParameterError` out of `loss.backward()`. Every synced backward is checked,
    so a parameter left unused only from some later step on (a branch taken from then on)
    fails at that step, where torch DDP at world size 1 fails at the next forward, and not
    at all after the last step.
    """

    __slots__ = ("_strategy", "_names", "_used", "_armed", "_queued", "_handles")

    def __init__(self, strategy: str, tracked: list[tuple[str, nn.Parameter]]) -> None:
        self._strategy = strategy
        self._names = [name for name, _ in tracked]
        self._used = bytearray(len(tracked))
        self._armed = False  # the next backward is a synced one
        self._queued = False  # the end-of-backward check is queued for the running backward
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                         for i, (_, p) in enumerate(tracked)]

    def forwarded(self, synced: bool) -> None:
        """After each forward: `synced` (grad enabled, outside no_sync) arms the next backward.
        A check still queued belongs to a backward that raised: it starts afresh."""
        if self._queued:
            self._reset()
        self._armed = self._armed or synced

    def _on_grad(self, i: int, _param: torch.Tensor) -> None:
        self._used[i] = 1
        if self._armed and not self._queued:
            self._queued = True
            _queue_callback(self._check)

    def _check(self) -> None:
        try:
            unused = [name for name, used in zip(self._names, self._used) if not used]
            if unused:
                raise UnusedParameterError(unused_message(self._strategy, unused, [[0]] * len(unused)))
        finally:
            self._reset()

    def _reset(self) -> None:
        self._armed = self._queued = False
        self._used = bytearray(len(self._names))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def check_every_parameter_used(strategy: str, module: nn.Module, find_unused_parameters: bool) -> None:
    """After one backward in a single process: the rule the wrappers apply at every world size
    (torch DDP's too: at world size 1 its next forward raises), with the wrappers' message, so
    the driver's precheck and local mode refuse what the workers would."""
    if find_unused_parameters or not registry.get(strategy).requires_all_used:
        return
    names = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if names:
        raise UnusedParameterError(unused_message(strategy, names, [[0]] * len(names)))


def unused_message(strategy: str, names: list[str], ranks: list[list[int]], limit: int = 6) -> str:
    """The parameters in name order: the same message whatever order a strategy syncs them in
    (the driver's single-process check says it as the workers do)."""
    shown = ", ".join(f"'{n}' on rank(s) {r}" for n, r in sorted(zip(names, ranks))[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (
        f"{len(names)} trainable parameter(s) got no gradient in a synchronised backward "
        f"(strategy {strategy!r}, find_unused_parameters=False): {shown}{more}. Without "
        "find_unused_parameters (the default, as in torch DDP) every trainable parameter must "
        "take part in the loss on every rank. Pass find_unused_parameters=True (config: "
        "parallel.find_unused_parameters: true) to let them be skipped (grad stays None where no "
        "rank used them, as in torch DDP), or freeze them with requires_grad_(False)."
    )




def format_bytes(nbytes: float) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def describe_tensors(names: list[str], nbytes: int, limit: int = 3) -> str:
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{format_bytes(nbytes)}, params: {shown}"
