"""Warm-up + cosine schedule and optimizer groups: pure functions, no Ray."""

from __future__ import annotations

import math

import pytest
import torch

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.optim import WarmupCosine, build_optimizer, lr_at

pytestmark = pytest.mark.timeout(30)


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    kw = dict(peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(100, **kw) == pytest.approx(0.1)  # stays at the floor past the end
    lrs = [lr_at(s, **kw) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_no_warmup_starts_at_peak():
    assert lr_at(0, peak_lr=0.3, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(0.3)


def test_scheduler_sets_param_groups_and_resumes_exactly():
    model = torch.nn.Linear(3, 3)
    train = TrainConfig(lr=0.5, warmup_steps=2, min_lr_ratio=0.0, weight_decay=0.1)
    opt = build_optimizer(model.parameters(), train)
    sched = WarmupCosine.from_config(opt, train, total_steps=10)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    state = sched.state_dict()

    opt2 = build_optimizer(model.parameters(), train)
    sched2 = WarmupCosine.from_config(opt2, train, total_steps=10)
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert seen[:2] == [0.25, 0.5]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))


def test_weight_decay_only_on_matrices_and_sgd_momentum():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model.parameters(), TrainConfig(weight_decay=0.2))
    decays = {len(g["params"]): g["weight_decay"] for g in opt.param_groups}
    assert decays == {1: 0.2, 3: 0.0}  # the weight matrix vs bias, norm weight, norm bias
    sgd = build_optimizer(model.parameters(), TrainConfig(optimizer="sgd", momentum=0.8))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8


def test_linear_and_constant_shapes_share_the_warmup_and_the_floor():
    kw = dict(peak_lr=1.0, warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert [lr_at(s, shape="linear", **kw) for s in (0, 1, 2, 7, 12, 50)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    assert [lr_at(s, shape="constant", **kw) for s in (0, 1, 2, 12, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0])
    model = torch.nn.Linear(3, 3)
    opt = build_optimizer(model.parameters(), TrainConfig(weight_decay=0.2, no_decay=False))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2] and len(opt.param_groups[0]["params"]) == 2


def test_a_users_schedule_resumes_at_its_position_and_stretches_to_a_new_total():
    from raytrain_ddp.config import Config
    from raytrain_ddp.user import UserCode
    from raytrain_ddp.worker.optim import build_schedule

    def sched(optimizer, total_steps, floor=0.0):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(floor, 1.0 - s / total_steps))

    cfg = Config.model_validate({"train": {"lr": 1.0, "schedule": "m:sched", "schedule_kwargs": {"floor": 0.1}}})
    code = UserCode(schedule=sched)
    model = torch.nn.Linear(2, 2)
    first = build_schedule(torch.optim.SGD(model.parameters(), lr=1.0), cfg, 10, code)
    for _ in range(4):
        first.step()
    assert first.lr == pytest.approx(0.6) and first.state_dict() == {"last_epoch": 4}
    again = build_schedule(torch.optim.SGD(model.parameters(), lr=1.0), cfg, 10, code)
    again.load_state_dict(first.state_dict())
    assert again.lr == pytest.approx(0.6)  # the same position on the same curve
    stretched = build_schedule(torch.optim.SGD(model.parameters(), lr=1.0), cfg, 20, code)
    stretched.load_state_dict(first.state_dict())
    assert stretched.lr == pytest.approx(0.8)  # 20 steps now: the rest of the curve stretches


def test_a_users_optimizer_or_schedule_that_is_wrong_is_one_line_naming_the_key():
    from raytrain_ddp.config import Config
    from raytrain_ddp.errors import UserError
    from raytrain_ddp.user import UserCode

    cfg = Config.model_validate({"train": {"optimizer": "m:make", "schedule": "m:sched"}})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match=r"train.optimizer='m:make' returned a list, not a torch.optim.Optimizer"):
        UserCode(optimizer=lambda model: list(model.parameters())).build_optimizer(cfg, model)
    with pytest.raises(UserError, match=r"train.optimizer='m:make' raised TypeError"):
        UserCode(optimizer=lambda: None).build_optimizer(cfg, model)
    with pytest.raises(UserError, match=r"train.schedule='m:sched' returned a float"):
        UserCode(schedule=lambda opt, total: 0.1).build_schedule(cfg, torch.optim.SGD(model.parameters(), lr=1), 5)


def test_optimizer_kernel_is_fused_on_cuda_only():
    from raytrain_ddp.worker.optim import optimizer_kernel

    class _P:  # stands in for a parameter (no GPU here)
        def __init__(self, cuda: bool, floating: bool = True) -> None:
            self.is_cuda, self._floating = cuda, floating

        def is_floating_point(self) -> bool:
            return self._floating

    assert optimizer_kernel([_P(True), _P(True)]) == {"fused": True}
    assert optimizer_kernel([_P(True), _P(False)]) == {}
    assert optimizer_kernel([_P(True), _P(True, floating=False)]) == {}
    assert optimizer_kernel([torch.nn.Parameter(torch.zeros(2))]) == {}  # CPU: torch's default
