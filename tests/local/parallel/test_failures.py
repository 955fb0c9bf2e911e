"""What happens when ranks disagree: different weights or models, unused parameters, a rank
that never joins the all-reduce. Every case must end in a clear error (on every rank where
that is promised) or the right gradient, and never in a hang: run_ranks kills at its deadline.
The three cases run in one spawn of two ranks (the module fixture `ranks`), the rank that
never joins last: it leaves the default group with an operation that timed out.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _spawn import run_ranks
from _workloads import TINY_BUCKET_MB, make_model
from raytrain_ddp.parallel import REPLICATED_STRATEGIES, ModelMismatchError, wrap_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


# -- start-up checks ---------------------------------------------------------------------

def _start_up(world_rank, world_size):
    out = {}
    for strategy in REPLICATED_STRATEGIES:
        try:  # different seeds per rank: every rank must raise, none may hang
            wrap_model(make_model(seed=world_rank + 1), strategy, verify_init=True)
            out[strategy] = None
        except ModelMismatchError as exc:
            out[strategy] = str(exc)
        same = make_model(seed=7)
        before = [p.detach().clone() for p in same.parameters()]
        wrap_model(same, strategy, verify_init=True)  # identical weights pass untouched
        out[strategy + "/same_ok"] = all(torch.equal(a, b) for a, b in zip(before, same.parameters()))
        model = make_model(seed=world_rank + 1)
        if world_rank == 1:  # a rank that built another model fails clearly, on every rank
            model.append(nn.Linear(3, 3).double())
        try:
            wrap_model(model, strategy)
            out[strategy + "/structure"] = None
        except ModelMismatchError as exc:
            out[strategy + "/structure"] = str(exc)
    # Without verify_init, rank 0's weights AND buffers win.
    bn = nn.BatchNorm1d(3)
    bn.running_mean.fill_(float(world_rank))
    torch.manual_seed(world_rank)
    bn.weight.data.uniform_()
    wrapped = wrap_model(bn, "bucketed")
    out["buffer"] = wrapped.module.running_mean.tolist()
    weights = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(weights, wrapped.module.weight.detach())
    out["weights_equal"] = all(torch.equal(w, weights[0]) for w in weights)
    return out


def test_verify_init_and_structure_raise_on_every_rank(ranks):
    for rank, out in enumerate(r["start_up"] for r in ranks):
        for strategy in REPLICATED_STRATEGIES:
            msg = out[strategy]
            assert msg is not None, f"{strategy}: rank {rank} did not raise"
            assert "model parameters are not the same on all processes" in msg
            assert "parameter '0.weight' on rank(s) [1] differs from rank 0" in msg, msg
            assert "torch.manual_seed" in msg  # says how to fix it
            assert out[strategy + "/same_ok"], strategy
            assert "structure differs across ranks" in out[strategy + "/structure"], strategy
        assert out["buffer"] == [0.0, 0.0, 0.0]
        assert out["weights_equal"]


# -- a parameter without a gradient in a step ----------------------------------------------

class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        return self.head(h + self.b(x) if use_b else h)


# micro-steps of one window per rank: (uses b?) for each micro-step; rank 1 never uses b in the synced one
PLANS = {"single": [[True], [False]], "window": [[True, True], [True, False]]}


def _grads(state, world_rank, plan):
    """Rank world_rank's local (unsynced) accumulated gradient, computed without communication."""
    model = Branchy().double()
    model.load_state_dict(state)
    for j, use_b in enumerate(plan[world_rank]):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * world_rank + j))
        (model(x, use_b).sum() / len(plan[world_rank])).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _unused(world_rank, world_size):
    out = {}
    for strategy, cap in [("bucketed", TINY_BUCKET_MB), ("bucketed", 25.0), ("naive", 25.0)]:
        for plan_name, plan in PLANS.items():
            torch.manual_seed(world_rank)
            model = wrap_model(Branchy().double(), strategy, bucket_cap_mb=cap, find_unused_parameters=True)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            n = len(plan[world_rank])
            for j, use_b in enumerate(plan[world_rank]):
                x = torch.randn(3, 4, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(10 * world_rank + j))
                ctx = model.no_sync() if j < n - 1 else torch.enable_grad()
                with ctx:
                    (model(x, use_b).sum() / n).backward()
            expected = [_grads(state, r, plan) for r in range(world_size)]
            err = max((p.grad - sum(e[name] for e in expected) / world_size).abs().max().item()
                      for name, p in model.module.named_parameters())
            out[(strategy, cap, plan_name)] = (err, model.comm_stats["syncs"])
    return out


def test_unused_parameter_does_not_hang_and_averages_zero(ranks):
    for out in (r["unused"] for r in ranks):
        for key, (err, syncs) in out.items():
            assert err < 1e-12, f"{key}: gradient off by {err}"
            assert syncs == 1, key


# -- a rank that never joins: the waiting rank gets a named timeout ------------------------

TIMEOUT_S = 2.0


def _timeouts(world_rank, world_size):
    store = dist.distributed_c10d._get_default_store()
    groups = {s: dist.new_group() for s in ("bucketed", "naive")}  # one stuck op per group
    models = {s: wrap_model(make_model(seed=1), s, process_group=g, collective_timeout_s=TIMEOUT_S,
                            bucket_cap_mb=TINY_BUCKET_MB) for s, g in groups.items()}
    models["native"] = wrap_model(make_model(seed=1), "native", collective_timeout_s=TIMEOUT_S)
    x = torch.randn(2, 5, dtype=torch.float64)
    # Two steps together: the first agrees on unused parameters, the second's forward is
    # where torch DDP rebuilds its buckets (a collective); then rank 1 stops taking part.
    for _ in range(2):
        for model in models.values():
            model(x).sum().backward()
    if world_rank == 1:  # skips the backward, stays alive until rank 0 has timed out everywhere
        store.wait(["rank0_done"], timedelta(seconds=100))
        return None
    out = {}
    for strategy, model in models.items():
        start = time.monotonic()
        try:
            model(x).sum().backward()
            out[strategy] = ("no error", "", 0.0)
        except Exception as exc:  # noqa: BLE001 - the type is what we check
            out[strategy] = (type(exc).__name__, str(exc), time.monotonic() - start)
    store.set("rank0_done", "1")
    return out


def _every_case(world_rank, world_size):
    return {"start_up": _start_up(world_rank, world_size), "unused": _unused(world_rank, world_size),
            "timeouts": _timeouts(world_rank, world_size)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Each rank's results of the three cases, from one spawn (the group's own timeout, 110 s,
    far above the wrappers' TIMEOUT_S: the timeout case must see ours fire)."""
    return run_ranks(_every_case, 2, timeout_s=130, pg_timeout_s=110)


def test_collective_timeout_names_the_operation(ranks):
    out = ranks[0]["timeouts"]
    for strategy, (kind, msg, elapsed) in out.items():
        assert TIMEOUT_S * 0.9 <= elapsed < 100, (strategy, elapsed, msg)  # ours fired, not the group's (110 s)
        assert "on rank 0 of 2" in msg, (strategy, msg)
    kind, msg, _ = out["bucketed"]
    assert kind == "CollectiveTimeoutError", msg
    assert "all-reduce of bucket 1/2" in msg and "params: 4.bias, 4.weight, 0.bias" in msg, msg
    assert f"did not finish within {TIMEOUT_S:g}s" in msg, msg
    kind, msg, _ = out["naive"]
    assert kind == "CollectiveTimeoutError", msg
    assert "all-reduce of gradient 1/4" in msg and "0.weight" in msg, msg
    kind, msg, _ = out["native"]  # through DDP's reducer the type becomes RuntimeError; the text stays
    assert "all-reduce of DDP bucket" in msg and f"within {TIMEOUT_S:g}s" in msg, msg
