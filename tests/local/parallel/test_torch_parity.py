"""Rank by rank against torch DDP: every strategy trains like `DistributedDataParallel` with
the same options, or raises a clear error; never a silent difference, never a hang.

float64, 2 gloo ranks, ranks starting from different weights and seeing different data.
The reference is torch DDP with the same options, compared on every rank (parameters AND
buffers, <= 1e-9), on models with BatchNorm, an embedding tied to the output head, a branch
no rank uses and one only rank 0 uses, a layer frozen (or unfrozen) after step 1, and a
wrapper inside a container. One spawn for what must match, one for what must raise.
"""

from __future__ import annotations

import contextlib
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _ddp_models import batch, build, loss_of
from _spawn import run_ranks
from _workloads import TINY_BUCKET_MB
from raytrain_ddp.parallel import REPLICATED_STRATEGIES, wrap_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TOL = 1e-9
OURS = REPLICATED_STRATEGIES


def _wrap(kind: str, module: nn.Module, pg, **opts):
    if kind == "torch":
        return DistributedDataParallel(module, process_group=pg, **opts)
    return wrap_model(module, kind, bucket_cap_mb=TINY_BUCKET_MB, process_group=pg, **opts)


def _snapshot(module: nn.Module) -> dict:
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()}}


def _train(kind, name, world_rank, *, opts=None, steps=3, k=2, solo=False, frozen=(), after_step=None):
    """Train `steps` AdamW steps of `k` micro-batches; return the end state and grad-None names."""
    pg = dist.new_group()
    module = build(name, seed=world_rank + 1)  # different on every rank: the wrap must fix it
    for layer in frozen:
        getattr(module, layer).requires_grad_(False)
    if name == "bn":  # buffers differ at wrap time too: synced there unless broadcast_buffers=False
        module.bn.running_mean.add_(world_rank)
    model = _wrap(kind, module, pg, **(opts or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    none_grads = []
    for s in range(steps):
        for j in range(k):
            x, y = batch(name, s, j, world_rank)
            extra = (solo and world_rank == 0,) if name == "branchy" else ()
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                (loss_of(name, model(x, *extra), y) / k).backward()
        none_grads.append(sorted(n for n, p in model.module.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(s, model)
    state = _snapshot(model.module)
    state["none_grads"] = none_grads
    if kind != "torch":
        state["stats"] = model.comm_stats
    return state


def _single(name, world_size, *, steps=3, k=2, frozen=(), after_step=None):
    """One process, rank 0's initial weights, every rank's micro-batches of a step in one mean."""
    module = build(name, seed=1)
    for layer in frozen:
        getattr(module, layer).requires_grad_(False)
    opt = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(steps):
        parts = [batch(name, s, j, r) for r in range(world_size) for j in range(k)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss_of(name, module(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(s, module)
    return _snapshot(module)


def _diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest difference over parameters and buffers, and the name where it is."""
    worst, where = 0.0, ""
    for group in ("params", "buffers"):
        if a[group].keys() != b[group].keys():
            return float("inf"), f"{group} names differ: {sorted(a[group])} vs {sorted(b[group])}"
        for name, t in a[group].items():
            d = (t.double() - b[group][name].double()).abs().max().item() if t.numel() else 0.0
            if d > worst or not worst and d != d:
                worst, where = d, f"{group[:-1]} {name}"
    return worst, where


def _guard(fn):
    """Run one scenario; an exception becomes its message, so one failure hides no other."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test reports
        return f"{type(exc).__name__}: {exc}"


def _eval_forward(step, model):
    if step == 0:  # a no_grad forward in train mode: BatchNorm still updates its running stats
        with torch.no_grad():
            model(batch("bn", 99, 0, dist.get_rank())[0])


def _freeze_lin1(step, model):
    if step == 0:
        model.module.lin1.requires_grad_(False)


def _unfreeze_lin1(step, model):
    if step == 0:
        getattr(model, "module", model).lin1.requires_grad_(True)


# -- one spawn: the semantics every strategy must share with torch DDP ----------------------

SCENARIOS = {  # name -> (model, options, train kwargs, kinds compared against "torch")
    "buffers": ("bn", {}, dict(after_step=_eval_forward), OURS),
    "buffers_k1": ("bn", {}, dict(k=1), OURS),
    "no_buffer_broadcast": ("bn", {"broadcast_buffers": False}, {}, OURS),
    "tied": ("tied", {}, {}, OURS),
    "unused": ("branchy", {"find_unused_parameters": True}, dict(solo=True), OURS),
    "freeze": ("bn", {"find_unused_parameters": True}, dict(after_step=_freeze_lin1), OURS),
}


def _no_sync_rule(kind, world_rank):
    """Sync is decided at forward time (torch's rule): only the forward's context counts."""
    model = _wrap(kind, build("mlp", seed=world_rank + 1), dist.new_group())
    x, y = batch("mlp", 0, 0, world_rank)
    grads = {}
    for case in ("forward_in_no_sync", "backward_in_no_sync", "both_in_no_sync", "neither"):
        fwd = model.no_sync() if case in ("forward_in_no_sync", "both_in_no_sync") else contextlib.nullcontext()
        bwd = model.no_sync() if case in ("backward_in_no_sync", "both_in_no_sync") else contextlib.nullcontext()
        with fwd:
            loss = loss_of("mlp", model(x), y)
        with bwd:
            loss.backward()
        grads[case] = model.module.lin1.weight.grad.clone()
        model.module.zero_grad(set_to_none=True)
    return grads


def _nested(kind, world_rank):
    """A wrapper inside a container: its state_dict loads back, and into an unwrapped copy."""
    container = nn.ModuleDict({"g": _wrap(kind, build("bn", seed=world_rank + 1), dist.new_group())})
    state = container.state_dict()
    container.load_state_dict(state)
    keys = sorted(state)
    if kind != "torch":  # ours keep the bare model's keys, so a plain copy loads them too
        nn.ModuleDict({"g": build("bn", seed=5)}).load_state_dict(state)
    return keys


def _pickled(kind, world_rank):
    """A pickled wrapper comes back synchronising: one backward gives the rank-averaged grad."""
    model = wrap_model(build("mlp", seed=1), kind, bucket_cap_mb=TINY_BUCKET_MB)
    clone = pickle.loads(pickle.dumps(model))
    x, y = batch("mlp", 0, 0, world_rank)
    loss_of("mlp", clone(x), y).backward()
    plain = build("mlp", seed=1)
    loss_of("mlp", plain(x), y).backward()
    err = 0.0
    for p, q in zip(clone.module.parameters(), plain.parameters()):
        mean = q.grad.clone()
        dist.all_reduce(mean)
        err = max(err, (p.grad - mean / dist.get_world_size()).abs().max().item())
    return err, clone.comm_stats["syncs"]


def _parity(world_rank, world_size):
    out = {}
    for scenario, (name, opts, kwargs, kinds) in SCENARIOS.items():
        for kind in ("torch",) + kinds:
            out[(scenario, kind)] = _guard(lambda: _train(kind, name, world_rank, opts=opts, **kwargs))
    # Freezing after wrap needs no option for the from-scratch strategies: as in one process.
    for kind in ("naive", "bucketed"):
        out[("freeze_default", kind)] = _guard(
            lambda: _train(kind, "bn", world_rank, after_step=_freeze_lin1))
        for opts in ({}, {"find_unused_parameters": True}):
            out[("unfreeze", kind, bool(opts))] = _guard(
                lambda: _train(kind, "mlp", world_rank, opts=opts, frozen=("lin1",), after_step=_unfreeze_lin1))
    for kind in ("torch",) + OURS:
        out[("no_sync", kind)] = _guard(lambda: _no_sync_rule(kind, world_rank))
        out[("nested", kind)] = _guard(lambda: _nested(kind, world_rank))
    for kind in ("naive", "bucketed"):
        out[("pickle", kind)] = _guard(lambda: _pickled(kind, world_rank))
    return out


@pytest.fixture(scope="module")
def parity():
    return run_ranks(_parity, 2, timeout_s=150, pg_timeout_s=60)


def _assert_matches_torch(parity, scenario, kinds=OURS, reference="torch"):
    for rank, out in enumerate(parity):
        ref = out[(scenario, reference)]
        assert isinstance(ref, dict), f"{scenario}: torch DDP itself failed on rank {rank}: {ref}"
        for kind in kinds:
            got = out[(scenario, kind)]
            assert isinstance(got, dict), f"{scenario}/{kind} rank {rank}: {got}"
            err, where = _diff(got, ref)
            assert err <= TOL, f"{scenario}/{kind} rank {rank}: differs from torch DDP by {err:g} at {where}"
            assert got["none_grads"] == ref["none_grads"], (scenario, kind, rank, got["none_grads"], ref["none_grads"])


def test_buffers_rebroadcast_before_forward_like_torch(parity):
    """Item 1: BatchNorm running stats follow rank 0's, exactly when torch DDP broadcasts them."""
    for scenario in ("buffers", "buffers_k1", "no_buffer_broadcast"):
        _assert_matches_torch(parity, scenario)
    # The buffer broadcast is counted apart: all-reduce bytes stay the gradient bytes.
    grad_bytes = sum(p.numel() * 8 for p in build("bn", 0).parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in build("bn", 0).buffers())
    for kind in OURS:
        stats = parity[0][("buffers_k1", kind)]["stats"]
        assert stats["syncs"] == 3 and stats["allreduce_bytes"] == 3 * grad_bytes, (kind, stats)
        assert stats["broadcast_bytes"] == 3 * buffer_bytes, (kind, stats)
        assert parity[0][("no_buffer_broadcast", kind)]["stats"]["broadcast_bytes"] == 0, kind


def test_tied_embedding_matches_torch(parity):
    _assert_matches_torch(parity, "tied")


def test_globally_unused_parameters_keep_grad_none(parity):
    """Items 2 and 3: `dead` (no rank) keeps grad None and never moves; `solo` (rank 0 only) is
    averaged with rank 1's zeros; every strategy, find_unused_parameters=True, as torch."""
    _assert_matches_torch(parity, "unused")
    for kind in OURS:
        assert parity[1][("unused", kind)]["none_grads"] == [["dead.bias", "dead.weight"]] * 3, kind
    initial = build("branchy", seed=1).dead.weight  # rank 0's init, broadcast at wrap
    assert torch.equal(parity[1][("unused", "bucketed")]["params"]["dead.weight"], initial.detach())


def test_freezing_after_wrap_works_as_in_one_process(parity):
    """Item 4: a layer frozen after step 1 stops moving; unfreezing is synchronised."""
    _assert_matches_torch(parity, "freeze")
    for kind in ("naive", "bucketed"):  # no option needed for the from-scratch strategies
        for rank, out in enumerate(parity):
            got = out[("freeze_default", kind)]
            assert isinstance(got, dict), f"{kind} rank {rank}: {got}"
            err, where = _diff(got, out[("freeze", "torch")])
            assert err <= TOL, f"freeze_default/{kind} rank {rank}: {err:g} at {where}"
    reference = _single("mlp", 2, frozen=("lin1",), after_step=_unfreeze_lin1)
    for rank, out in enumerate(parity):
        for kind in ("naive", "bucketed"):
            for opt in (False, True):
                got = out[("unfreeze", kind, opt)]
                assert isinstance(got, dict), f"unfreeze/{kind} rank {rank}: {got}"
                err, where = _diff(got, reference)
                assert err <= TOL, f"unfreeze/{kind} find_unused={opt} rank {rank}: {err:g} at {where}"


def test_no_sync_is_decided_at_forward_time(parity):
    """Item 5: one rule for every strategy, torch's: a forward inside no_sync means no sync."""
    for rank, out in enumerate(parity):
        ref = out[("no_sync", "torch")]
        for kind in OURS:
            got = out[("no_sync", kind)]
            assert isinstance(got, dict), f"{kind} rank {rank}: {got}"
            for case, grad in ref.items():
                err = (got[case] - grad).abs().max().item()
                assert err <= TOL, f"{kind} rank {rank}, {case}: differs from torch DDP by {err:g}"
    # and the rule is not vacuous: synced grads agree across ranks, local ones do not
    assert torch.equal(parity[0][("no_sync", "torch")]["backward_in_no_sync"],
                       parity[1][("no_sync", "torch")]["backward_in_no_sync"])
    assert not torch.equal(parity[0][("no_sync", "torch")]["forward_in_no_sync"],
                           parity[1][("no_sync", "torch")]["forward_in_no_sync"])


def test_wrapper_nested_in_a_container_round_trips(parity):
    """Item 6: ModuleDict({"g": wrapped}).state_dict() loads back (and into a bare copy)."""
    bare_keys = sorted("g." + k for k in build("bn", 0).state_dict())
    for rank, out in enumerate(parity):
        assert isinstance(out[("nested", "torch")], list), out[("nested", "torch")]
        for kind in OURS:
            assert out[("nested", kind)] == bare_keys, f"{kind} rank {rank}: {out[('nested', kind)]}"


def test_pickled_wrapper_still_synchronises(parity):
    """Item 7: naive and bucketed pickle (hooks are rebuilt on load), and the copy syncs."""
    for rank, out in enumerate(parity):
        for kind in ("naive", "bucketed"):
            got = out[("pickle", kind)]
            assert isinstance(got, tuple), f"{kind} rank {rank}: {got}"
            err, syncs = got
            assert err <= 1e-12 and syncs == 1, (kind, rank, got)


# -- one spawn: what must raise, by name, on every rank, quickly --------------------------

def _raises(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _unused_step(kind, case, world_rank):
    """Default options (find_unused_parameters=False): `dead` unused everywhere, or `solo`
    unused on rank 1 only. The first backward must raise, naming it."""
    module = build("branchy", seed=1)
    if case == "solo":
        module.dead.requires_grad_(False)
    model = wrap_model(module, kind, process_group=dist.new_group(), collective_timeout_s=20)
    x, y = batch("branchy", 0, 0, world_rank)
    use_solo = case == "dead" or world_rank == 0
    loss_of("branchy", model(x, use_solo), y).backward()


def _native_unused_later(world_rank):
    """native checks with its own hooks on the first synced backward only; a parameter left
    unused later (here `solo`, on every rank at step 2) gets torch's check at the next
    forward, re-raised naming it."""
    module = build("branchy", seed=1)
    module.dead.requires_grad_(False)
    model = wrap_model(module, "native", process_group=dist.new_group(), collective_timeout_s=20)
    for s in range(3):
        x, y = batch("branchy", s, 0, world_rank)
        loss_of("branchy", model(x, s == 0), y).backward()


def _native_requires_grad_change(case, opts, world_rank):
    """native (torch DDP) cannot follow a requires_grad change without find_unused_parameters
    (freeze) or at all (unfreeze): the next forward must raise, naming the parameter."""
    module = build("mlp", seed=1)
    if case == "unfreeze":
        module.lin1.requires_grad_(False)
    model = wrap_model(module, "native", process_group=dist.new_group(), **opts)
    for s in range(3):
        x, y = batch("mlp", s, 0, world_rank)
        loss_of("mlp", model(x), y).backward()
        module.zero_grad(set_to_none=True)
        if s == 0:
            module.lin1.requires_grad_(case == "unfreeze")


def _errors(world_rank, world_size):
    out = {}
    for kind in OURS:
        for case in ("dead", "solo"):
            out[(kind, case)] = _raises(lambda: _unused_step(kind, case, world_rank))
    out[("native", "later")] = _raises(lambda: _native_unused_later(world_rank))
    out[("native", "freeze")] = _raises(lambda: _native_requires_grad_change("freeze", {}, world_rank))
    for opts in ({}, {"find_unused_parameters": True}):
        out[("native", "unfreeze", bool(opts))] = _raises(
            lambda: _native_requires_grad_change("unfreeze", opts, world_rank))
    return out


def test_unused_or_changed_parameters_raise_by_name_without_hanging():
    """Items 3 and 4: without find_unused_parameters, an unused parameter (on every rank or on
    one) fails the first backward on every rank, naming it (native: one left
    unused at a later step fails the next forward, named), before the group's timeout; native names a requires_grad
    change it cannot follow."""
    pg_timeout_s = 40
    per_rank = run_ranks(_errors, 2, timeout_s=120, pg_timeout_s=pg_timeout_s)
    before_timeout = 0.9 * pg_timeout_s  # raised by the check itself, not by the group's timeout (any load)
    for rank, out in enumerate(per_rank):
        for kind in OURS:
            for case, name in (("dead", "dead.weight"), ("solo", "solo.weight")):
                msg, elapsed = out[(kind, case)]
                assert name in msg and "find_unused_parameters" in msg, f"{kind}/{case} rank {rank}: {msg}"
                assert elapsed < before_timeout, f"{kind}/{case} rank {rank}: took {elapsed:.1f}s ({msg})"
            assert "on rank(s) [1]" in out[(kind, "solo")][0], out[(kind, "solo")][0]
        msg, elapsed = out[("native", "later")]
        assert msg.startswith("UnusedParameterError") and "'solo.weight'" in msg, f"later rank {rank}: {msg}"
        assert "find_unused_parameters" in msg and elapsed < before_timeout, (rank, elapsed, msg)
        for key in (("native", "freeze"), ("native", "unfreeze", False), ("native", "unfreeze", True)):
            msg, _ = out[key]
            assert "lin1.weight" in msg and "requires_grad" in msg, f"{key} rank {rank}: {msg}"
