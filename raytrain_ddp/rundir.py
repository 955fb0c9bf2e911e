"""The run directory: every file name in it, where it is, and how it is read and written.

Owns: the names of `<run.storage_path>/<name>/`'s files; `Location`, a path on a
`pyarrow.fs.FileSystem` (local disk, `s3://`, `gs://`, `abfs://`: whatever
`pyarrow.fs.FileSystem.from_uri` resolves), through which every run-directory access
goes; reading JSON-lines files (a torn last line, left by a killed writer, is skipped)
and `JsonlFile`, the driver's writer for them. Must not touch: what a record means (the
meter and the driver's console do), checkpoint contents (`checkpoint.py`), Ray.

    config.yaml      the resolved config of the latest fit (driver)
    metrics.jsonl    one line per log interval and per validation (rank 0 -> driver)
    attempts.jsonl   one line per worker-group start (rank 0 -> driver)
    summary.json     the outcome, written when the fit ends (driver)
    abort.json       why every rank stopped together (non-finite policy; rank 0 -> driver)
    tensorboard/     event files, when `run.loggers` has tensorboard (driver)
    checkpoint_*/    checkpoints (`checkpoint.py`), written by Ray Train's report
    hold.json        who holds the run while a fit runs (`driver/hold.py`)
    compile-cache.bin  torch's compile caches, `train.compile` (rank 0, `worker/compiled.py`)

Why one abstraction: on a cluster whose nodes have their own disks the run directory
lives in object storage, and the same code must serve a laptop's `./runs`. Only the
driver writes here (workers send their records through Ray, see `driver/stream.py`);
checkpoints reach storage through Ray Train's upload.

Why `JsonlFile` rewrites on object stores: objects cannot be appended to. Locally it
appends (and a reader sees whole lines as they come); on `s3://` and friends each flush
rewrites the whole object from the records held in memory (one PUT: a reader sees the
old or the new object, never half).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import pyarrow.fs as pafs

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
TIMELINE_FILE = "timeline.jsonl"  # the start-up timeline (timeline.py)
SUMMARY_FILE = "summary.json"
ABORT_FILE = "abort.json"
TENSORBOARD_DIR = "tensorboard"
TRACKED_FILE = "trackers.json"  # {"step": T}: the trackers had every committed line up to T (driver/stream.py)
CHECKPOINT_PREFIX = "checkpoint_"
HOLD_FILE = "hold.json"
COMPILE_CACHE_FILE = "compile-cache.bin"
OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs")


@dataclass(frozen=True)
class Location:
    """A file or directory on a pyarrow filesystem; picklable (it travels to workers).

    `path` is the filesystem's own path (no scheme); `uri` is what users see and type:
    the local absolute path, or `s3://bucket/key` (query parameters of the configured
    URI, such as `endpoint_override`, live in `fs`, not in the URI shown).
    """

    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def parse(cls, where: Union[str, os.PathLike, "Location"]) -> "Location":
        """A local path (relative ones resolved against the cwd) or a `scheme://` URI."""
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if "://" not in text or text.startswith("file://"):
            local = str(Path(text.removeprefix("file://")).expanduser().resolve())
            return cls(pafs.LocalFileSystem(), local, local)
        fs, path = pafs.FileSystem.from_uri(text)
        return cls(fs, path.rstrip("/"), text.split("?", 1)[0].rstrip("/"))

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path:
        if not self.is_local:
            raise ValueError(f"{self.uri} is not on the local filesystem")
        return Path(self.path)

    def plain(self) -> Union[Path, "Location"]:
        """A `Path` when local (what callers holding paths compare with), else itself."""
        return self.local_path if self.is_local else self

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(self.fs, self.path.rstrip("/").rsplit("/", 1)[0], self.uri.rstrip("/").rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> "Location":
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.uri

    # ------------------------------------------------------------ queries

    def info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def children(self) -> list[tuple["Location", pafs.FileInfo]]:
        """Direct children with their info; [] when this is not a directory."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(self / info.base_name, info) for info in infos]

    # ------------------------------------------------------------ reading and writing

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as handle:
            return handle.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, payload: bytes) -> None:
        """Replace the file as a whole: a reader sees the old or the new content."""
        if self.is_local:
            path = self.local_path
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(payload)
            os.replace(tmp, path)
            return
        with self.fs.open_output_stream(self.path) as handle:  # one object PUT: atomic
            handle.write(payload)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def create_new(self, payload: bytes) -> bool:
        """Write the file only if it is not there; True when this call created it.

        Atomic locally: a complete temporary file is hard-linked to the name (`link`
        fails when the name exists, as `O_EXCL` does). pyarrow exposes no conditional
        PUT, so on object stores this is a check then a PUT: a writer racing this one
        may replace it, and callers that need to know read it back (`driver/hold.py`).
        """
        if not self.is_local:
            if self.exists():
                return False
            self.write_bytes(payload)
            return True
        path = self.local_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(payload)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def append_text(self, text: str) -> None:
        """Local files only (object stores cannot append; `JsonlFile` rewrites there)."""
        path = self.local_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(text)
            handle.flush()

    def delete(self) -> None:
        """Remove a file; nothing happens when it is not there."""
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass

    def mkdir(self) -> None:
        """Local directories are made; object stores have none to make."""
        if self.is_local:
            self.local_path.mkdir(parents=True, exist_ok=True)

    def upload_from(self, local_dir: Union[str, os.PathLike]) -> None:
        """Copy a local directory's files to here (TensorBoard's event files, a checkpoint)."""
        self.mkdir()  # a local destination must exist: pyarrow creates no directory for the copy
        pafs.copy_files(os.fspath(local_dir), self.path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.fs)


Where = Union[str, os.PathLike, Location]


def run_dir_of(cfg: "Config") -> Location:
    """`<run.storage_path>/<name>` as a `Location` (local paths made absolute)."""
    return Location.parse(cfg.run.storage_path) / cfg.name


def unused_name(cfg: "Config") -> str:
    """`name=<name>-N` for the first N whose run directory does not exist yet (local storage)."""
    base = cfg.name
    storage = cfg.run.storage_path
    for n in range(2, 1000):
        candidate = f"{base}-{n}"
        if "://" in storage or not (Path(storage).expanduser() / candidate).exists():
            return f"name={candidate}"
    return f"name={base}-new"


def is_object_store(storage_path: str) -> bool:
    return storage_path.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES if "://" in storage_path else False


# ---------------------------------------------------------------- JSON lines


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """Every complete JSON object line; a torn last line (writer killed) is ignored."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_jsonl(where: Where) -> list[dict[str, Any]]:
    """The records of a JSONL file (a local path or a `Location`); [] when it is missing."""
    loc = Location.parse(where)
    try:
        return parse_jsonl(loc.read_text())
    except (FileNotFoundError, IsADirectoryError):
        return []


def read_metrics(where: Where) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (or of RUN_DIR/metrics.jsonl)."""
    loc = Location.parse(where)
    return read_jsonl(loc / METRICS_FILE if loc.is_dir() else loc)


def dumps_record(record: dict[str, Any]) -> str:
    return json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=True)


class JsonlFile:
    """The driver's writer for one JSONL file of the run directory.

    Holds the file's records (read once at open: a resumed run keeps one history);
    `flush()` makes the file hold them, appending locally and rewriting on object stores.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        try:
            text = loc.read_text()
        except (FileNotFoundError, IsADirectoryError):
            text = ""
        self.records: list[dict[str, Any]] = parse_jsonl(text)
        self._pending: list[dict[str, Any]] = []
        self._rewrite = bool(text) and not text.endswith("\n")  # a torn last line: rewrite it away

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            record = {k: _plain(v) for k, v in record.items()}
            self.records.append(record)
            self._pending.append(record)

    def keep(self, predicate: Any) -> None:
        """Drop the records `predicate` rejects (a resumed run redoes those steps)."""
        kept = [r for r in self.records if predicate(r)]
        if len(kept) != len(self.records):
            self.records, self._pending, self._rewrite = kept, [], True

    def sort(self, key: Any) -> None:
        """Order the records by `key` (lines filled in from a checkpoint go where their step is)."""
        ordered = sorted(self.records, key=key)
        if any(a is not b for a, b in zip(ordered, self.records)):
            self.records, self._pending, self._rewrite = ordered, [], True

    def amend_last(self, fields: dict[str, Any]) -> None:
        """Add `fields` to the newest record (an attempt's line learns where it resumed from)."""
        if not self.records:
            return
        last = self.records[-1]
        last.update({k: _plain(v) for k, v in fields.items()})
        if not any(record is last for record in self._pending):
            self._rewrite = True  # already in the file

    @property
    def dirty(self) -> bool:
        return bool(self._pending) or self._rewrite

    def flush(self) -> None:
        if not self.dirty:
            return
        if self._rewrite or not self.loc.is_local:
            self.loc.write_text("".join(dumps_record(r) + "\n" for r in self.records))
        else:
            self.loc.append_text("".join(dumps_record(r) + "\n" for r in self._pending))
        self._pending, self._rewrite = [], False


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return value  # json writes NaN / Infinity; read back by json.loads
    return value

