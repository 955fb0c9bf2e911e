"""Every private name of torchft the package relies on, in one room (like `ray_compat.py` for Ray).

Owns: each private torchft name as one small function; a torchft release that moves one
fails its test in `tests/unit/test_torchft_compat.py` by this module's function name.
torchft is imported inside each function: it is an optional dependency (`[live]`).
Also relied on, by override rather than by call: `ProcessGroupGloo._create_pg` and
`ProcessGroupNCCL._create_pg(store, rank, world_size)` (`worker/live.py`'s `LiveGroup`
makes its sub-groups with it); its test is `test_create_pg`.
"""

from __future__ import annotations

from typing import Any, Optional


def quorum_id(manager: Any) -> int:
    """The id of the quorum `manager` last configured its group for (`Manager._quorum_id`)."""
    return manager._quorum_id


def manager_server(manager: Any) -> Optional[Any]:
    """The `ManagerServer` a first rank's `Manager` runs (`Manager._manager`), None on other ranks."""
    return getattr(manager, "_manager", None)


def bracketed(host: str) -> str:
    """`host` as the host part of an address: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bound_manager(host: str, **kwargs: Any) -> Any:
    """A torchft `Manager` whose server listens on `host` only (advertised as `host` too).

    torchft binds the manager's gRPC server to `[::]` (every interface) with no way to
    say otherwise; it serves quorum and commit calls without any token. The
    `torchft.manager.ManagerServer` that `Manager.__init__` builds is given `host` in its
    bind address for that call only (`tests/unit/test_live_pieces.py` checks the socket)."""
    import torchft.manager as torchft_manager

    server = torchft_manager.ManagerServer

    def bound_server(*, bind: str, **options: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return server(bind=f"{bracketed(host)}:{port}", **options)

    torchft_manager.ManagerServer = bound_server
    try:
        return torchft_manager.Manager(hostname=host, **kwargs)
    finally:
        torchft_manager.ManagerServer = server
