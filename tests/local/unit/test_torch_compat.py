"""Every private torch name `parallel/torch_compat.py` relies on is still where it looks, and no
other module of the package spells one (issue #42).

Each test checks one function of torch_compat against the installed torch, on the CPU, and
fails by name: "torch_compat.X: <what> is gone in torch <version>". `make compat` runs these on
every torch version the project supports.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from _compat import attr_or_fail
import torch
import torch.distributed as dist

from raytrain_ddp.ops.ranks import run_ranks
from raytrain_ddp.parallel import torch_compat

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(torch_compat.__file__).resolve().parents[1]
ROOMS = {"parallel/torch_compat.py", "torchft_compat.py", "ray_compat.py"}


def _gone(function: str, what: str) -> str:
    return f"torch_compat.{function}: {what} is gone in torch {torch.__version__}"


def _attr(function: str, dotted: str) -> Any:
    """Import `module.path:attr.attr`, failing by the name of the torch_compat function that uses it."""
    return attr_or_fail(_gone, function, dotted)


def test_flatten_and_unflatten_dense_tensors():
    _attr("flatten_dense_tensors", "torch._utils:_flatten_dense_tensors")
    _attr("unflatten_dense_tensors", "torch._utils:_unflatten_dense_tensors")
    parts = [torch.ones(2), torch.zeros(3)]
    flat = torch_compat.flatten_dense_tensors(parts)
    assert flat.tolist() == [1, 1, 0, 0, 0]
    assert [t.tolist() for t in torch_compat.unflatten_dense_tensors(flat, parts)] == [[1, 1], [0, 0, 0]]


def test_foreach_norm_and_mul():
    _attr("foreach_norm", "torch:_foreach_norm")
    _attr("foreach_mul_", "torch:_foreach_mul_")
    tensors = [torch.tensor([3.0, -4.0]), torch.tensor([1.0])]
    assert [n.item() for n in torch_compat.foreach_norm(tensors, 2.0)] == [5.0, 1.0]
    torch_compat.foreach_mul_(tensors, 0.5)
    assert tensors[0].tolist() == [1.5, -2.0]


def test_nccl_trace_dump():
    _attr("nccl_trace_dump", "torch:_C")  # the dump itself exists only in NCCL builds: None is an answer
    assert torch_compat.nccl_trace_dump() is None or callable(torch_compat.nccl_trace_dump())


def test_c10d_registry(tmp_path):
    c10d = _attr("default_group", "torch.distributed.distributed_c10d:_world")
    for name in ("default_pg", "pg_map", "pg_names"):
        if not hasattr(c10d, name):
            pytest.fail(_gone("default_group / is_registered / registered_groups / group_name", f"c10d._world.{name}"))
    _attr("set_default_group", "torch.distributed.distributed_c10d:_update_default_pg")
    _attr("unregister_group", "torch.distributed.distributed_c10d:_unregister_process_group")
    _attr("default_store", "torch.distributed.distributed_c10d:_get_default_store")
    # in a fresh process of its own: another test in this one may have a process group set up
    run_ranks(_c10d_registry_body, 1, str(tmp_path / "store"), init_pg=False, timeout_s=50)


def _c10d_registry_body(world_rank: int, world_size: int, store_path: str) -> None:
    assert torch_compat.default_group() is None and not dist.is_initialized()
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = torch_compat.default_group()
        assert group is dist.group.WORLD and torch_compat.is_registered(group)
        assert torch_compat.default_store() is not None
        sub = dist.new_group([0])
        assert torch_compat.registered_groups() == [group, sub]
        name = torch_compat.group_name(sub)
        assert name is not None
        dist.destroy_process_group(sub)
        torch_compat.unregister_group(name)
        assert torch_compat.group_name(sub) is None and not torch_compat.is_registered(sub)
        torch_compat.register_backend(sub, "gloo", store)
        assert torch_compat.is_registered(sub)
        torch_compat.set_default_group(group)
        assert torch_compat.default_group() is group
    finally:
        c10d = importlib.import_module("torch.distributed.distributed_c10d")
        c10d._world.pg_map.pop(sub, None)
        dist.destroy_process_group()


def test_forget_unscaled():
    _attr("forget_unscaled", "torch.amp:GradScaler")
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    if not hasattr(scaler, "_per_optimizer_states"):
        pytest.fail(_gone("forget_unscaled", "GradScaler._per_optimizer_states"))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)  # a second unscale_ of the same step is refused...
    torch_compat.forget_unscaled(scaler)
    scaler.unscale_(optimizer)  # ...until the step's record is forgotten


def test_autograd_and_profiler_names():
    _attr("unsafe_preserve_version_counter", "torch.autograd:_unsafe_preserve_version_counter")
    _attr("autograd_queue_callback", "torch.autograd:Variable._execution_engine.queue_callback")
    _attr("profiler_enabled", "torch.autograd:_profiler_enabled")
    t = torch.zeros(2)
    version = t._version
    with torch_compat.unsafe_preserve_version_counter((t,)):
        t.add_(1)
    assert t._version == version
    assert callable(torch_compat.autograd_queue_callback()) and torch_compat.profiler_enabled() is False


def test_fsdp_comm_classes():
    _attr("fsdp_comm_classes", f"{torch_compat.FSDP_COMM_API}:AllGather")
    _attr("fsdp_comm_classes", f"{torch_compat.FSDP_COMM_API}:ReduceScatter")
    gather, scatter = torch_compat.fsdp_comm_classes()
    assert isinstance(gather, type) and isinstance(scatter, type)


def test_device_constructors_and_tree_leaves():
    _attr("device_constructors", "torch.utils._device:_device_constructors")
    _attr("tree_leaves", "torch.utils._pytree:tree_flatten")
    assert torch.zeros in torch_compat.device_constructors()
    t = torch.zeros(1)
    assert torch_compat.tree_leaves({"a": [t, (1, t)]}) == [t, 1, t]


def test_module_tables_compile_backend_and_ddp_first_bucket():
    _attr("compile_backend", "torch:_TorchCompileInductorWrapper")
    _attr("compile_backend", "torch._dynamo:lookup_backend")
    _attr("ddp_first_bucket_bytes", "torch.distributed:_DEFAULT_FIRST_BUCKET_BYTES")
    block, holder = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Module()
    for name in torch_compat.MODULE_TABLES:
        if not hasattr(block, name):
            pytest.fail(_gone("share_module_tables", f"nn.Module.{name}"))
    torch_compat.share_module_tables(holder, block)
    assert list(holder.state_dict()) == list(block.state_dict()) == ["0.weight", "0.bias"]
    assert callable(torch_compat.compile_backend("aot_eager", None))
    assert callable(torch_compat.compile_backend("inductor", "max-autotune"))
    assert torch_compat.ddp_first_bucket_bytes() == 2**20
    _attr("compile_cache_hits", "torch._dynamo.utils:counters")
    assert isinstance(torch_compat.compile_cache_hits(), int)


# ------------------------------------------------------------------ nobody else spells a private name

_OWNERS = re.compile(r"^(torch|torchft|c10d|dist)\b")
_HOLDERS = {"scaler", "manager"}  # GradScaler / torchft Manager held under these names


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private_uses(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            dotted = _dotted(node)
            head = dotted.split(".")
            if _OWNERS.match(dotted) or any(h in _HOLDERS for h in head[:-1]):
                found.append((node.lineno, dotted))
        elif isinstance(node, ast.ImportFrom) and node.module and _OWNERS.match(node.module):
            if any(p.startswith("_") for p in node.module.split(".")) or any(
                    a.name.startswith("_") for a in node.names):
                found.append((node.lineno, node.module))
    return found


def test_no_other_module_spells_a_private_torch_or_torchft_name():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ROOMS:
            continue
        bad += [f"raytrain_ddp/{rel}:{line}: {what}" for line, what in _private_uses(path.read_text())]
    assert not bad, "private torch/torchft names outside their compat rooms:\n" + "\n".join(bad)
