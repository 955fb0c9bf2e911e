"""torchft's reconfigurable process group as `run.recovery: live` uses it (`live.py`).

Owns: the group class (`LiveGroup`: NCCL on CUDA, gloo on the CPU), installing it as torch's
default group, and where this worker's manager and the lighthouse listen. Must not touch:
the step's commit and retry (`live.py`), the wrappers (used as they are, over this group).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from raytrain_ddp.parallel import torch_compat
from raytrain_ddp.torchft_compat import bracketed

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # set on every worker by Ray's torchft backend
LIGHTHOUSE_HOST_ENV = "RAYTRAIN_DDP_LIGHTHOUSE_HOST"  # the address our launcher bound the lighthouse to


def live_group_base(device: Optional[torch.device] = None) -> tuple[type, str]:
    """torchft's reconfigurable group for `device`, and its backend's name: NCCL on CUDA, gloo on
    the CPU (torchft's gloo group also takes CUDA tensors, but through host memory, and its
    waits block the host: issue #41)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if device is not None and torch.device(device).type == "cuda":
        return ProcessGroupNCCL, "nccl"
    return ProcessGroupGloo, "gloo"


# Over 60 lines: one class definition, built on first use (torchft is an optional dependency).
def live_group_class(device: Optional[torch.device] = None) -> type:
    """torchft's reconfigurable group for `device` (`live_group_base`), with what torch expects of a
    default group."""
    base, backend = live_group_base(device)

    class LiveGroup(base):  # type: ignore[misc, valid-type]
        """Our rank is the quorum's (torch asks the default group for it); an all-reduce without
        options is a sum (our bucketed wrapper calls the group's method directly).

        `dist.new_group` on it (torch calls a default group's `new_group`) gives a plain c10d
        gloo group of the current quorum, which torch registers like any group: torch DDP
        (`native`) runs on one, since its C++ reducer reads the group's size from the C++ base,
        and torchft's is built once with size 1. Its store keys are numbered per quorum (every
        member re-wraps in the same order after a reconfiguration); `ahead` of them are made
        with the quorum, and each reconfiguration ends the previous quorum's. A torch whose
        `new_group` does not ask the default group (2.11) makes sub-groups itself (a wrapper's
        side group too): once `adopt` sees one, every group c10d registered since the quorum
        formed is ended with the quorum's, and none are made ahead (torch would never take
        them). gloo closes a
        group's connections only when the group is freed, not at its `abort`, and
        a wrapper holds its sub-group until the re-wrap: a member whose own collectives
        completed is stopped by the step's commit vote, which every member reaches."""

        _store: Any = None
        _subgroups: list = []  # this quorum's, handed out or not
        _ready: list = []  # made with the quorum, not handed out yet
        _before: list = []  # the groups c10d held when the quorum formed
        _torch_makes = False  # torch makes sub-groups itself (adopt saw one)
        ahead = 0  # sub-groups to make with each quorum (`live.SUBGROUPS`)
        quorum: Optional[int] = None  # the quorum id it was last configured for (torchft passes it)
        backend_name = backend  # what c10d's map records for it and its sub-groups

        def rank(self) -> int:
            return self.parent.rank()

        def allreduce(self, tensors: list, opts: Any = None) -> Any:
            if opts is None:
                opts = torch.distributed.AllreduceOptions()
            return super().allreduce(tensors, opts)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:  # torchft_compat's override
            self._store, self._subgroups = store, []
            if torch_compat.is_registered(self):  # torch's new_group prefixes the default group's store
                torch_compat.register_backend(self, backend, store)
            return super()._create_pg(store, rank, world_size)

        def new_group(self, ranks: list, timeout: Any = None, pg_options: Any = None, group_name: Any = None,
                      group_desc: Any = None, backend: Any = None) -> Any:  # backend: torch >= 2.15 passes it
            if list(ranks) != list(range(self.size())):
                raise NotImplementedError(f"run.recovery=live: a sub-group of ranks {list(ranks)} of the "
                                          f"{self.size()}-rank reconfigurable group (only all of them)")
            return self._ready.pop(0) if self._ready else self._subgroup()

        def _subgroup(self) -> Any:
            store = torch.distributed.PrefixStore(f"raytrain/sub{len(self._subgroups)}/", self._store)
            group = base._create_pg(self, store, self.rank(), self.size())
            self._subgroups.append(group)
            return group

        def adopt(self, group: Any) -> Any:
            """`group`, a sub-group `torch.distributed.new_group` returned; one torch made itself
            (it did not ask `new_group` above) is ended with this quorum's, and the ones made
            ahead, which torch will not take, are ended now and no longer made."""
            if group not in self._subgroups:
                self._end(self._ready)
                self._subgroups = [g for g in self._subgroups if g not in self._ready] + [group]
                self._ready, self.ahead, self._torch_makes = [], 0, True
            return group

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      quorum_id: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
            """Sub-groups are made with the quorum, while every member is there: a member lost before
            the re-wrap then fails the wrap's first collective at once, not a rendezvous at its timeout."""
            self._end_subgroups()
            self.quorum = quorum_id  # before the group is made, as the manager records it
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kwargs)
            self._ready = [self._subgroup() for _ in range(self.ahead)]
            self._before = torch_compat.registered_groups()

        def abort(self, errored: bool = True) -> None:
            for group in self._subgroups:  # what a backend that can abort does (NCCL); gloo: nothing
                with contextlib.suppress(Exception):
                    group.abort()
            super().abort(errored)

        def _end_subgroups(self) -> None:
            made = [g for g in torch_compat.registered_groups() if g is not self and g not in self._before
                    and g not in self._subgroups] if self._torch_makes else []
            self._end(self._subgroups + made)
            self._subgroups, self._ready = [], []

        @staticmethod
        def _end(groups: list) -> None:
            for group in groups:
                with contextlib.suppress(Exception):
                    group.abort()
                name = torch_compat.group_name(group)
                if torch_compat.is_registered(group):
                    with contextlib.suppress(Exception):
                        torch.distributed.destroy_process_group(group)
                if name is not None:  # destroy leaves a sub-group in torch's registry by name
                    with contextlib.suppress(Exception):
                        torch_compat.unregister_group(name)

    return LiveGroup


def node_address() -> str:
    """Where this worker's manager listens: on loopback when the lighthouse does (our launcher's
    embedded instance: one machine), else on this worker's node address as Ray knows it (Ray's
    torch backend sets `MASTER_ADDR` to it for each replica group, and in live mode every worker
    is the first rank of its own group): the node's IP on a cluster."""
    lighthouse = os.environ.get(LIGHTHOUSE_HOST_ENV, "")
    if lighthouse in ("127.0.0.1", "::1"):
        return lighthouse
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


def lighthouse_address() -> str:
    """Where the lighthouse is: Ray's `TORCHFT_LIGHTHOUSE`, at the address our launcher bound it
    to. torchft's lighthouse advertises this machine's host name whatever it is bound to, and
    the name may resolve elsewhere (127.0.1.1 in many /etc/hosts) than the bound address."""
    address, host = os.environ[LIGHTHOUSE_ENV], os.environ.get(LIGHTHOUSE_HOST_ENV)
    if not host:
        return address
    scheme, _, rest = address.rpartition("://")
    port = rest.rsplit(":", 1)[1]
    return f"{scheme + '://' if scheme else ''}{bracketed(host)}:{port}"


def install_default_group(group: Any) -> Any:
    """Make `group` torch's default process group; returns the one it replaces.

    Every collective of the run that names no group (the loss and verdict all-reduce, the
    preemption agreement, validation, the wrappers) then goes over the reconfigurable one.
    Ray set up a one-rank group per replica group; it comes back at `close`.
    """
    previous = torch_compat.default_group()
    torch_compat.set_default_group(group)
    if not torch_compat.is_registered(group):  # torch asks the map for the backend's name, new_group for the store
        torch_compat.register_backend(group, getattr(group, "backend_name", "gloo"), getattr(group, "_store", None))
    return previous
