"""Checkpoint files: atomic save, verified safe load, newest-valid lookup.

Owns: the on-disk layout of one checkpoint directory and how the run directory's
checkpoints are found and ranked. Must not touch: Ray (the loop hands the directory to
`ray.train.report`, which copies it to storage), the model or optimizer objects (callers
pass and receive plain state dicts), torch.distributed.

Reading goes through `rundir.Location` (pyarrow.fs), so finding, verifying and loading
work the same on a local run directory and on `s3://` / `gs://` / `abfs://`: a function
given a `Location` answers with `Location`s, one given a local path with `Path`s.
Writing is always local (a worker's staging directory, uploaded by Ray Train).

Layout of a checkpoint directory:

    state.pt        torch.save of {component name: its state_dict()} (tensors and plain
                    Python values only; see `worker/state.py` for the components)
    manifest.json   {"format", "step", "epoch", "fit_id", "files": {name: {sha256, size}},
                    "lines": the metrics lines since the previous checkpoint, and, for a
                    survivor's copy of the last step (recovery/replica.py), "origin")

Why a manifest written last: a directory holding `manifest.json` whose sizes and sha256
match is a complete checkpoint; anything else (a crash mid-write, an upload to storage
cut short -- Ray copies the files in no set order, so the manifest may land before the
state --, bit rot, a file swapped in by someone else) is detected before `torch.load`
runs. Every file is written to a temporary name, fsynced and `os.replace`d, so a reader
never sees half a file under its final name.

Why `weights_only=True` and plain types: loading a pickle can run arbitrary code. With
`weights_only=True` torch refuses anything that is not tensors, containers and
primitives, so RNG states (numpy's uint32 key array, Python's tuple of ints) are stored
as tensors and rebuilt on load by `rng_state()` / `set_rng_state()`.

A checkpoint that cannot be used raises `CheckpointError` naming the file and what is
wrong; `load_latest_valid` then falls back to the next newest one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np
import pyarrow.fs as pafs
import torch

from raytrain_ddp.errors import CheckpointError
from raytrain_ddp.rundir import CHECKPOINT_PREFIX, Location

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: one entry per component (`progress`, `run`, ...); 1 was a flat dict
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
REQUIRED_KEYS = ("model", "optimizer", "progress", "run")

PathLike = Union[str, os.PathLike]
Where = Union[str, os.PathLike, Location]


# ---------------------------------------------------------------- save / load


def save_checkpoint(dirpath: PathLike, state: dict[str, Any], origin: Optional[str] = None,
                    lines: Optional[list[dict[str, Any]]] = None) -> Path:
    """Write `state` into `dirpath` (created if needed); returns the directory.

    The state must hold only tensors, containers and primitives (see `rng_state`), so
    that `load_checkpoint` can read it back with `weights_only=True`. `origin`, when
    given, is recorded in the manifest (a survivor's copy of the last step says so), and
    so are `lines`, the metrics lines since the previous checkpoint (a survivor's copy: its
    step's), as `metrics.jsonl` holds them.
    """
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state is missing keys {missing}")
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    _atomic_write(dirpath / STATE_FILE, payload)
    manifest = {
        "format": FORMAT,
        "step": int(state["progress"]["step"]),
        "epoch": int(state["progress"]["epoch"]),
        "fit_id": state["run"].get("fit_id"),
        "created": time.time(),
        "files": {STATE_FILE: {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}},
        **({"origin": origin} if origin else {}),
        **({"lines": lines} if lines else {}),
    }
    _atomic_write(dirpath / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    _fsync_dir(dirpath)
    return dirpath


def load_checkpoint(path: Where) -> dict[str, Any]:
    """Verify the manifest, then load `state.pt` with `weights_only=True`.

    `path` is a checkpoint directory or its `state.pt`, local or a `Location` in object
    storage (read through pyarrow.fs into memory, verified there). Raises
    `CheckpointError` naming the file when it is missing, incomplete, truncated,
    corrupted or not a plain-tensor checkpoint.
    """
    loc = Location.parse(path)
    info = loc.info()
    dirpath = loc.parent if info.type == pafs.FileType.File else loc
    if info.type == pafs.FileType.NotFound or not dirpath.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a checkpoint directory")
    manifest = read_manifest(dirpath)
    entry = manifest.get("files", {}).get(STATE_FILE)
    state_path = dirpath / STATE_FILE
    if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
        raise CheckpointError(f"{dirpath / MANIFEST_FILE}: no sha256/size entry for {STATE_FILE}")
    try:
        payload = state_path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        raise CheckpointError(f"{state_path}: missing (checkpoint incomplete)") from None
    if len(payload) != entry["size"]:
        raise CheckpointError(
            f"{state_path}: {len(payload)} bytes, manifest says {entry['size']} (truncated or incomplete copy)"
        )
    if hashlib.sha256(payload).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{state_path}: sha256 does not match {MANIFEST_FILE} (file corrupted or replaced)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{state_path}: refused to load: not a plain-tensor checkpoint ({first_line}); "
            "only files written by raytrain_ddp can be resumed"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: holds a {type(state).__name__}, expected a state dict")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{state_path}: missing keys {missing}; not a raytrain_ddp checkpoint")
    return state


def read_manifest(dirpath: Where) -> dict[str, Any]:
    manifest_path = Location.parse(dirpath) / MANIFEST_FILE
    try:
        text = manifest_path.read_text()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"{manifest_path}: missing (checkpoint incomplete or not written by raytrain_ddp)") from None
    try:
        manifest = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: checkpoint format {manifest.get('format') if isinstance(manifest, dict) else '?'} "
                              f"is not this version's ({FORMAT}); resume it with the raytrain_ddp that wrote it, "
                              "or start a new run (name=...)")
    return manifest


# ---------------------------------------------------------------- finding


def find_checkpoints(run_dir: Where) -> list[Any]:
    """Checkpoint directories under `run_dir`, newest first by recorded step.

    Ties (the same step written by two runs) go to the most recently written. A
    directory whose manifest cannot be read sorts last: it is kept so that
    `load_latest_valid` can report why it was skipped. `Path`s for a local path,
    `Location`s for a `Location`.
    """
    loc = Location.parse(run_dir)
    ranked = []
    for child, info in loc.children():
        if not (info.type == pafs.FileType.Directory and child.name.startswith(CHECKPOINT_PREFIX)):
            continue
        try:
            step = int(read_manifest(child).get("step", -1))
        except (CheckpointError, TypeError, ValueError):
            step = -1
        manifest = (child / MANIFEST_FILE).info()
        mtime = (manifest.mtime or info.mtime) if manifest.type == pafs.FileType.File else info.mtime
        ranked.append((step, mtime.timestamp() if mtime else 0.0, child))
    ranked.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [_like(run_dir, path) for _, _, path in ranked]


def load_latest_valid(candidates: Iterable[Where]) -> Optional[tuple[dict[str, Any], Any]]:
    """Load the first candidate that verifies; log and skip the ones that do not."""
    for candidate in candidates:
        try:
            return load_checkpoint(candidate), _like(candidate, Location.parse(candidate))
        except CheckpointError as exc:
            logger.warning("skipping checkpoint: %s", exc)
    return None


def _like(given: Where, loc: Location) -> Any:
    """Answer in the caller's kind: a `Location` for a `Location`, else a `Path`."""
    return loc if isinstance(given, Location) else loc.local_path


# ---------------------------------------------------------------- RNG state as plain types


def capture_rng(cuda_device: Any = None) -> tuple[Any, ...]:
    """The RNG states as the libraries give them (no conversion: cheap at every step); `rng_state` makes them storable.

    CUDA: the generator of this worker's own device only (`cuda_device`, default the
    current one), never one per visible device: Ray shares `CUDA_VISIBLE_DEVICES` among a
    node's workers, so "all devices" is other workers' devices, and after a resize down
    a state per device would name devices the restoring worker no longer sees.
    """
    index = _own_cuda_index(cuda_device)
    cuda = (index, torch.cuda.get_rng_state(index)) if index is not None else None
    return torch.get_rng_state(), np.random.get_state(), random.getstate(), cuda


def _own_cuda_index(device: Any = None, initialised_only: bool = True) -> Optional[int]:
    """This worker's CUDA device index, or None where it has none (`initialised_only`: or
    CUDA is unused in this process so far -- reading an RNG state must not initialise it)."""
    if not torch.cuda.is_available() or (initialised_only and not torch.cuda.is_initialized()):
        return None
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if device.index is not None:
            return device.index
    return torch.cuda.current_device()


def rng_state(captured: Optional[tuple[Any, ...]] = None, cuda_device: Any = None) -> dict[str, Any]:
    """torch / numpy / python RNG states (now, or as `capture_rng` took them) as tensors and
    primitives (weights_only-safe)."""
    torch_state, np_state, py_state, cuda = captured if captured is not None else capture_rng(cuda_device)
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    py_version, py_internal, py_gauss = py_state
    state = {
        "torch": torch_state,
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }
    if cuda is not None:
        state["cuda_device"], state["cuda"] = cuda  # the saver's index (informational), its state
    return state


def set_rng_state(state: dict[str, Any], cuda_device: Any = None) -> None:
    """Restore `rng_state`'s streams; CUDA: only this worker's own device (`restore_cuda_rng`)."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state((
        np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
        np_state["has_gauss"], np_state["cached_gaussian"],
    ))
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(int(v) for v in py_state["internal"].tolist()),
                     py_state["gauss_next"]))
    restore_cuda_rng(state.get("cuda"), cuda_device)


def restore_cuda_rng(saved: Any, cuda_device: Any = None) -> Optional[int]:
    """Set this worker's own CUDA generator from a checkpoint's `rng["cuda"]`; returns the
    device index set, or None when nothing was (no CUDA here, nothing saved, or no entry
    for this device).

    `saved` is one state (this format: the saver's own device) or, from checkpoints
    written before it, a list with one state per device the saver could see: then the
    entry at this worker's own index, if the list has one. Never `set_rng_state_all`: it
    indexes every device of the list, and after a resize down this worker sees fewer.
    """
    if saved is None:
        return None
    index = _own_cuda_index(cuda_device, initialised_only=False)
    if index is None:
        return None
    if isinstance(saved, (list, tuple)):
        if index >= len(saved):
            return None  # the older format had no state for this device: keep the seeded one
        saved = saved[index]
    torch.cuda.set_rng_state(saved, index)
    return index


# ---------------------------------------------------------------- helpers


def _atomic_write(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(dirpath: Path) -> None:
    try:
        fd = os.open(dirpath, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
