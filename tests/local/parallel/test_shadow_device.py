"""One train_step per strategy with the model "on a device" that host tensors must not meet.

The fake-CUDA check of issue 41, in the form this machine allows: `FakeTensorMode` cannot
run a backward on CUDA without a GPU (`tests/_shadow_device.py` says exactly
why), so `ShadowDevice` tracks host tensors on the CPU instead. Each strategy (naive,
bucketed, native, zero1, fsdp) runs three `train_step`s of the quickstart and the GPT
preset on 2 gloo ranks (torch's fake process group cannot serve `native`: DDP's comm hook
reads the future's value, which the fake backend leaves None). It fails on a host tensor
meeting a device one in any op and on more than one host read of a device tensor per
steady step (the non-finite verdict: docs/parallel.md). What it cannot cover: the
branches taken only when `device.type == "cuda"` (stream waits, the collective watch,
fused optimizers), covered by `test_cuda_waits.py`, `test_replica_device.py` and the lint
(`tests/local/unit/test_cuda_lint.py`).
"""

from __future__ import annotations

import pytest
import torch

from _spawn import run_ranks
from raytrain_ddp.job import Job
from raytrain_ddp.parallel import STRATEGIES
from _shadow_device import DeviceMismatch, ShadowDevice
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.state import build_state
from raytrain_ddp.worker.step import train_step
from test_host_syncs import _preset

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def test_shadow_device_catches_a_host_tensor_and_counts_reads():
    weight = torch.ones(3)  # built outside: "on the device"
    with ShadowDevice() as mode:
        assert float(torch.tensor(2.0) * weight.sum()) == 6.0  # a 0-dim host scalar may meet it...
        with pytest.raises(DeviceMismatch, match=r"shape \[\(3,\)\]"):
            torch.zeros(3) + weight  # ...a host vector may not
        assert torch.zeros(3, device=weight.device).add(weight).tolist() == [1.0, 1.0, 1.0]
        batch = torch.ones(3)
        mode.host(batch)
        moved = batch.to(weight.device)
        assert not mode.is_host(moved) and mode.is_host(batch)
    assert mode.reads == ["__float__", "tolist"]


def _steps(world_rank: int, world_size: int) -> dict:
    out = {}
    for preset in ("quickstart", "gpt"):
        for strategy in STRATEGIES:
            cfg, spec, window = _preset(preset, strategy, world_rank)
            rank = Rank(world_rank, world_size, world_rank, torch.device("cpu"))
            job = Job(cfg=cfg, spec=spec, run_dir="/nonexistent", fit_id="f" * 32)
            state = build_state(job, rank, total_steps=100)
            reads, mode = [], ShadowDevice()  # one mode: the optimizer's host step counters stay known
            try:
                for step in range(3):
                    batches = window(step)  # on the device already: the data shard moves them (to_device)
                    # non-fused optimizers keep their `step` counters on the host on CUDA too (no sync there)
                    mode.host([entry["step"] for entry in state.optimizer.state.values() if "step" in entry])
                    before = len(mode.reads)
                    with mode:
                        train_step(state, batches, 2, cfg.train, rank)
                    reads.append(mode.reads[before:])
            except DeviceMismatch as exc:
                reads.append(f"DeviceMismatch: {exc}")
            out[(preset, strategy)] = reads
    return out


def test_one_train_step_per_strategy_keeps_host_tensors_off_the_device():
    for per_rank in run_ranks(_steps, 2, timeout_s=200, threads=1):
        assert set(per_rank) == {(p, s) for p in ("quickstart", "gpt") for s in STRATEGIES}
        for key, reads in per_rank.items():
            assert not any(isinstance(r, str) for r in reads), (key, reads)  # no host tensor met the device
            assert all(len(r) <= 1 for r in reads[1:]), (key, reads)  # steady: the non-finite verdict only
