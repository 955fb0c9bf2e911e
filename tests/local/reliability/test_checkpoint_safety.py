"""Checkpoints that cannot hurt a run: crashes mid-save, damaged files, hostile pickles (issue #6, item 7).

No Ray: the driver's resume path (`launcher.resolve_resume`) and the worker's
(`worker.checkpointer.find_resume_state`, with Ray's offered checkpoint stubbed) are called directly
on real checkpoint directories written by `checkpoint.save_checkpoint`.

Crashes are real process deaths: a forked child saves a checkpoint and `os._exit`s at
the chosen point (between writing a file and renaming it into place); the parent then
looks for the latest checkpoint exactly as a restarted run would.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import types
from pathlib import Path

import pytest
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp.errors import CheckpointError
from raytrain_ddp.driver.resume import ResumeError, resolve_resume
from raytrain_ddp.job import Job
from raytrain_ddp.worker.checkpointer import find_resume_state

pytestmark = pytest.mark.timeout(90)

FIT = "f" * 32


def _state(step: int, fit_id: str = FIT) -> dict:
    model = torch.nn.Linear(4, 3)
    return {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
            "schedule": {}, "progress": {"step": step, "epoch": 0, "steps_into_epoch": step},
            "rng": ckpt.rng_state(), "run": {"world_size": 2, "fit_id": fit_id}}


def _save(run_dir: Path, step: int, fit_id: str = FIT) -> Path:
    return ckpt.save_checkpoint(run_dir / f"checkpoint_{step:08d}_{fit_id[:8]}", _state(step, fit_id))


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [f"run.storage_path={run_dir.parent}", f"name={run_dir.name}", *overrides])


def _crash_while_saving(run_dir: Path, step: int, crash_before: str) -> int:
    """Fork a child that saves checkpoint `step` and dies (os._exit) right before
    `os.replace` moves `crash_before` into place: the file is fully written under its
    temporary name, the rename never happens. Returns the child's exit status."""
    pid = os.fork()
    if pid == 0:  # child: never returns
        try:
            real_replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if Path(dst).name == crash_before:
                    os._exit(17)  # the process dies between write and rename
                return real_replace(src, dst, *args, **kwargs)

            os.replace = replace
            _save(run_dir, step)
        finally:
            os._exit(3)  # reaching this means the crash point was never hit
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("crash_before", [ckpt.STATE_FILE, ckpt.MANIFEST_FILE])
def test_crash_between_write_and_rename_never_becomes_the_latest(tmp_path, crash_before, caplog):
    run_dir = tmp_path / "run"
    good = _save(run_dir, 10)
    assert _crash_while_saving(run_dir, 20, crash_before) == 17

    crashed = run_dir / f"checkpoint_00000020_{FIT[:8]}"
    assert crashed.is_dir() and list(crashed.glob(f".{crash_before}.tmp-*")), "the child did write the file"
    # The driver's resume path and the worker's fallback both take step 10, never the torn 20.
    assert resolve_resume(_cfg(run_dir), run_dir) == good
    found = ckpt.find_checkpoints(run_dir)
    assert found == [good, crashed]  # no manifest: ranked below every complete checkpoint
    state, path = ckpt.load_latest_valid(found)
    assert path == good and state["progress"]["step"] == 10
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.checkpoint"):
        assert ckpt.load_latest_valid([crashed]) is None  # and never loadable on its own
    assert "manifest.json: missing" in caplog.text and crashed.name in caplog.text
    with pytest.raises(ResumeError, match=rf"{crashed.name}.*manifest\.json: missing"):
        resolve_resume(_cfg(run_dir, f"run.resume={crashed}"), run_dir)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_truncate, "truncated"), (_flip_byte, "sha256 does not match")])
def test_damaged_latest_checkpoint_is_named_and_the_previous_one_is_used(tmp_path, monkeypatch, caplog,
                                                                         damage, reason):
    run_dir = tmp_path / "run"
    _save(run_dir, 10)
    previous = _save(run_dir, 20)
    latest = _save(run_dir, 30)
    damage(latest / ckpt.STATE_FILE)

    # Driver: re-running the same name (run.resume unset) and run.resume=latest continue from 20.
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.checkpoint"):
        assert resolve_resume(_cfg(run_dir), run_dir) == previous
        assert resolve_resume(_cfg(run_dir, "run.resume=latest"), run_dir) == previous
    assert f"{latest.name}/state.pt" in caplog.text and reason in caplog.text
    # Asking for the damaged one by path is a clear error naming the file, not a traceback.
    with pytest.raises(ResumeError, match=rf"run.resume=.*{latest.name}/state\.pt.*{reason}"):
        resolve_resume(_cfg(run_dir, f"run.resume={latest}"), run_dir)

    # Worker, restarted inside the same fit: Ray offers its latest reported checkpoint (the
    # damaged copy); the worker falls back to this fit's previous one.
    import ray.train

    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: types.SimpleNamespace(path=str(latest)))
    job = Job(cfg=_cfg(run_dir), spec=None, run_dir=str(run_dir), fit_id=FIT)
    state, path = find_resume_state(job)
    assert path == previous and state["progress"]["step"] == 20


class _CreatesSentinel:
    """Unpickling this calls open(path, 'w'): arbitrary code that leaves a visible trace."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forge(directory: Path, payload: bytes, step: int) -> None:
    """Replace state.pt and forge a matching manifest (an attacker can compute sha256 too)."""
    (directory / ckpt.STATE_FILE).write_bytes(payload)
    manifest = json.loads((directory / ckpt.MANIFEST_FILE).read_text())
    manifest["step"] = step
    manifest["files"][ckpt.STATE_FILE] = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    (directory / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))


def _payload(kind: str, sentinel: Path) -> bytes:
    evil = {"model": _CreatesSentinel(sentinel), "optimizer": {},
            "progress": {"step": 99, "epoch": 0, "steps_into_epoch": 0}, "run": {}}
    if kind == "raw-pickle":
        return pickle.dumps(evil)
    buffer = io.BytesIO()
    torch.save(evil, buffer)  # torch's zip format, same hostile pickle inside
    return buffer.getvalue()


def _payload_is_live(payload: bytes, sentinel: Path) -> bool:
    """Control: an unprotected torch.load of the payload in a forked child creates the sentinel."""
    pid = os.fork()
    if pid == 0:
        try:
            torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return sentinel.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["torch-zip", "raw-pickle"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, kind):
    control = tmp_path / "control_sentinel"
    assert _payload_is_live(_payload(kind, control), control), "the hostile payload must really run code"

    sentinel = tmp_path / "SENTINEL"
    run_dir = tmp_path / "run"
    good = _save(run_dir, 10)
    evil = _save(run_dir, 99)
    _forge(evil, _payload(kind, sentinel), step=99)

    with pytest.raises(CheckpointError, match=rf"{evil.name}/state\.pt: refused to load"):
        ckpt.load_checkpoint(evil)
    assert resolve_resume(_cfg(run_dir), run_dir) == good  # newest by step, refused, skipped
    with pytest.raises(ResumeError, match="refused to load"):
        resolve_resume(_cfg(run_dir, f"run.resume={evil / 'state.pt'}"), run_dir)
    assert not sentinel.exists(), "unpickling ran attacker code"
