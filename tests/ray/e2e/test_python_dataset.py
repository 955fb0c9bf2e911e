"""docs/byo.md's torchrun tutorial port through the Python API (#57): a map-style torch Dataset
as it is, on 2 Ray workers; Ctrl-C, then the same command, every sample once by the
fault-sequence ledger (`tests/_ledger.py`). Ctrl-C in local mode: tests/local/e2e/test_python_interrupt.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp.rundir import read_metrics
from _procs import ctrl_c_after_three_steps

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[3]
SCRIPT = '''
import sys
import raytrain_ddp

try:
    raytrain_ddp.train({tiny!r}, overrides=["run.storage_path={runs}", "name=py", "scaling.num_workers=0",
                                           "train.epochs=500", "run.log_every_steps=1"])
except KeyboardInterrupt as exc:
    print("KEYBOARD INTERRUPT:", exc, flush=True)
    sys.exit(42)
print("RETURNED", flush=True)
'''


@pytest.mark.timeout(480)
def test_a_torch_dataset_as_is_trains_on_two_workers_and_resumes_after_ctrl_c_every_sample_once(tmp_path):
    """#57: the torchrun tutorial's map-style Dataset (float (B, 1) targets) through the Python
    API, docs/byo.md's snippet as it is: 2 Ray workers, a Ctrl-C, the same command again; every
    committed step trained on distinct rows, each epoch's train rows once (the fault-sequence
    ledger's rule), the steps once each, and the run directory names the task and the source."""
    import re

    from _ledger import committed_rows
    from _hooks import ENABLE, SAMPLE_LOG_ENV, STEP_DELAY_ENV

    [snippet] = re.findall(r"<!-- tested: tests/ray/e2e/test_python_dataset.py -->\n```python\n(.*?)```",
                           (REPO / "docs" / "byo.md").read_text(), re.S)
    (tmp_path / "tutorial.py").write_text(snippet)
    runs, samples = tmp_path / "runs", tmp_path / "samples"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    env.update(ENABLE, PYTHONUNBUFFERED="1", **{SAMPLE_LOG_ENV: str(samples), STEP_DELAY_ENV: "0.05"})
    command = [sys.executable, "tutorial.py", f"run.storage_path={runs}", "train.epochs=2", "run.log_every_steps=1"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = runs / "tutorial" / "metrics.jsonl"
    out = ctrl_c_after_three_steps(proc, metrics, wait_s=300)
    assert proc.returncode != 0 and "KeyboardInterrupt: interrupted at step" in out, out[-3000:]
    first = json.loads((runs / "tutorial" / "summary.json").read_text())
    assert first["status"] == "interrupted" and first["checkpoint_step"] == first["steps"] >= 3, first
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"resume    from {first['checkpoint']} (step {first['steps']})" in done.stdout, done.stdout[-3000:]
    assert "data      torch Datasets given from Python: 1,638 train / 410 val rows, task other" in done.stdout
    summary = json.loads((runs / "tutorial" / "summary.json").read_text())
    steps_per_epoch, total = 1638 // 32, 2 * (1638 // 32)
    assert summary["status"] == "ok" and summary["steps"] == total and summary["workers"] == 2, summary
    assert [r["step"] for r in read_metrics(metrics) if "loss" in r and "val_loss" not in r] == list(range(1, total + 1))
    rows = committed_rows(samples)
    assert sorted(rows) == list(range(1, total + 1))
    for epoch in range(2):  # every train row at most once an epoch, each step's 32 rows from 2 ranks
        seen = [r for step in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1) for r in rows[step]]
        assert len(seen) == steps_per_epoch * 32 and len(set(seen)) == len(seen), epoch
    assert first["steps"] < steps_per_epoch  # the Ctrl-C landed mid-epoch: the resume was at a sample, not an epoch
    kept = sorted(int(p.name.split("_")[1]) for p in (runs / "tutorial").glob("checkpoint_[0-9]*"))
    assert kept == [first["steps"], total], kept  # checkpoint_every_epochs 5: none at epoch 1's end; the last step's
    phases = summary["startup"]["attempts"][0]["phases"]  # the timeline starts at the process's start
    assert list(phases)[0] == "imports" and phases["imports"] > 0, phases
    ours = ("raytrain-ddp", "[rank ", "step ", "  data ", "  model ", "  batch ", "  schedule ", "  resume ")
    foreign = [line for line in (done.stdout + done.stderr).splitlines() if line.strip() and not line.startswith(ours)]
    assert not foreign, foreign[:20]  # none of Ray's INFO lines: Ray started by train(), with our console
