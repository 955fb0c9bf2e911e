"""The loop's pieces without Ray: one optimizer step, non-finite handling, validation,
checkpoint state round trip, resume resolution and the test-only fault plan.

A world-size-1 gloo group (file store, no ports) stands in for Ray Train's process group.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp.data import DataSpec
from raytrain_ddp.launcher import ResumeError, resolve_resume
from raytrain_ddp.loop import NonFiniteAbort, train_step, validate
from raytrain_ddp.worker import (
    FaultPlan, Job, Progress, Rank, build_parts, record_attempt, restore, training_state,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]

SPEC = DataSpec("classification", (8,), 3, 64, 16, "test")
RANK = Rank(world_rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


def _cfg(*overrides):
    return load_config(None, ["model.name=mlp", "model.hidden_sizes=[16]", "train.global_batch_size=8",
                              "train.micro_batch_size=4", "scaling.num_workers=1", "parallel.strategy=naive",
                              *overrides])


def _window(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]


def test_train_step_returns_window_mean_loss_and_steps(group):
    cfg = _cfg()
    parts = build_parts(cfg, SPEC, RANK, total_steps=10)
    window = _window()
    with torch.no_grad():
        expected = sum(parts.loss_fn(parts.module(x), y).item() for x, y in window) / 2
    before = [p.detach().clone() for p in parts.params]
    progress = Progress()
    loss = train_step(parts, window, 2, progress, cfg, RANK)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(before, parts.params))
    assert all(p.grad is None for p in parts.params)  # zeroed for the next window
    assert parts.scheduler.last_step == 1 and progress.nonfinite_steps == 0


def test_nonfinite_loss_skips_the_step_then_aborts_after_max_consecutive(group):
    cfg = _cfg("train.nonfinite.max_consecutive=2")
    parts = build_parts(cfg, SPEC, RANK, total_steps=10)
    before = [p.detach().clone() for p in parts.params]
    progress = Progress()
    loss = train_step(parts, _window(), 2, progress, cfg, RANK, poison=math.nan)
    assert math.isnan(loss) and progress.nonfinite_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, parts.params))  # skipped
    train_step(parts, _window(1), 2, progress, cfg, RANK)  # a good step resets the streak
    assert progress.consecutive_nonfinite == 0 and progress.nonfinite_steps == 1
    train_step(parts, _window(2), 2, progress, cfg, RANK, poison=math.nan)
    with pytest.raises(NonFiniteAbort, match="2 in a row.*train.lr"):
        train_step(parts, _window(3), 2, progress, cfg, RANK, poison=math.inf)

    abort_cfg = _cfg("train.nonfinite.action=abort")
    with pytest.raises(NonFiniteAbort, match="action=abort"):
        train_step(build_parts(abort_cfg, SPEC, RANK, 10), _window(), 2, Progress(), abort_cfg, RANK, poison=math.nan)


class _ValData:
    def __init__(self, batches):
        self.batches = batches

    def val_batches(self):
        return iter(self.batches)


def test_validate_sums_loss_and_accuracy_over_all_batches(group):
    cfg = _cfg()
    parts = build_parts(cfg, SPEC, RANK, total_steps=10)
    batches = _window() + [(torch.randn(3, 8), torch.tensor([0, 1, 2]))]
    with torch.no_grad():
        outs = [(parts.module(x), y) for x, y in batches]
    n = sum(len(y) for _, y in outs)
    loss = sum(parts.loss_fn(o, y).item() * len(y) for o, y in outs) / n
    acc = sum((o.argmax(-1) == y).sum().item() for o, y in outs) / n
    out = validate(parts, _ValData(batches), RANK, SPEC)
    assert out["val_loss"] == pytest.approx(loss, rel=1e-6) and out["val_accuracy"] == pytest.approx(acc)
    assert validate(parts, _ValData([]), RANK, SPEC) == {}


def test_checkpoint_state_round_trip_restores_progress_and_optimizer(group, tmp_path):
    cfg = _cfg()
    job = Job(cfg=cfg, spec=SPEC, run_dir=str(tmp_path), fit_id="f" * 32)
    parts = build_parts(cfg, SPEC, RANK, total_steps=10)
    progress = Progress()
    for i in range(3):
        train_step(parts, _window(i), 2, progress, cfg, RANK)
    progress.step, progress.epoch, progress.steps_into_epoch = 3, 1, 1
    ckpt.save_checkpoint(tmp_path / "checkpoint_x", training_state(parts, progress, job, RANK))
    state = ckpt.load_checkpoint(tmp_path / "checkpoint_x")

    fresh = build_parts(cfg, SPEC, RANK, total_steps=10, model_state=state["model"])
    resumed = restore(fresh, state, RANK)
    assert (resumed.step, resumed.epoch, resumed.steps_into_epoch) == (3, 1, 1)
    assert fresh.scheduler.last_step == 3 and fresh.optimizer.param_groups[0]["lr"] == parts.optimizer.param_groups[0]["lr"]
    for a, b in zip(parts.params, fresh.params):
        assert torch.equal(a, b)
    # the same next step from both: optimizer moments were restored too
    train_step(parts, _window(9), 2, Progress(), cfg, RANK)
    train_step(fresh, _window(9), 2, Progress(), cfg, RANK)
    for a, b in zip(parts.params, fresh.params):
        assert torch.allclose(a, b)
    assert record_attempt(job, RANK) == 1 and record_attempt(job, RANK) == 2


def test_resolve_resume_modes(tmp_path):
    run_dir = tmp_path / "run"
    assert resolve_resume(_cfg(), run_dir) is None  # fresh
    with pytest.raises(ResumeError, match="run.resume=latest.*no valid checkpoint"):
        resolve_resume(_cfg("run.resume=latest"), run_dir)
    state = {"model": {}, "optimizer": {}, "step": 4, "epoch": 0, "steps_into_epoch": 4, "fit_id": "a"}
    ckpt.save_checkpoint(run_dir / "checkpoint_4", state)
    ckpt.save_checkpoint(run_dir / "checkpoint_8", {**state, "step": 8})
    (run_dir / "checkpoint_8" / "state.pt").write_bytes(b"garbage")  # damaged newest
    assert resolve_resume(_cfg(), run_dir) == run_dir / "checkpoint_4"
    assert resolve_resume(_cfg("run.resume=latest"), run_dir) == run_dir / "checkpoint_4"
    assert resolve_resume(_cfg(f"run.resume={run_dir / 'checkpoint_4'}"), run_dir) == run_dir / "checkpoint_4"
    with pytest.raises(ResumeError, match=r"checkpoint_8/state\.pt"):
        resolve_resume(_cfg(f"run.resume={run_dir / 'checkpoint_8'}"), run_dir)
    with pytest.raises(ResumeError, match="run.resume=never.*already exists"):
        resolve_resume(_cfg("run.resume=never"), run_dir)


def test_fault_plan_parses_and_fires_only_where_asked(monkeypatch):
    monkeypatch.delenv("RAYTRAIN_DDP_FAULT", raising=False)
    assert FaultPlan.from_env() is None
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "rank=0,step=3,attempt=2,mode=raise")
    plan = FaultPlan.from_env()
    assert plan == FaultPlan(rank=0, step=3, attempt=2, mode="raise")
    plan.after_step(RANK, 3, attempt=1)  # other attempt: nothing
    plan.after_step(RANK, 2, attempt=2)  # other step: nothing
    with pytest.raises(RuntimeError, match="injected fault"):
        plan.after_step(RANK, 3, attempt=2)
    nan_plan = FaultPlan(rank=0, step=5, attempt=1, mode="nan")
    assert math.isnan(nan_plan.loss_poison(RANK, 5, 1)) and nan_plan.loss_poison(RANK, 4, 1) == 1.0
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "step=1,mode=explode")
    with pytest.raises(ValueError, match="mode must be"):
        FaultPlan.from_env()


def test_bf16_autocast_step_on_cpu_and_sgd_with_clipping(group):
    cfg = _cfg("train.precision=bf16", "train.optimizer=sgd", "train.clip_grad_norm=0.01")
    parts = build_parts(cfg, SPEC, RANK, total_steps=10)
    before = [p.detach().clone() for p in parts.params]
    loss = train_step(parts, _window(), 2, Progress(), cfg, RANK)
    assert math.isfinite(loss) and not parts.scaler.is_enabled()
    moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, parts.params)))
    # one SGD step from zero momentum with a clipped gradient moves at most lr * max_norm
    assert 0 < moved <= cfg.train.lr * 0.01 * (1 + 1e-3)
