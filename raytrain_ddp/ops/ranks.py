"""Run one function on W ranks of a process group on 127.0.0.1 and bring back what each returned.

Owns: starting rank processes, the process group they share, collecting results or
tracebacks, and making sure nothing outlives its deadline. Must not touch: Ray (this
package must import without it), or any process it did not start (leftovers are killed
by pid, never by name). One launcher for the test suite (tests/_spawn.py re-exports it)
and for `raytrain-ddp bench`, so both start, time out and clean up ranks the same way.
Nothing here is imported by `raytrain_ddp.parallel` itself: import this module by name.

    from raytrain_ddp.ops.ranks import run_ranks

    def _body(world_rank, world_size, scale):     # module level, so it pickles by name
        t = torch.ones(1) * world_rank * scale
        dist.all_reduce(t)
        return t.item()                           # anything picklable

    assert run_ranks(_body, 2, 10.0, timeout_s=60) == [10.0, 10.0]

Why it is built this way:
- Ranks start from a `forkserver` that has imported torch once, so each rank costs a
  fork, not a 2-second `import torch` (pass start_method="spawn" for a clean interpreter).
- `threads=N` calls `torch.set_num_threads(N)` in each rank before anything else: W ranks
  on a machine with few cores would otherwise each start one intra-op thread per core and
  oversubscribe them (the benchmarks pass 1 on CPU).
- After `init_process_group` all ranks pass one barrier (so nobody leaves while a peer is
  still connecting); then each rank pickles its result itself and leaves with `os._exit`:
  no process-group teardown can abort or hang after the answer is in, and a rank that
  raised never keeps its peers waiting. Peers blocked in a collective with an exited rank
  get a connection error at once, so ranks should do the same collectives (as real
  training does) or synchronise before returning.
- The port is picked free, then bound by rank 0's store: a rank whose process group fails on
  a port taken in between (or a peer not reachable yet, `errors.start_fault`) ends that start,
  and the ranks start again on a fresh port (at most `START_TRIES` starts, one deadline).
- One hard deadline for the whole group: on expiry every rank still running is killed
  (SIGKILL, by pid) and `RankTimeout` says which ranks never answered.
- A rank that raised makes `run_ranks` raise `RankFailed` carrying that rank's formatted
  traceback (the first failing rank by rank order; the others are attached too).
  Use `return_exceptions=True` to get `RankException` objects in the result list instead
  (for tests that expect some ranks to raise). Both errors subclass `RankError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

from raytrain_ddp.errors import START_TRIES, start_fault

START = "start"  # a rank's answer: its process group failed on a fault a fresh port can mend

__all__ = ["run_ranks", "free_port", "RankError", "RankFailed", "RankTimeout", "RankException"]


class RankError(RuntimeError):
    """The ranks did not all answer: one raised (`RankFailed`) or the deadline passed (`RankTimeout`)."""


class RankFailed(RankError):
    """A rank raised; the message holds its traceback (and the others', if any)."""


class RankTimeout(RankError):
    """Some ranks did not finish before the deadline; they were killed."""


@dataclass
class RankException:
    """What a rank raised, as seen from the parent (return_exceptions=True)."""

    world_rank: int
    type_name: str  # e.g. "CollectiveTimeoutError"
    message: str  # str(exception)
    traceback: str
    elapsed_s: float  # seconds from process-group init to the raise

    def __str__(self) -> str:
        return f"rank {self.world_rank} raised {self.type_name}: {self.message}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, world_rank, world_size, port, args, kwargs, backend, init_pg, pg_timeout_s, threads,
               out_q):
    # Runs in the child. Loopback only: gloo otherwise resolves the hostname to pick an interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if os.path.exists("/sys/class/net/lo") else "lo0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(world_rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(world_rank), LOCAL_WORLD_SIZE=str(world_size))
    start = time.monotonic()
    try:
        import torch  # already imported by the forkserver: free
        import torch.distributed as dist

        if threads is not None:
            torch.set_num_threads(threads)
        if init_pg:
            try:
                dist.init_process_group(
                    backend, init_method=f"tcp://127.0.0.1:{port}", rank=world_rank,
                    world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
                )
            except Exception as exc:
                if start_fault(exc) is None:
                    raise
                out_q.put((world_rank, START, pickle.dumps(start_fault(exc))))  # run_ranks starts them again
                out_q.close()
                out_q.join_thread()
                os._exit(0)
            # Every rank finishes connecting before any may leave: a rank that returns (or
            # raises) at once would otherwise break a peer still inside gloo's connect.
            # NCCL needs a device for it; left to itself every rank would pick GPU 0.
            if backend == "nccl":
                dist.barrier(device_ids=[world_rank % torch.cuda.device_count()])
            else:
                dist.barrier()
        start = time.monotonic()
        payload = ("ok", pickle.dumps(fn(world_rank, world_size, *args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        payload = ("err", pickle.dumps(RankException(
            world_rank, type(exc).__name__, str(exc), traceback.format_exc(), time.monotonic() - start)))
    out_q.put((world_rank,) + payload)
    out_q.close()
    out_q.join_thread()  # flush before leaving without any teardown
    if init_pg:
        _linger(world_rank, world_size)
    os._exit(0)


def _linger(world_rank: int, world_size: int, limit_s: float = 10.0) -> None:
    """Leave together (bounded): an early exit could reset sockets a peer is still reading.

    Uses the TCP store, not gloo, so it works even after a failed collective; a rank that
    never arrives costs at most `limit_s` (and the parent's deadline still applies).
    Rank 0 hosts the store, so it leaves last: only after every other rank has seen that
    all arrived and said so. Otherwise a peer's last poll finds the store gone, and the
    store client prints a ~30-line "Connection reset by peer" C++ trace on a run that
    succeeded.
    """
    try:
        from raytrain_ddp.parallel import torch_compat

        store = torch_compat.default_store()
        store.add("_launch_done", 1)
        deadline = time.monotonic() + limit_s
        while store.add("_launch_done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.02)
        if world_rank != 0:
            store.add("_launch_left", 1)  # the last time this rank talks to the store
            return
        while store.add("_launch_left", 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone already
        pass


_CTX_CACHE: dict[str, Any] = {}


def _context(start_method: str):
    if start_method not in _CTX_CACHE:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _CTX_CACHE[start_method] = ctx
    return _CTX_CACHE[start_method]


# Over 60 lines: the launcher's contract is its docstring; the body is ~30 lines of start, wait, collect.
def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    init_pg: bool = True,
    pg_timeout_s: Optional[float] = None,
    return_exceptions: bool = False,
    start_method: str = "forkserver",
    threads: Optional[int] = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(world_rank, world_size, *args, **kwargs)` on `world_size` ranks; return results by rank.

    `init_pg=False` skips `init_process_group` (the env vars are still set).
    `pg_timeout_s` is the process group's own collective timeout (default: `timeout_s`),
    so a lost peer fails the collective before the parent's deadline kills the ranks.
    `threads`: torch intra-op threads per rank (default: torch's own choice).
    `backend`: "gloo" (CPU) or "nccl" (one GPU per rank; `fn` picks its device).
    """
    ctx = _context(start_method)
    pg_timeout = pg_timeout_s if pg_timeout_s is not None else timeout_s
    deadline = time.monotonic() + timeout_s
    for tried in range(1, START_TRIES + 1):  # the picked port taken before rank 0 bound it: a fresh one
        results, procs = _start_ranks(ctx, fn, world_size, free_port(), args, kwargs, backend, init_pg,
                                      pg_timeout, threads, deadline)
        if not any(status == START for status, _ in results.values()) or tried == START_TRIES:
            break
    causes = [answer for status, answer in results.values() if status == START]
    if causes:
        raise RankFailed(f"{fn.__name__}: the ranks' process group did not form, {START_TRIES} times: {causes[0]}")
    missing = [r for r in range(world_size) if r not in results]
    failed = [results[r][1] for r in sorted(results) if results[r][0] == "err"]
    if missing:
        detail = "".join(f"\n--- {e} ---\n{e.traceback}" for e in failed)
        exitcodes = {r: procs[r].exitcode for r in missing}
        raise RankTimeout(
            f"{fn.__name__}: ranks {missing} of {world_size} did not answer within {timeout_s}s "
            f"(killed; exit codes {exitcodes}){detail}"
        )
    if failed and not return_exceptions:
        first = failed[0]
        others = "".join(f"\n--- also: {e} ---\n{e.traceback}" for e in failed[1:])
        raise RankFailed(f"{fn.__name__}: {first}\n{first.traceback}{others}")
    return [results[r][1] for r in range(world_size)]


def _start_ranks(ctx: Any, fn: Callable[..., Any], world_size: int, port: int, args: Any, kwargs: Any, backend: str,
                 init_pg: bool, pg_timeout: float, threads: Optional[int],
                 deadline: float) -> tuple[dict[int, tuple[str, Any]], list[Any]]:
    """One start of the ranks on `port`: what each answered (a rank whose process group failed on
    a start fault answers `START`, and the others are killed then), and the processes."""
    out_q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, name=f"rank{r}", daemon=True,
                    args=(fn, r, world_size, port, args, kwargs, backend, init_pg, pg_timeout, threads,
                          out_q))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, blob = out_q.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and out_q.empty():
                    break  # every process died without answering (e.g. killed, segfault)
                continue
            results[rank] = (status, pickle.loads(blob))
            if status == START:  # its peers wait for a store that is not theirs: not for long
                break
    finally:
        for proc in procs:
            proc.join(timeout=0 if any(v[0] == START for v in results.values())
                      else max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        out_q.close()
    return results, procs
