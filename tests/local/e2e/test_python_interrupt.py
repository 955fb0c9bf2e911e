"""Ctrl-C in `raytrain_ddp.train(...)` saves the step, then raises `KeyboardInterrupt` (#45).

Before, `train()` returned normally, so a script went on with a half-trained model and
exited 0. A subprocess runs `raytrain_ddp.train` on the tiny config in local mode (the
interrupt's path through `train()` is the same as a Ray fit's; local mode keeps the test
free of a Ray start); once it has trained a few steps the test sends SIGINT to it alone, as
a terminal's Ctrl-C reaches a script. The same on 2 Ray workers, with docs/byo.md's
torchrun tutorial port (#57), is tests/ray/e2e/test_python_dataset.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp import checkpoint as ckpt
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


def test_ctrl_c_in_train_saves_the_step_then_raises_keyboard_interrupt(tmp_path):
    runs = tmp_path / "runs"
    script = SCRIPT.format(tiny=str(REPO / "examples" / "configs" / "tiny.yaml"), runs=runs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env={**env, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ctrl_c_after_three_steps(proc, runs / "py" / "metrics.jsonl", wait_s=180)
    assert proc.returncode == 42, out[-3000:]  # raised out of train(), not returned
    assert "KEYBOARD INTERRUPT: interrupted at step" in out and "RETURNED" not in out, out[-3000:]
    summary = json.loads((runs / "py" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] >= 3, summary
    assert summary["checkpoint_step"] == summary["steps"], summary  # the step it was at is saved
    assert ckpt.load_checkpoint(summary["checkpoint"])["progress"]["step"] == summary["steps"]
