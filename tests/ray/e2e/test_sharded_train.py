"""The sharded strategies through the product: `zero1` trains the tiny config on two Ray
workers and checkpoints a consolidated optimizer state; a second fit resumes it as `fsdp`
(another strategy, the same checkpoint format) and finishes the run.

Two fits on the session's local Ray instance; the numerical equivalence of both
strategies is checked without Ray in tests/local/parallel/test_zero_fsdp.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.rundir import read_metrics

pytestmark = pytest.mark.timeout(300)

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny.yaml"


def test_zero1_trains_and_checkpoints_then_fsdp_resumes_the_run(ray_cluster, tmp_path):
    common = [f"run.storage_path={tmp_path}", "name=sharded"]
    first = run_training(load_config(TINY, [*common, "parallel.strategy=zero1", "train.epochs=1"]))
    assert first["status"] == "ok" and first["steps"] == 22 and first["workers"] == 2
    run_dir = Path(first["run_dir"])
    state = ckpt.load_checkpoint(first["checkpoint"])
    params = state["model"]
    # The optimizer state is whole (consolidated from both workers' shards), in torch's format.
    # Numbered as build_optimizer's groups number them: matrices (decayed) first, then the rest.
    optimizer = state["optimizer"]
    order = [n for n, v in params.items() if v.dim() >= 2] + [n for n, v in params.items() if v.dim() < 2]
    assert [g["params"] for g in optimizer["param_groups"]] == [[0, 1], [2, 3]]
    assert sorted(optimizer["state"]) == list(range(len(params)))
    for i, name in enumerate(order):
        entry = optimizer["state"][i]
        assert entry["exp_avg"].shape == params[name].shape == entry["exp_avg_sq"].shape, name
        assert torch.count_nonzero(entry["exp_avg_sq"]) > 0, name  # every shard was trained
    n_params = sum(v.numel() for v in params.values())
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    for r in train:  # one reduce-scatter of the whole (padded to 2) fp32 gradient per step
        assert r["allreduce_calls"] == 1 and 0 <= r["allreduce_bytes"] - 4 * n_params < 8, r
    assert train[-1]["loss"] < train[0]["loss"]

    second = run_training(load_config(TINY, [*common, "run.resume=latest", "parallel.strategy=fsdp"]))
    assert second["status"] == "ok" and second["resumed_from"] == first["checkpoint"]
    assert second["steps"] == 44 and second["epochs"] == 2 and second["attempts"] == 1
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [22, 44] and val[1]["val_loss"] < val[0]["val_loss"]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    final = ckpt.load_checkpoint(second["checkpoint"])
    assert final["progress"]["step"] == 44
    assert sorted(final["optimizer"]["state"]) == list(range(len(params)))  # whole again, from fsdp
    assert final["model"].keys() == params.keys()
