"""The one seam for code that is not the product: a hooks object, a no-op by default.

Owns: the `Hooks` interface the loop calls at fixed points, and loading an
implementation named in `RAYTRAIN_DDP_HOOKS` ("package.module:factory", or "/path/to/file.py:factory"
for one outside every process's import path), forwarded to workers with every other
`RAYTRAIN_DDP_*` variable. Must not touch: any particular implementation. The tests supply
theirs by file (`tests/_hooks.py`: fault plans, a simulated preemption signal; not in the
package), so Ray's workers and torchrun's ranks load it whatever their `sys.path`; production
runs leave the variable unset and get `Hooks()`, whose methods do nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from raytrain_ddp.worker.context import Rank

HOOKS_ENV = "RAYTRAIN_DDP_HOOKS"


class Hooks:
    """Called by every rank; each method is a no-op here."""

    def before_process_group(self, world_rank: int) -> None:
        """This worker's process group is about to form: on Ray its actor is up (a live
        replacement's too) and the group's port not picked yet (`driver/startup.py`'s
        `StartHooks`); under torchrun, before its `init_process_group` (`driver/torchrun.py`)."""

    def on_start(self, rank: "Rank") -> None:
        """This worker's loop starts (a live replacement's too), before it joins any group."""

    def on_attempt(self, rank: "Rank", attempt: int, module: Any) -> None:
        """A worker group started (attempt 1, 2, ...); `module` is the bare model."""

    def on_validator(self, module: Any) -> None:
        """Rank 0 built its validator's copy of the model (`run.validation: async`, `validator.py`)."""

    def before_step(self, step: int) -> None:
        """Optimizer step `step` starts on this rank: its first micro-batch is next."""

    def after_step(self, step: int) -> None:
        """Optimizer step `step` finished on this rank."""

    def preemption_source(self, real: Callable[[int], Any]) -> Optional[tuple[Callable[[int], Any], float]]:
        """Replace Ray's preemption poll: (source, poll interval in s), or None to keep Ray's."""
        return None


def load_hooks() -> Hooks:
    """`Hooks()` unless `RAYTRAIN_DDP_HOOKS` names a factory returning one."""
    spec = os.environ.get(HOOKS_ENV)
    if not spec:
        return Hooks()
    module_name, _, attr = spec.partition(":")
    factory = getattr(_module(module_name), attr or "from_env")
    hooks = factory()
    if not isinstance(hooks, Hooks):
        raise TypeError(f"{HOOKS_ENV}={spec!r} returned {type(hooks).__name__}, not a raytrain_ddp Hooks")
    return hooks


def _module(name: str) -> Any:
    """A module by import path, or by file (registered under its file's stem, once per process)."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    stem = os.path.basename(name)[:-3]
    if stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(stem, name)
        sys.modules[stem] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[stem]
