"""The elastic tests' shared reference: the config's uninterrupted 1-worker run.

Trained once per session; every other run (2 and 4 workers, a resize, a preemption)
must end on the same parameters. See `_elastic.py` for the config.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _elastic import Reference, elastic_cfg, states_by_step
from raytrain_ddp.driver.fit import run_training


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory) -> Reference:
    """The uninterrupted run on one worker (4 accumulation steps), in this process (local
    mode: the same loop, data order and checkpoints as one Ray worker, without a fit's
    worker group: the Ray runs compare against it)."""
    summary = run_training(elastic_cfg(tmp_path_factory.mktemp("elastic_ref"), "ref", "scaling.num_workers=0"))
    assert summary["status"] == "ok", summary.get("error")
    return Reference(summary, states_by_step(Path(summary["run_dir"])))
