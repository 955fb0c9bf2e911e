"""Every private torchft name the package relies on, in one room (like `ray_compat.py` for Ray).

Owns: each reliance on torchft beyond its public API as one small function; a torchft release
that moves one fails its test in `tests/local/unit/test_torchft_compat.py` by this module's name.
torchft is imported inside each function: it is an optional dependency (`[live]`).
Also relied on, by override rather than by call: `ProcessGroupGloo._create_pg` and
`ProcessGroupNCCL._create_pg(store, rank, world_size)` (`recovery/live_group.py`'s `LiveGroup`
makes its sub-groups with it and registers itself with the store torchft made for the quorum;
its test is `test_create_pg`). Why not torchft's public composition instead (`ManagedProcessGroup`,
`torchft.ddp.DistributedDataParallel`): torch DDP's C++ reducer reads a group's size from its C++
base, which torchft builds once with size 1 (so `native` needs a plain c10d group of the quorum,
made from that store), and torchft's DDP replaces our wrappers (naive, bucketed, native) with one
of its own that forces `find_unused_parameters` and waits on each bucket.
"""

from __future__ import annotations

import os
from typing import Any, Optional


def bracketed(host: str) -> str:
    """`host` as the host part of an address: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bound_manager(host: str, servers: Optional[list] = None, **kwargs: Any) -> Any:
    """A torchft `Manager` whose server listens on `host` only (advertised as `host` too); the
    `ManagerServer` it built (the first rank's) is appended to `servers`.

    torchft binds the manager's gRPC server to `[::]` (every interface) with no way to
    say otherwise; it serves quorum and commit calls without any token. The
    `torchft.manager.ManagerServer` that `Manager.__init__` builds is given `host` in its
    bind address for that call only (`tests/local/unit/test_live_pieces.py` checks the socket)."""
    import torchft.manager as torchft_manager

    server = torchft_manager.ManagerServer

    def bound_server(*, bind: str, **options: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        built = server(bind=f"{bracketed(host)}:{port}", **options)
        if servers is not None:
            servers.append(built)
        return built

    torchft_manager.ManagerServer = bound_server
    try:
        return torchft_manager.Manager(hostname=host, **kwargs)
    finally:
        torchft_manager.ManagerServer = server


def raised_in_torchft(exc: BaseException) -> bool:
    """Whether `exc` was raised inside torchft's code (a file under a `torchft/` folder): a
    collective on its reconfigurable group whose peer is gone fails in the C++ call that
    torchft's wrapper makes (`ProcessGroupWrapper.allreduce` and the like), with no frame of
    torch.distributed or of ours, and no type of its own to tell it by."""
    tb = exc.__traceback__
    while tb is not None:
        if "torchft/" in tb.tb_frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        tb = tb.tb_next
    return False
