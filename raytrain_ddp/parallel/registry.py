"""The one table of data-parallel strategies: what a strategy is, written once.

Owns: every strategy name, and for each its wrapper class (an import path, loaded on
first use), whether it is replicated or sharded, the `wrap_model` options it accepts
beyond the common ones (the same names as the `parallel.*` config keys where one
exists), whether it tunes its layout (`bucket_cap_mb` / `compress` = "auto"), and the
`train.precision` values it supports, whether `train.compile` compiles it. `wrap_model`, the config's checks, survivors'
recovery (`recovery/replica.py`) and `raytrain-ddp verify` all read it; a test fails on a
strategy name written anywhere else in the package. Adding a strategy: one row here and
its own module.

Must not touch: torch or anything else of ours: the config imports this module, and
`import raytrain_ddp.config` loads no torch. Standard library only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal, Optional

# Options every strategy takes (besides the module and the process group).
COMMON_OPTIONS = ("verify_init", "collective_timeout_s", "broadcast_buffers", "find_unused_parameters")
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision; fp16 needs a GPU, whatever the strategy


@dataclass(frozen=True)
class Strategy:
    """One row of the table."""

    name: str
    cls: str  # "module:attribute" of the wrapper class (`load`)
    layout: Literal["replicated", "sharded"]  # replicated: every rank holds the same gradients
    options: tuple[str, ...] = ()  # wrap_model keywords beyond COMMON_OPTIONS
    tunes: bool = False  # bucket_cap_mb / compress "auto": timed tuning of the layout
    shards_parameters: bool = False  # parameters themselves are sharded (a gather to read them)
    precision: tuple[str, ...] = PRECISIONS
    local: Optional[str] = None  # "module:attribute" of the class used without a process group
    # without find_unused_parameters, a trainable parameter no gradient reached is an error
    # (`UnusedParameterError`), as in torch DDP; FSDP2 reduce-scatters zeros for it instead
    requires_all_used: bool = True
    # train.compile (`WrappedModel.compile`): False where torch.compile would compile nothing
    compiles: bool = True

    @property
    def replicated(self) -> bool:
        return self.layout == "replicated"

    def load(self) -> Any:
        """The wrapper class (imports its module: torch)."""
        return _load(self.cls)

    def load_local(self) -> Any:
        """The class `wrap_model` returns without a process group (`local`)."""
        return _load(self.local) if self.local else None


_TABLE = (
    Strategy("naive", "raytrain_ddp.parallel.naive:NaiveDDP", "replicated"),
    Strategy("bucketed", "raytrain_ddp.parallel.bucketed:BucketedDDP", "replicated",
             options=("bucket_cap_mb", "compress", "first_bucket_mb", "shm"), tunes=True),
    Strategy("native", "raytrain_ddp.parallel.native:NativeDDP", "replicated",
             options=("bucket_cap_mb", "compress", "first_bucket_mb", "device_ids"),
             local="raytrain_ddp.parallel.native:LocalModel"),
    Strategy("zero1", "raytrain_ddp.parallel.zero1:Zero1DDP", "sharded",
             options=("bucket_cap_mb", "compress", "first_bucket_mb")),
    Strategy("fsdp", "raytrain_ddp.parallel.fsdp:FullyShardedDP", "sharded",
             options=("bucket_cap_mb", "compress", "param_dtype"), shards_parameters=True,
             requires_all_used=False, compiles=False),
)
STRATEGIES: dict[str, Strategy] = {s.name: s for s in _TABLE}
NAMES: tuple[str, ...] = tuple(STRATEGIES)
DEFAULT: str = "bucketed"  # parallel.strategy's default
REPLICATED: tuple[str, ...] = tuple(s.name for s in _TABLE if s.replicated)
SHARDED: tuple[str, ...] = tuple(s.name for s in _TABLE if not s.replicated)
TUNERS: tuple[str, ...] = tuple(s.name for s in _TABLE if s.tunes)
COMPILERS: tuple[str, ...] = tuple(s.name for s in _TABLE if s.compiles)
COMPILE_REFUSAL = ("dynamo skips the modules FSDP2 manages (their forward runs in torch.distributed), so "
                   "compiling them compiles no graph")


def get(name: str, key: str = "strategy") -> Strategy:
    """The row for `name`; a ValueError naming `key` (the option or config key) otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"{key}={name!r} is not one of {NAMES}")
    return STRATEGIES[name]


def accepting(option: str) -> tuple[str, ...]:
    """Names of the strategies whose wrapper takes `option`."""
    return tuple(s.name for s in _TABLE if option in s.options or option in COMMON_OPTIONS)


def name_of(module: str) -> str:
    """The strategy implemented in `module` (a strategy module sets its `strategy` from this)."""
    for s in _TABLE:
        if s.cls.partition(":")[0] == module:
            return s.name
    raise KeyError(f"{module} implements no strategy of the registry (parallel/registry.py)")


def quoted(names: tuple[str, ...]) -> str:
    """'a', 'b' and 'c': for error messages."""
    shown = [repr(n) for n in names]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
