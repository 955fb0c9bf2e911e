"""Your optimizer, schedule and metrics, from YAML, through a killed worker (issue #30).

`train.optimizer: "usermod:make"` builds AdamW with a no-decay group of its own;
`train.schedule: "usermod:sched"` returns a LambdaLR; `train.metrics: "usermod:f1"` adds
`val_f1` (a (sum, count) pair), `val_err` (a per-batch mean) and `val_top2`. One CLI run on
2 workers with `zero1` (which shards whatever optimizer the user built) loses rank 1
after step 12 and goes on: every logged step's `lr` is the user's schedule at that step,
before and after the restart, the final optimizer state holds the user's two groups, and
the user's metrics are aggregated over both ranks' validation rows exactly as the
built-in accuracy is (`val_err == 1 - val_accuracy`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.rundir import read_jsonl, read_metrics

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[3]
CLI = Path(sys.executable).parent / "raytrain-ddp"

USERMOD = '''
import torch

def make(model, lr=0.01, decay=0.1):
    decay_params = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay_params, "weight_decay": decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr)

def sched(optimizer, total_steps, floor=0.2):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(floor, 1.0 - s / total_steps))

def f1(output, batch):
    _, y = batch
    pred = output.argmax(-1)
    tp = ((pred == 1) & (y == 1)).sum()
    wrong_1 = ((pred == 1) != (y == 1)).sum()  # false positives and false negatives of class 1
    top2 = (output.topk(2, dim=-1).indices == y[:, None]).any(-1).sum()
    return {"f1": (2 * tp, 2 * tp + wrong_1), "err": (pred != y).float().mean(), "top2": (top2, len(y))}
'''


def user_lr(step: int, total: int, lr: float = 0.02, floor: float = 0.2) -> float:
    """The rate `sched` gives optimizer step `step` (1-based, as metrics.jsonl counts)."""
    return lr * max(floor, 1.0 - (step - 1) / total)


def test_your_optimizer_and_schedule_train_shard_and_resume_on_their_curve(tmp_path):
    (tmp_path / "usermod.py").write_text(USERMOD)
    config = REPO / "examples" / "configs" / "tiny.yaml"  # usermod.py is found in the current directory
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env["RAYTRAIN_DDP_FAULT"] = "rank=1,step=12,attempt=1,mode=exit"
    done = subprocess.run(
        [str(CLI), "train", str(config), f"run.storage_path={tmp_path / 'runs'}", "name=yours", "train.epochs=1",
         "run.log_every_steps=1", "parallel.strategy=zero1", "train.optimizer=usermod:make",
         "train.optimizer_kwargs={lr: 0.02, decay: 0.1}", "train.schedule=usermod:sched",
         "train.schedule_kwargs={floor: 0.2}", "train.metrics=usermod:f1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)  # two fits (a restart); 73 s idle, 240 s was seen at CI's load
    run_dir = tmp_path / "runs" / "yours"
    story = f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, story
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["attempts"] == 2 and summary["steps"] == 22, story
    attempts = [r for r in read_jsonl(run_dir / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    assert attempts[1]["resumed_step"] in (10, 12), attempts  # mid-run, past step 1
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 23)), story
    for r in lines:  # the user's curve, on both sides of the restart
        assert r["lr"] == pytest.approx(user_lr(r["step"], 22), rel=1e-9), (r["step"], r["lr"])
    state = ckpt.load_checkpoint(summary["checkpoint"])
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0], groups  # the user's groups, consolidated
    assert state["schedule"] == {"last_epoch": 22}
    config_yaml = (run_dir / "config.yaml").read_text()
    assert "optimizer: usermod:make" in config_yaml and "schedule: usermod:sched" in config_yaml
    assert "metrics: usermod:f1" in config_yaml
    val = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert val and all(k in val[-1] for k in ("val_f1", "val_err", "val_top2")), val
    last = val[-1]
    assert 0.0 <= last["val_f1"] <= 1.0
    assert last["val_err"] == pytest.approx(1.0 - last["val_accuracy"], abs=1e-6)  # rows weighted over both ranks (float32 batch means)
    assert last["val_accuracy"] <= last["val_top2"] <= 1.0
    assert summary["final_metrics"]["val_f1"] == last["val_f1"]
    assert "val_f1" in done.stdout and "epochs" in done.stdout, story
