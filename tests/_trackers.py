"""Read the trackers back with their own clients: TensorBoard's EventAccumulator, MLflow's
MlflowClient, and a W&B offline run's `.wandb` file parsed into wandb's own protobuf records.

W&B keeps an offline run in one file, `<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb`,
until `wandb sync` uploads it, and wandb (0.31) ships no Python reader for it any more (its
`sdk.internal.datastore` moved into the Go core). The format is LevelDB's log format with a
7-byte header (`:W&B`, magic 0xBEE1, version): 32 KiB blocks of chunks (crc32c, length,
type FULL/FIRST/MIDDLE/LAST, data), each record a `wandb_internal_pb2.Record`. The parser
below checks the header and the framing and leaves the content to wandb's protobuf classes;
it does not check the crc.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows them (restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a W&B run file ({ident!r}, {magic:#x})"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"{path}: chunk type {kind} at {pos}"
        if pos + 7 + length > len(data):  # still being written
            return
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_offline_run(wandb_dir: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """The one offline run under `wandb_dir`: its name, project, config, history rows and exit code.

    wandb's service process writes the file on its own, and `finish()` can return before the
    last records land: read again until the run's exit record is there (bounded).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read_offline_run(wandb_dir)
        if run["exit_code"] is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def _read_offline_run(wandb_dir: Path) -> dict[str, Any]:
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out: dict[str, Any] = {"history": [], "exit_code": None, "file": files[0]}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = record.run.display_name, record.run.project
            out["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def wandb_points(run: dict[str, Any], tag: str) -> list[tuple[int, float]]:
    return [(row["_step"], row[tag]) for row in run["history"] if tag in row]
