"""data.sharding='sharded' on Ray: the samples of every step across a kill, a resume on another
worker count, and an uninterrupted run (issue #14).

Two fits of the elastic config (digits MLP, global batch 64 = micro 16 x workers x
accumulation, 12 steps, a checkpoint every 6) with sharded data and the sample log of
`tests/_hooks.py` (`RAYTRAIN_DDP_SAMPLE_LOG`: each rank records a digest of
every row it trained on, per step):

* the reference: 1 worker, uninterrupted;
* 2 workers, rank 1 raises after step 8 (no restarts), so the latest checkpoint is step 6;
  then the same run resumed on 4 workers, 6 steps into the epoch.

Every step anyone trained (including steps 7 and 8 of the failed fit, later redone) saw
exactly the reference's samples for that step; the resumed history is steps 1..12, each
once; and the final parameters equal the reference's (the trajectory test's tolerance).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from _elastic import ATOL, STEPS, elastic_cfg, max_difference, states_by_step
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.rundir import read_metrics
from _hooks import SAMPLE_LOG_ENV

pytestmark = pytest.mark.timeout(480)

SHARDED = "data.sharding=sharded"


def _steps(log_dir: Path) -> dict[tuple[int, int], list[str]]:
    """(attempt, step) -> the sorted digests of the rows every rank trained on in that step."""
    rows: dict[tuple[int, int], list[str]] = defaultdict(list)
    worlds: dict[tuple[int, int], set[int]] = defaultdict(set)
    for path in sorted(log_dir.glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows[record["attempt"], record["step"]] += record["rows"]
            worlds[record["attempt"], record["step"]].add(record["rank"])
    return {key: sorted(value) for key, value in rows.items()}


def test_sharded_steps_keep_their_samples_across_a_kill_and_a_resize(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(SAMPLE_LOG_ENV, str(tmp_path / "ref-log"))
    ref = run_training(elastic_cfg(tmp_path, "ref", SHARDED, "scaling.num_workers=1"))
    assert ref["status"] == "ok", ref.get("error")
    reference = _steps(tmp_path / "ref-log")
    assert sorted(step for _attempt, step in reference) == list(range(1, STEPS + 1))
    by_step = {step: rows for (_attempt, step), rows in reference.items()}
    assert all(len(rows) == 64 for rows in by_step.values())
    seen = [d for rows in by_step.values() for d in rows]
    assert len(set(seen)) > 0.95 * len(seen)  # distinct rows across steps (digits has a few twins)
    assert (Path(ref["run_dir"]) / "data" / "train" / "store.json").exists()

    monkeypatch.setenv(SAMPLE_LOG_ENV, str(tmp_path / "resize-log"))
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "rank=1,step=8,attempt=1,mode=raise")
    first = run_training(elastic_cfg(tmp_path, "resize", SHARDED, "scaling.num_workers=2", "run.max_failures=0",
                                     "run.recovery=checkpoint"))  # resume from the durable step 6
    assert first["status"] == "failed" and "injected fault" in first["error"]
    killed = _steps(tmp_path / "resize-log")
    assert sorted(step for _attempt, step in killed) == list(range(1, 9))

    monkeypatch.setenv(SAMPLE_LOG_ENV, str(tmp_path / "resume-log"))
    monkeypatch.delenv("RAYTRAIN_DDP_FAULT")
    second = run_training(elastic_cfg(tmp_path, "resize", SHARDED, "scaling.num_workers=4", "run.resume=latest"))
    assert second["status"] == "ok", second.get("error")
    assert second["resumed_from"] == first["checkpoint"] and second["workers"] == 4
    resumed = _steps(tmp_path / "resume-log")
    assert sorted(step for _attempt, step in resumed) == list(range(7, STEPS + 1))  # nothing skipped

    for (_attempt, step), rows in [*killed.items(), *resumed.items()]:
        assert rows == by_step[step], f"step {step} trained on other samples than the reference's"
    history = {step: rows for (_a, step), rows in killed.items() if step <= 6}
    history.update({step: rows for (_a, step), rows in resumed.items()})
    assert history == by_step  # the run's history: each step once, the reference's samples

    train = [r for r in read_metrics(Path(second["run_dir"]) / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    final = states_by_step(Path(second["run_dir"]))[STEPS]
    expected = states_by_step(Path(ref["run_dir"]))[STEPS]
    assert final["run"]["world_size"] == 4 and final["progress"] == expected["progress"]
    assert max_difference(final["model"], expected["model"]) < ATOL


def test_sharded_user_pipeline_runs_preprocess_once_and_reuses_its_store(ray_cluster, tmp_path):
    """A user pipeline (`data.preprocess` on Ray Data's tasks, dict batches): the driver
    writes what preprocess returned (here twice the rows and a new column) as the store;
    a second prepare of the same inputs reuses it; workers read dict batches from it."""
    import numpy as np
    import torch

    from raytrain_ddp.config import load_config
    from raytrain_ddp.data.ray_datasets import prepare_datasets
    from raytrain_ddp.data.worker_data import WorkerData
    from raytrain_ddp.driver.preflight import precheck
    from raytrain_ddp.user import UserCode

    def twice_with_weight(batch):  # defined here: pickled by value to Ray Data's tasks
        raw = np.stack(list(batch["x"])).astype(np.float32)  # a list column: an array per row
        x = np.concatenate([raw, raw])
        return {"x": x, "y": np.concatenate([batch["y"], batch["y"]]), "w": x.sum(axis=1)}

    overrides = [f"run.storage_path={tmp_path}", "name=byo", "model.name=mlp", "data.inputs=[x]",
                 "data.sharding=sharded", "train.global_batch_size=64", "data.val_fraction=0.2",
                 "scaling.num_workers=2"]
    cfg = load_config(None, [*overrides, "train.micro_batch_size=16"])
    code = UserCode(preprocess=twice_with_weight)
    prepared = prepare_datasets(cfg, precheck(cfg, code), code)
    assert prepared.datasets == {} and prepared.spec.train_rows == 2 * 1438 and prepared.spec.val_rows == 2 * 359
    part = tmp_path / "byo" / "data" / "train" / "part-00000.arrow"
    written = part.stat().st_mtime_ns
    again = prepare_datasets(cfg, precheck(cfg, code), code)
    assert again.spec.train_rows == prepared.spec.train_rows and part.stat().st_mtime_ns == written  # reused
    # what a resume may change: the micro batch (the store keeps its 16-row chunks), prefetch
    resized = load_config(None, [*overrides, "train.micro_batch_size=32", "data.prefetch_batches=3"])
    prepare_datasets(resized, precheck(resized, code), code)
    assert part.stat().st_mtime_ns == written
    assert next(WorkerData(resized, again.spec, 0, 2, torch.device("cpu")).train_windows(epoch=0))[0]["x"].shape[0] == 32

    workers = [WorkerData(cfg, prepared.spec, rank, 2, torch.device("cpu")) for rank in range(2)]
    window = next(workers[1].train_windows(epoch=0))
    assert len(window) == 2 and set(window[0]) == {"x", "y", "w"}
    assert torch.allclose(window[0]["w"], window[0]["x"].sum(dim=1))  # rows stay whole
    val = sum(len(batch["y"]) for w in workers for batch in w.val_batches())
    assert val == prepared.spec.val_rows
