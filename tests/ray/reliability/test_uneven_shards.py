"""Uneven data never makes ranks disagree on the number of micro-steps (issue #6, item 5).

One TorchTrainer fit on the session's Ray runs the real `data.WorkerData` (streaming
sharding) on 2 ranks over 1,001 parquet rows in three unequal files -- not divisible by
workers x micro-batch (2 x 16) -- without and with a local shuffle buffer, and over
deliberately unequal per-rank shards (rank 0: 1,001 rows, rank 1: 600, as a split that is
not equal would give). After every window each rank does one all-reduce (standing in for
the gradient sync), so a rank with an extra window would block; the process group's
timeout turns that into a failure, never a hang. The per-rank micro-step counts are
gathered with all_gather and compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _harness import tiny

pytestmark = pytest.mark.timeout(600)  # 276 s seen at CI's load

EPOCHS = 2


def _count_loop(loop_config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    from raytrain_ddp.data.worker_data import TRAIN, WorkerData
    from raytrain_ddp.worker.context import Rank

    rank = Rank.current()
    spec, out = loop_config["spec"], Path(loop_config["out"])
    shard = ray.train.get_dataset_shard(TRAIN)
    variants = {
        "split, no shuffle buffer": (loop_config["plain"], shard),
        "split, shuffle buffer 48": (loop_config["buffered"], shard),
        "unequal shards, shuffle buffer 48": (loop_config["buffered"],
                                              loop_config["unequal"][rank.world_rank].iterator()),
    }
    results = {}
    for name, (cfg, source) in variants.items():
        data = WorkerData(cfg, spec, rank.world_rank, rank.world_size, rank.device, shards={TRAIN: source})
        per_epoch = []
        for epoch in range(EPOCHS):
            micro_steps = 0
            for window in data.train_windows(epoch):
                micro_steps += len(window)
                dist.all_reduce(torch.ones(1))  # the gradient sync every rank must reach
            per_epoch.append(micro_steps)
        gathered = [None] * rank.world_size
        dist.all_gather_object(gathered, per_epoch)
        results[name] = gathered
    if rank.is_main:
        out.write_text(json.dumps(results))


def test_micro_step_counts_are_identical_on_every_rank(ray_cluster, tmp_path):
    import ray.data
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_ddp.data.ray_datasets import prepare_datasets
    from raytrain_ddp.driver.preflight import precheck

    files = tmp_path / "data"
    files.mkdir()
    start = 0
    for n in (211, 300, 490):  # 1,001 rows: odd, and not a multiple of 2 workers x 16
        rows = range(start, start + n)
        pq.write_table(pa.table({"x": pa.array([[float(i % 13)] * 4 for i in rows], pa.list_(pa.float32())),
                                 "y": pa.array([i % 3 for i in rows], pa.int64())}), files / f"part{n}.parquet")
        start += n
    base = ["data.source=parquet", f"data.path={files}", "data.val_fraction=0", "data.sharding=streaming",
            "model.name=mlp"]
    plain = tiny(tmp_path, "uneven", *base, "data.shuffle=false")
    buffered = tiny(tmp_path, "uneven", *base, "data.shuffle_buffer=48")
    prepared = prepare_datasets(buffered, precheck(buffered))
    assert prepared.spec.train_rows == 1001
    unequal = [ray.data.read_parquet(str(files)), ray.data.read_parquet(str(files)).limit(600)]

    out = tmp_path / "counts.json"
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    trainer = TorchTrainer(
        _count_loop,
        train_loop_config={"spec": prepared.spec, "plain": plain, "buffered": buffered, "unequal": unequal,
                           "out": str(out)},
        torch_config=TorchConfig(backend="gloo", timeout_s=60),  # a stray collective fails, not hangs
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="uneven-count", storage_path=str(tmp_path / "ray")),
        datasets=prepared.datasets, dataset_config=prepared.data_config,
    )
    trainer.fit()

    counts = json.loads(out.read_text())
    assert len(counts) == 3
    for name, (rank0, rank1) in counts.items():
        assert rank0 == rank1, f"{name}: rank 0 ran {rank0} micro-steps per epoch, rank 1 {rank1}"
        assert all(c > 0 and c % 2 == 0 for c in rank0), (name, rank0)  # whole windows of 2 micro-steps
    # 500 rows a rank -> 31 micro-batches of 16 -> 15 whole windows of 2 = 30 micro-steps
    assert counts["split, no shuffle buffer"][0] == [30] * EPOCHS
    # unequal shards: everyone stops where the smallest (600 rows -> 37 batches -> 18 windows) ends
    assert counts["unequal shards, shuffle buffer 48"][0] == [36] * EPOCHS
