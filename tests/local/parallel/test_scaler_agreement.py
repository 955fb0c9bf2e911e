"""zero1 with a GradScaler: an overflow in one rank's shard is every rank's overflow.

After zero1's reduce-scatter each rank holds only its chunk of the averaged gradient, so
an inf lands in one rank's chunk. Without agreement that rank's `scaler.step` skips
`optimizer.step()` and with it the parameter all-gather its peer waits in: a deadlock
(and scales that drift apart). Here rank 1 injects an inf into one gradient element that
falls in rank 0's chunk only; both ranks must skip the step together, back the scale off
identically, keep identical weights, and then step normally -- under a hard deadline.
torch's plain `torch.amp.GradScaler` on CPU tensors, as a library user would write it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import run_ranks
from _workloads import make_model, step_data
from raytrain_ddp.parallel import wrap_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _scaler_steps(world_rank: int, world_size: int) -> dict:
    model = make_model(seed=1).float()
    wrapper = wrap_model(model, "zero1", bucket_cap_mb=1.0)
    opt = wrapper.make_optimizer(lambda params: torch.optim.AdamW(params, lr=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    last = model[-1].bias  # the first bucket's first element (reverse order): rank 0's chunk
    shard = wrapper._shards[0]
    assert len(wrapper._shards) == 1 and (shard.lo == 0) == (world_rank == 0)  # offset 0: rank 0's
    inject = {"on": True}

    def poison(grad):
        if inject["on"] and world_rank == 1:
            grad = grad.clone()
            grad[0] = float("inf")
        return grad

    last.register_hook(poison)
    before = [p.detach().clone() for p in model.parameters()]
    out = {"skipped": [], "scales": [], "found_inf": []}
    for step in range(3):
        inject["on"] = step == 0
        x, y = step_data(step, 8)
        lo = world_rank * 4
        loss = nn.functional.mse_loss(wrapper(x[lo:lo + 4].float()), y[lo:lo + 4].float())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        out["found_inf"].append(found)
        scaler.step(opt)  # skips optimizer.step() -- and zero1's all-gather -- on overflow
        scaler.update()
        opt.zero_grad(set_to_none=True)
        out["scales"].append(scaler.get_scale())
        if step == 0:
            out["skipped"].append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_one_ranks_overflow_makes_every_rank_skip_together():
    results = run_ranks(_scaler_steps, 2, timeout_s=60)
    r0, r1 = results
    assert r0["found_inf"][0] == 1.0 and r1["found_inf"][0] == 1.0  # rank 1's inf sat in rank 0's chunk
    assert r0["found_inf"][1:] == [0.0, 0.0] and r1["found_inf"][1:] == [0.0, 0.0]
    assert r0["skipped"] == r1["skipped"] == [True]  # nobody stepped on the overflow
    assert r0["scales"] == r1["scales"] and r0["scales"][0] == 2.0**9  # backed off together
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)  # the later steps stepped (and all-gathered) on both
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"], make_model(seed=1).float().parameters()))


def _padding_only_ranks(world_rank: int, world_size: int) -> dict:
    """One 2-element parameter over 3 ranks: rank 2's chunk is padding only (issue #41 item 4)."""
    out: dict = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(1, 1, bias=True)
        wrapper = wrap_model(model, "zero1", bucket_cap_mb=1.0)
        opt = wrapper.make_optimizer(lambda params: torch.optim.AdamW(params, lr=0.1, fused=fused))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        items = {"n": 0}
        real_item = torch.Tensor.item

        def counted(self):
            items["n"] += 1
            return real_item(self)

        scales, found = [], []
        for step in range(3):
            x = torch.full((4, 1), float("inf") if step == 0 and world_rank == 2 else 1.0 + world_rank)
            loss = wrapper(x).square().mean()
            scaler.scale(loss).backward()
            torch.Tensor.item = counted
            try:
                scaler.step(opt)  # fused: found_inf goes to the kernel, never read on the host
            finally:
                torch.Tensor.item = real_item
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        out[fused] = {"slices": len(opt._slices), "amp": opt._step_supports_amp_scaling, "items": items["n"],
                      "scales": scales, "params": [p.detach().clone() for p in model.parameters()]}
    return out


def test_a_rank_with_only_padding_agrees_and_fused_steps_never_read_found_inf():
    results = run_ranks(_padding_only_ranks, 3, timeout_s=90)
    for fused in (False, True):
        by_rank = [r[fused] for r in results]
        assert [r["slices"] for r in by_rank] == [1, 1, 0]  # rank 2 holds padding only
        assert [r["amp"] for r in by_rank] == [fused] * 3
        for r in by_rank:  # rank 2's inf (in rank 0's and 1's chunks): everyone skipped and backed off
            assert r["scales"] == [2.0**9, 2.0**9, 2.0**9], r
            for a, b in zip(r["params"], by_rank[0]["params"]):
                assert torch.equal(a, b)
        if fused:
            assert [r["items"] for r in by_rank] == [0, 0, 0]  # no host read of found_inf
        else:
            assert all(r["items"] > 0 for r in by_rank)  # torch's own path: it reads found_inf
