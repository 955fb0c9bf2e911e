"""The chunk store: a data split laid out for exact reads of a few rows (`data.sharding: sharded`).

Owns: the on-disk layout of `<run dir>/data/<split>/` (Arrow IPC files holding one record
batch per *chunk* of `data.chunk_rows` consecutive rows, and `store.json`, written last,
which makes a store complete); writing it from a stream of Arrow tables (the driver, fed
by Ray Data); reading one chunk by its index (a worker: a ranged read of that record
batch only, through `pyarrow.fs`, so local disks and object stores alike); and the epoch
order of chunks and each rank's chunks for a step. Must not touch: Ray, torch, models,
what the columns mean (`columns.py` and `worker_data.py` turn them into tensors).

The order (a function of seed, epoch and step only, never of the worker count):

* chunk *i* holds rows ``[i*c, (i+1)*c)`` of the stored split, which the driver wrote in
  a seeded random order (Ray Data's `random_shuffle`) when `data.shuffle` is on;
* epoch *e* visits the ``N // c`` full chunks in a permutation seeded by (seed, *e*);
* optimizer step *s* is chunks ``[s*G/c, (s+1)*G/c)`` of that permutation, and in
  micro-step *m* rank *r* of *W* takes the ``b/c`` chunks at ``(m*W + r)*b/c`` — the
  exact-mode formula at chunk granularity (``c`` divides the micro batch ``b``).

So the samples of step *s* are the same for 1, 2 or 4 workers; a rank reads only its
own chunks (about ``1/W`` of the epoch); resuming at step *s* reads from chunk
``s*G/c`` on, and nothing is skipped or repeated. Shuffle quality: a uniform
permutation of chunks every epoch over rows shuffled once; the ``c`` rows of a chunk
stay together in every epoch (smaller `data.chunk_rows`: closer to a per-row shuffle,
more reads).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import pyarrow as pa

STORE_DIR = "data"  # under the run directory
MANIFEST = "store.json"
FORMAT = 1
CHUNKS_PER_FILE = 4096


@dataclass(frozen=True)
class Manifest:
    """What `store.json` records: rows, chunk size, files, and the inputs it was built from."""

    rows: int
    chunk_rows: int
    chunks: int  # including a last, shorter chunk
    chunks_per_file: int
    files: list[str]
    columns: list[str]
    fingerprint: str

    @property
    def full_chunks(self) -> int:
        return self.rows // self.chunk_rows

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **self.__dict__}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        if raw.pop("format", None) != FORMAT:
            raise ValueError("unknown store format")
        return cls(**raw)


def fingerprint(*parts: Any) -> str:
    """A stable digest of what a store was built from (config values, input file stats)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read_manifest(where: Any) -> Optional[Manifest]:
    """The store's manifest, or None when there is no complete store at `where` (a `Location`)."""
    target = where / MANIFEST
    if not target.exists():
        return None
    try:
        return Manifest.from_json(target.read_text())
    except (ValueError, KeyError, TypeError):
        return None


def write_store(where: Any, tables: Iterable[pa.Table], chunk_rows: int, fp: str,
                chunks_per_file: int = CHUNKS_PER_FILE) -> Manifest:
    """Write `tables` (in order) as chunks of `chunk_rows` rows; the manifest goes last.

    Memory: at most one incoming table plus one chunk. An existing store there is replaced.
    """
    where.mkdir()
    old = read_manifest(where)
    if old is not None:
        (where / MANIFEST).delete()
    files: list[str] = []
    pending: list[pa.Table] = []
    pending_rows, rows, chunks = 0, 0, 0
    writer, sink, schema = None, None, None

    def emit(chunk: pa.Table) -> None:
        nonlocal writer, sink, chunks
        if chunks % chunks_per_file == 0:
            if writer is not None:
                writer.close()
                sink.close()
            name = f"part-{chunks // chunks_per_file:05d}.arrow"
            files.append(name)
            sink = where.fs.open_output_stream((where / name).path)
            writer = pa.ipc.new_file(sink, schema)
        batches = chunk.combine_chunks().to_batches()
        writer.write_batch(batches[0] if len(batches) == 1 else pa.concat_batches(batches))
        chunks += 1

    for table in tables:
        if table.num_rows == 0:
            continue
        if schema is None:
            schema = table.schema
        elif not table.schema.equals(schema):
            table = table.cast(schema)
        pending.append(table)
        pending_rows += table.num_rows
        rows += table.num_rows
        if pending_rows >= chunk_rows:
            buffer = pa.concat_tables(pending)
            full = (buffer.num_rows // chunk_rows) * chunk_rows
            for start in range(0, full, chunk_rows):
                emit(buffer.slice(start, chunk_rows))
            rest = buffer.slice(full)
            pending, pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
    if pending_rows:
        emit(pa.concat_tables(pending))
    if writer is not None:
        writer.close()
        sink.close()
    for name, _info in where.children():  # files of an older, larger store
        if name.name.startswith("part-") and name.name not in files:
            name.delete()
    manifest = Manifest(rows, chunk_rows, chunks, chunks_per_file, files,
                        list(schema.names) if schema is not None else [], fp)
    (where / MANIFEST).write_text(manifest.to_json())
    return manifest


def _raw_kind(kind: pa.DataType) -> Optional[tuple[np.dtype, tuple[int, ...]]]:
    """(numpy dtype, shape of one row) of a column whose chunk bytes are one plain array:
    a fixed-size list of numbers (a feature vector, shape (size,)) or a number (shape ());
    None otherwise."""
    def numeric(k: pa.DataType) -> bool:
        return pa.types.is_integer(k) or pa.types.is_floating(k)

    if pa.types.is_fixed_size_list(kind) and numeric(kind.value_type):
        return np.dtype(kind.value_type.to_pandas_dtype()), (kind.list_size,)
    if numeric(kind):
        return np.dtype(kind.to_pandas_dtype()), ()
    return None


class _RawIndex:
    """Where each chunk's column bytes sit in a local store's files, for reads straight into
    the batch's arrays (`StoreReader.read_arrays`): one positional read per chunk and column,
    no Arrow objects, no intermediate copy.

    Built per file on first use by mapping the file and asking Arrow for each record batch's
    buffer addresses (only the batches' metadata pages are touched; the map is closed at
    once, so nothing of it stays resident). A column qualifies when every chunk holds it as
    one contiguous array of values: a fixed-size list of numbers (its values buffer; the
    list's validity is ignored, as `columns.arrow_numpy` ignores it) or numbers without
    nulls. A column of another type turns the raw path off for the store; a chunk with nulls
    in a column is read through Arrow (`read_arrays` returns None for a batch holding it), as
    `arrow_numpy` decides per table.
    """

    def __init__(self, schema: pa.Schema) -> None:
        self.kinds = [_raw_kind(field.type) for field in schema]
        self.names = list(schema.names)
        self.usable = all(k is not None for k in self.kinds)
        self.chunks: dict[int, Optional[list[tuple[int, int]]]] = {}  # chunk -> [(offset, rows)] per column
        self.fds: dict[int, int] = {}

    def index_file(self, file_index: int, path: str, first_chunk: int) -> None:
        mapped = pa.memory_map(path)
        try:
            size = mapped.size()
            base = mapped.read_buffer(1).address  # the address of byte 0
            mapped.seek(0)
            reader = pa.ipc.open_file(mapped)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                where = []
                for j, (dtype, row) in enumerate(self.kinds):  # type: ignore[misc]
                    column, width = batch.column(j), int(np.prod(row))
                    if row:  # a fixed-size list
                        values = column.values  # the whole child: the list's own offset is added below
                        start = column.offset * width + values.offset
                    else:
                        values, start = column, column.offset
                    data = values.buffers()[1]
                    offset = None if data is None else data.address - base + start * dtype.itemsize
                    if (values.null_count or offset is None or offset < 0  # nulls; not in the map (compressed)
                            or offset + len(column) * width * dtype.itemsize > size):
                        where = None  # this chunk: the Arrow path (as arrow_numpy decides per table)
                        break
                    where.append((offset, len(column)))
                self.chunks[first_chunk + b] = where
        finally:
            mapped.close()
        self.fds[file_index] = os.open(path, os.O_RDONLY)  # open for the reader's lifetime, as its Arrow files


class StoreReader:
    """Reads chunks by index: each read fetches one record batch's bytes, nothing more."""

    def __init__(self, where: Any, manifest: Optional[Manifest] = None):
        self.where = where
        self.manifest = manifest or read_manifest(where)
        if self.manifest is None:
            raise FileNotFoundError(f"{where}: no complete chunk store ({MANIFEST} missing)")
        self._readers: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._raw: Any = None  # a _RawIndex, False (not usable), None (not decided yet)

    def chunk(self, index: int) -> pa.RecordBatch:
        m = self.manifest
        if not 0 <= index < m.chunks:
            raise IndexError(f"chunk {index} of {m.chunks}")
        file, batch = divmod(index, m.chunks_per_file)
        with self._lock:
            reader = self._readers.get(file)
            if reader is None:
                handle = self.where.fs.open_input_file((self.where / m.files[file]).path)
                reader = self._readers[file] = pa.ipc.open_file(handle)
            return reader.get_batch(batch)

    def table(self, indices: Iterable[int]) -> pa.Table:
        """Chunks in the given order, as one table."""
        return pa.Table.from_batches([self.chunk(int(i)) for i in indices])

    def read_arrays(self, indices: Iterable[int]) -> Optional[dict[str, np.ndarray]]:
        """Chunks in the given order as one numpy array per column -- the arrays
        `columns.arrow_numpy(self.table(indices))` gives, read straight from the files
        (`_RawIndex`) -- or None where the raw path does not apply (a store in object
        storage, a column that is not plain numbers): read `table` then."""
        indices = [int(i) for i in indices]
        raw = self._raw_index()
        if raw is None:
            return None
        m = self.manifest
        with self._lock:
            for i in indices:
                file = i // m.chunks_per_file
                if file not in raw.fds:
                    raw.index_file(file, str((self.where / m.files[file]).local_path), file * m.chunks_per_file)
        where = [raw.chunks[i] for i in indices]
        if any(w is None for w in where):
            return None
        rows = sum(w[0][1] for w in where)
        out: dict[str, np.ndarray] = {}
        for j, (name, (dtype, shape)) in enumerate(zip(raw.names, raw.kinds)):  # type: ignore[misc]
            array = np.empty((rows, *shape), dtype=dtype)
            flat = memoryview(array.reshape(-1).view(np.uint8))
            row_bytes, at = int(np.prod(shape)) * dtype.itemsize, 0
            for i, chunk in zip(indices, where):
                offset, n = chunk[j]
                size = n * row_bytes
                got = os.preadv(raw.fds[i // m.chunks_per_file], [flat[at:at + size]], offset)
                if got != size:
                    raise OSError(f"{self.where}: short read of chunk {i} ({got} of {size} bytes)")
                at += size
            out[name] = array
        return out

    def _raw_index(self) -> Optional[_RawIndex]:
        if self._raw is None:  # decided on first use
            self._raw = False
            if getattr(self.where, "is_local", False) and self.manifest.chunks:
                index = _RawIndex(self.chunk(0).schema)
                if index.usable:
                    self._raw = index
        return self._raw or None


def epoch_chunks(full_chunks: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The visiting order of the full chunks in `epoch`: seeded by (seed, epoch) only."""
    if not shuffle:
        return np.arange(full_chunks, dtype=np.int64)
    return np.random.Generator(np.random.PCG64([int(seed), int(epoch), 0x5A4D])).permutation(full_chunks)


def rank_chunks(order: np.ndarray, step: int, micro: int, *, chunk_rows: int, micro_batch_size: int,
                accumulation_steps: int, world_size: int, world_rank: int) -> np.ndarray:
    """The chunks rank `world_rank` reads for micro-step `micro` of optimizer step `step`."""
    per_micro = micro_batch_size // chunk_rows
    per_step = per_micro * accumulation_steps * world_size
    start = step * per_step + (micro * world_size + world_rank) * per_micro
    return order[start:start + per_micro]
