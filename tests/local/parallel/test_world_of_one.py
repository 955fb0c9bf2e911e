"""World size 1 is as strict as world size 2 (issue #45, item 2): local mode and a plain
`wrap_model` without a process group refuse what the workers refuse, with the workers'
message. The reference is torch DDP on a 1-rank group: its reducer still runs, and a
parameter left unused at one step fails the next forward ("Expected to have finished
reduction in the prior iteration ... did not receive grad for rank 0: ...").

The model's `late` branch is used at step 0 only, so the driver's precheck (one sample
backward) and native's first-step check both see every parameter used; the error comes
from step 1 on. Gloo ranks spawned on 127.0.0.1, no Ray.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from torch import nn

from _spawn import run_ranks
from raytrain_ddp.parallel import wrap_model
from raytrain_ddp.parallel.errors import RequiresGradChangeError, UnusedParameterError

pytestmark = pytest.mark.timeout(120)

CHECKED = ("naive", "bucketed", "zero1", "native")  # the strategies with the unused-parameter rule


class LateUnused(nn.Module):
    """`late` takes part in the loss at step 0 only (a branch the model stops taking)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.late = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_late: bool) -> torch.Tensor:
        return self.a(x) + self.late(x) if use_late else self.a(x)


def _x(step: int, world_rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + world_rank),
                       dtype=torch.float64)


def _train(strategy: str, world_rank: int, steps: int = 4, **options) -> tuple[str, int, str]:
    """(error type, the step it came at, its message), or ("", steps, "") without an error."""
    torch.manual_seed(0)
    wrapper = wrap_model(LateUnused().double(), strategy, **options)
    opt = wrapper.make_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    step = 0
    try:
        for step in range(steps):
            wrapper(_x(step, world_rank), step == 0).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - what we compare
        return type(exc).__name__, step, str(exc)
    finally:
        wrapper.close()
    return "", steps, ""


def _no_rank(message: str) -> str:
    return re.sub(r"on rank\(s\) \[[\d, ]*\]", "on rank(s) [...]", message)


def _late_unused(world_rank, world_size):
    return {strategy: _train(strategy, world_rank, collective_timeout_s=20) for strategy in CHECKED + ("fsdp",)}


def _alone_cases(world_rank, world_size):
    """What else holds at world size 1 (a 1-rank group, or none: run in the test process)."""
    out = {}
    for strategy in ("naive", "bucketed", "zero1"):
        # freezing after wrap is followed (not reported as unused), as at world size 2
        torch.manual_seed(0)
        model = LateUnused().double()
        wrapper = wrap_model(model, strategy)
        wrapper(_x(0, 0), True).sum().backward()
        model.zero_grad(set_to_none=True)
        model.late.requires_grad_(False)
        wrapper(_x(1, 0), False).sum().backward()
        out[(strategy, "freeze")] = model.late.weight.grad is None
        # a parameter used in an earlier micro-step of the window counts as used
        model.late.requires_grad_(True)
        with wrapper.no_sync():
            wrapper(_x(2, 0), True).sum().backward()
        wrapper(_x(3, 0), False).sum().backward()
        out[(strategy, "window")] = model.late.weight.grad is not None
        wrapper.close()
    for strategy in CHECKED:  # find_unused_parameters: allowed, grad stays None
        torch.manual_seed(0)
        model = LateUnused().double()
        wrapper = wrap_model(model, strategy, find_unused_parameters=True)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            wrapper(_x(step, 0), step == 0).sum().backward()
        out[(strategy, "allowed")] = model.late.weight.grad is None
        wrapper.close()
    # zero1 refuses a requires_grad change once its optimizer exists, at every world size
    torch.manual_seed(0)
    model = LateUnused().double()
    wrapper = wrap_model(model, "zero1")
    opt = wrapper.make_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))  # noqa: F841 - held
    model.late.requires_grad_(False)
    try:
        wrapper(_x(0, 0), False)
        out["zero1_after_optimizer"] = ("", "")
    except RequiresGradChangeError as exc:
        out["zero1_after_optimizer"] = (type(exc).__name__, str(exc))
    wrapper.close()
    return out


def _spawned(world_rank, world_size):
    """Both checks' rank side in one spawn per world size: the late-unused runs, then the rest."""
    return {"late": _late_unused(world_rank, world_size), "alone": _alone_cases(world_rank, world_size)}


@pytest.fixture(scope="module")
def spawned() -> dict[int, list[dict]]:
    """{world size: per-rank results}: one 1-rank group and one 2-rank group for the whole module
    (two spawns, where each test once spawned both sizes)."""
    return {1: run_ranks(_spawned, 1, timeout_s=90), 2: run_ranks(_spawned, 2, timeout_s=90, pg_timeout_s=40)}


@pytest.mark.distributed
def test_a_parameter_unused_from_step_two_fails_at_world_size_one_as_at_two(spawned):
    grouped = spawned[1][0]["late"]
    pair = [out["late"] for out in spawned[2]]
    alone = _late_unused(0, 1)  # no process group at all (wrap_model in a script)
    for strategy in CHECKED:
        two = {(kind, step, _no_rank(message)) for kind, step, message in (out[strategy] for out in pair)}
        assert len(two) == 1, (strategy, two)
        kind, step, message = two.pop()
        assert kind == UnusedParameterError.__name__ and "'late.weight'" in message and "'late.bias'" in message
        # the scratch strategies raise at the end of the step's backward; native, on a group,
        # at the next forward (torch's reducer, as torch DDP at world size 1 too)
        assert step == (2 if strategy == "native" else 1), (strategy, step)
        assert grouped[strategy] == pair[0][strategy], (strategy, grouped[strategy], pair[0][strategy])
        solo_kind, solo_step, solo_message = alone[strategy]
        assert (solo_kind, _no_rank(solo_message)) == (kind, message), (strategy, alone[strategy])
        assert solo_step == 1, (strategy, solo_step)  # LocalModel: no reducer, checks every backward
    for out in [grouped, alone] + pair:
        assert out["fsdp"] == ("", 4, ""), out["fsdp"]  # FSDP2 reduce-scatters zeros, at every size


@pytest.mark.distributed
def test_world_size_one_follows_or_refuses_what_world_size_two_does(spawned):
    grouped = spawned[1][0]["alone"]
    for out in (grouped, _alone_cases(0, 1)):
        for strategy in ("naive", "bucketed", "zero1"):
            assert out[(strategy, "freeze")] and out[(strategy, "window")], (strategy, out)
        for strategy in CHECKED:
            assert out[(strategy, "allowed")], strategy
        kind, message = out["zero1_after_optimizer"]
        assert kind == RequiresGradChangeError.__name__ and "'late.weight'" in message, message
    pair = [out["alone"]["zero1_after_optimizer"] for out in spawned[2]]
    assert pair[0] == pair[1] == grouped["zero1_after_optimizer"]


def test_local_model_refuses_what_native_refuses_and_pickles():
    torch.manual_seed(0)
    model = LateUnused().double()
    wrapper = wrap_model(model, "native")  # no process group: LocalModel
    wrapper(_x(0, 0), True).sum().backward()
    model.late.requires_grad_(False)
    with pytest.raises(RequiresGradChangeError, match="'late.weight' now has requires_grad=False"):
        wrapper(_x(1, 0), False)
    model.late.requires_grad_(True)
    for strategy in ("native", "naive"):
        copy = pickle.loads(pickle.dumps(wrap_model(LateUnused().double(), strategy)))
        copy(_x(0, 0), True).sum().backward()  # the hooks came back with the copy
        with pytest.raises(UnusedParameterError, match="'late.weight' on rank"):
            copy(_x(1, 0), False).sum().backward()
