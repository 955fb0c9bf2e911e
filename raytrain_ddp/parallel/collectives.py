"""Agree-across-ranks helpers: the small collectives that keep every rank on one decision.

Owns: the few reductions the loop, the data shard and the preemption guard use so that
every rank takes the same branch at the same step (skip a step, stop an epoch, poll Ray,
resume from a step), and the `bucketed` wrapper uses to agree on its tuned layout. Must not touch: gradients (the wrappers own those), Ray.

Every helper is a collective: all ranks must call it, in the same order. Outside a
process group (or with one rank) each returns the local answer, so unit tests and
world-size-1 runs need no special case.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from raytrain_ddp.parallel.errors import PeerLost, RanksDisagreeError


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """A collective's failure as `PeerLost`: around one synchronous collective (and nothing
    else) a `RuntimeError` can only be the group's. The wrappers' own collectives use it too."""
    try:
        yield
    except PeerLost:
        raise
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PeerLost(f"{what} failed on this rank ({type(exc).__name__}: {first}); a peer rank was lost") from exc


def _active(group: Optional[dist.ProcessGroup] = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_sum_(t: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum `t` over the ranks of `group`, in place, and return it: nothing is read on the host
    (on CUDA the all-reduce is queued on the stream; read the result when it is needed)."""
    if _active(group):
        with collective("all reduce"):
            dist.all_reduce(t, group=group)
    return t


def sum_over_ranks(values: Sequence[float] | torch.Tensor, device: Optional[torch.device] = None,
                   group: Optional[dist.ProcessGroup] = None) -> list[float]:
    """Element-wise sum over the ranks of `group` (default: all); float64 unless a tensor is given."""
    t = values.detach().clone() if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.float64, device=device)
    if _active(group):
        with collective("all reduce"):
            dist.all_reduce(t, group=group)
    return t.flatten().tolist()  # one device->host copy, not one per element


def union_over_ranks(names: Sequence[str]) -> list[str]:
    """The sorted union of every rank's `names` (a rank that saw no batch still learns them)."""
    if not _active():
        return sorted(set(names))
    gathered: list[Optional[list[str]]] = [None] * dist.get_world_size()
    with collective("all gather object"):
        dist.all_gather_object(gathered, sorted(set(names)))
    return sorted(set().union(*(g or [] for g in gathered)))


def max_over_ranks(values: Sequence[float], device: Optional[torch.device] = None) -> list[float]:
    """Element-wise maximum over ranks."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if _active():
        with collective("all reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_true(flag: bool, device: Optional[torch.device] = None) -> bool:
    """True only if `flag` is true on every rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if _active():
        with collective("all reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def from_main(value: int, device: Optional[torch.device] = None) -> int:
    """Rank 0's `value` on every rank."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if _active():
        with collective("broadcast"):
            dist.broadcast(t, src=0)
    return int(t.item())


def check_same(value: int, what: str, device: Optional[torch.device] = None) -> None:
    """Raise on every rank, naming `what`, unless all ranks hold the same `value`."""
    high, neg_low = max_over_ranks([value, -value], device)
    if int(high) != -int(neg_low):
        raise RanksDisagreeError(f"ranks disagree on {what}: min {-int(neg_low)}, max {int(high)} (this rank: {value})")
