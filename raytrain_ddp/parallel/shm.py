"""Gradient all-reduce through shared memory, for ranks that share one host (CPU tensors).

Owns: the shared segments (one file in /dev/shm per flat gradient buffer), the exchange
of one bucket, and the collective decision to use them. Must not touch: buckets, hooks,
what is sent when (`bucketed.py` decides). torch and torch.distributed only.

Why: gloo moves every byte through the kernel's TCP stack, even between two processes on
one machine. Writing the bucket into shared memory, one one-element all-reduce on the
process group as a barrier, and summing the ranks' slots does the same all-reduce with
plain memory traffic (measured in benchmarks/README.md#shared-memory-all-reduce). torch
has no shared-memory CPU backend; DeepSpeed's CPU inference uses the same idea.

Layout: a segment per flat buffer of `numel` elements holds `[2][world_size][numel]`: two
parities, one slot per rank. Exchanging the bucket `flat[lo:hi]` at synced backward `s`:
    launch  copy the bucket into `seg[s % 2][rank][lo:hi]`; start the barrier (async)
    wait    the barrier (every rank wrote its slot), then the bucket becomes
            `seg[s % 2][0][lo:hi] + seg[s % 2][1][lo:hi] + ...`, in rank order: the same
            bits on every rank (for two ranks, the bits gloo's sum gives: a + b == b + a)
No second barrier: a rank writes parity `p` again at backward `s + 2`, after it has waited
for every barrier of `s + 1`, and no rank starts those before it has read its slots of `s`.
Every exchange is a collective on the process group in the caller's order, so a rank that
dies or stalls fails its peers' waits as a gloo all-reduce would (`collective_timeout_s`).

Used only when every rank opened rank 0's segments (one host, or one /dev/shm), the
gradients are on CPU and the segments fit `budget_bytes` and half the free space of
/dev/shm; otherwise `open_exchange` returns None on every rank and gloo does the work.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from raytrain_ddp.parallel import torch_compat

SHM_DIR = "/dev/shm"
SPAN = "shm:all_reduce"  # torch.profiler's name for the copy into the slot and the sum (as gloo's "gloo:all_reduce")
BUDGET_BYTES = 4 * 2**30  # the segments of one wrapper, all ranks' slots and both parities


class ShmWork:
    """One bucket's exchange in flight; `wait` and `is_completed` as a process group's work."""

    __slots__ = ("_barrier", "_finish", "_done")

    def __init__(self, barrier, finish) -> None:
        self._barrier, self._finish, self._done = barrier, finish, False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout=None) -> bool:
        if not self._done:
            if timeout is None:
                self._barrier.wait()
            else:
                self._barrier.wait(timeout=timeout)
            with _span():
                self._finish()
            self._done = True
        return True


class ShmExchange:
    """The segments of one set of flat buffers, opened on every rank (see the module docstring)."""

    def __init__(self, segments: list[torch.Tensor], pg, world_rank: int, world_size: int) -> None:
        self._segments = segments  # [2][world][numel] per flat buffer, views of shared memory
        self._pg = pg if pg is not None else dist.group.WORLD
        self.rank, self.world_size = world_rank, world_size
        self.syncs = 0  # completed synced backwards: the parity in use

    def launch(self, flat_index: int, bucket: torch.Tensor, lo: int, hi: int) -> ShmWork:
        slots = self._segments[flat_index][self.syncs % 2]
        with _span():
            slots[self.rank, lo:hi].copy_(bucket)
        barrier = self._pg.allreduce([torch.zeros(1, dtype=torch.int32)])  # its own: several are in flight
        if self.world_size == 2:
            finish = lambda: torch.add(slots[0, lo:hi], slots[1, lo:hi], out=bucket)  # noqa: E731
        else:
            finish = lambda: torch.sum(slots[:, lo:hi], dim=0, out=bucket)  # noqa: E731
        return ShmWork(barrier, finish)

    def synced(self) -> None:
        """A synced backward finished: the next one writes the other parity."""
        self.syncs += 1


def open_exchange(flats: list[torch.Tensor], pg, world_rank: int, world_size: int,
                  budget_bytes: int = BUDGET_BYTES, shm_dir: str = SHM_DIR,
                  wait: Callable[[Any, str], None] = lambda work, what: work.wait()) -> Optional[ShmExchange]:
    """Collective: every rank of `pg` calls it with its flat buffers (same sizes everywhere).

    Rank 0 creates the segments (and reserves their pages, so a full /dev/shm is an error
    here and not a SIGBUS later), the others open them by a name rank 0 broadcasts; rank 0
    unlinks the files once every rank holds them, so nothing outlives the processes. Returns
    None on every rank where any rank could not (another host, no space), and without any
    communication when there is nothing to share or it is not on CPU (the same on every rank).
    `wait(work, what)` waits for its two collectives (the wrapper's, with its timeout).
    """
    if not flats or any(f.device.type != "cpu" for f in flats):
        return None
    group_rank_0 = dist.get_global_rank(pg, 0) if pg is not None else 0
    sizes = [2 * world_size * f.numel() * f.element_size() for f in flats]
    token = torch.zeros(16, dtype=torch.uint8)
    segments: Optional[list[torch.Tensor]] = []
    created: list[str] = []  # rank 0 unlinks them however this ends: nothing outlives the processes
    if world_rank == 0:  # create first: the others open as soon as they hear the name
        if sum(sizes) <= min(budget_bytes, _free_bytes(shm_dir) // 2):
            token.copy_(torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8))
            created = _paths(shm_dir, token, len(flats))
            segments = _open_all(created, sizes, flats, world_size, create=True)
            if segments is None:
                token.zero_()  # all zeros: not this time
    try:
        wait(dist.broadcast(token, src=group_rank_0, group=pg, async_op=True), "broadcast of the shared-memory name")
        if not token.any():
            return None
        if world_rank != 0:
            segments = _open_all(_paths(shm_dir, token, len(flats)), sizes, flats, world_size, create=False)
        ok = torch.tensor([segments is not None], dtype=torch.int32)
        # after it every rank holds them, or all give up
        wait(dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg, async_op=True), "all-reduce of the shared-memory check")
    finally:
        for path in created:
            _unlink(path)
    if not ok.item():
        return None
    return ShmExchange(segments, pg, world_rank, world_size)


def _paths(shm_dir: str, token: torch.Tensor, count: int) -> list[str]:
    return [os.path.join(shm_dir, f"raytrain_ddp_{token.numpy().tobytes().hex()}_{i}") for i in range(count)]


def _open_all(paths: list[str], sizes: list[int], flats: list[torch.Tensor], world_size: int,
              create: bool) -> Optional[list[torch.Tensor]]:
    try:
        return [_map(path, size, flat.dtype, create).view(2, world_size, flat.numel())
                for path, size, flat in zip(paths, sizes, flats)]
    except OSError:
        if create:
            for path in paths:
                _unlink(path)
        return None


@contextlib.contextmanager
def _span() -> Iterator[None]:
    """A `SPAN` in torch.profiler's trace while it records (`record_function` costs
    microseconds; checking whether the profiler is on, 0.1 us)."""
    if not torch_compat.profiler_enabled():
        yield
        return
    from torch.profiler import record_function

    with record_function(SPAN):
        yield


def _map(path: str, size: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A tensor over the file at `path` (created and filled to `size` bytes by rank 0)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
        buffer = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=dtype)


def _free_bytes(shm_dir: str) -> int:
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
