"""Every private name of torch the package relies on, in one room (like `ray_compat.py` for Ray).

Owns: each private torch name as one small function; a torch release that moves one fails
its test in `tests/local/unit/test_torch_compat.py` by this module's function name. Must not
touch: what the callers do with the answer. It lives in `parallel/` because `parallel/`
imports only torch and itself, and the wrappers need some of these names too.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

# -- tensors -------------------------------------------------------------------------


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of `tensors` (`torch._utils._flatten_dense_tensors`)."""
    return torch._utils._flatten_dense_tensors(list(tensors))


def unflatten_dense_tensors(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """`flat` cut back into tensors shaped like `like` (`torch._utils._unflatten_dense_tensors`)."""
    return torch._utils._unflatten_dense_tensors(flat, list(like))


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Each tensor's norm in one fused kernel (`torch._foreach_norm`)."""
    return list(torch._foreach_norm(list(tensors), ord))


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """Every tensor multiplied in place by `scalar`, fused (`torch._foreach_mul_`)."""
    torch._foreach_mul_(list(tensors), scalar)


def nccl_trace_dump() -> Optional[Callable[[], bytes]]:
    """NCCL's flight recorder dump (`torch._C._distributed_c10d._dump_nccl_trace`), None where absent."""
    return getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)


# -- c10d's registry of process groups ---------------------------------------------


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


def default_store() -> Any:
    """The default process group's store (`c10d._get_default_store`)."""
    return _c10d()._get_default_store()


def default_group() -> Any:
    """torch's default process group as c10d holds it (`c10d._world.default_pg`), None if unset."""
    return _c10d()._world.default_pg


def set_default_group(group: Any) -> None:
    """Make `group` torch's default process group (`c10d._update_default_pg`)."""
    _c10d()._update_default_pg(group)


def is_registered(group: Any) -> bool:
    """Whether c10d's map of groups holds `group` (`c10d._world.pg_map`)."""
    return group in _c10d()._world.pg_map


def registered_groups() -> list:
    """Every group c10d's map holds (`c10d._world.pg_map`)."""
    return list(_c10d()._world.pg_map)


def register_backend(group: Any, backend: str, store: Any) -> None:
    """Record `group`'s backend name and store in c10d's map (`c10d._world.pg_map`): torch asks the
    map for a group's backend, and `new_group` for the default group's store."""
    _c10d()._world.pg_map[group] = (backend, store)


def group_name(group: Any) -> Optional[str]:
    """The name c10d registered `group` under (`c10d._world.pg_names`), None if none."""
    return _c10d()._world.pg_names.get(group)


def unregister_group(name: str) -> None:
    """Drop a group from c10d's registry by name (`c10d._unregister_process_group`): `destroy_process_group`
    leaves a sub-group there."""
    _c10d()._unregister_process_group(name)


# -- torch.amp -----------------------------------------------------------------------


def forget_unscaled(scaler: torch.amp.GradScaler) -> None:
    """Clear the scaler's per-step record (`GradScaler._per_optimizer_states`): `unscale_` marked the
    optimizer as unscaled, and a step put back to its boundary is unscaled again."""
    scaler._per_optimizer_states.clear()


# -- nn.Module --------------------------------------------------------------------------

MODULE_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def share_module_tables(into: torch.nn.Module, source: torch.nn.Module) -> None:
    """`into` holds `source`'s own parameters, buffers and children under the same names: the same
    tables (`nn.Module._parameters`, `_buffers`, `_modules`, `_non_persistent_buffers_set`), not copies."""
    into.__dict__.update({name: getattr(source, name) for name in MODULE_TABLES})


# -- torch.compile ---------------------------------------------------------------------


def compile_backend(name: str, mode: Optional[str]) -> Callable[..., Any]:
    """The callable `torch.compile(backend=name, mode=mode)` would use: inductor's with its mode
    (`torch._TorchCompileInductorWrapper`), any other by name (`torch._dynamo.lookup_backend`)."""
    if name == "inductor":
        return torch._TorchCompileInductorWrapper(mode, None, None)
    from torch._dynamo import lookup_backend

    return lookup_backend(name)


def compile_cache_hits() -> int:
    """Lookups of inductor's FX graph cache and of the AOTAutograd cache that hit, in this process
    (`torch._dynamo.utils.counters`: torch has no public count): what proves a restart reused
    the compile caches (`worker/compiled.py`), in the tests and the bench."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def ddp_first_bucket_bytes() -> int:
    """torch DDP's first bucket cap, which torch.compile's DDPOptimizer assumes
    (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`)."""
    import torch.distributed as dist

    return dist._DEFAULT_FIRST_BUCKET_BYTES


# -- autograd and the profiler ---------------------------------------------------------


def unsafe_preserve_version_counter(tensors: tuple[torch.Tensor, ...]) -> Any:
    """A context in which in-place writes to `tensors` leave their version counters as they were
    (`torch.autograd._unsafe_preserve_version_counter`)."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)


def autograd_queue_callback() -> Callable[[Callable[[], None]], None]:
    """The autograd engine's "run this when the backward pass ends"
    (`torch.autograd.Variable._execution_engine.queue_callback`)."""
    return torch.autograd.Variable._execution_engine.queue_callback


def profiler_enabled() -> bool:
    """Whether torch.profiler is recording (`torch.autograd._profiler_enabled`, ~0.1 us)."""
    return torch.autograd._profiler_enabled()


FSDP_COMM_API = "torch.distributed.fsdp._fully_shard._fsdp_api"  # FSDP2's custom-collective classes


def fsdp_comm_classes() -> tuple[type, type]:
    """FSDP2's `AllGather` and `ReduceScatter` bases for custom collectives (`FSDP_COMM_API`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def device_constructors() -> set[Any]:
    """The tensor factories that take `device=` (`torch.utils._device._device_constructors`):
    the test-only shadow device (`tests/_shadow_device.py`) flags those called without one."""
    from torch.utils._device import _device_constructors

    return _device_constructors()


def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of a nested structure of lists, tuples and dicts (`torch.utils._pytree.tree_flatten`)."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)[0]
