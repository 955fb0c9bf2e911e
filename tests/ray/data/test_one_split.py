"""One hold-out split for every route (#45): the same rows, seed and fraction give the same
validation rows from parquet through Ray, from a Ray Dataset given from Python, and in local
mode (and the bundled data use the same rule, `sources.split_table`). Each row's label is its
id; the datasets are prepared as a fit would prepare them, without a fit.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_ddp.config import load_config
from raytrain_ddp.data.columns import VAL
from raytrain_ddp.data.ray_datasets import prepare_datasets
from raytrain_ddp.data.sources import split_table
from raytrain_ddp.driver.local import local_data
from raytrain_ddp.driver.preflight import precheck
from raytrain_ddp.user import resolve

pytestmark = pytest.mark.timeout(240)

ROWS = 97


def _cfg(*overrides: str):
    return load_config(None, ["model.name=mlp", "train.global_batch_size=8", "train.micro_batch_size=4",
                              "scaling.num_workers=2", "data.val_fraction=0.2", "train.seed=7", *overrides])


def _ids(ds) -> list[int]:
    return sorted(int(row["y"]) for row in ds.take_all())


def _held_out(prepared) -> list[int]:
    """The validation rows a Ray fit's workers read: from the object store (the built-in
    data's exact route) or through Ray Data (a dataset given from Python)."""
    import ray

    if prepared.shards:
        return sorted(int(v) for v in ray.get(prepared.shards[VAL]).columns["y"])
    return _ids(prepared.datasets[VAL])


def test_parquet_a_ray_dataset_and_local_mode_hold_out_the_same_rows(ray_cluster, tmp_path):
    x = np.stack([np.arange(ROWS, dtype=np.float32), np.ones(ROWS, np.float32)], axis=1)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"x": list(x), "y": np.arange(ROWS)}), path)
    expected = sorted(split_table(pq.read_table(path), _cfg())[1].column("y").to_pylist())
    assert len(expected) == round(ROWS * 0.2)

    on_ray = _cfg("data.source=parquet", f"data.path={path}")
    cfg, code = resolve(on_ray)
    via_parquet = _held_out(prepare_datasets(cfg, precheck(cfg, code), code))

    shards, spec = local_data(cfg, precheck(cfg, code), code)
    in_local_mode = sorted(int(v) for v in shards[VAL].columns["y"])

    given = {"train": ray_cluster.data.from_items([{"x": row, "y": i} for i, row in enumerate(x)])}
    cfg, code = resolve(_cfg("data.source=datasets"))
    via_dataset = _held_out(prepare_datasets(cfg, precheck(cfg, code, given), code, given))

    assert via_parquet == in_local_mode == via_dataset == expected
    assert spec.val_rows == len(expected) and spec.train_rows == ROWS - len(expected)
