"""The Ray Datasets the workers read, built on the driver from `cfg.data`.

Owns: turning `cfg.data` into Ray Datasets (parquet, bundled digits, synthetic, or the
user's own, through `data.preprocess` as `map_batches`' function: `Preprocess`), the
`DataSpec` the model is built from with its row counts, the chunk stores of
`data.sharding: sharded` (`write_stores`), and the `DataConfig` that tells Ray Train which
datasets to split. Must not touch: models, optimisation, process groups, the cluster (the
driver hands in its memory check, `driver/memory.check_exact_fits`); each worker's
batches (`worker_data.py`); the checks that need no Ray (`sources.py`).

Three sharding modes (`data.sharding`):

* ``exact`` (default): the datasets are *not* split; every worker reads the full set once
  into memory (the built-in data from Ray's object store, `_in_object_store`; a user's
  pipeline through Ray Data), draws the same seeded permutation each epoch and takes
  its own disjoint slice of every global batch. The set of samples in optimizer step *s*
  is therefore the same for 1, 2 or 8 workers, which is what makes elastic resizing keep
  the optimisation identical, and mid-epoch resume exact (skip *s* global batches).
  Costs each worker a copy of the training set: for data that fits in worker memory.
* ``streaming``: Ray Data's `streaming_split(equal=True)` hands each worker a disjoint
  stream read with `iter_torch_batches` (prefetch, seeded per-epoch local shuffle). Scales
  past memory; the order depends on the worker count and resume is exact only at epoch
  boundaries. Equal rows are not equal batches once a local shuffle buffer is in play,
  so before every window the ranks agree (all-reduce MIN) that all of them still have a
  full window: every rank runs the same number of micro-steps, and none can deadlock.

* ``sharded``: the guarantees of ``exact`` without a copy per worker. The driver writes
  each split once (Ray Data reads, preprocesses and, with `data.shuffle`, shuffles it;
  `write_stores`) as a chunk store under ``<run dir>/data/`` (`data/store.py`
  explains the layout and the order); every epoch is a seeded permutation of chunks and
  each worker reads only the chunks of its slice of every global batch. Memory per
  worker: its prefetch window, not the data set.

Only full global batches are trained on: the remainder of an epoch (fewer than
`global_batch_size` rows) is dropped, so every optimizer step averages over exactly the
configured global batch at any worker count.

A user pipeline (`data.preprocess`, dict batches via `data.inputs`, or Ray Datasets given
from Python; see `raytrain_ddp.user`): the raw rows are split first (a file-level row
never lands in both splits), then `data.preprocess` runs through Ray Data's
`map_batches` on its CPU tasks, before training; with exact sharding the result is
materialized once on the driver, which also counts its rows (a preprocess may change
them). Before Ray starts, a few raw rows go through the whole pipeline on the driver
(`driver/preflight.precheck` -> `user.check_pipeline`), so a broken one costs nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pyarrow as pa

from raytrain_ddp.config import Config
from raytrain_ddp.data.columns import TRAIN, VAL, uses_own_data
from raytrain_ddp.data.sources import (Prechecked, arrays_table, bundled_tables, check_row_counts, dataset_table,
                                       load_digits_arrays,
                                       model_shape, parquet_bytes, split_table, synthetic_arrays)
from raytrain_ddp.job import DataSpec

# The driver's memory check of exact sharding (`driver/memory.check_exact_fits`), given the bytes.
FitsCheck = Callable[[Config, int], None]


@dataclass
class PreparedData:
    """What the workers are handed: the datasets, the data's spec, Ray Train's `DataConfig`,
    and for the in-memory route the shards in Ray's object store (name -> ObjectRef of a
    `LocalShard`; the loop's config carries them: `launcher.build_trainer`)."""

    datasets: dict[str, Any]  # name -> ray.data.Dataset
    spec: DataSpec
    data_config: Any  # ray.train.DataConfig
    shards: dict[str, Any] = dataclasses.field(default_factory=dict)


def prepare_datasets(cfg: Config, checked: Prechecked, code: Any = None, given: Optional[dict[str, Any]] = None,
                     *, fits: Optional[FitsCheck] = None) -> PreparedData:
    """Build and check the datasets on the driver; every problem raises `DataError` early.

    `checked`: what the driver's precheck found (`driver/preflight.precheck`); `fits`: the
    driver's memory check of exact sharding, called with the training data's bytes (None:
    not checked)."""
    import ray.data
    import ray.train

    fits = fits or (lambda cfg, data_bytes: None)
    if uses_own_data(cfg):
        return _prepare_user_data(cfg, checked, code, given, fits)
    if cfg.data.sharding == "exact":
        return _in_object_store(cfg, checked, fits)
    bundled = bundled_tables(cfg)
    table = bundled.table if bundled else None
    source = bundled.source if bundled else str(cfg.data.path)
    if bundled is not None:
        total_rows, spec_shape, num_classes, task = table.num_rows, bundled.shape, bundled.classes, bundled.task
        train_table, val_table = bundled.train, bundled.val
        datasets = {TRAIN: ray.data.from_arrow(train_table)}
        if val_table is not None:
            datasets[VAL] = ray.data.from_arrow(val_table)
    else:
        info = checked.parquet
        assert info is not None
        total_rows, spec_shape, num_classes, task = info.rows, info.feature_shape, info.num_classes, info.task
        spec_shape = model_shape(cfg, spec_shape)
        full = ray.data.read_parquet(info.files).select_columns([cfg.data.features, cfg.data.label])
        if info.val is not None:
            total_rows += info.val.rows
            num_classes = max(num_classes, info.val.num_classes)
            val_ds = ray.data.read_parquet(info.val.files).select_columns([cfg.data.features, cfg.data.label])
            datasets = {TRAIN: full, VAL: val_ds}
        elif cfg.data.val_fraction > 0:
            datasets = held_out(cfg, full, info.files, [cfg.data.features, cfg.data.label])
        else:
            datasets = {TRAIN: full}

    val_rows = datasets[VAL].count() if VAL in datasets else 0  # metadata for in-memory tables
    train_rows = total_rows - val_rows
    check_row_counts(cfg, train_rows, val_rows, source)
    fits(cfg, table.nbytes if table is not None else parquet_bytes(info.files))  # driver/memory.py
    if cfg.data.sharding == "sharded":
        inputs = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in info.files + (info.val.files if info.val else [])
                  ] if table is None else [source]
        store, _ = write_stores(cfg, datasets, inputs)
        spec = DataSpec(task, tuple(spec_shape), int(num_classes), int(train_rows), int(val_rows), source, store=store)
        return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]))

    if cfg.data.sharding == "streaming" and cfg.data.shuffle:
        datasets[TRAIN] = datasets[TRAIN].randomize_block_order(seed=cfg.train.seed)
    split = [TRAIN] if cfg.data.sharding == "streaming" else []
    spec = DataSpec(task, tuple(spec_shape), int(num_classes), int(train_rows), int(val_rows), source)
    return PreparedData(datasets, spec, ray.train.DataConfig(datasets_to_split=split))


def _in_object_store(cfg: Config, checked: Prechecked, fits: FitsCheck) -> PreparedData:
    """`exact` sharding of the built-in data: the rows every worker reads whole, read once here
    (`in_memory.in_memory_shards`: local mode's rows and split) and put in Ray's object store,
    which each worker maps without a copy per read: no Ray Data pipeline, dataset manager or
    stats actor to start, and a replacement worker reads what its predecessor read."""
    import ray
    import ray.train

    from raytrain_ddp.data.in_memory import in_memory_shards

    bundled = bundled_tables(cfg)
    fits(cfg, bundled.table.nbytes if bundled is not None else parquet_bytes(checked.parquet.files))  # before reading
    shards, spec = in_memory_shards(cfg, checked, None)
    return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]),
                        shards={name: ray.put(shard) for name, shard in shards.items()})


def held_out(cfg: Config, ds: Any, files: Optional[list[str]], columns: Optional[list[str]]) -> dict[str, Any]:
    """{train, val}: data.val_fraction of the rows held out by the one rule of every route
    (`sources.split_table`: the seeded permutation of the row indices, the same rows as
    local mode and the bundled data). With exact sharding (the rows fit in memory) the table
    is read here -- parquet `files` with pyarrow, as local mode reads them; a Ray Dataset
    through Ray -- and split in milliseconds. Streaming and sharded data, which need not fit,
    are split by Ray Data's seeded `train_test_split` (other rows: docs/usage.md#data)."""
    import pyarrow.parquet as pq
    import ray.data

    if cfg.data.sharding != "exact":
        train, val = ds.train_test_split(test_size=cfg.data.val_fraction, shuffle=True, seed=cfg.train.seed)
        return {TRAIN: train, VAL: val}
    table = pq.read_table(files, columns=columns) if files is not None else dataset_table(ds)
    train, val = split_table(table, cfg)
    return {TRAIN: ray.data.from_arrow(train), **({VAL: ray.data.from_arrow(val)} if val is not None else {})}


def _prepare_user_data(cfg: Config, checked: Prechecked, code: Any, given: Optional[dict[str, Any]],
                       fits: FitsCheck) -> PreparedData:
    """A user pipeline's datasets: split the raw rows, `map_batches(preprocess)`, count."""
    import ray.data
    import ray.train

    info = checked.parquet
    split = cfg.data.val_fraction > 0
    if cfg.data.sharding == "exact" and (code is None or code.preprocess is None):
        return _user_rows_in_memory(cfg, checked, given, fits)
    if given is not None:  # torch Datasets' tables through Ray Data as well (streaming, sharded, a preprocess)
        train, val = (ray.data.from_arrow(ds) if isinstance(ds, pa.Table) else ds
                      for ds in (given[TRAIN], given.get(VAL)))
    elif info is not None:
        train = ray.data.read_parquet(info.files)
        val = ray.data.read_parquet(info.val.files) if info.val else None
    else:  # bundled arrays: the same seeded split as the built-in data path
        features, labels = load_digits_arrays() if cfg.data.source == "digits" else synthetic_arrays(cfg)
        train_table, val_table = split_table(arrays_table(features, labels, cfg.data), cfg)
        train = ray.data.from_arrow(train_table)
        val = ray.data.from_arrow(val_table) if val_table is not None else None
        split = False
    if val is None and split:
        held = held_out(cfg, train, info.files if given is None and info is not None else None, None)
        train, val = held[TRAIN], held.get(VAL)
    datasets = {TRAIN: train, **({VAL: val} if val is not None else {})}
    for name, ds in datasets.items():
        if code is not None and code.preprocess is not None:
            # On Ray Data's CPU tasks, not in the training loop (its module is in the job's runtime_env).
            ds = ds.map_batches(Preprocess(code.preprocess), batch_format="numpy")
        if not cfg.data.inputs:
            ds = ds.select_columns([cfg.data.features, cfg.data.label])
        datasets[name] = ds
    if cfg.data.sharding == "sharded":  # rows counted as the stores are written
        inputs = None if given is not None else (
            [(f, os.path.getsize(f), os.path.getmtime(f)) for f in info.files + (info.val.files if info.val else [])]
            if info is not None else [cfg.data.source])
        store, rows = write_stores(cfg, datasets, inputs)
        check_row_counts(cfg, rows[TRAIN], rows.get(VAL, 0), checked.pipeline.spec.source)
        spec = dataclasses.replace(checked.pipeline.spec, train_rows=rows[TRAIN], val_rows=rows.get(VAL, 0), store=store)
        return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]))
    with _ray_data_quiet():  # Ray Data logs every execution at INFO on the driver
        if cfg.data.sharding == "exact":
            datasets = {name: ds.materialize() for name, ds in datasets.items()}
            fits(cfg, datasets[TRAIN].size_bytes())  # driver/memory.py
        train_rows = datasets[TRAIN].count()
        val_rows = datasets[VAL].count() if VAL in datasets else 0
    source = checked.pipeline.spec.source
    check_row_counts(cfg, train_rows, val_rows, source)
    if cfg.data.sharding == "streaming" and cfg.data.shuffle:
        datasets[TRAIN] = datasets[TRAIN].randomize_block_order(seed=cfg.train.seed)
    spec = dataclasses.replace(checked.pipeline.spec, train_rows=int(train_rows), val_rows=int(val_rows))
    if cfg.data.sharding == "exact":  # materialized above: its blocks go to the workers as one object each
        return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]),
                            shards={name: ray.put(_whole(ds)) for name, ds in datasets.items()})
    split = [TRAIN] if cfg.data.sharding == "streaming" else []
    return PreparedData(datasets, spec, ray.train.DataConfig(datasets_to_split=split))


def _whole(ds: Any) -> Any:
    """A materialized dataset's rows, in block order, as the numpy columns Ray Data's
    `iter_batches(batch_format="numpy")` hands over (Ray's converter): a `LocalShard`."""
    from raytrain_ddp.data.in_memory import LocalShard, _numpy

    return LocalShard(_numpy(dataset_table(ds)))




def _user_rows_in_memory(cfg: Config, checked: Prechecked, given: Optional[dict[str, Any]],
                         fits: FitsCheck) -> PreparedData:
    """A user pipeline without a preprocess, under `exact`: its rows (a given dataset's blocks,
    parquet, the bundled arrays) read once here as Arrow tables, held out by `split_table`,
    and put in the object store as one `LocalShard` per split, with no Ray Data execution
    beyond reading a given dataset's blocks once (the workers read the same rows as before)."""
    import pyarrow.parquet as pq
    import ray
    import ray.train

    from raytrain_ddp.data.in_memory import LocalShard, _numpy

    info = checked.parquet
    if given is not None:
        tables = {name: dataset_table(given[name]) for name in (TRAIN, VAL) if name in given}
    elif info is not None:
        tables = {TRAIN: pq.read_table(info.files), **({VAL: pq.read_table(info.val.files)} if info.val else {})}
    else:  # bundled arrays: the built-in data's split
        features, labels = load_digits_arrays() if cfg.data.source == "digits" else synthetic_arrays(cfg)
        tables = dict(zip((TRAIN, VAL), split_table(arrays_table(features, labels, cfg.data), cfg)))
    if VAL not in tables and cfg.data.val_fraction > 0:
        tables[TRAIN], tables[VAL] = split_table(tables[TRAIN], cfg)
    if not cfg.data.inputs:
        tables = {name: t.select([cfg.data.features, cfg.data.label]) for name, t in tables.items() if t is not None}
    tables = {name: t for name, t in tables.items() if t is not None and (name == TRAIN or t.num_rows)}
    fits(cfg, tables[TRAIN].nbytes)  # driver/memory.py
    train_rows, val_rows = tables[TRAIN].num_rows, tables[VAL].num_rows if VAL in tables else 0
    check_row_counts(cfg, train_rows, val_rows, checked.pipeline.spec.source)
    spec = dataclasses.replace(checked.pipeline.spec, train_rows=int(train_rows), val_rows=int(val_rows))
    return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]),
                        shards={name: ray.put(LocalShard(_numpy(t))) for name, t in tables.items()})


def write_stores(cfg: Config, datasets: dict[str, Any], inputs: Optional[list[Any]]) -> tuple[Any, dict[str, int]]:
    """data.sharding='sharded': write each split once as a chunk store (`data/store.py`) under
    `<run dir>/data/`: Ray Data reads (and preprocesses) in order, the driver writes one
    block at a time. A complete store built from the same inputs (`inputs`: file names,
    sizes and times; None when unknown, e.g. Ray Datasets given from Python) and the same
    data config is reused, so a resume reads exactly the rows it trained on.
    Returns (the stores' directory, rows per split)."""
    from raytrain_ddp.rundir import run_dir_of
    from raytrain_ddp.data.store import STORE_DIR, fingerprint, read_manifest, write_store

    root = run_dir_of(cfg) / STORE_DIR
    chunk = cfg.chunk_rows()
    what = cfg.data.model_dump(mode="json", exclude={"prefetch_batches", "chunk_rows"})  # may change on resume
    rows: dict[str, int] = {}
    for name, ds in datasets.items():
        where = root / name
        fp = fingerprint(inputs, name, what, cfg.train.seed)
        old = read_manifest(where)
        # data.chunk_rows unset: a resume with another micro batch keeps the store's chunks
        # (the order of every epoch depends on them) when they still divide the micro batch.
        same_chunks = old is not None and (old.chunk_rows == chunk or (
            cfg.data.chunk_rows is None and cfg.train.micro_batch_size % old.chunk_rows == 0))
        if inputs is not None and old is not None and old.fingerprint == fp and same_chunks:
            rows[name] = old.rows
            continue
        if name == TRAIN and cfg.data.shuffle:  # once: rows of a chunk are random neighbours
            ds = ds.random_shuffle(seed=cfg.train.seed)
        ds.context.execution_options.preserve_order = True  # the same store from the same inputs
        with _ray_data_quiet():
            tables = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)
            rows[name] = write_store(where, tables, chunk, fp).rows
    return root, rows


@contextlib.contextmanager
def _ray_data_quiet() -> Iterator[None]:
    logger = logging.getLogger("ray.data")
    level = logger.level
    if os.environ.get("RAYTRAIN_DDP_VERBOSE", "").lower() not in ("1", "true", "yes"):
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class Preprocess:
    """`data.preprocess` as Ray Data's `map_batches` function.

    Holds the user's function pickled, and unpickles it on first call, on the Ray Data
    task (whose runtime_env carries the module): Ray's controller, which also receives
    the datasets, never has to import the user's code.
    """

    def __init__(self, fn: Callable[[dict], dict]) -> None:
        import ray.cloudpickle

        self._blob = ray.cloudpickle.dumps(fn)
        self._fn: Optional[Callable[[dict], dict]] = None

    def __call__(self, batch: dict) -> dict:
        if self._fn is None:
            self._fn = pickle.loads(self._blob)
        return self._fn(batch)

    def __getstate__(self) -> dict[str, Any]:
        return {"_blob": self._blob, "_fn": None}
