"""One rank's data: optimizer-step windows of micro-batches on the device.

Owns: turning this worker's Ray Data shard (or its chunks of the chunk store) into windows
of `accumulation_steps` micro-batches (each rank's slice of every global batch), and the
validation share; the columns as tensors (`columns.py` cuts them). A micro-batch is
whatever `raytrain_ddp.batch` builds from the columns of its rows: an `(x, y)` tuple or a
dict of named tensors. `WorkerData` is the facade the loop sees; behind it one reader per
`data.sharding` mode (`READERS`). Must not touch: models, optimisation, the driver's
datasets (`ray_datasets.py` builds them and explains the three `data.sharding` modes).

* ``exact``: every worker reads the full (unsplit) set once into memory, draws the same
  seeded permutation each epoch and takes its disjoint slice of every global batch, so
  the samples of optimizer step *s* are the same at any worker count.
* ``sharded``: the order of ``exact`` at chunk granularity, read from the chunk store the
  driver wrote (`store.py`): each rank reads only its chunks of each step,
  on a reader thread a few steps ahead, so its data memory is that window.
* ``streaming``: `iter_torch_batches` over this worker's `streaming_split` stream; before
  every window the ranks agree that all still have a full one (`all_true`), so every
  rank runs the same number of micro-steps and none can deadlock.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import numpy as np

from raytrain_ddp.batch import BatchFormat, to_device
from raytrain_ddp.config import Config
from raytrain_ddp.data.columns import TRAIN, VAL, arrow_numpy, column_arrays, num_rows
from raytrain_ddp.data.steps import steps_per_epoch
from raytrain_ddp.errors import DataError
from raytrain_ddp.job import DataSpec
from raytrain_ddp.parallel.collectives import all_true

_READ_BATCH_ROWS = 4096
# sharded: a step read faster than this stays in the training thread (see `ShardedReader.train_windows`)
INLINE_READ_S = 0.001


class _Reader:
    """What every sharding mode shares: the run's numbers, the batch format, the counters the
    meter reads, and the in-memory helpers (a whole shard as tensors, columns as a batch)."""

    reads_ray_shards = True  # its rows come from `ray.train.get_dataset_shard` (not a chunk store)

    def __init__(self, cfg: Config, spec: DataSpec, world_rank: int, world_size: int, device: Any,
                 shards: Optional[dict[str, Any]]) -> None:
        if shards is None and self.reads_ray_shards:
            shards = _ray_shards(spec)
        self.cfg, self.spec = cfg, spec
        self.world_rank, self.world_size = world_rank, world_size
        self.device = device
        self.micro_batch_size = cfg.train.micro_batch_size
        self.accumulation_steps = cfg.accumulation_steps(world_size)
        self.global_batch_size = cfg.train.global_batch_size
        self.wait_seconds = 0.0
        self.read_ahead_steps = 0  # sharded: windows that came from the reader thread
        self.inline_read_s = INLINE_READ_S  # sharded: a step read faster stays in this thread
        self.format = BatchFormat.of(cfg)
        shards = shards or {}
        self._train_shard = shards.get(TRAIN)
        self._val_shard = shards.get(VAL)
        self._val_columns: Optional[dict[str, Any]] = None
        self.steps_per_epoch = 0

    def train_windows(self, epoch: int, skip_steps: int) -> Iterator[list[Any]]:
        """One list of `accumulation_steps` micro-batches per optimizer step."""
        raise NotImplementedError

    def val_batches(self, share: Optional[tuple[int, int]] = None) -> Iterator[Any]:
        """This rank's disjoint, strided share of the validation rows (each row once overall);
        `share`: (rank, size) instead of this rank's ((0, 1): every row, `worker/validator.py`)."""
        if self._val_shard is None:
            return
        if self._val_columns is None:
            self._val_columns = self._materialize(self._val_shard)
        rank, size = share or (self.world_rank, self.world_size)
        mine = {name: column[rank::size] for name, column in self._val_columns.items()}
        size = max(self.micro_batch_size, 256)
        for start in range(0, num_rows(mine), size):
            yield self._batch({name: column[start:start + size] for name, column in mine.items()})

    def epoch_order(self, rows: int, epoch: int) -> Any:
        """The same permutation on every rank and at every world size: seeded by (seed, epoch)."""
        import torch

        if not self.cfg.data.shuffle:
            return torch.arange(rows)
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + epoch)
        return torch.randperm(rows, generator=gen)

    def _materialize(self, shard: Any) -> dict[str, Any]:
        """Read a whole (unsplit) dataset once through Ray Data into CPU tensors, one per column."""
        import torch

        start = time.perf_counter()
        parts: dict[str, list[np.ndarray]] = {}
        for batch in shard.iter_batches(batch_size=_READ_BATCH_ROWS, batch_format="numpy"):
            for name, array in column_arrays(batch, self.cfg, self.spec).items():
                parts.setdefault(name, []).append(array)
        columns = {name: torch.from_numpy(np.concatenate(arrays)) for name, arrays in parts.items()}
        self.wait_seconds += time.perf_counter() - start
        return columns

    def _collate(self, batch: dict[str, np.ndarray]) -> Any:
        import torch

        return self._batch({name: torch.from_numpy(a) for name, a in column_arrays(batch, self.cfg, self.spec).items()})

    def _batch(self, columns: dict[str, Any]) -> Any:
        return to_device(self.format.assemble(columns), self.device)


class ExactReader(_Reader):
    """``exact``: the whole (unsplit) training set in memory, this rank's slice of every
    global batch of one seeded order."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._train_columns = self._materialize(self._train_shard)
        self.steps_per_epoch = steps_per_epoch(num_rows(self._train_columns), self.global_batch_size)

    def train_windows(self, epoch: int, skip_steps: int) -> Iterator[list[Any]]:
        """This rank's micro-batches of each global batch of the epoch's order, from memory."""
        assert self._train_columns is not None
        columns = self._train_columns
        order = self.epoch_order(num_rows(columns), epoch)
        b, k, w, r = self.micro_batch_size, self.accumulation_steps, self.world_size, self.world_rank
        for step in range(skip_steps, self.steps_per_epoch):
            start = time.perf_counter()
            global_idx = order[step * self.global_batch_size:(step + 1) * self.global_batch_size]
            window = []
            for micro in range(k):
                idx = global_idx[(micro * w + r) * b:(micro * w + r + 1) * b]
                window.append(self._batch({name: column[idx] for name, column in columns.items()}))
            self.wait_seconds += time.perf_counter() - start
            yield window


class ShardedReader(_Reader):
    """``sharded``: this rank's chunks of every global batch, read from the chunk store."""

    reads_ray_shards = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from raytrain_ddp.data.store import StoreReader, read_manifest

        store = self.spec.store
        self._store = StoreReader(store / TRAIN)
        self._val_store = StoreReader(store / VAL) if read_manifest(store / VAL) else None
        if self.micro_batch_size % self._store.manifest.chunk_rows:
            raise DataError(f"{store}: its chunks of {self._store.manifest.chunk_rows} rows do not divide "
                            f"train.micro_batch_size={self.micro_batch_size}")
        self.steps_per_epoch = steps_per_epoch(self._store.manifest.rows, self.global_batch_size)

    def step_chunks(self, epoch: int, step: int) -> list[Any]:
        """sharded: this rank's chunk indices for each micro-step of `step` (`store.py`)."""
        from raytrain_ddp.data.store import epoch_chunks, rank_chunks

        if getattr(self, "_order", (None,))[0] != epoch:
            self._order = (epoch, epoch_chunks(self._store.manifest.full_chunks, self.cfg.train.seed, epoch,
                                               self.cfg.data.shuffle))
        return [rank_chunks(self._order[1], step, micro, chunk_rows=self._store.manifest.chunk_rows,
                            micro_batch_size=self.micro_batch_size, accumulation_steps=self.accumulation_steps,
                            world_size=self.world_size, world_rank=self.world_rank)
                for micro in range(self.accumulation_steps)]

    def train_windows(self, epoch: int, skip_steps: int) -> Iterator[list[Any]]:
        """Read this rank's chunks of each step: in this thread while a step's read is quick,
        then on a reader thread up to `ahead` steps ahead; resident data is those windows
        (pinned on CUDA), never the data set.

        A local store in the page cache reads a step in well under a millisecond, less than
        handing it over from another thread costs (the in-memory gather's speed inline, 0.73x
        of it through the thread under the bench's load: benchmarks/README.md#ingest-sharded).
        The first step whose read takes longer than `inline_read_s` (object storage, a cold or
        network disk, big batches; not counting a pass's first step, which also draws the
        epoch's order and opens files) moves the rest of the epoch to the reader thread,
        where reading overlaps training. `data.prefetch_batches: 0` always reads here."""
        ahead = max(1, -(-self.cfg.data.prefetch_batches // self.accumulation_steps))
        pinned = getattr(self.device, "type", "cpu") == "cuda"

        def read(step: int) -> list[Any]:
            window = []
            for chunks in self.step_chunks(epoch, step):
                batch = self.format.assemble(self._columns(self._store, chunks))
                window.append(_pin(batch) if pinned else batch)
            return window

        steps = iter(range(skip_steps, self.steps_per_epoch))
        reader: Optional[ReadAhead] = None
        slow = False  # a step after the first read slowly: the rest of the epoch goes to the thread
        try:
            while True:
                if slow and reader is None:
                    reader = ReadAhead(read, steps, ahead)
                start = time.perf_counter()
                if reader is None:
                    step = next(steps, None)
                    if step is None:
                        return
                    window = read(step)
                    slow = (self.cfg.data.prefetch_batches > 0 and step != skip_steps  # the first also opens files
                            and time.perf_counter() - start >= self.inline_read_s)
                else:
                    window = reader.next()
                    if window is None:
                        return
                    self.read_ahead_steps += 1
                window = [to_device(batch, self.device) for batch in window]
                self.wait_seconds += time.perf_counter() - start
                yield window
        finally:
            if reader is not None:
                reader.close()

    def _columns(self, store: Any, chunks: list[int]) -> dict[str, Any]:
        """Chunks of a store as tensors, one per column: read straight into the arrays where the
        store allows it (`StoreReader.read_arrays`), else through an Arrow table."""
        import torch

        arrays = store.read_arrays(chunks)
        if arrays is None:
            arrays = arrow_numpy(store.table(chunks))
        return {name: torch.from_numpy(array if array.flags.writeable else array.copy())  # views of Arrow's buffers
                for name, array in column_arrays(arrays, self.cfg, self.spec).items()}

    def val_batches(self, share: Optional[tuple[int, int]] = None) -> Iterator[Any]:
        """Every `world_size`-th chunk of the validation store from this rank's (each row once)."""
        if self._val_store is None:
            return
        rank, size = share or (self.world_rank, self.world_size)
        mine = list(range(rank, self._val_store.manifest.chunks, size))
        per = max(1, max(self.micro_batch_size, 256) // self._val_store.manifest.chunk_rows)
        for start in range(0, len(mine), per):
            yield self._batch(self._columns(self._val_store, mine[start:start + per]))


class StreamingReader(_Reader):
    """``streaming``: this rank's `streaming_split` stream, windows while every rank has one."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # rows_per_rank // (micro batch x accumulation) as before: the same number, as the
        # global batch is world_size x micro batch x accumulation (config.accumulation_steps)
        self.steps_per_epoch = steps_per_epoch(self.spec.train_rows, self.global_batch_size)

    def train_windows(self, epoch: int, skip_steps: int) -> Iterator[list[Any]]:
        """`iter_torch_batches` over this rank's stream, a window while every rank has a full one."""
        buffer = self.cfg.data.shuffle_buffer
        if buffer is None and self.cfg.data.shuffle:
            buffer = max(1024, 8 * self.micro_batch_size)
        batches = iter(self._train_shard.iter_torch_batches(
            batch_size=self.micro_batch_size,
            prefetch_batches=self.cfg.data.prefetch_batches,
            local_shuffle_buffer_size=buffer if self.cfg.data.shuffle else None,
            local_shuffle_seed=(self.cfg.train.seed * 1_000_003 + epoch) * 1009 + self.world_rank
            if self.cfg.data.shuffle else None,
            drop_last=True,
            collate_fn=self._collate,
            device=str(self.device) if getattr(self.device, "type", "cpu") != "cpu" else "cpu",
        ))
        step = 0
        while True:
            start = time.perf_counter()
            window = []
            for _ in range(self.accumulation_steps):
                batch = next(batches, None)
                if batch is None:
                    break
                window.append(batch)
            self.wait_seconds += time.perf_counter() - start
            if not self._all_ranks_have(len(window) == self.accumulation_steps):
                return
            if step >= skip_steps:
                yield window
            step += 1

    def _all_ranks_have(self, full: bool) -> bool:
        """Agree across ranks that everyone still has a full window."""
        return all_true(full, self.device)


READERS: dict[str, type[_Reader]] = {"exact": ExactReader, "sharded": ShardedReader, "streaming": StreamingReader}


class WorkerData:
    """One rank's view of the data: optimizer-step windows of micro-batches on `device`.

    A facade over the reader of its `data.sharding` (`READERS`): the loop, the meter and
    the tests see one interface whatever the mode."""

    def __init__(self, cfg: Config, spec: DataSpec, world_rank: int, world_size: int, device: Any,
                 shards: Optional[dict[str, Any]] = None):
        """`shards` defaults to `ray.train.get_dataset_shard(...)`; tests pass Ray Data iterators."""
        self.reader = READERS[cfg.data.sharding](cfg, spec, world_rank, world_size, device, shards)
        self.cfg, self.spec = cfg, spec
        self.world_rank, self.world_size, self.device = world_rank, world_size, device
        self.micro_batch_size = self.reader.micro_batch_size
        self.accumulation_steps = self.reader.accumulation_steps
        self.global_batch_size = self.reader.global_batch_size
        self.steps_per_epoch = self.reader.steps_per_epoch
        self.format = self.reader.format

    @property
    def wait_seconds(self) -> float:
        """Seconds spent waiting for data, cumulative (the meter's data wait)."""
        return self.reader.wait_seconds

    @property
    def read_ahead_steps(self) -> int:
        """sharded: windows that came from the reader thread."""
        return self.reader.read_ahead_steps

    @property
    def inline_read_s(self) -> float:
        """sharded: a step read faster than this stays in the training thread."""
        return self.reader.inline_read_s

    @inline_read_s.setter
    def inline_read_s(self, seconds: float) -> None:
        self.reader.inline_read_s = seconds

    def train_windows(self, epoch: int, skip_steps: int = 0) -> Iterator[list[Any]]:
        """Yield one list of `accumulation_steps` micro-batches per optimizer step."""
        return self.reader.train_windows(epoch, skip_steps)

    def val_batches(self, share: Optional[tuple[int, int]] = None) -> Iterator[Any]:
        """This rank's disjoint share of the validation rows (each row once overall); `share`: (rank, size)."""
        return self.reader.val_batches(share)

    def epoch_order(self, rows: int, epoch: int) -> Any:
        """The same permutation on every rank and at every world size: seeded by (seed, epoch)."""
        return self.reader.epoch_order(rows, epoch)


def _ray_shards(spec: DataSpec) -> dict[str, Any]:
    """This worker's dataset shards from Ray Train (the train split, and val if it has rows)."""
    import ray.train

    shards = {TRAIN: ray.train.get_dataset_shard(TRAIN)}
    if spec.val_rows:
        shards[VAL] = ray.train.get_dataset_shard(VAL)
    return shards


class ReadAhead:
    """`read(step)` for each step on one thread, double-buffered in groups of `ahead` results.

    Results cross between the threads a group at a time, not one by one: the reader reads a
    group while the consumer works through the previous one, hands it over whole, and
    starts the next once the consumer has taken it. On this 2-core box each hand-off (a
    lock, a wake-up, the GIL changing threads) cost about as much as reading a local chunk:
    handed over step by step the sharded path delivered 0.72-0.77x the in-memory gather, in
    groups about 1.0x at the bench's `ahead` of 4 (benchmarks/README.md#ingest-sharded).
    The first group is one result, so an epoch's first batch does not wait for a whole
    group. Resident: at most 2 x `ahead` results (the consumer's group and the next).
    An exception in `read` is raised by `next` after the results read before it; `close`
    stops the reader and joins it.
    """

    def __init__(self, read: Any, steps: Any, ahead: int) -> None:
        import collections
        import threading

        self._read, self._steps, self._ahead = read, iter(steps), max(1, ahead)
        self._ready: Any = collections.deque()  # the group handed over (under the lock)
        self._taken: Any = collections.deque()  # the consumer's group, no lock
        self._cv = threading.Condition()
        self._done = self._stop = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="raytrain-ddp-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        group: list[Any] = []
        size = 1
        try:
            for step in self._steps:
                if not group:  # a new group: only once the consumer took the previous one
                    with self._cv:
                        while self._ready and not self._stop:
                            self._cv.wait()
                if self._stop:
                    return
                group.append(self._read(step))
                if len(group) >= size:
                    with self._cv:
                        self._ready.extend(group)
                        self._cv.notify()
                    group, size = [], self._ahead
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._error = exc
        finally:
            with self._cv:
                self._ready.extend(group)
                self._done = True
                self._cv.notify_all()

    def next(self) -> Any:
        """The next result, or None after the last one."""
        if self._taken:
            return self._taken.popleft()
        with self._cv:
            while not self._ready and not self._done:
                self._cv.wait()
            if self._ready:
                self._taken, self._ready = self._ready, self._taken  # the whole group, one hand-off
                self._cv.notify()
                return self._taken.popleft()
            if self._error is not None:
                raise self._error
            return None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()


def _pin(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {key: _pin(value) for key, value in batch.items()}
    return type(batch)(_pin(value) for value in batch)
