"""`PeerLost`: a failed collective is typed where our code meets it, and recovery reads the type (#42)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from raytrain_ddp.parallel import collectives
from raytrain_ddp.parallel.errors import CollectiveTimeoutError, PeerLost
from raytrain_ddp.recovery.replica import is_peer_loss

pytestmark = pytest.mark.timeout(60)


def test_the_agreement_helpers_raise_peer_lost_when_their_collective_fails(monkeypatch):
    def reset(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")

    monkeypatch.setattr(collectives, "_active", lambda group=None: True)
    monkeypatch.setattr(dist, "all_reduce", reset)
    for call in (lambda: collectives.max_over_ranks([1.0]), lambda: collectives.sum_over_ranks([1.0]),
                 lambda: collectives.all_true(True)):
        with pytest.raises(PeerLost, match="all reduce failed on this rank.*Connection reset by peer") as caught:
            call()
        assert is_peer_loss(caught.value)


def test_recovery_recognises_the_type_raised_or_chained():
    assert issubclass(CollectiveTimeoutError, PeerLost) and issubclass(PeerLost, RuntimeError)
    assert is_peer_loss(PeerLost("all-reduce of bucket 1 failed"))
    try:
        try:
            raise PeerLost("all-reduce of bucket 1 failed")
        except PeerLost as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as outer:
        assert is_peer_loss(outer)
    assert not is_peer_loss(RuntimeError("a bug in the user's forward"))


def test_ranks_that_disagree_after_a_successful_collective_are_not_a_lost_peer(monkeypatch):
    """`check_same` raises from `raytrain_ddp/parallel/`, whose frames alone would read as a lost
    peer; its own type says the collective succeeded and this rank's state is wrong."""
    from raytrain_ddp.parallel.errors import RanksDisagreeError

    monkeypatch.setattr(collectives, "max_over_ranks", lambda values, device=None: [7, -5])  # min 5, max 7
    with pytest.raises(RanksDisagreeError, match="ranks disagree on micro-steps: min 5, max 7") as caught:
        collectives.check_same(5, "micro-steps")
    assert not is_peer_loss(caught.value)
    try:
        try:
            collectives.check_same(5, "micro-steps")
        except RanksDisagreeError as inner:
            raise RuntimeError("the epoch failed") from inner
    except RuntimeError as outer:
        assert not is_peer_loss(outer)


def test_the_start_up_collectives_raise_peer_lost_when_their_collective_fails(monkeypatch):
    """The wrappers' own synchronous collectives are typed where they are called (#42 item 4),
    not recognised afterwards by the frames they failed in."""
    import torch

    from raytrain_ddp.parallel import startup

    def reset(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")

    monkeypatch.setattr(dist, "all_reduce", reset)
    monkeypatch.setattr(dist, "broadcast", reset)
    module = torch.nn.Linear(2, 2)
    with pytest.raises(PeerLost, match="all-reduce of the model's structure failed on this rank"):
        startup.check_structure(module, None, 2, 0)
    monkeypatch.setattr(startup, "check_structure", lambda *args: None)
    monkeypatch.setattr(dist, "get_global_rank", lambda pg, rank: rank, raising=False)
    for verify in (False, True):
        with pytest.raises(PeerLost, match="broadcast of rank 0's weights failed on this rank.*Connection reset"):
            startup.sync_initial_state(module, None, verify=verify, world_size=2, world_rank=1)
