"""What every data-parallel strategy shares: the wrapper interface, start-up sync, errors.

Owns: `WrappedModel` (the one interface naive / bucketed / native implement, shaped like
Lightning Fabric's strategy: call it like the module, `.module` for the bare model,
`.no_sync()` to skip gradient sync, `.comm_stats` for what was sent), the rank-0
broadcast / `verify_init` check done at wrap time, and the errors the wrappers raise.
Must not touch: Ray, optimizers, data, checkpoints files. Only torch and torch.distributed.
"""

from __future__ import annotations

import contextlib
import zlib
from datetime import timedelta
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.errors import UserError

STRATEGIES = ("naive", "bucketed", "native")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish in time, or failed; the message names the operation.

    Usually a peer rank died, hangs, or skipped a step (ranks must run the same number
    of synced backward passes). Raised on the rank that was left waiting.
    """


class ModelMismatchError(UserError, RuntimeError):
    """Ranks hold different models (structure, or weights with verify_init=True)."""


class WrappedModel(nn.Module):
    """Interface shared by the three strategies.

    - call it like the module; `.module` is the bare model (save `.module` or use
      `state_dict()`, which returns the bare module's keys, so checkpoints load into an
      unwrapped model and into every strategy alike);
    - `.no_sync()` suppresses gradient sync: backward only accumulates locally;
    - outside `no_sync()`, when `loss.backward()` returns every rank holds the same
      gradient, averaged over ranks, so `optimizer.step()` is safe right away;
    - `.comm_stats` / `reset_comm_stats()` account for what was all-reduced.

    Build optimizers from `wrapper.parameters()` or `wrapper.module.parameters()` (same
    tensors); use `wrapper.module.named_parameters()` when names matter (the wrapper adds a
    prefix, as torch DDP does).
    """

    strategy: str = ""

    def __init__(self, process_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self._pg = process_group
        if process_group is None and not dist.is_initialized():
            self.world_size, self.world_rank = 1, 0
        else:
            self.world_size = dist.get_world_size(process_group)
            self.world_rank = dist.get_rank(process_group)
        self._sync_enabled = True
        self._stats = {"allreduce_calls": 0, "allreduce_bytes": 0, "syncs": 0}

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

    # -- sync control -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and send nothing."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def comm_stats(self) -> dict[str, Any]:
        """Cumulative since wrap (or `reset_comm_stats`): all-reduce calls and bytes on the wire."""
        return dict(self._stats)

    def close(self) -> None:
        """Stop synchronising (remove hooks). Called automatically when the module is re-wrapped."""

    def reset_comm_stats(self) -> None:
        for key in ("allreduce_calls", "allreduce_bytes", "syncs"):
            self._stats[key] = 0


_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class ScratchBase(WrappedModel):
    """What naive and bucketed share: the start-up sync, hook handles, waiting and counting."""

    def __init__(self, module: nn.Module, process_group, verify_init: bool,
                 collective_timeout_s: Optional[float]) -> None:
        super().__init__(process_group)
        self.wrapped = module
        self.collective_timeout_s = collective_timeout_s
        if self.world_size > 1:
            sync_initial_state(module, process_group, verify=verify_init,
                               world_size=self.world_size, world_rank=self.world_rank)
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._queued = False  # a sync callback is queued for the running backward
        self._handles: list = []

    def close(self) -> None:
        """Remove our gradient hooks: the module trains unsynchronised again (or can be re-wrapped)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def module(self) -> nn.Module:
        return self.wrapped

    def _wait(self, work, what: str) -> None:
        wait_work(work, what, self.collective_timeout_s, self.world_rank, self.world_size)

    def _count(self, tensor: torch.Tensor) -> None:
        self._stats["allreduce_calls"] += 1
        self._stats["allreduce_bytes"] += tensor.numel() * tensor.element_size()


# -- start-up: same structure everywhere, then rank 0's weights everywhere --------------

def _named_state(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """Parameters then buffers, in registration order: the order every rank broadcasts in."""
    items = [("parameter", n, p) for n, p in module.named_parameters()]
    items += [("buffer", n, b) for n, b in module.named_buffers()]
    return items


def check_structure(module: nn.Module, pg, world_size: int, world_rank: int) -> None:
    """One tiny all-reduce so a rank with a different model fails clearly instead of hanging."""
    items = _named_state(module)
    device = items[0][2].device if items else torch.device("cpu")
    signature = ";".join(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}" for kind, name, t in items)
    crc = zlib.crc32(signature.encode())
    flags = torch.tensor([crc, -crc], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
    if flags[0].item() != crc or flags[1].item() != -crc:
        raise ModelMismatchError(
            f"the model's structure differs across ranks (rank {world_rank} of {world_size} has "
            f"{len(items)} parameters/buffers, signature crc32={crc}); every rank must build the "
            "same model (same names, shapes and dtypes) before wrap_model"
        )


def sync_initial_state(module: nn.Module, pg, *, verify: bool, world_size: int, world_rank: int) -> None:
    """Broadcast rank 0's parameters and buffers (verify=False), or check they already agree.

    With verify=True nothing is overwritten: every rank compares its tensors with rank 0's
    and a flag matrix is all-reduced, so every rank (not only the odd one out) raises the
    same `ModelMismatchError` naming the first differing tensor; no rank is left waiting.
    """
    items = _named_state(module)
    if not items:
        return
    device = items[0][2].device
    check_structure(module, pg, world_size, world_rank)
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    differs = torch.zeros(world_size, len(items), dtype=torch.int32, device=device)
    max_diff: dict[int, float] = {}
    with torch.no_grad():
        for i, (_, _, tensor) in enumerate(items):
            if not verify:
                dist.broadcast(tensor.data, src=src, group=pg)
                continue
            reference = tensor.detach().clone()
            dist.broadcast(reference, src=src, group=pg)
            if not torch.equal(reference, tensor.detach()):
                differs[world_rank, i] = 1
                if tensor.is_floating_point() and tensor.numel():
                    max_diff[i] = (reference - tensor.detach()).abs().max().item()
    if not verify:
        return
    dist.all_reduce(differs, group=pg)  # everyone learns every rank's verdict
    bad_items = differs.any(dim=0).nonzero()
    if bad_items.numel():
        i = int(bad_items[0])
        kind, name, _ = items[i]
        ranks = differs[:, i].nonzero().flatten().tolist()
        n_bad = bad_items.numel()
        here = f" (max abs difference on this rank: {max_diff[i]:g})" if i in max_diff else ""
        raise ModelMismatchError(
            f"model parameters are not the same on all processes: {kind} '{name}' on rank(s) "
            f"{ranks} differs from rank 0{here}; {n_bad} of {len(items)} tensors differ. "
            "Seed every rank identically before building the model (torch.manual_seed), or "
            "wrap with verify_init=False to broadcast rank 0's weights instead."
        )


# -- waiting on collectives --------------------------------------------------------------

def wait_work(work, what: str, timeout_s: Optional[float], world_rank: int, world_size: int) -> None:
    """Wait for an async collective; a timeout or failure becomes a `CollectiveTimeoutError`.

    `timeout_s=None` waits as long as the process group's own timeout (set at
    `init_process_group`) allows; a failure then is still reported with `what` in it.
    """
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo: RuntimeError("Operation timed out!"), DistBackendError, ...
        text = str(exc)
        if timeout_s is not None and "timed out" in text.lower():
            verdict = f"did not finish within {timeout_s:g}s"
        else:
            verdict = f"failed ({type(exc).__name__}: {text.strip().splitlines()[0] if text else ''})"
        raise CollectiveTimeoutError(
            f"{what} {verdict} on rank {world_rank} of {world_size}; a peer rank probably died, "
            "hangs, or skipped this step (every rank must run the same synced backward passes)"
        ) from exc


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def describe_tensors(names: list[str], nbytes: int, limit: int = 3) -> str:
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{format_bytes(nbytes)}, params: {shown}"
