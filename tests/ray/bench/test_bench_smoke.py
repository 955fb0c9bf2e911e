"""`raytrain-ddp bench --quick` end to end at the smoke preset (`make test-bench`; it starts
Ray): every section written, with sane values. The sections at toy size and the bench's
pieces that need no Ray are tests/local/bench/."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import TIMED, VARIANTS, positive as _positive

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    env = dict(os.environ, RAYTRAIN_DDP_BENCH_SIZE="smoke")
    env.pop("RAY_ADDRESS", None)  # the suite starts its own local instance
    proc = subprocess.run([sys.executable, "-m", "raytrain_ddp", "bench", "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)  # ~150 s on a quiet 2-core box; CI shares it
    return proc, out


@pytest.mark.bench_smoke
@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_quick_bench_writes_every_section(smoke_run):
    proc, out = smoke_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    results = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| variant |" in proc.stdout and "**Targets**" in proc.stdout
    assert results["meta"]["preset"] == "smoke" and results["meta"]["device"] == "cpu"

    strategies = results["strategies"]
    assert strategies["world_size"] == 2 and strategies["threads_per_rank"] == 1
    for model in ("mlp", "gpt"):
        section = strategies[model]
        for variant in VARIANTS:
            assert _positive(section["step_ms"][variant]), (model, variant)
            spread = section["spread_ms"][variant]
            assert spread["min"] <= spread["p25"] <= spread["median"] <= spread["p75"] <= spread["max"]
        for name in ("bucketed_over_native", "naive_over_bucketed", "bucketed_over_torch_ddp"):
            assert _positive(section["ratios"][name]), (model, name)
        # Exposed communication from the wrappers' own timing (#19): sane, no timing asserted.
        for variant in TIMED:
            c = section["comm"][variant]
            assert 0.0 <= c["exposed_ms"] <= c["comm_ms"] and 0.0 <= c["overlap_fraction"] <= 1.0, (model, c)
            assert c["exposed_ms"] <= section["spread_ms"][variant]["max"], (model, variant, c)
        assert section["comm"]["naive"]["overlap_fraction"] == 0.0  # all after backward
        assert "torch_ddp" not in section["comm"]  # torch DDP has no counter
        auto = section["auto"]  # bucketed_auto decided during its warm-up
        assert auto["bucket_cap_mb"] > 0 and auto["buckets"] >= 1 and auto["compress"] is None, auto
        assert _positive(section["ratios"]["bucketed_auto_over_torch_ddp"])
        assert set(section["paired_over_torch_ddp"]) == {"bucketed_25mb", "bucketed_25mb_gloo", "bucketed_auto",
                                                         "native"}
        assert all(_positive(v) for v in section["paired_over_torch_ddp"].values()), section
        parity = section["parity"]  # the launches that judge #19 (smoke: one launch of 2 rounds, no interval)
        assert parity["launches"] == 1 and parity["rounds_per_launch"] == 2, parity
        assert _positive(parity["ratio"]) and _positive(parity["control"]) and _positive(parity["gloo"]), parity
        assert set(parity["step_ms"]) == {"bucketed_25mb", "bucketed_25mb_gloo", "torch_ddp", "torch_ddp_control"}
        assert parity["per_launch"] == [parity["ratio"]] and all(math.isnan(v) for v in parity["ci95"]), parity
    assert "| paired bucketed_25mb / torch_ddp |" in proc.stdout
    assert "**bucketed / torch DDP over separate launches**" in proc.stdout
    assert "**Exposed communication**" in proc.stdout and "`bucketed_auto` on mlp:" in proc.stdout

    acc = results["accumulation"]
    seen = {(row["strategy"], row["k"]) for row in acc["rows"]}
    assert seen == {(s, k) for s in ("naive", "bucketed", "native") for k in (1, 2, 4, 8)}
    for row in acc["rows"]:
        # Exact counts, not timings: every gradient byte exactly once per optimizer step,
        # nothing sent on the micro-steps under no_sync.
        assert abs(row["bytes_over_min"] - 1.0) <= 1e-9, row
        assert row["allreduce_bytes_per_step"] == row["min_bytes_per_step"] > 0
        assert row["nonfinal_calls"] == 0 and row["nonfinal_bytes"] == 0, row
        assert row["allreduce_calls_per_step"] >= 1
        assert _positive(row["ms_per_sample"])
    calls = {row["strategy"]: row["allreduce_calls_per_step"] for row in acc["rows"] if row["k"] == 1}
    assert calls["naive"] == 6  # one per parameter tensor of the 3-layer MLP (3 weights + 3 biases)

    mem = results["memory"]  # issue #16; the smoke preset measures the MLP only
    for strategy, row in mem["mlp"]["strategies"].items():
        assert _positive(row["step_ms"]["median"]) and _positive(row["fits_params"]), strategy
    shares = {k: row["optimizer_share_of_bucketed"] for k, row in mem["mlp"]["strategies"].items()}
    assert abs(shares["zero1"] * 2 - 1) < 0.01 and abs(shares["fsdp"] * 2 - 1) < 0.01, shares
    wire = mem["mlp"]["strategies"]["zero1"]["wire"]
    assert wire["grad_sync_over_grad_bytes"] == wire["all_gather_over_param_bytes"] == 1.0, wire

    ray = results["ray_overhead"]
    for key in ("plain_step_ms", "ray_step_ms", "ray_over_plain", "plain_startup_s", "ray_startup_s", "ray_init_s"):
        assert _positive(ray[key]), key
    assert ray["world_size"] == 2

    ck = results["checkpoint"]
    for state, least_mb in (("quickstart", 1.0), ("large", 100.0)):
        section = ck["states"][state]
        assert section["state_mb"] >= least_mb, (state, section["state_mb"])
        for mode in ("sync", "async"):
            assert _positive(section[mode]["median"]) and section[mode]["n"] == ck["per_mode"], (state, mode)
    assert ck["kept"] == ck["kept_verified"] == 2  # num_to_keep, every kept one verifies after async uploads
    assert "ray_default_poll" not in ck  # smoke: the second fit (same path, Ray's 2 s poll) is the full presets'

    ingest = results["ingest"]
    for reader in ("ray_data", "ray_data_materialized", "dataloader_stream", "dataloader_rows", "in_memory"):
        assert _positive(ingest["samples_per_s"][reader]), reader
        assert all(p["rows"] == ingest["rows"] for p in ingest["readers"][reader]["passes"])
    assert _positive(ingest["ray_data_over_in_memory"])
    for reader in ("sharded", "sharded_thread", "sharded_chunk256", "sharded_rank0_of_2"):  # data.sharding: sharded's batch path
        assert _positive(ingest["samples_per_s"][reader]) and _positive(ingest[f"{reader}_over_in_memory"]), reader
    memory = ingest["sharded_memory"]
    assert memory["rows_read"] > 0 and memory["peak_mb"] >= memory["start_mb"] > 0
    assert 0.0 <= ingest["data_wait_fraction"] <= 1.0
    assert ingest["training"]["streaming"]["status"] == "ok"

    rec = results["recovery"]  # issue #15: the smoke preset times the replica's per-step cost, no kill runs
    for model, least_mb in (("quickstart", 1.0), ("large", 100.0)):
        row = rec["overhead"][model]
        assert row["state_mb"] >= least_mb, (model, row)
        for key in ("step_ms", "step_with_mark_ms", "mark_ms", "overhead_pct"):
            assert _positive(row[key]), (model, key, row)
    assert "kill" not in rec and "skipped" in rec["kill_note"]
    assert "**Keeping the replica" in proc.stdout

    names = {v["target"] for v in results["targets"]}
    assert "Ray Train / plain torch.distributed step" in names and len(names) == 14
    assert "sharded / in-memory samples/s (default: inline while reads are quick)" in names  # issue #14
    assert "replica's cost per step, % of step time (quickstart)" in names
    assert "quickstart checkpoint blocks the step loop (s, async upload)" in names
    assert "**Checkpoint: time the step loop is blocked**" in proc.stdout
