"""Bad parquet is rejected before any training worker starts (issue #6, item 8).

`tests/local/data/test_data.py` checks `data.check_parquet` itself and
`tests/local/unit/test_config_fuzz.py` the config; here the same inputs go through the real
entry points (`run_training`, and the `raytrain-ddp train` command). The proof that they
fail before any worker is paid for is stronger than counting actors: Ray is never even
contacted (connecting is replaced by a tripwire, and the CLI is pointed at an address
where nothing listens, so reaching Ray would give a different error).
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
from raytrain_ddp.driver.fit import run_training

pytestmark = pytest.mark.timeout(120)

CLI = Path(sys.executable).parent / "raytrain-ddp"


def _rows(n: int, label=None) -> pa.Table:
    x = pa.array([[float(i % 7)] * 4 for i in range(n)], type=pa.list_(pa.float32()))
    return pa.table({"x": x, "y": label if label is not None else pa.array([i % 3 for i in range(n)], pa.int64())})


def test_bad_parquet_fails_fast_naming_file_and_column_before_ray(tmp_path, monkeypatch):
    import raytrain_ddp.driver.launcher as launcher

    def tripwire(cfg):
        raise AssertionError("Ray was contacted before the data was checked")

    monkeypatch.setattr(launcher, "connect_ray", tripwire)
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

    for path, message in cases.items():
        cfg = tiny(tmp_path, path.stem, "data.source=parquet", f"data.path={path}", "data.val_fraction=0",
                   "model.name=mlp")
        with pytest.raises(DataError, match=message):
            run_training(cfg)
        assert not (tmp_path / path.stem).exists()  # no run directory either


def test_cli_rejects_files_with_differing_schemas_in_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(_rows(100), data / "a.parquet")
    table = _rows(100)
    pq.write_table(table.set_column(1, "y", pa.array([str(i) for i in range(100)])), data / "b.parquet")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_DDP_")}
    env["RAY_ADDRESS"] = "127.0.0.1:9"  # discard port: joining Ray here would fail differently
    done = subprocess.run([str(CLI), "train", str(TINY), f"run.storage_path={tmp_path}", "name=schemas",
                           "data.source=parquet", f"data.path={data}"],
                          env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stdout + done.stderr  # a user error, not a crash
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "b.parquet: column 'y' has type string, but" in done.stderr and "a.parquet has int64" in done.stderr
    assert not (tmp_path / "schemas").exists()
