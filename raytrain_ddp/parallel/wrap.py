"""`wrap_model`: the single entry point to the data-parallel wrappers.

Owns: checking `wrap_model`'s options against the strategy's row of the registry
(`parallel/registry.py`: which options a strategy takes, which tunes "auto"), closing an
earlier wrapper of the same module, and building the registry's class. Must not touch:
Ray, anything of ours outside `parallel/` (a test enforces it); strategy names (the
registry's alone).
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel import registry
from raytrain_ddp.parallel.base import WrappedModel

COMPRESSIONS = (None, "bf16", "auto")
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# module -> its current wrapper (weak both ways; nothing stored on the module, so it still pickles)
_LIVE_WRAPPERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


# Over 60 lines: the public signature and its documented keywords; the body is the registry lookup and checks.
def wrap_model(
    module: nn.Module,
    strategy: str,
    *,
    bucket_cap_mb: Union[float, str] = 25.0,
    first_bucket_mb: float = 1.0,
    compress: Optional[str] = None,
    verify_init: bool = False,
    process_group: Optional[dist.ProcessGroup] = None,
    device_ids: Optional[list] = None,
    collective_timeout_s: Optional[float] = None,
    broadcast_buffers: bool = True,
    find_unused_parameters: bool = False,
    param_dtype: Optional[torch.dtype] = None,
    shm: bool = True,
) -> WrappedModel:
    """Wrap `module` (already on its device) for data-parallel training.

    Every strategy trains like torch DDP with the same options, rank by rank (see
    `WrappedModel` for the rules, `raytrain-ddp verify` to check it on your model), or
    raises an error naming the parameter; never a silent difference.

    Must be called on every rank of the group (it communicates): rank 0's parameters and
    buffers are broadcast to all ranks, or, with `verify_init=True`, compared, and every
    rank raises `ModelMismatchError` naming the first tensor that differs.

    strategy             one of `STRATEGIES` (the names of `parallel/registry.py`).
    bucket_cap_mb        bucketed/native: bucket size; smaller = earlier overlap, more calls.
                         "auto" (bucketed): a few timed synced steps at the start pick it
                         for this model and network, the same on every rank
                         (`wrapper.tuning` says what was chosen).
    first_bucket_mb      bucketed/native/zero1: cap of the first bucket (the output layers, whose
                         gradients backward produces first), 1 MiB as in torch DDP, so
                         communication starts early.
    compress             None | "bf16": all-reduce bf16 copies of fp32 gradients (half the
                         bytes); bucketed and native only; refused for 16-bit parameters.
                         "auto" (bucketed): also time bf16 while tuning, keep it if it pays.
    process_group        default: the global group; without one (or world size 1) the
                         scratch strategies send nothing, and native returns `LocalModel`;
                         every check that needs no peer (unused parameters, requires_grad
                         changes) is still made, with the message world size 2 gives.
    device_ids           native only, as in torch DDP (e.g. [local_rank] on GPU; None on CPU).
    collective_timeout_s a gradient all-reduce that does not finish in this time raises
                         `CollectiveTimeoutError` naming the bucket/parameter. The process
                         group's own timeout (init_process_group) still applies, and if it is
                         shorter it fires first (reported the same way). On NCCL, without
                         it, waits return at once and only NCCL's watchdog enforces the
                         group's timeout, by aborting the process (see `base.wait_work`).
    broadcast_buffers    as torch DDP: re-broadcast rank 0's buffers (BatchNorm running
                         stats) before each forward that follows a synced one.
    find_unused_parameters as torch DDP: parameters that get no gradient in a synced backward
                         are allowed; they keep grad=None if no rank used them. Without it
                         such a parameter raises `UnusedParameterError` naming it, at that
                         step, on every rank at the first step (never a hang).

    param_dtype          fsdp only: FSDP2's mixed-precision parameter dtype (e.g.
                         torch.bfloat16); the other strategies leave precision to autocast.
    shm                  bucketed, CPU: when every rank of the group is on one host, all-reduce
                         the buckets through shared memory (/dev/shm) instead of gloo's TCP,
                         the same sums; decided together at the first synced backward, gloo
                         otherwise (`wrapper.transport` says which). False: always the group.

    Sharded strategies (`SHARDED_STRATEGIES`: zero1 written from scratch, fsdp = torch
    FSDP2) keep 1/W of the optimizer state per rank: build the optimizer with
    `wrapper.make_optimizer(factory)` and clip with `wrapper.clip_grad_norm_`, which every
    strategy offers (docs/parallel.md).

    Changing `requires_grad` after wrapping: naive/bucketed follow it (frozen parameters
    stop syncing and keep grad None, unfrozen ones start), as in one process; native raises
    `RequiresGradChangeError` naming the parameter where torch DDP cannot follow it.
    Wrapping a module that is already wrapped closes the earlier wrapper first.
    """
    spec = registry.get(strategy)
    _check_options(module, spec, bucket_cap_mb, first_bucket_mb, compress, collective_timeout_s)
    previous = _LIVE_WRAPPERS.get(module)
    if previous is not None and previous() is not None:
        previous().close()  # two live wrappers would both sync every backward
    given = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compress=compress,
                 device_ids=device_ids, param_dtype=param_dtype, shm=shm)
    if spec.local and process_group is None and not dist.is_initialized():
        # one process: nothing to synchronise, the checks that need no peer still made
        wrapper = spec.load_local()(module, find_unused_parameters=find_unused_parameters)
    else:
        options = {key: given[key] for key in spec.options}
        wrapper = spec.load()(module, process_group, verify_init=verify_init,
                              collective_timeout_s=collective_timeout_s, broadcast_buffers=broadcast_buffers,
                              find_unused_parameters=find_unused_parameters, **options)
    _LIVE_WRAPPERS[module] = weakref.ref(wrapper)
    return wrapper


def _check_options(module: nn.Module, spec: registry.Strategy, bucket_cap_mb, first_bucket_mb,
                   compress, collective_timeout_s) -> None:
    """Raise a ValueError naming the option that `spec`'s strategy cannot take as given."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress={compress!r} is not one of {COMPRESSIONS}")
    if compress is not None and "compress" not in spec.options:
        raise ValueError(
            f"compress={compress!r} is supported by {registry.quoted(registry.accepting('compress'))}, "
            f"not {spec.name!r} (it sends each gradient as is)"
        )
    auto = [name for name, value in (("bucket_cap_mb", bucket_cap_mb), ("compress", compress)) if value == "auto"]
    if auto and not spec.tunes:
        raise ValueError(f"{auto[0]}='auto' (timed tuning of the layout) is supported by "
                         f"{registry.quoted(registry.TUNERS)} only, not {spec.name!r}; give a number "
                         "(bucket_cap_mb) or None/'bf16' (compress)")
    if compress == "bf16":
        sixteen = [n for n, p in module.named_parameters() if p.requires_grad and p.dtype in _SIXTEEN_BIT]
        if sixteen:
            raise ValueError(
                f"compress={compress!r} would send the same bytes and lose precision: parameter "
                f"'{sixteen[0]}' ({len(sixteen)} in all) is already 16-bit "
                f"({dict(module.named_parameters())[sixteen[0]].dtype}); use compress=None"
            )
    if bucket_cap_mb != "auto" and not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be > 0 or 'auto'")
    if not (isinstance(first_bucket_mb, (int, float)) and first_bucket_mb > 0):
        raise ValueError(f"first_bucket_mb={first_bucket_mb!r} must be > 0")
    if collective_timeout_s is not None and not collective_timeout_s > 0:
        raise ValueError(f"collective_timeout_s={collective_timeout_s!r} must be > 0 (or None)")
    if isinstance(module, WrappedModel):
        raise ValueError(f"module is already wrapped (strategy {module.strategy!r}); pass .module")
