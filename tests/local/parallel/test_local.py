"""One process: no process group (or a group of one), the accumulation window's arithmetic,
bucket assignment, argument errors, and the no-Ray
import rule. Mostly milliseconds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from _spawn import run_ranks
from _workloads import make_model, make_optimizer, reference_params, step_data
from raytrain_ddp.parallel import (
    REPLICATED_STRATEGIES, LocalModel, WrappedModel, accumulation_window, chunked, wrap_model,
)
from raytrain_ddp.parallel import tuning
from raytrain_ddp.parallel.base import CommClock, split_comm_time
from raytrain_ddp.parallel.bucketed import assign_buckets

pytestmark = pytest.mark.timeout(60)


class _FakeWrapper:
    """Records which micro-steps ran under no_sync."""

    world_size = 1

    def __init__(self) -> None:
        self.synced: list[bool] = []
        self._in_no_sync = False

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self._in_no_sync = True
            yield
            self._in_no_sync = False

        return ctx()


def test_accumulation_window_syncs_last_and_scales():
    fake = _FakeWrapper()
    batches = iter(range(7))
    seen = []
    while True:
        window = accumulation_window(fake, batches, expected=3)
        for mb, scale in window:
            seen.append((mb, scale, fake._in_no_sync))
        if not window.should_step:
            break
    assert [s[0] for s in seen] == list(range(7))
    assert [s[2] for s in seen] == [True, True, False] * 2 + [False]  # only last micro-step syncs
    assert [s[1] for s in seen] == pytest.approx([1 / 3] * 6 + [1.0])  # short window: its real size
    assert window.exhausted and window.size == 0

    dropped = accumulation_window(fake, iter(range(2)), expected=3, partial="drop")
    assert list(dropped) == [] and not dropped.should_step and dropped.dropped == 2

    by_count = accumulation_window(fake, [[0] * 3, [0] * 1], expected=2, count=len)
    assert [s for _, s in by_count] == pytest.approx([0.75, 0.25])
    assert [len(c) for c in chunked(range(5), 2)] == [2, 2, 1]

    with pytest.raises(ValueError, match="expected=2"):
        accumulation_window(fake, [1, 2, 3], expected=2)
    with pytest.raises(ValueError, match="partial='keep'"):
        accumulation_window(fake, [1], expected=2, partial="keep")


def test_assign_buckets_reverse_order_caps_and_dtypes():
    ps = [torch.zeros(256), torch.zeros(256), torch.zeros(10, dtype=torch.float64), torch.zeros(256),
          torch.zeros(600)]
    # caps in bytes: 2 KB (first bucket per dtype 1 KB); a bucket closes once it holds its cap
    assert assign_buckets(ps, cap_bytes=2048, first_cap_bytes=1024) == [[0], [1, 3], [2], [4]]
    assert assign_buckets(ps, cap_bytes=10**6) == [[0, 1, 3, 4], [2]]


def test_first_bucket_cap_and_the_tiny_models_layout():
    """The equivalence suite's tiny model (float64, reverse order: 24, 192, 64, 320 bytes)."""
    ps = [torch.zeros(3, dtype=torch.float64), torch.zeros(24, dtype=torch.float64),
          torch.zeros(8, dtype=torch.float64), torch.zeros(40, dtype=torch.float64)]
    assert assign_buckets(ps, cap_bytes=256) == [[0, 1, 2], [3]]  # TINY_BUCKET_MB: closes at >= 256 B
    assert assign_buckets(ps, cap_bytes=256, first_cap_bytes=24) == [[0], [1, 2], [3]]


def test_exposed_communication_is_the_union_of_spans_after_backward():
    # two overlapping all-reduces [0, 3] and [2, 5], one later [7, 8]; backward ended at 4
    comm, exposed = split_comm_time(4.0, [(2.0, 5.0), (0.0, 3.0), (7.0, 8.0)])
    assert comm == 6.0 and exposed == 2.0  # union 0-5 and 7-8; after 4: 4-5 and 7-8
    assert split_comm_time(10.0, [(0.0, 1.0)]) == (1.0, 0.0)  # all hidden
    assert split_comm_time(0.0, [(1.0, 2.0), (1.5, 2.5)]) == (1.5, 1.5)  # all exposed (naive)
    assert split_comm_time(0.0, []) == (0.0, 0.0)


class _Work:
    """A collective that completes when the test says so (what CommClock asks of a work)."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_comm_clock_stamps_completions_when_the_training_thread_sees_them():
    clock, first, second = CommClock(), _Work(), _Work()
    clock.launched(first)
    clock.launched(second)
    clock.poll()  # nothing finished yet
    assert clock.ended == [0.0, 0.0] and clock.open == [0, 1]
    second.done = True  # out of order: gloo may finish a later bucket first
    clock.poll()
    assert clock.ended[0] == 0.0 and clock.ended[1] >= clock.started[1] and clock.open == [0]
    seen = clock.ended[1]
    first.done = True
    clock.poll()
    assert clock.open == [] and clock.ended[0] >= seen and clock.ended[1] == seen  # a stamp is kept
    (s0, e0), (s1, e1) = clock.spans()
    assert s0 <= s1 <= e1 <= e0


def test_auto_tuner_visits_every_candidate_then_keeps_the_fastest():
    options = [tuning.Candidate(1.0, None, 4), tuning.Candidate(25.0, None, 1), tuning.Candidate(1.0, "bf16", 4)]
    tuner = tuning.AutoTuner(options, rounds=2)
    assert tuner.steps == 1 + 2 * 3 and tuner.choice is None and tuner.summary is None
    cost = {options[0]: 10.0, options[1]: 8.0, options[2]: 7.9}  # bf16 1% faster: not worth it
    seen = []
    for _ in range(tuner.steps):
        current = tuner.current
        seen.append(current)
        tuner.record(cost[current])  # no process group: the local medians decide
    assert set(seen) == set(options) and seen.count(options[0]) == 3  # the warm-up uses the first
    assert tuner.choice == options[1] and tuner.current == options[1]
    assert tuner.summary["ms"] == {"1 MB": 10e3, "25 MB": 8e3, "1 MB bf16": 7.9e3}
    assert "25 MB (1 bucket)" in tuner.describe()
    fast = tuning.AutoTuner(options, rounds=1)
    for _ in range(fast.steps):
        fast.record({options[0]: 10.0, options[1]: 8.0, options[2]: 5.0}[fast.current])
    assert fast.choice == options[2]  # bf16 saves 37%: kept
    alone = tuning.AutoTuner(options[:1])
    assert alone.steps == 0 and alone.choice == options[0] and "same buckets" in alone.describe()


def test_auto_candidates_scale_with_the_gradient():
    assert tuning.candidate_caps(9446400) == (0.56, 1.1, 2.3, 4.5, 25.0)  # the bench MLP, 9 MB
    assert tuning.candidate_caps(4 * 10**9) == (25.0, 100.0)  # 4 GB: capped at 100 MB
    assert tuning.candidate_caps(1000) == (25.0,)  # tiny: one layout whatever the cap


def test_wrap_model_rejects_bad_options():
    with pytest.raises(ValueError, match="'naive'"):
        wrap_model(nn.Linear(2, 2), "naive", compress="bf16")
    with pytest.raises(ValueError, match="strategy='ddp' is not one of"):
        wrap_model(nn.Linear(2, 2), "ddp")
    with pytest.raises(ValueError, match="compress='fp8'"):
        wrap_model(nn.Linear(2, 2), "bucketed", compress="fp8")
    with pytest.raises(ValueError, match="already wrapped"):
        wrap_model(wrap_model(nn.Linear(2, 2), "bucketed"), "naive")
    for strategy in ("naive", "native", "zero1"):  # timed tuning is bucketed's
        with pytest.raises(ValueError, match="bucket_cap_mb='auto' .* 'bucketed' only"):
            wrap_model(nn.Linear(2, 2), strategy, bucket_cap_mb="auto")
    with pytest.raises(ValueError, match="compress='auto' .* 'bucketed' only"):
        wrap_model(nn.Linear(2, 2), "native", compress="auto")
    with pytest.raises(ValueError, match="first_bucket_mb=0 must be > 0"):
        wrap_model(nn.Linear(2, 2), "bucketed", first_bucket_mb=0)
    for strategy in ("bucketed", "native"):  # bf16 on 16-bit parameters: same bytes, less precision
        for dtype in (torch.float16, torch.bfloat16):
            with pytest.raises(ValueError, match="parameter 'weight' .* is already 16-bit"):
                wrap_model(nn.Linear(2, 2).to(dtype), strategy, compress="bf16")


def _single(world_rank=0, world_size=1):
    """Every strategy equals plain training, sends nothing; state_dict has bare keys."""
    out = {}
    for strategy in REPLICATED_STRATEGIES:
        model = wrap_model(make_model(seed=1), strategy)
        assert isinstance(model, WrappedModel) and model.strategy == strategy
        opt = make_optimizer("adamw", model.parameters())
        for s in range(2):
            x, y = step_data(s, 6)
            for (xb, yb), scale in accumulation_window(model, iter([(x[:3], y[:3]), (x[3:], y[3:])]),
                                                       expected=2):
                (nn.functional.mse_loss(model(xb), yb) * scale).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        assert not model.module.training
        out[strategy] = dict(params=[p.detach().clone() for p in model.module.parameters()],
                             stats=model.comm_stats, keys=list(model.state_dict()),
                             local=isinstance(model, LocalModel))
        model.load_state_dict(make_model(seed=3).state_dict())  # bare keys load back
    return out


def _check_single(out, native_local: bool):
    reference = reference_params("adamw", 2, [6, 6])
    for strategy, res in out.items():
        assert max((p - r).abs().max().item() for p, r in zip(res["params"], reference)) < 1e-12
        assert res["stats"]["allreduce_calls"] == 0 and res["stats"]["allreduce_bytes"] == 0, strategy
        assert res["keys"] == list(make_model(1).state_dict()), strategy
    assert out["native"]["local"] is native_local


def test_no_process_group_runs_without_communication():
    import torch.distributed as dist

    assert not dist.is_initialized()
    _check_single(_single(), native_local=True)  # native without a group: LocalModel pass-through


@pytest.mark.distributed
def test_world_size_one_group():
    (out,) = run_ranks(_single, 1, timeout_s=45)
    # naive/bucketed skip communication at world size 1; native is real DDP, whose one
    # rank still "all-reduces" with itself, so only the first two are held to zero here.
    reference = reference_params("adamw", 2, [6, 6])
    for strategy, res in out.items():
        assert max((p - r).abs().max().item() for p, r in zip(res["params"], reference)) < 1e-12, strategy
    assert out["naive"]["stats"]["allreduce_calls"] == out["bucketed"]["stats"]["allreduce_calls"] == 0
    assert not out["native"]["local"] and out["native"]["stats"]["allreduce_calls"] == 2


def test_import_does_not_pull_ray():
    code = "import sys, raytrain_ddp.parallel; assert 'ray' not in sys.modules, 'ray imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr


def _rewrap(world_rank, world_size):
    """Wrapping the same module twice must not sync twice (the first wrapper is closed)."""
    net = make_model(seed=1)
    first = wrap_model(net, "bucketed")
    second = wrap_model(net, "naive")
    second(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    return (first.comm_stats["allreduce_calls"], second.comm_stats["allreduce_calls"],
            sum(p.requires_grad for p in net.parameters()))


@pytest.mark.distributed
def test_rewrapping_closes_the_previous_wrapper():
    for first_calls, second_calls, n_trainable in run_ranks(_rewrap, 2, timeout_s=45):
        assert first_calls == 0  # the closed bucketed wrapper no longer syncs
        assert second_calls == n_trainable


def _shm_transport(world_rank, world_size, dirs):
    """bucketed on CPU ranks of one host: shared memory, decided at the first synced backward;
    the same bits as gloo; nothing left in /dev/shm; every rank falls back together."""
    import os

    import torch.distributed as dist

    from raytrain_ddp.parallel import shm

    def train(**options):
        net = make_model(seed=1)
        wrapper = wrap_model(net, "bucketed", bucket_cap_mb=0.0001, first_bucket_mb=0.0001, **options)
        before = wrapper.transport
        opt = make_optimizer("sgd", net.parameters())
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            x, y = step_data(step, 4 * world_size)
            nn.functional.mse_loss(wrapper(x[world_rank::world_size]), y[world_rank::world_size]).backward()
            opt.step()
        return before, wrapper.transport, len(wrapper._buckets), [p.detach().clone() for p in net.parameters()]

    out = {"shm": train(), "gloo": train(shm=False)}
    out["left_in_dev_shm"] = [f for f in os.listdir(shm.SHM_DIR) if f.startswith("raytrain_ddp_")]
    flats = [torch.zeros(1000), torch.zeros(10, dtype=torch.float64)]
    # another host (here: another directory per rank), or no room: None on every rank
    out["apart"] = shm.open_exchange(flats, None, world_rank, world_size, shm_dir=dirs[world_rank]) is None
    out["no_room"] = shm.open_exchange(flats, None, world_rank, world_size, budget_bytes=0) is None
    out["left_apart"] = sorted(os.listdir(dirs[world_rank]))
    # two flat buffers (two dtypes), one exchange each, summed in rank order on every rank
    ex = shm.open_exchange(flats, None, world_rank, world_size)
    sums = []
    for parity in range(3):
        works = []
        for i, flat in enumerate(flats):
            flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype) * (world_rank + 1) + parity)
            works.append(ex.launch(i, flat[2:7], 2, 7))
        for work in works:
            assert not work.is_completed()
            work.wait()
            assert work.is_completed()
        ex.synced()
        sums.append([flat.tolist()[:8] for flat in flats])
    dist.barrier()
    return out, sums


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_goes_through_shared_memory_on_one_host_with_gloos_bits(tmp_path, world):
    """Two ranks: gloo's bits exactly. Three (slots summed with torch.sum): the same bits on
    every rank, and gloo's result up to the order of the sum."""
    dirs = [str(tmp_path / f"rank{r}") for r in range(world)]
    for d in dirs:
        (tmp_path / d).mkdir()
    ranks = run_ranks(_shm_transport, world, dirs, timeout_s=90)
    for world_rank, (out, sums) in enumerate(ranks):
        before, after, buckets, params = out["shm"]
        assert (before, after) == ("undecided", "shm") and buckets == 2
        assert out["gloo"][1] == "process_group" and out["gloo"][2] == buckets
        if world == 2:
            assert all(torch.equal(a, b) for a, b in zip(params, out["gloo"][3]))  # bit for bit
        else:
            assert max((a - b).abs().max().item() for a, b in zip(params, out["gloo"][3])) < 1e-12
        assert all(torch.equal(a, b) for a, b in zip(params, ranks[0][0]["shm"][3]))  # replicas stay identical
        assert out["left_in_dev_shm"] == []  # unlinked once every rank held it
        assert out["apart"] and out["no_room"] and out["left_apart"] == []
        for parity, (floats, doubles) in enumerate(sums):
            # elements 2..6 are k * (1 + 2 + ... + W) + W * parity, summed over ranks; the rest this rank's own
            total = world * (world + 1) // 2
            expected = [k * (world_rank + 1) + parity if not 2 <= k < 7 else total * k + world * parity
                        for k in range(8)]
            assert floats == expected and doubles[:8] == expected
