"""`native` (torch DDP) over run.recovery=live's reconfigurable group, without Ray (#28).

Two gloo ranks install torchft's reconfigurable group (`recovery/live_group.py`'s `LiveGroup`) as
torch's default group, as a live worker does, and wrap a model with `native` on the
sub-group a live worker gives it (`dist.new_group`, which torch hands to the default
group's `new_group`; made with the quorum, while every member is there). One spawn
checks, in order:
- the gradient after backward is the mean of both ranks' (float64, against one process);
- a peer that stops taking part fails this rank's next DDP collective at the group's
  timeout (torch DDP syncs its rebuilt bucket order at the second forward), and
  `is_peer_loss` says it is a lost peer (a dead peer fails it at once:
  `tests/ray/elastic/test_live_recovery.py`);
- a reconfiguration ends the old quorum's sub-groups (gone from torch's registry), and a
  wrapper on the new quorum's sub-group gives the mean gradient again;
- `naive` and `bucketed`, which run on the reconfigurable group itself, give it too.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

TIMEOUT_S = 3.0  # the groups' timeout: the silent peer's cost


def _model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1) / 10


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _native_over_live_group(world_rank, world_size):
    import torch.distributed.distributed_c10d as c10d

    from raytrain_ddp.parallel import registry, wrap_model
    from raytrain_ddp.recovery.live import SUBGROUPS
    from raytrain_ddp.recovery.live_group import install_default_group, live_group_class
    from raytrain_ddp.recovery.replica import is_peer_loss

    native = next(s for s in registry.STRATEGIES.values() if SUBGROUPS.get(s.load()))
    address = f"127.0.0.1:{os.environ['MASTER_PORT']}"
    group = live_group_class()(timeout=timedelta(seconds=TIMEOUT_S))
    group.ahead = SUBGROUPS[native.load()]  # as LiveSession sets it
    group.configure(f"{address}/quorum1", "r", world_rank, world_size)
    out = {"made_with_the_quorum": len(group._ready)}
    install_default_group(group)
    before = set(c10d._world.pg_map)

    def train_once() -> list[torch.Tensor]:
        model = _model()
        sub = group.adopt(dist.new_group(timeout=timedelta(seconds=TIMEOUT_S)))  # as LiveSession.wrapper_group
        wrapper = wrap_model(model, native.name, process_group=sub, collective_timeout_s=TIMEOUT_S)
        wrapper(_batch(world_rank)).sum().backward()
        return _grads(model), wrapper, sub

    grads, wrapper, _ = train_once()
    out["first"] = grads
    # DDP's group and native's side group, both used: made with the quorum where torch asks the
    # default group for them; else (torch 2.11) the two torch made, the ones made ahead ended
    out["subgroups"] = (len(group._subgroups), len(group._ready))
    out["delegated"] = group.ahead > 0  # adopt() stops making them ahead where torch never asks
    # Rank 1 stops taking part: rank 0's next collective fails at the group's timeout.
    if world_rank == 0:
        try:
            wrapper(_batch(world_rank)).sum().backward()
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = (str(exc)[:600], is_peer_loss(exc))
        group._store.set("rank0_failed", "1")
    else:
        group._store.wait(["rank0_failed"], timedelta(seconds=60))
    wrapper.close()
    group.configure(f"{address}/quorum2", "r", world_rank, world_size)  # the next quorum
    out["registered"] = len(set(c10d._world.pg_map) - before)
    out["second"], _, _ = train_once()
    for key, strategy, shm in (("naive", "naive", False), ("bucketed", "bucketed", False),
                               ("bucketed_shm", "bucketed", True)):  # these run on the reconfigurable group itself
        model = _model()
        wrapper = wrap_model(model, strategy, process_group=group, collective_timeout_s=TIMEOUT_S, shm=shm)
        wrapper(_batch(world_rank)).sum().backward()
        out[key] = _grads(model)
        out[key + "_transport"] = getattr(wrapper, "transport", "process_group")
        wrapper.close()
    return out


def test_native_runs_over_the_reconfigurable_group_and_a_silent_peer_is_a_peer_loss():
    reference = []
    for rank in range(2):
        model = _model()
        model(_batch(rank)).sum().backward()
        reference.append(_grads(model))
    mean = [(a + b) / 2 for a, b in zip(*reference)]
    outs = run_ranks(_native_over_live_group, 2, timeout_s=100)
    for rank, out in enumerate(outs):
        for key in ("first", "second", "naive", "bucketed", "bucketed_shm"):
            assert max((g - m).abs().max().item() for g, m in zip(out[key], mean)) < 1e-12, (rank, key)
        # torch 2.13 and later ask the default group for a sub-group (2.11 does not)
        assert out["delegated"] == (tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)), rank
        assert out["made_with_the_quorum"] == 2 and out["subgroups"] == ((2, 0) if out["delegated"] else (1, 0))
        assert out["registered"] == 0  # the old quorum's groups are gone
        assert (out["bucketed_transport"], out["bucketed_shm_transport"]) == ("process_group", "shm"), rank
    message, peer_loss = outs[0]["error"]
    assert peer_loss, message
