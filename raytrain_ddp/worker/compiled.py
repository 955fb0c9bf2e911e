"""`train.compile`: how the step computes, never what (activation checkpointing, the other
such switch, is `models.checkpoint_activations`: the driver's checks apply it too).

Owns: `compile_wrapper` (the wrapped model compiled as its strategy says, `WrappedModel.compile`)
and `CompileClock`, the backend that counts the graphs compiled and the seconds spent (the
start-up timeline's compile phase), and carries torch's compile caches in the run directory
(`compile-cache.bin`): every rank loads them before its first step, rank 0 saves them when it
compiled something new. Training, `raytrain-ddp verify` and the bench call these same
functions. Must not touch: the strategies' hooks (each wrapper compiles itself), the step.

Why the run directory: inductor's FX graph and AOTAutograd caches already persist on a node's
disk (`TORCHINDUCTOR_CACHE_DIR`, default under /tmp), which serves a restart on the same node;
a new node, a fresh container, or a cluster without a shared disk starts cold. torch's public
"mega-cache" (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`) packs what this
process compiled or hit into bytes that populate those caches elsewhere; the run directory
(local or object storage, `rundir.Location`) is where every worker of every attempt finds
them. torch keys each entry by graph, inputs, config and its own version: a stale or foreign
file only misses (and an unreadable one is said and ignored), it never changes a number.
Only inductor fills these caches (other backends compile nothing worth keeping).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from raytrain_ddp.errors import UserError
from raytrain_ddp.parallel import torch_compat
from raytrain_ddp.rundir import COMPILE_CACHE_FILE, Location

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
        self.cache: Optional[Location] = None  # the run directory's compile-cache.bin (`use_cache`)
        self.loaded, self._saved = 0, 0  # artifacts loaded; graphs compiled when rank 0 last saved

    def use_cache(self, run_dir: Location, rank: Any) -> int:
        """Before the first step: torch's caches filled from the run directory's compile-cache.bin
        (a restart, a resume, a new node); the artifacts loaded (0: none there, or unreadable)."""
        self.cache = run_dir / COMPILE_CACHE_FILE
        info, why = None, "torch could not read it"
        try:
            payload = self.cache.read_bytes() if self.cache.exists() else b""
            info = torch.compiler.load_cache_artifacts(payload) if payload else None
        except Exception as exc:  # noqa: BLE001 -- a cache is an optimisation: a bad one costs a cold compile
            payload, why = b"?", f"{type(exc).__name__}: {exc}"
        if payload and info is None:
            rank.say(f"warning: train.compile: {self.cache} not loaded ({why}): compiling cold")
        self.loaded = sum(len(keys) for keys in info.artifacts.values()) if info else 0
        return self.loaded

    def _save(self, rank: Any) -> None:
        """Rank 0, after a step in which torch compiled: what this process compiled or found in
        the caches, packed (`torch.compiler.save_cache_artifacts`) over the run directory's file."""
        if self.cache is None or not rank.is_main or self.graphs == self._saved:
            return
        self._saved = self.graphs
        try:
            packed = torch.compiler.save_cache_artifacts()
            if packed:
                self.cache.write_bytes(packed[0])
        except Exception as exc:  # noqa: BLE001 -- the next start compiles cold, nothing else is lost
            rank.say(f"warning: train.compile: {self.cache} not saved ({type(exc).__name__}: {exc})")

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(graph, example_inputs)
        finally:
            self.graphs += 1
            self.seconds += time.perf_counter() - start

    def first_step_seconds(self, rank: Any) -> float:
        """After each step: the compile seconds so far (rank 0 saves the caches when torch compiled
        in it); after the first, once, a line from rank 0 when torch compiled nothing (dynamo
        skips a model whose forward is torch's own, such as a bare `nn.Sequential`): the run
        trains eagerly, and says so."""
        self._save(rank)
        if not self._checked and not self.graphs:
            rank.say("warning: train.compile: torch compiled no graph in the first step (a model whose forward is "
                     "torch's own, such as a bare nn.Sequential, is skipped by dynamo): training runs eagerly")
        self._checked = True
        return self.seconds

    def __getattr__(self, name: str) -> Any:  # inductor's wrapper answers dynamo's questions (its config)
        if name in ("inner", "_checked", "cache", "loaded", "_saved"):
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
