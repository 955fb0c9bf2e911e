"""`train.compile`: how the step computes, never what (activation checkpointing, the other
such switch, is `models.checkpoint_activations`: the driver's checks apply it too).

Owns: `compile_wrapper` (the wrapped model compiled as its strategy says, `WrappedModel.compile`)
and `CompileClock`, the backend that counts the graphs compiled and the seconds spent (the
start-up timeline's compile phase). Training, `raytrain-ddp verify` and the bench call these
same functions. Must not touch: the strategies' hooks (each wrapper compiles itself), the
step, the files.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from raytrain_ddp.errors import UserError
from raytrain_ddp.parallel import torch_compat

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


class CompileClock:
    """The torch.compile backend `train.compile` uses: the chosen one (inductor with its mode),
    counting the graphs it compiled (`graphs`: a compiled run shows them, an eager one none)
    and the seconds compiling took (`seconds`: the start-up timeline's compile phase)."""

    def __init__(self, backend: str, mode: Optional[str]) -> None:
        if backend not in torch.compiler.list_backends(exclude_tags=()):
            raise UserError(f"train.compile_backend={backend!r} is not a torch.compile backend "
                            f"(this torch has {', '.join(torch.compiler.list_backends(exclude_tags=()))})")
        self.inner = torch_compat.compile_backend(backend, mode)
        self.graphs, self.seconds, self._checked = 0, 0.0, False

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(graph, example_inputs)
        finally:
            self.graphs += 1
            self.seconds += time.perf_counter() - start

    def first_step_seconds(self, rank: Any) -> float:
        """After each step: the compile seconds so far; after the first, once, a line from rank 0
        when torch compiled nothing (dynamo skips a model whose forward is torch's own, such
        as a bare `nn.Sequential`): the run trains eagerly, and says so."""
        if not self._checked and not self.graphs:
            rank.say("warning: train.compile: torch compiled no graph in the first step (a model whose forward is "
                     "torch's own, such as a bare nn.Sequential, is skipped by dynamo): training runs eagerly")
        self._checked = True
        return self.seconds

    def __getattr__(self, name: str) -> Any:  # inductor's wrapper answers dynamo's questions (its config)
        if name in ("inner", "_checked"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def compile_wrapper(wrapper: Any, cfg: "Config") -> Optional[CompileClock]:
    """`train.compile`: the wrapped model compiled as its strategy needs (`wrapper.compile`, in
    place); the clock that counts what torch compiles, lazily, in the first steps. None when off."""
    setting = cfg.train.compile
    if setting is False:
        return None
    clock = CompileClock(cfg.train.compile_backend, None if setting in (True, "default") else setting)
    try:
        wrapper.compile(backend=clock)
    except ValueError as exc:  # what this strategy cannot compile: one line
        raise UserError(f"train.compile with parallel.strategy={cfg.parallel.strategy!r}: {exc}") from None
    return clock
