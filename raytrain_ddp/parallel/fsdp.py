"""Strategy `fsdp`: torch's FSDP2 (`fully_shard`) behind the wrapper interface.

Owns: which submodules become FSDP units, the mixed-precision policy, the forward-time
sync decision mapped onto FSDP2's `set_requires_gradient_sync`, buffer broadcasts, the
global gradient norm, what FSDP sends (`comm_stats`, counted by FSDP2's own custom-comm
hooks), and consolidated model / optimizer state through torch.distributed.checkpoint's
state_dict API, converted to torch's plain formats so a checkpoint moves between
strategies and worker counts. Must not touch: Ray, the training loop, files.

What FSDP2 does (ZeRO stage 3): every parameter is a DTensor sharded on dim 0 over the
ranks (padded to a multiple of W; a parameter with fewer rows than ranks is sharded on a
dimension W divides instead, so it does not sit on rank 0 alone). Before a unit's forward its parameters are
all-gathered (in `param_dtype`); after it, non-root units free them again and re-gather
them in backward; a unit's gradients are reduce-scattered (in the reduce dtype) as soon
as its backward is done, so each rank keeps the averaged gradient of its shard only. The
optimizer built over the sharded parameters holds 1/W of the state.

Units: bottom-up, a submodule becomes its own unit when the parameters below it that no
smaller unit took reach `bucket_cap_mb` (FSDP1's size-based policy; module containers
such as ModuleList are skipped because FSDP hooks run on forward, and so are submodules
sharing a parameter with the rest of the model); the root takes the rest.

Precision: `param_dtype` (train.precision bf16 -> torch.bfloat16) is FSDP2's
MixedPrecisionPolicy.param_dtype: the all-gathered parameters and the compute are bf16,
the sharded parameters and the optimizer stay in their own dtype. Gradients are reduced
in the parameters' own dtype, or bf16 with compress="bf16". On gloo, FSDP2's default
ReduceOp.AVG does not exist; the wrapper asks FSDP2 for SUM with a division instead
(`set_force_sum_reduction_for_comms`), which is also the order of operations in float64.

Model and optimizer checkpoints (`state_dict()`, `make_optimizer(...).state_dict()`) are
collectives: the full tensors are gathered to rank 0's CPU (`full_state_dict=True,
cpu_offload=True`), `{}` elsewhere; every rank loads the full state and keeps its shard.
"""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel import registry, torch_compat
from raytrain_ddp.parallel.collectives import collective
from raytrain_ddp.parallel.base import SHARD_STAT_KEYS, WrappedModel, broadcast_coalesced, sync_initial_state
from raytrain_ddp.parallel.zero1 import _copy, all_gather_flat, reduce_scatter_flat

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def plan_units(module: nn.Module, cap_bytes: int) -> list[nn.Module]:
    """Submodules to `fully_shard` (children before parents), FSDP1's size-based policy."""
    owners: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name)
    taken: set[int] = set()
    units = []
    named = list(module.named_modules())
    for prefix, sub in reversed(named[1:]):  # reversed pre-order: children before their parents
        if isinstance(sub, _CONTAINERS):
            continue
        inside = {id(p): p for p in sub.parameters()}
        free = [p for pid, p in inside.items() if pid not in taken]
        if sum(p.numel() * p.element_size() for p in free) < cap_bytes:
            continue
        shared = any(not n.startswith(prefix + ".") for pid in inside for n in owners[pid])
        if shared:  # a parameter also used elsewhere must live in a common ancestor's unit
            continue
        units.append(sub)
        taken.update(inside)
    return units


def shard_placement(world_size: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2 shards dim 0; a parameter with fewer rows than ranks (a (1, T, C) position
    table) would then sit on rank 0 alone, so it is sharded on a dimension W divides."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter):
        if param.dim() == 0 or param.shape[0] >= world_size:
            return None  # FSDP2's default, Shard(0)
        dim = next((d for d, size in enumerate(param.shape) if size >= world_size and size % world_size == 0), None)
        return None if dim is None else Shard(dim)

    return place


# What the wrapper calls on FSDP2; `fully_shard` / `shard_placement_fn` became public in 2.6
# and the custom collectives and forced SUM reduction came later. Checked at wrap time, before
# any collective, so every rank of an older torch stops with the same clear error.
# `set_reduce_scatter_unused_params` (reduce-scatter zeros for a parameter a rank did not use)
# is newer than torch 2.11, the GPU machine's: it is needed only with find_unused_parameters,
# and its default (off) is what a torch without it does, so only that option asks for it.
FSDP2_METHODS = ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                 "set_requires_gradient_sync")
FSDP2_UNUSED_METHOD = "set_reduce_scatter_unused_params"


def check_fsdp2_support(find_unused_parameters: bool = False) -> None:
    """Raise naming what this torch lacks when it cannot run strategy 'fsdp' (with
    `find_unused_parameters` when asked)."""
    import inspect

    missing: list[str] = []
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
        torch_compat.fsdp_comm_classes()
    except ImportError as exc:
        missing.append(f"torch.distributed.fsdp.fully_shard and its custom-collective API ({exc})")
    else:
        wanted = FSDP2_METHODS + ((FSDP2_UNUSED_METHOD,) if find_unused_parameters else ())
        missing += [f"FSDPModule.{name}" for name in wanted if not hasattr(FSDPModule, name)]
        if "shard_placement_fn" not in inspect.signature(fully_shard).parameters:
            missing.append("fully_shard(shard_placement_fn=...)")
    if missing:
        needs = "with parallel.find_unused_parameters " if find_unused_parameters and missing == [
            f"FSDPModule.{FSDP2_UNUSED_METHOD}"] else ""
        raise RuntimeError(
            f"parallel.strategy 'fsdp' {needs}needs FSDP2 APIs that torch {torch.__version__} lacks: "
            f"{', '.join(missing)}. Install a torch in this project's range (pyproject.toml: the "
            "range `make compat` passes), or use strategy 'zero1' (sharded optimizer state, "
            "written from scratch, no FSDP2 needed)"
        )


def _comms(stats: dict[str, Any]):
    """FSDP2 custom comms that count what they send, then do what FSDP2's defaults do."""
    AllGather, ReduceScatter = torch_compat.fsdp_comm_classes()

    class CountingAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            stats["all_gather_calls"] += 1
            stats["all_gather_bytes"] += output_tensor.numel() * output_tensor.element_size()
            return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            nbytes = input_tensor.numel() * input_tensor.element_size()
            for key, add in (("reduce_scatter_calls", 1), ("reduce_scatter_bytes", nbytes),
                             ("allreduce_calls", 1), ("allreduce_bytes", nbytes)):
                stats[key] += add
            return reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return CountingAllGather(), CountingReduceScatter()


class FullyShardedDP(WrappedModel):
    """torch FSDP2 with the interface and forward-time rules of the other strategies."""

    strategy = registry.name_of(__name__)  # "fsdp": the name is the registry's

    def __init__(self, module: nn.Module, process_group=None, *, bucket_cap_mb: float = 25.0,
                 compress: Optional[str] = None, param_dtype: Optional[torch.dtype] = None,
                 verify_init: bool = False, collective_timeout_s: Optional[float] = None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False) -> None:
        if process_group is None and collective_timeout_s is not None and dist.is_initialized():
            process_group = dist.new_group(timeout=timedelta(seconds=collective_timeout_s))
        super().__init__(process_group, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters)
        for key in SHARD_STAT_KEYS:
            self._stats[key] = 0
        self.collective_timeout_s = collective_timeout_s
        self.wrapped = module
        self._buffers_due = True
        self.units: list[nn.Module] = []
        self._ran, self._owners = set(), []
        # before any collective: every rank fails alike on an older torch (one rank too, so
        # local mode refuses what the workers would)
        check_fsdp2_support(find_unused_parameters)
        if self.world_size == 1:  # nothing to shard: the module itself, as `LocalModel`
            return
        sync_initial_state(module, process_group, verify=verify_init, world_size=self.world_size,
                           world_rank=self.world_rank)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        device = next(itertools.chain(module.parameters(), module.buffers())).device
        mesh = DeviceMesh.from_group(process_group or dist.group.WORLD, device.type)
        own = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        reduce_dtype = torch.bfloat16 if compress == "bf16" else (own if param_dtype is not None else None)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        place = shard_placement(self.world_size)
        for unit in plan_units(module, int(bucket_cap_mb * 2**20)):
            fully_shard(unit, mesh=mesh, mp_policy=policy, shard_placement_fn=place)
        fully_shard(module, mesh=mesh, mp_policy=policy, shard_placement_fn=place)
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        gather, scatter = _comms(self._stats)
        gloo = dist.get_backend(process_group) == "gloo"
        for unit in self.units:
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
            unit.set_force_sum_reduction_for_comms(gloo)  # gloo has no ReduceOp.AVG
        if find_unused_parameters:  # off is FSDP2's default, and all a torch without it does
            module.set_reduce_scatter_unused_params(True)
        self._stats["buckets"] = len(self.units)
        self._ran: set[str] = set()  # submodules whose forward ran with grad enabled since the last step
        self._owners: list[tuple[nn.Parameter, list[str]]] = []
        if find_unused_parameters:
            self._watch_forwards()

    # -- unused parameters: torch DDP's grad None -----------------------------------------
    def _watch_forwards(self) -> None:
        """Forward hooks on each submodule that owns parameters (public hooks, no FSDP internals),
        and each trainable parameter's owners (a tied one has several)."""
        owners: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, sub in self.wrapped.named_modules():
            own = list(sub.named_parameters(recurse=False, remove_duplicate=False))
            for _, param in own:
                if param.requires_grad:
                    owners.setdefault(id(param), (param, []))[1].append(name)
            if own:
                sub.register_forward_hook(lambda m, args, out, name=name: self._ran.add(name)
                                          if torch.is_grad_enabled() else None)
        self._owners = list(owners.values())

    @torch.no_grad()
    def drop_unused_grads(self) -> None:
        """Before the optimizer step: a parameter no forward on any rank used since the last step
        gets grad None, as torch DDP leaves it, so the optimizer creates no state for it and never
        moves it (no weight decay). FSDP2 reduce-scatters zeros for it instead
        (`set_reduce_scatter_unused_params`, needed while ranks differ). "Unused": none of its
        modules' forwards ran on any rank, and its gradient is zero on every rank (a parameter
        read from another module's code got a real one). One small all-reduce (MAX) and one host
        read of its result per step, only with find_unused_parameters (torch DDP's unused-parameter
        map costs a copy per step too)."""
        if not self._owners:
            return
        device = self._owners[0][0].device
        flags = torch.zeros(len(self._owners), 2, device=device)
        for i, (param, names) in enumerate(self._owners):
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            flags[i, 0] = float(any(n in self._ran for n in names))
            if grad is not None:
                flags[i, 1] = (grad != 0).any()  # on the device: no host sync per parameter
        self._ran.clear()
        with collective("all-reduce of the used-parameter flags"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._pg)
        for (param, _), (ran, nonzero) in zip(self._owners, flags.tolist()):
            if not ran and not nonzero:
                param.grad = None

    def forget_forwards(self) -> None:
        """A window ended without a step (zero_grad): its forwards say nothing about the next."""
        self._ran.clear()

    @property
    def module(self) -> nn.Module:
        return self.wrapped

    # -- forward: torch DDP's sync decision and buffer rule -------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        synced = torch.is_grad_enabled() and self._sync_enabled
        if self.units:
            if self.broadcast_buffers and self._buffers_due:
                nbytes = broadcast_coalesced(list(self.wrapped.buffers()), self._pg)
                if nbytes:
                    self._stats["broadcasts"] += 1
                    self._stats["broadcast_bytes"] += nbytes
            if torch.is_grad_enabled():  # the forward decides whether its backward reduces
                self.wrapped.set_requires_gradient_sync(synced)
        out = self.wrapped(*args, **kwargs)
        if synced and self.units:
            self._stats["syncs"] += 1
        self._buffers_due = synced
        return out

    def compile(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Refused (`registry.COMPILE_REFUSAL`): compiling the root or each unit in place, as
        torchtitan compiles per block, compiled no graph here (torch 2.13, gloo)."""
        raise ValueError(f"train.compile: not with strategy {self.strategy!r}: {registry.COMPILE_REFUSAL}")

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every unit gathered once (a collective), kept through any number of forwards."""
        if not self.units:
            yield
            return
        for unit in self.units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in self.units:  # FSDP2's defaults: the root keeps its parameters after forward
                unit.set_reshard_after_forward(unit is not self.wrapped, recurse=False)
                unit.reshard()

    # -- checkpoints: full state through torch.distributed.checkpoint ---------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The bare module's keys and full tensors on rank 0 (CPU), `{}` elsewhere: a collective."""
        if not self.units:
            return self.wrapped.state_dict(*args, **kwargs)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Every rank passes the full state (as a checkpoint holds it) and keeps its shard."""
        if not self.units:
            return self.wrapped.load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(self.wrapped, dict(state_dict),
                                    options=StateDictOptions(full_state_dict=True, strict=strict))

    # -- the optimizer side ---------------------------------------------------------------
    def make_optimizer(self, factory: Callable[[list], torch.optim.Optimizer]):
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        optimizer = factory(params)
        return FSDPOptimizer(self, optimizer) if self.units else optimizer

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip over the sharded gradients: the norm is global (DTensor reductions)."""
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total


class FSDPOptimizer:
    """A torch optimizer over FSDP's sharded parameters, with consolidated checkpoints.

    Everything but the checkpoint goes straight to the torch optimizer. `state_dict()` is a
    collective (DCP's `get_optimizer_state_dict`, full state on rank 0's CPU) returned in
    torch's own format, parameters numbered as the optimizer numbers them, so it loads into
    any strategy; `load_state_dict` takes that format on every rank.
    """

    def __init__(self, wrapper: FullyShardedDP, optimizer: torch.optim.Optimizer) -> None:
        self._wrapper = wrapper
        self._inner = optimizer
        fqn = {id(p): name for name, p in wrapper.module.named_parameters()}
        self._fqns = [fqn[id(p)] for g in optimizer.param_groups for p in g["params"]]

    param_groups = property(lambda self: self._inner.param_groups)
    state = property(lambda self: self._inner.state)
    defaults = property(lambda self: self._inner.defaults)
    inner = property(lambda self: self._inner)

    def __repr__(self) -> str:
        return f"FSDPOptimizer({self._inner!r})"

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        self._wrapper.drop_unused_grads()  # torch DDP's grad None for what no forward used
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wrapper.forget_forwards()
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError("fsdp: build the optimizer with every group from the start (make_optimizer)")

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self._wrapper.module, self._inner,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:
            return {}
        index = {name: i for i, name in enumerate(itertools.chain.from_iterable(
            g["params"] for g in full["param_groups"]))}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved = list(itertools.chain.from_iterable(g["params"] for g in state["param_groups"]))
        if len(saved) != len(self._fqns) or len(state["param_groups"]) != len(self._inner.param_groups):
            raise ValueError(
                f"optimizer state has {len(state['param_groups'])} group(s) over {len(saved)} parameters, "
                f"this optimizer {len(self._inner.param_groups)} over {len(self._fqns)}: it was saved "
                "for another model or optimizer configuration"
            )
        name = dict(zip(saved, self._fqns))  # positions pair up, as torch's load_state_dict pairs them
        by_name = {"state": {name[i]: {k: _copy(v) if torch.is_tensor(v) and v.dim() == 0 else v
                                       for k, v in entry.items()} for i, entry in state["state"].items()},
                   "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self._wrapper.module, self._inner, by_name,
                                 options=StateDictOptions(full_state_dict=True))
