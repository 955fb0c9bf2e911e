"""Local mode, `scaling.num_workers=0` (issue #30): this process, no Ray, and your debugger.

The real CLI trains the tiny config with a user model whose forward calls `breakpoint()`
once; pdb reads the commands from the CLI's stdin and prints to its stdout, as it would
in the user's terminal. Ray never starts: its temp dir (RAY_TMPDIR, private to this test)
stays empty and the CLI never has a child process. Then the same command with more steps
continues from the checkpoint, as a Ray run's would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_ddp.rundir import read_metrics
from _timeline import timeline_problems

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
CLI = Path(sys.executable).parent / "raytrain-ddp"

USER_MODEL = '''
from torch import nn

stopped = []

class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(spec.feature_shape[0], 32), nn.ReLU(), nn.Linear(32, spec.num_classes))

    def forward(self, x):
        if not stopped:
            stopped.append(1)
            secret = "stopped in the user's forward"
            breakpoint()
        return self.body(x)

def build(spec):
    return Net(spec)
'''


def _children(pid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_local_mode_trains_without_ray_stops_in_your_debugger_and_resumes(tmp_path):
    (tmp_path / "usermodel.py").write_text(USER_MODEL)
    ray_tmp = tmp_path / "raytmp"
    ray_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONUNBUFFERED="1", PYTHONBREAKPOINT="pdb.set_trace")
    command = [str(CLI), "train", str(REPO / "examples" / "configs" / "tiny.yaml"), "scaling.num_workers=0",
               f"run.storage_path={tmp_path / 'runs'}", "name=local", "model.name=usermodel:build",
               "train.max_steps=30", "run.log_every_steps=1"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    chunks: list[bytes] = []  # what it printed so far (pdb's prompt ends no line)
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(proc.stdout.fileno(), 65536), b"")),
                              daemon=True)
    reader.start()
    children: set[int] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # while it starts, until it sits in pdb
        children |= set(_children(proc.pid))
        if b"(Pdb) " in b"".join(chunks):
            break
        time.sleep(0.05)
    with contextlib.suppress(BrokenPipeError):  # (it ended early: its output says why, below)
        proc.stdin.write(b"p secret + '!'\nc\n")
        proc.stdin.close()
    proc.wait(timeout=240)
    reader.join(timeout=30)
    out = b"".join(chunks).decode()
    assert proc.returncode == 0, out[-3000:]
    assert "\"stopped in the user's forward!\"" in out, out[-3000:]  # pdb ran in this process, on its stdin
    assert "usermodel.py" in out  # and showed the user's own frame
    assert not children and not any(ray_tmp.iterdir()), (children, list(ray_tmp.iterdir()))  # no Ray at all

    run_dir = tmp_path / "runs" / "local"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 30 and summary["workers"] == 1, summary
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 31)) and lines[-1]["loss"] < lines[0]["loss"]
    assert timeline_problems(run_dir, summary) == []  # the start-up timeline, without Ray (issue #39)
    assert summary["startup"]["attempts"][0]["phases"]["ray"] == 0

    # resumed compiled and with activation checkpointing (issue #55): the checkpoint of the plain
    # model loads (same names), compiling is the start-up's own phase, and training goes on
    again = subprocess.run([*command[:-2], "train.max_steps=40", "run.log_every_steps=1", "train.compile=true",
                            "train.compile_backend=aot_eager", "model.activation_checkpointing=[Sequential]"],
                           cwd=tmp_path,
                           env={**env, "PYTHONBREAKPOINT": "0"},  # this time without stopping
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "(step 30)" in again.stdout and not any(ray_tmp.iterdir())
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 41))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"]["val_accuracy"] > 0.5
    assert summary["startup"]["attempts"][0]["phases"]["compile"] > 0 and timeline_problems(run_dir, summary) == []


def test_local_mode_never_imports_ray(tmp_path):
    """No Ray module is even imported (about a second of start-up): start to first step is
    the imports of torch and the loop. The time is recorded in docs/usage.md, not asserted."""
    code = ("import sys\nfrom raytrain_ddp.cli import main\n"
            f"rc = main(['train', {str(REPO / 'examples' / 'configs' / 'quickstart.yaml')!r}, 'scaling.num_workers=0', "
            f"'run.storage_path={tmp_path / 'runs'}', 'name=noray', 'train.max_steps=2'])\n"
            "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "print('RAY MODULES', loaded)\nsys.exit(rc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "RAY MODULES []" in done.stdout, done.stdout[-2000:]


def test_async_validation_runs_on_the_validator_thread_equals_inline_and_a_resume_validates_what_was_left(
        tmp_path, monkeypatch):
    """run.validation=async (issue #55), in this process (local mode: cheap, and spies reach the loop).

    An async run whose loop validated inline fails here: every validation runs on the validator's
    thread, alone, none through the loop's (`PARTS.validate`); its figures equal the inline run's
    exactly, whose checkpoint holds the same weights (the copy's construction moved no RNG). Then a
    validation that dies (as with its process) leaves step 22 unvalidated: the same command again
    validates that epoch-end checkpoint, and every epoch's val metrics are in metrics.jsonl once."""
    import threading

    import torch

    from raytrain_ddp import checkpoint as ckpt
    from raytrain_ddp.config import ConfigError, load_config
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.goodput import report
    from raytrain_ddp.worker import loop, validator

    tiny = REPO / "examples" / "configs" / "tiny.yaml"

    def fit(name: str, *more: str) -> tuple[dict, Path]:
        cfg = load_config(tiny, ["scaling.num_workers=0", f"run.storage_path={tmp_path}", f"name={name}", *more])
        return run_training(cfg), tmp_path / name

    calls: list[tuple[str, str, bool]] = []
    real = validator.validate
    fail_once: list[int] = []

    def on_thread(state, data, rank, spec, alone=False):
        calls.append(("validator", threading.current_thread().name, alone))
        if fail_once:
            fail_once.pop()
            raise RuntimeError("the validation died")
        return real(state, data, rank, spec, alone=alone)

    def in_loop(*args, **kwargs):
        calls.append(("loop", threading.current_thread().name, False))
        return real(*args, **kwargs)

    monkeypatch.setattr(validator, "validate", on_thread)
    monkeypatch.setattr(loop, "PARTS", loop.PARTS._replace(validate=in_loop))  # what the loop's recovery half validates with
    done, async_dir = fit("async", "run.validation=async")
    assert done["status"] == "ok", done.get("error")
    assert calls == [("validator", "raytrain-ddp-validator", True)] * 2, calls  # never the loop's
    val = [r for r in read_metrics(async_dir / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [22, 44]
    assert val[0]["validation_async_s"] > 0 and val[1]["validation_async_s"] == 0  # the last one: waited for
    assert report(async_dir)["validation_async_s"] == val[0]["validation_async_s"]  # goodput: off the path

    calls.clear()
    done, inline_dir = fit("inline")
    assert done["status"] == "ok" and [c[0] for c in calls] == ["loop"] * 2, calls
    inline_val = [r for r in read_metrics(inline_dir / "metrics.jsonl") if "val_loss" in r]
    strip = ("time", "validation_s", "validation_async_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in val] == \
        [{k: v for k, v in r.items() if k not in strip} for r in inline_val]
    weights = [ckpt.load_checkpoint(ckpt.find_checkpoints(d)[0])["model"] for d in (async_dir, inline_dir)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])

    fail_once.append(1)  # step 22's validation dies; the error is the run's at the next hand-off
    done, again_dir = fit("again", "run.validation=async", "train.max_steps=30")
    assert done["status"] != "ok" and "the validation died" in str(done.get("error")), done
    assert not [r for r in read_metrics(again_dir / "metrics.jsonl") if "val_loss" in r]
    done, _ = fit("again", "run.validation=async")
    assert done["status"] == "ok", done.get("error")
    val = [r for r in read_metrics(again_dir / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [22, 44], val  # 22: the resumed group's validation of its checkpoint

    with pytest.raises(ConfigError, match="run.checkpoint_every_epochs=2"):
        load_config(tiny, ["run.validation=async", "run.checkpoint_every_epochs=2"])
