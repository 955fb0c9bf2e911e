"""Data-parallel wrappers: from scratch (naive, bucketed, zero1), torch DDP (native), FSDP2 (fsdp).

Owns: the package's public names, each imported on first use (PEP 562), so that the
strategy table (`parallel.registry`) and the errors (`parallel.errors`) load without
torch: the config reads the registry, and `import raytrain_ddp.config` stays light.
`wrap_model` (`parallel/wrap.py`) is the single entry point. Must not import Ray or
anything of ours outside this package (a test enforces it): the loop reaches Ray, this
package only torch and torch.distributed.

    model = wrap_model(net, "bucketed", bucket_cap_mb=25)
    for step in range(steps):
        for (x, y), scale in accumulation_window(model, next_micro_batches(), expected=k):
            (loss_fn(model(x), y) * scale).backward()    # syncs only on the last one
        optimizer.step(); optimizer.zero_grad()

`STRATEGIES` is every strategy name; `REPLICATED_STRATEGIES` those after whose synced
backward every rank holds the same gradients, `SHARDED_STRATEGIES` those that shard the
optimizer state (build the optimizer with `wrapper.make_optimizer(factory)` and clip with
`wrapper.clip_grad_norm_(max_norm)`; docs/parallel.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from raytrain_ddp.parallel import registry

STRATEGIES = registry.NAMES
REPLICATED_STRATEGIES = registry.REPLICATED
SHARDED_STRATEGIES = registry.SHARDED

_P = "raytrain_ddp.parallel"
_LAZY = {  # public name -> the module that defines it
    "wrap_model": f"{_P}.wrap", "COMPRESSIONS": f"{_P}.wrap",
    "WrappedModel": f"{_P}.base",
    "CollectiveTimeoutError": f"{_P}.errors", "PeerLost": f"{_P}.errors", "ModelMismatchError": f"{_P}.errors",
    "UnusedParameterError": f"{_P}.errors", "RequiresGradChangeError": f"{_P}.errors",
    "NaiveDDP": f"{_P}.naive", "BucketedDDP": f"{_P}.bucketed", "NativeDDP": f"{_P}.native",
    "LocalModel": f"{_P}.native", "Zero1DDP": f"{_P}.zero1", "ZeroOptimizer": f"{_P}.zero1",
    "FullyShardedDP": f"{_P}.fsdp", "FSDPOptimizer": f"{_P}.fsdp",
    "accumulation_window": f"{_P}.accumulate", "AccumulationWindow": f"{_P}.accumulate",
    "chunked": f"{_P}.accumulate",
}
__all__ = sorted([*_LAZY, "STRATEGIES", "REPLICATED_STRATEGIES", "SHARDED_STRATEGIES"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
