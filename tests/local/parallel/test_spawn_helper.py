"""The shared rank launcher (raytrain_ddp.ops.ranks, via tests/_spawn.py): results, tracebacks, deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _spawn import RankFailed, RankTimeout, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]


def _sum_ranks(world_rank, world_size, scale):
    t = torch.tensor([float(world_rank)])
    dist.all_reduce(t)
    return t.item() * scale, os.environ["MASTER_ADDR"]


def _rank1_raises(world_rank, world_size):
    if world_rank == 1:
        raise ValueError("boom on rank 1")
    return "fine"


def _rank1_hangs(world_rank, world_size):
    if world_rank == 1:
        time.sleep(120)
    return os.getpid()


def _threads(world_rank, world_size):
    return torch.get_num_threads()


def test_results_errors_and_deadline():
    assert run_ranks(_sum_ranks, 3, 2.0, timeout_s=30) == [(6.0, "127.0.0.1")] * 3

    with pytest.raises(RankFailed, match="rank 1 raised ValueError: boom on rank 1"):
        run_ranks(_rank1_raises, 2, timeout_s=30)
    mixed = run_ranks(_rank1_raises, 2, timeout_s=30, return_exceptions=True)
    assert mixed[0] == "fine" and mixed[1].type_name == "ValueError"

    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[(0, )?1\] of 2 did not answer within 3"):
        run_ranks(_rank1_hangs, 2, timeout_s=3)  # rank 0 may miss it too on a loaded machine
    assert time.monotonic() - start < 30  # killed at the deadline, not after the 120 s sleep


def test_a_port_taken_between_its_pick_and_rank_zeros_bind_is_picked_again(monkeypatch):
    """Issue #56: the first pick is a port another program listens on (taken after the pick):
    rank 0's store cannot listen, and the ranks start again on a fresh port."""
    import socket

    from raytrain_ddp.ops import ranks

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    picked, real = [], ranks.free_port
    monkeypatch.setattr(ranks, "free_port", lambda: picked.append(real() if picked else taken.getsockname()[1])
                        or picked[-1])
    try:
        assert ranks.run_ranks(_sum_ranks, 2, 1.0, timeout_s=40) == [(1.0, "127.0.0.1")] * 2
    finally:
        taken.close()
    assert len(picked) == 2, picked  # the taken port, then a fresh one


def test_threads_per_rank_and_no_ray():
    # 3 is nobody's default on this machine, so the value must come from `threads`.
    assert run_ranks(_threads, 2, threads=3, init_pg=False, timeout_s=30) == [3, 3]
    code = "import sys, raytrain_ddp.ops.ranks; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


_QUIET_LAUNCHES = """
import torch, torch.distributed as dist
from raytrain_ddp.ops.ranks import run_ranks

def body(world_rank, world_size):
    t = torch.ones(1000)
    dist.all_reduce(t)
    return float(t[0])

if __name__ == "__main__":
    for _ in range(8):
        assert run_ranks(body, 2, timeout_s=30, threads=1) == [2.0, 2.0]
"""


def test_successful_launches_print_nothing(tmp_path):
    # Rank 0 hosts the TCP store: if it left while a peer still polled it, the peer's store
    # client printed a ~30-line "Connection reset by peer" C++ trace (about one launch in
    # three, seen in `bench --quick`). Eight launches make a regression all but certain to show.
    script = tmp_path / "launches.py"
    script.write_text(_QUIET_LAUNCHES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=55)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Connection reset" not in done.stderr and "TCPStore" not in done.stderr, done.stderr[-3000:]
