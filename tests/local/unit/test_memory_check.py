"""Data that will not fit is caught before a worker starts (issue #30, driver/memory.py)."""

from __future__ import annotations

import pytest

from raytrain_ddp.config import load_config
from raytrain_ddp.data.sources import parquet_bytes
from raytrain_ddp.driver.memory import GiB, check_exact_fits, worker_share
from raytrain_ddp.errors import UserError

pytestmark = pytest.mark.timeout(30)


def _node(memory_gib: float, cpus: float, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"memory": memory_gib * GiB, "CPU": cpus}}


def test_the_measured_case_a_1_2_gb_set_on_workers_of_3_gb_is_refused_naming_sharded():
    cfg = load_config(None, ["scaling.num_workers=4"])
    nodes = [_node(12.0, 4), _node(64.0, 16), _node(100.0, 8, alive=False)]  # 4 workers on a 12 GiB node: 3 GiB each
    with pytest.raises(UserError, match=r"data.sharding=exact: .* 1.20 GiB .* about 3x that \(3.60 GiB\).*"
                                        r"\(3.00 GiB: 4 worker\(s\) on a node with 12.00 GiB for Ray\); "
                                        r"use data.sharding=sharded"):
        check_exact_fits(cfg, int(1.2 * GiB), nodes)
    check_exact_fits(cfg, int(0.9 * GiB), nodes)  # 2.7 GiB: fits
    check_exact_fits(load_config(None, ["scaling.num_workers=4", "data.sharding=sharded"]), int(1.2 * GiB), nodes)


def test_a_workers_share_counts_the_workers_its_node_runs():
    cfg = load_config(None, ["scaling.num_workers=2", "scaling.cpus_per_worker=2"])
    assert worker_share(cfg, [_node(16.0, 8)]) == (8.0 * GiB, 16.0 * GiB, 2)  # at most the run's 2 workers
    assert worker_share(cfg, [_node(16.0, 1)]) is None  # no worker fits there: not counted
    assert check_exact_fits(cfg, 10 * GiB, []) is None  # nothing known of the nodes: no guess


def test_parquet_size_comes_from_the_footers(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": np.arange(10_000, dtype=np.float64)}), tmp_path / "a.parquet")
    assert 80_000 <= parquet_bytes([str(tmp_path / "a.parquet")]) < 100_000
