"""Checkpoint files without Ray: round trip, RNG state, damage detection, newest-valid fallback."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


def _state(step: int, fit_id: str = "fit-a") -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": {"last_step": step},
            "progress": {"step": step, "epoch": step // 10, "steps_into_epoch": step % 10},
            "rng": ckpt.rng_state(), "run": {"world_size": 2, "fit_id": fit_id}}


def test_round_trip_restores_tensors_optimizer_and_every_rng(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = _state(7)
    ckpt.save_checkpoint(tmp_path / "checkpoint_a", state)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    loaded = ckpt.load_checkpoint(tmp_path / "checkpoint_a")
    ckpt.set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert loaded["progress"]["step"] == 7 and loaded["progress"]["steps_into_epoch"] == 7
    assert loaded["run"]["fit_id"] == "fit-a"
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["optimizer"]["state"][0]["exp_avg"].shape == (3, 4)
    manifest = json.loads((tmp_path / "checkpoint_a" / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["files"]["state.pt"]["size"] > 0
    assert not list((tmp_path / "checkpoint_a").glob(".*tmp*")), "temporary files left behind"


def test_truncated_corrupted_and_incomplete_checkpoints_are_named(tmp_path):
    for name in ("trunc", "flip", "nomanifest"):
        ckpt.save_checkpoint(tmp_path / name, _state(1))
    state_file = tmp_path / "trunc" / "state.pt"
    state_file.write_bytes(state_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"trunc/state\.pt.*truncated"):
        ckpt.load_checkpoint(tmp_path / "trunc")

    flipped = tmp_path / "flip" / "state.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"flip/state\.pt.*sha256"):
        ckpt.load_checkpoint(tmp_path / "flip")

    (tmp_path / "nomanifest" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"nomanifest/manifest\.json.*missing"):
        ckpt.load_checkpoint(tmp_path / "nomanifest")
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nowhere")


class _Boom:
    def __reduce__(self):
        return (print, ("arbitrary code ran",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_with_code_is_refused_even_with_a_matching_manifest(tmp_path, capsys):
    evil = tmp_path / "checkpoint_evil"
    ckpt.save_checkpoint(evil, _state(3))
    payload = pickle.dumps({"model": _Boom(), "optimizer": {}, "progress": {"step": 3, "epoch": 0, "steps_into_epoch": 3},
                            "run": {}})
    (evil / "state.pt").write_bytes(payload)
    manifest = json.loads((evil / "manifest.json").read_text())
    import hashlib

    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"checkpoint_evil/state\.pt: refused to load"):
        ckpt.load_checkpoint(evil)
    assert "arbitrary code ran" not in capsys.readouterr().out


def test_find_orders_by_recorded_step_and_load_latest_valid_falls_back(tmp_path):
    for step in (5, 20, 10):
        ckpt.save_checkpoint(tmp_path / f"checkpoint_{step:03d}", _state(step))
    (tmp_path / "checkpoint_broken").mkdir()  # no manifest: sorts last
    (tmp_path / "not_a_checkpoint").mkdir()
    found = ckpt.find_checkpoints(tmp_path)
    assert [p.name for p in found] == ["checkpoint_020", "checkpoint_010", "checkpoint_005", "checkpoint_broken"]

    newest = tmp_path / "checkpoint_020" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:-10])
    state, path = ckpt.load_latest_valid(found)
    assert path.name == "checkpoint_010" and state["progress"]["step"] == 10
    assert ckpt.load_latest_valid([tmp_path / "checkpoint_broken"]) is None
    assert ckpt.find_checkpoints(tmp_path / "missing") == []


def test_state_missing_required_keys_is_rejected_on_save(tmp_path):
    with pytest.raises(ValueError, match="missing keys"):
        ckpt.save_checkpoint(tmp_path / "x", {"model": {}})


class _FakeCuda:
    """torch.cuda's RNG functions on a host without GPUs: `visible` devices, this worker on
    `current`; each device's generator state is a distinct tensor, and setting one is recorded."""

    def __init__(self, monkeypatch, visible: int, current: int) -> None:
        self.visible, self.current = visible, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(visible)}
        self.set_calls: list[tuple[int, int]] = []  # (device index, first byte of the state)
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(cuda, "get_rng_state", self._get)
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        monkeypatch.setattr(cuda, "get_rng_state_all", self._never)
        monkeypatch.setattr(cuda, "set_rng_state_all", self._never)

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        if not 0 <= index < self.visible:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")  # what a real GPU says
        return index

    def _get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def _set(self, state, device="cuda"):
        self.set_calls.append((self._index(device), int(state[0])))

    @staticmethod
    def _never(*args, **kwargs):
        raise AssertionError("the all-devices RNG functions must not be used")


def test_cuda_rng_is_saved_and_restored_for_this_workers_device_only(monkeypatch):
    # Saved by rank 0 on cuda:2 of a node where it saw 4 devices (Ray shares CUDA_VISIBLE_DEVICES).
    saver = _FakeCuda(monkeypatch, visible=4, current=0)
    state = ckpt.rng_state(cuda_device=torch.device("cuda", 2))
    assert state["cuda_device"] == 2 and torch.equal(state["cuda"], saver.states[2])  # its own, not all 4
    assert ckpt.rng_state()["cuda_device"] == 0  # default: the current device

    # Resized down: rank 0 now sees 1 device, cuda:0. Its own generator takes the saved stream.
    loader = _FakeCuda(monkeypatch, visible=1, current=0)
    ckpt.set_rng_state(state, cuda_device=torch.device("cuda", 0))
    assert loader.set_calls == [(0, 2)]

    # A checkpoint from before: one state per visible device. This worker's own entry is used...
    old = {**state, "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(4)]}
    old.pop("cuda_device")
    loader = _FakeCuda(monkeypatch, visible=2, current=1)
    assert ckpt.restore_cuda_rng(old["cuda"]) == 1 and loader.set_calls == [(1, 11)]
    # ...and a device the list has no entry for keeps its seeded stream, no crash (the old
    # code's set_rng_state_all indexed all 4 and failed on a 2-device worker).
    assert ckpt.restore_cuda_rng(old["cuda"][:1], torch.device("cuda", 1)) is None
    ckpt.set_rng_state(old, cuda_device=torch.device("cuda", 1))
    assert loader.set_calls == [(1, 11), (1, 11)]


def test_cuda_rng_untouched_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = ckpt.rng_state()
    assert "cuda" not in state
    assert ckpt.restore_cuda_rng([torch.zeros(16, dtype=torch.uint8)]) is None  # a GPU checkpoint on a CPU host
