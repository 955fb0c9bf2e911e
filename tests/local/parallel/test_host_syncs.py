"""Host syncs per steady-state training step, every strategy, counted on CPU.

On CUDA a read of a device value on the host (`.item()`, `float()`, `bool()`, `.tolist()`)
or a tensor built from host values stalls the host until the device catches up: the CPU
can no longer queue the next step's work while the GPU computes. The budget
(ARCHITECTURE.md, docs/parallel.md "CUDA/NCCL path: audit"): at most one per
steady-state step -- the ranks' verdict on non-finite values, which decides whether the
optimizer steps. Logging and checkpoint steps may read more (the loss, for the line).

Counted under a `TorchDispatchMode` (`_syncs.py`): `aten._local_scalar_dense`, scalar
tensors built from host values (`aten.lift_fresh`) and `Tensor.tolist()`, over the
product's own step and its meter (`train_step` + `RunLog.step` on a step that writes no
line), on 2 gloo ranks, for the quickstart config (CNN on digits, accumulation 2,
clipping) and a small GPT preset. Reads of the optimizer's `step` counters are not
counted where torch keeps them on the host on CUDA as well (non-fused optimizers).
Measured: exactly 1 per step for naive, bucketed, native, zero1 and fsdp, on both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _spawn import run_ranks
from _syncs import counting, host_step_counters
from raytrain_ddp.config import load_config
from raytrain_ddp.job import DataSpec, Job
from raytrain_ddp.parallel import STRATEGIES
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.meter import RunLog
from raytrain_ddp.worker.state import build_state
from raytrain_ddp.worker.step import train_step

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "configs" / "quickstart.yaml"
GPT = ["model.name=gpt", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.source=synthetic",
       "data.synthetic.seq_len=16", "data.synthetic.num_classes=64", "train.global_batch_size=16",
       "train.micro_batch_size=4", "scaling.num_workers=2"]
WARMUP, MEASURED = 2, 3  # the first synced backward agrees on unused parameters (a read): not steady
BUDGET = 1


class _Data:
    wait_seconds = 0.0


def _preset(name: str, strategy: str, world_rank: int):
    if name == "quickstart":
        cfg = load_config(QUICKSTART, [f"parallel.strategy={strategy}", "run.log_every_steps=1000"])
        spec = DataSpec("classification", (1, 8, 8), 10, 1437, 360, "digits")

        def window(step: int) -> list:
            g = torch.Generator().manual_seed(10 * step + world_rank)
            return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
                    for _ in range(2)]
    else:
        cfg = load_config(None, [*GPT, f"parallel.strategy={strategy}", "run.log_every_steps=1000"])
        spec = DataSpec("lm", (16,), 64, 1000, 100, "synthetic")

        def window(step: int) -> list:
            g = torch.Generator().manual_seed(10 * step + world_rank)
            return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
                    for _ in range(2)]
    return cfg, spec, window


def _count(world_rank: int, world_size: int) -> dict[tuple[str, str], list[dict[str, int]]]:
    out = {}
    for preset in ("quickstart", "gpt"):
        for strategy in STRATEGIES:
            cfg, spec, window = _preset(preset, strategy, world_rank)
            rank = Rank(world_rank, world_size, world_rank, torch.device("cpu"))
            job = Job(cfg=cfg, spec=spec, run_dir="/nonexistent", fit_id="f" * 32)
            state = build_state(job, rank, total_steps=100)
            log = RunLog(job, rank, state, _Data(), total_steps=100)
            per_step = []
            for step in range(WARMUP + MEASURED):
                with counting(host_step_counters(state.optimizer)) as counter:
                    result = train_step(state, window(step), 2, cfg.train, rank)
                    log.step(result, end_of_epoch=False)  # no line due: nothing read
                per_step.append(dict(counter.counts))
            assert result.loss == result.loss  # a logging step would read it (finite here)
            out[(preset, strategy)] = per_step[WARMUP:]
    return out


def test_at_most_one_host_sync_per_steady_state_step_for_every_strategy():
    ranks = run_ranks(_count, 2, timeout_s=200, threads=1)
    for counts in ranks:
        assert set(counts) == {(p, s) for p in ("quickstart", "gpt") for s in STRATEGIES}
        for (preset, strategy), per_step in counts.items():
            for step in per_step:
                assert sum(step.values()) <= BUDGET, (preset, strategy, per_step)
                assert step == {"item": 1}, (preset, strategy, per_step)  # the non-finite verdict
