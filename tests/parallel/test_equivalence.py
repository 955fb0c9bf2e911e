"""W ranks x micro-batch b x k accumulation steps == one process over W*b*k samples.

Every strategy, SGD+momentum and AdamW, W in {2, 3}, float64, tiny buckets (several per
model), a frozen layer, ranks starting from different random weights (the wrap-time
broadcast must fix that), zero_grad(set_to_none=True) between steps. Plus, on W=2, the
communication accounting and bf16 compression. One spawn per world size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _spawn import run_ranks
from _workloads import (
    EXPECTED_BUCKETS, TINY_BUCKET_MB, make_model, make_optimizer, reference_params, step_data,
    trainable_bytes,
)
from raytrain_ddp.parallel import STRATEGIES, accumulation_window, wrap_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

STEPS, MICRO, ACCUM = 3, 3, 2


def _train(world_rank, world_size, strategy, optimizer, compress=None, sizes=None):
    """Train STEPS steps; `sizes[r][j]` = samples of rank r's micro-batch j (default MICRO)."""
    model = wrap_model(make_model(seed=world_rank + 1), strategy, bucket_cap_mb=TINY_BUCKET_MB,
                       compress=compress)
    opt = make_optimizer(optimizer, model.parameters())
    sizes = sizes or [[MICRO] * ACCUM for _ in range(world_size)]
    starts = [sum(map(sum, sizes[:r])) for r in range(world_size)]
    total = sum(map(sum, sizes))
    for s in range(STEPS):
        x, y = step_data(s, total)
        lo = starts[world_rank]
        micro = []
        for n in sizes[world_rank]:
            micro.append((x[lo:lo + n], y[lo:lo + n]))
            lo += n
        count = (lambda mb: len(mb[0])) if len(set(sum(sizes, []))) > 1 else None
        window = accumulation_window(model, iter(micro), expected=ACCUM, count=count)
        for (xb, yb), scale in window:
            (nn.functional.mse_loss(model(xb), yb) * scale).backward()
        assert window.should_step
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.module.parameters()], total


def _comm_checks(world_rank, world_size):
    """What each strategy sends: nothing under no_sync, one call per bucket, exact bytes."""
    out = {}
    x = torch.randn(4, 5)
    for strategy, compress in [("naive", None), ("bucketed", None), ("bucketed", "bf16"),
                               ("native", None), ("native", "bf16")]:
        # float32, the realistic wire format; half the cap keeps the float64 bucket layout.
        model = wrap_model(make_model(seed=world_rank + 1).float(), strategy,
                           bucket_cap_mb=TINY_BUCKET_MB / 2, compress=compress)
        with model.no_sync():
            model(x).sum().backward()
        quiet = model.comm_stats
        model(x).sum().backward()
        synced = model.comm_stats
        views = None
        if strategy == "bucketed":  # grads live in the flat buffer, even after set_to_none
            model.module.zero_grad(set_to_none=True)
            model(x).sum().backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in model.module.parameters()
                        if p.requires_grad}
            views = len(storages)
        model.reset_comm_stats()
        out[f"{strategy}/{compress}"] = dict(quiet=quiet, synced=synced, after_reset=model.comm_stats,
                                             storages=views)
    return out


def _run_all(world_rank, world_size):
    results = {}
    for strategy in STRATEGIES:
        for optimizer in ("sgd", "adamw"):
            results[(strategy, optimizer, None)] = _train(world_rank, world_size, strategy, optimizer)
    # One micro-step per window: the synced backward adopts fresh gradients (pre-divided
    # into the bucket in one pass) rather than finding them accumulated in the views.
    for strategy in ("naive", "bucketed"):
        results[(strategy, "adamw", "k1")] = _train(world_rank, world_size, strategy, "adamw",
                                                     sizes=[[MICRO]] * world_size)
    if world_size > 2:  # the rest does not depend on W: run it once, on W=2
        return results, None
    results[("bucketed", "adamw", "bf16")] = _train(world_rank, world_size, "bucketed", "adamw", "bf16")
    results[("native", "sgd", "bf16")] = _train(world_rank, world_size, "native", "sgd", "bf16")
    results[("bucketed", "sgd", "bf16-k1")] = _train(world_rank, world_size, "bucketed", "sgd", "bf16",
                                                     sizes=[[MICRO]] * world_size)
    # Uneven micro-batches (count= weights by samples): still one process's mean over all samples.
    results[("bucketed", "sgd", "uneven")] = _train(world_rank, world_size, "bucketed", "sgd",
                                                    sizes=[[3, 1], [2, 4]])
    return results, _comm_checks(world_rank, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_strategies_match_single_process(world_size):
    per_rank = run_ranks(_run_all, world_size, timeout_s=100)
    runs = per_rank[0][0]
    for key, (params, total) in runs.items():
        strategy, optimizer, variant = key
        reference = reference_params(optimizer, STEPS, [total] * STEPS)
        for rank, (rank_runs, _) in enumerate(per_rank):  # every rank ends identical
            for p, q in zip(params, rank_runs[key][0]):
                assert torch.equal(p, q), f"{key}: rank {rank} differs from rank 0"
        err = max((p - r).abs().max().item() for p, r in zip(params, reference))
        if variant and variant.startswith("bf16"):  # lossy on the wire: close, not exact
            assert 0 < err < 5e-2, f"{key}: bf16 run off by {err}"
        else:
            assert err < 1e-9, f"{key}: differs from one process by {err}"
        # The frozen layer never moved, and equals rank 0's initial weights on every rank.
        frozen = make_model(seed=1)[2].weight  # rank 0's seed
        assert torch.equal(params[2], frozen), key

    comm = per_rank[0][1]
    if world_size == 2:
        grad_bytes = trainable_bytes(make_model(0), itemsize=4)
        n_trainable = sum(p.requires_grad for p in make_model(0).parameters())
        for name, stats in comm.items():
            assert stats["quiet"]["allreduce_calls"] == 0 and stats["quiet"]["allreduce_bytes"] == 0, name
            assert stats["after_reset"]["allreduce_calls"] == 0, name
            synced = stats["synced"]
            assert synced["syncs"] == 1, name
            wire = grad_bytes // 2 if name.endswith("bf16") else grad_bytes  # bf16 halves it
            assert synced["allreduce_bytes"] == wire, (name, synced)
        assert comm["naive/None"]["synced"]["allreduce_calls"] == n_trainable
        for name in ("bucketed/None", "bucketed/bf16"):
            assert comm[name]["synced"]["allreduce_calls"] == EXPECTED_BUCKETS == comm[name]["synced"]["buckets"]
            assert comm[name]["storages"] == 1  # every grad is a view into the one flat buffer
        for name in ("native/None", "native/bf16"):
            assert comm[name]["synced"]["allreduce_calls"] == comm[name]["synced"]["buckets"] >= 1
