"""Bad parquet is rejected before any training worker starts (issue #6, item 8).

`tests/data/test_data.py` checks `data.check_parquet` itself and
`tests/unit/test_config_fuzz.py` the config; here the same inputs go through the real
entry points (`run_training`, and the `raytrain-ddp train` command) joined to the session's
Ray instance, and the proof is that no `RayTrainWorker` actor was ever created.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _harness import TINY, tiny
from raytrain_ddp.errors import DataError
from raytrain_ddp.launcher import run_training

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

CLI = Path(sys.executable).parent / "raytrain-ddp"


def _rows(n: int, label=None) -> pa.Table:
    x = pa.array([[float(i % 7)] * 4 for i in range(n)], type=pa.list_(pa.float32()))
    return pa.table({"x": x, "y": label if label is not None else pa.array([i % 3 for i in range(n)], pa.int64())})


def _train_workers(ray_cluster) -> int:
    from ray.util.state import list_actors

    address = ray_cluster.get_runtime_context().gcs_address
    return len(list_actors(address=address, filters=[("class_name", "=", "RayTrainWorker")],
                           limit=10_000, raise_on_missing_output=False))


def test_bad_parquet_fails_fast_naming_file_and_column_with_no_worker_started(ray_cluster, tmp_path):
    cases = {}
    null_label = tmp_path / "null_label.parquet"
    pq.write_table(_rows(128, pa.array([1, None] * 64, pa.int64())), null_label)
    cases[null_label] = r"null_label\.parquet: column 'y' \(data\.label\) has 64 null values"
    empty = tmp_path / "empty.parquet"
    pq.write_table(_rows(0), empty)
    cases[empty] = r"empty\.parquet: parquet input has zero rows"
    one_row = tmp_path / "one_row.parquet"
    pq.write_table(_rows(1), one_row)
    cases[one_row] = r"one_row\.parquet: 1 training rows is fewer than scaling\.num_workers=2"

    workers_before = _train_workers(ray_cluster)
    for path, message in cases.items():
        cfg = tiny(tmp_path, path.stem, "data.source=parquet", f"data.path={path}", "data.val_fraction=0",
                   "model.name=mlp")
        with pytest.raises(DataError, match=message):
            run_training(cfg)
        assert not (tmp_path / path.stem).exists()  # no run directory either
    assert _train_workers(ray_cluster) == workers_before


def test_cli_rejects_files_with_differing_schemas_in_one_line(ray_cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(_rows(100), data / "a.parquet")
    table = _rows(100)
    pq.write_table(table.set_column(1, "y", pa.array([str(i) for i in range(100)])), data / "b.parquet")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_DDP_")}
    env["RAY_ADDRESS"] = ray_cluster.get_runtime_context().gcs_address

    workers_before = _train_workers(ray_cluster)
    done = subprocess.run([str(CLI), "train", str(TINY), f"run.storage_path={tmp_path}", "name=schemas",
                           "data.source=parquet", f"data.path={data}"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr  # a user error, not a crash
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "b.parquet: column 'y' has type string, but" in done.stderr and "a.parquet has int64" in done.stderr
    assert _train_workers(ray_cluster) == workers_before
    assert not (tmp_path / "schemas").exists()
