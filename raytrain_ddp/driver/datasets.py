"""Driver-side data: sources, checks before workers start, and the Ray Datasets handed to them.

Owns: turning `cfg.data` into Ray Datasets on the driver (parquet, bundled digits,
synthetic), the `DataSpec` the model is built from, and checking the data before any
worker is paid for (`precheck`). Must not touch: models, optimisation, process groups;
each worker's batches (`worker/shard.py`).

Three sharding modes (`data.sharding`):

* ``exact`` (default): the datasets are *not* split; every worker reads the full set once
  through Ray Data into memory, draws the same seeded permutation each epoch and takes
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
  `write_stores`) as a chunk store under ``<run dir>/data/`` (`raytrain_ddp/store.py`
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
(`precheck` -> `user.check_pipeline`), so a broken one costs nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import numpy as np
import pyarrow as pa

from raytrain_ddp.config import Config
from raytrain_ddp.driver.memory import check_exact_fits, parquet_bytes
from raytrain_ddp.errors import DataError, UserError
from raytrain_ddp.job import DataSpec
from raytrain_ddp.worker.shard import TRAIN, VAL, stack_column



@dataclass
class PreparedData:
    datasets: dict[str, Any]  # name -> ray.data.Dataset
    spec: DataSpec
    data_config: Any  # ray.train.DataConfig


# --------------------------------------------------------------------------- driver side


@dataclass(frozen=True)
class Prechecked:
    """What the driver's checks found, so `prepare_datasets` scans nothing twice."""

    parquet: Optional["ParquetInfo"] = None  # data.path's files (source: parquet)
    pipeline: Any = None  # `user.Checked` (spec without row counts, parameters) when user code runs


def precheck(cfg: Config, code: Any = None, given: Optional[dict[str, Any]] = None) -> Prechecked:
    """The data checks that need no Ray, run before Ray starts: bad parquet costs nothing.

    With user code (`code.custom`) or a user pipeline, a few raw rows also go through
    preprocess, the model factory, the forward and the loss (`user.check_pipeline`).
    `given`: the Ray Datasets of `raytrain_ddp.train(datasets=...)`, sampled through Ray.
    """
    from raytrain_ddp.user import check_pipeline, uses_own_data

    own = uses_own_data(cfg)
    if (given is None) != (cfg.data.source != "datasets"):
        raise UserError("data.source='datasets' means Ray Datasets given from Python: "
                        "raytrain_ddp.train(config, datasets={'train': ..., 'val': ...})")
    info = None
    if cfg.data.source == "parquet":
        if own:
            info = scan_parquet(cfg.data.path, cfg.data.label)
        else:
            info = check_parquet(cfg.data.path, cfg.data.features, cfg.data.label, lm=cfg.model.name == "gpt")
        if cfg.data.val_path:
            val = (scan_parquet(cfg.data.val_path, cfg.data.label, key="data.val_path") if own else
                   check_parquet(cfg.data.val_path, cfg.data.features, cfg.data.label,
                                 lm=cfg.model.name == "gpt", key="data.val_path"))
            info = dataclasses.replace(info, val=val)
        if not own:  # a preprocess may change the row counts: checked once it has run
            val_rows = info.val.rows if info.val else int(round(info.rows * cfg.data.val_fraction))
            _check_row_counts(cfg, info.rows - (0 if info.val else val_rows), val_rows, str(cfg.data.path))
    if code is None or not (code.custom or own):
        return Prechecked(info)
    sample, spec = _sample_and_spec(cfg, info, given)
    return Prechecked(info, check_pipeline(cfg, code, sample, spec))


def _sample_and_spec(cfg: Config, info: Optional["ParquetInfo"], given: Optional[dict[str, Any]]
                     ) -> tuple[dict[str, np.ndarray], DataSpec]:
    """A few raw rows (as Ray Data hands them to map_batches) and what is known of the spec."""
    from ray.data.block import BlockAccessor  # a converter only: Ray is not contacted

    from raytrain_ddp.user import SAMPLE_ROWS, uses_own_data

    own = uses_own_data(cfg)
    if given is not None:
        _check_given(given)
        sample = given[TRAIN].take_batch(SAMPLE_ROWS, batch_format="numpy")
        label = sample.get(cfg.data.label)
        classes = (int(given[TRAIN].max(cfg.data.label)) + 1
                   if label is not None and label.ndim == 1 and label.dtype.kind in "iu" else 0)
        return sample, DataSpec("other", (), classes, 0, 0, "Ray Datasets given from Python")
    if info is not None:
        first = next(f for f in info.files if _rows_in(f))
        table = pa.Table.from_batches([next(_parquet(first).iter_batches(batch_size=SAMPLE_ROWS))])
        shape = () if own else _model_shape(cfg, info.feature_shape)
        spec = DataSpec(info.task, shape, info.num_classes, 0, 0, str(cfg.data.path))
    else:
        features, labels = load_digits_arrays() if cfg.data.source == "digits" else synthetic_arrays(cfg)
        table = _table(features, labels, cfg.data).slice(0, SAMPLE_ROWS)
        shape, classes, task = _spec_from_arrays(cfg, features, labels)
        spec = DataSpec(task, () if own else tuple(shape), classes, 0, 0, cfg.data.source)
    return BlockAccessor.for_block(table).to_batch_format("numpy"), spec


def _check_given(given: dict[str, Any]) -> None:
    if not isinstance(given, dict) or TRAIN not in given or set(given) - {TRAIN, VAL}:
        found = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise UserError(f"datasets: expected {{'train': Dataset}} and optionally 'val', got {found}")
    for name, ds in given.items():
        if not hasattr(ds, "map_batches"):
            raise UserError(f"datasets[{name!r}] is a {type(ds).__name__}, not a ray.data.Dataset")


def prepare_datasets(cfg: Config, checked: Optional[Prechecked] = None, code: Any = None,
                     given: Optional[dict[str, Any]] = None) -> PreparedData:
    """Build and check the datasets on the driver; every problem raises `DataError` early."""
    import ray.data
    import ray.train

    from raytrain_ddp.user import uses_own_data

    checked = checked or precheck(cfg, code, given)
    if uses_own_data(cfg):
        return _prepare_user_data(cfg, checked, code, given)
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
        spec_shape = _model_shape(cfg, spec_shape)
        full = ray.data.read_parquet(info.files).select_columns([cfg.data.features, cfg.data.label])
        if info.val is not None:
            total_rows += info.val.rows
            num_classes = max(num_classes, info.val.num_classes)
            val_ds = ray.data.read_parquet(info.val.files).select_columns([cfg.data.features, cfg.data.label])
            datasets = {TRAIN: full, VAL: val_ds}
        elif cfg.data.val_fraction > 0:
            train_ds, val_ds = full.train_test_split(
                test_size=cfg.data.val_fraction, shuffle=True, seed=cfg.train.seed
            )
            datasets = {TRAIN: train_ds, VAL: val_ds}
        else:
            datasets = {TRAIN: full}

    val_rows = datasets[VAL].count() if VAL in datasets else 0  # metadata for in-memory tables
    train_rows = total_rows - val_rows
    _check_row_counts(cfg, train_rows, val_rows, source)
    check_exact_fits(cfg, table.nbytes if table is not None else parquet_bytes(info.files))  # driver/memory.py
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


@dataclass(frozen=True)
class Bundled:
    """A bundled source (digits, synthetic) as a table, its seeded split and the spec's numbers."""

    table: pa.Table
    train: pa.Table
    val: Optional[pa.Table]
    shape: tuple[int, ...]
    classes: int
    task: str
    source: str


def bundled_tables(cfg: Config) -> Optional[Bundled]:
    """`data.source` digits or synthetic, ready for the built-in data path (Ray Data's tables,
    or local mode's); None for parquet."""
    if cfg.data.source == "digits":
        (features, labels), source = load_digits_arrays(), "digits (scikit-learn, 1,797 8x8 images)"
    elif cfg.data.source == "synthetic":
        (features, labels), source = synthetic_arrays(cfg), f"synthetic ({cfg.data.synthetic.rows} rows)"
    else:
        return None
    table = _table(features, labels, cfg.data)
    shape, classes, task = _spec_from_arrays(cfg, features, labels)
    return Bundled(table, *_split_table(table, cfg), tuple(shape), classes, task, source)


def _prepare_user_data(cfg: Config, checked: Prechecked, code: Any, given: Optional[dict[str, Any]]) -> PreparedData:
    """A user pipeline's datasets: split the raw rows, `map_batches(preprocess)`, count."""
    import ray.data
    import ray.train

    from raytrain_ddp.user import Preprocess

    info = checked.parquet
    split = cfg.data.val_fraction > 0
    if given is not None:
        train, val = given[TRAIN], given.get(VAL)
    elif info is not None:
        train = ray.data.read_parquet(info.files)
        val = ray.data.read_parquet(info.val.files) if info.val else None
    else:  # bundled arrays: the same seeded split as the built-in data path
        features, labels = load_digits_arrays() if cfg.data.source == "digits" else synthetic_arrays(cfg)
        train_table, val_table = _split_table(_table(features, labels, cfg.data), cfg)
        train = ray.data.from_arrow(train_table)
        val = ray.data.from_arrow(val_table) if val_table is not None else None
        split = False
    if val is None and split:
        train, val = train.train_test_split(test_size=cfg.data.val_fraction, shuffle=True, seed=cfg.train.seed)
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
        _check_row_counts(cfg, rows[TRAIN], rows.get(VAL, 0), checked.pipeline.spec.source)
        spec = dataclasses.replace(checked.pipeline.spec, train_rows=rows[TRAIN], val_rows=rows.get(VAL, 0), store=store)
        return PreparedData({}, spec, ray.train.DataConfig(datasets_to_split=[]))
    with _ray_data_quiet():  # Ray Data logs every execution at INFO on the driver
        if cfg.data.sharding == "exact":
            datasets = {name: ds.materialize() for name, ds in datasets.items()}
            check_exact_fits(cfg, datasets[TRAIN].size_bytes())  # driver/memory.py
        train_rows = datasets[TRAIN].count()
        val_rows = datasets[VAL].count() if VAL in datasets else 0
    source = checked.pipeline.spec.source
    _check_row_counts(cfg, train_rows, val_rows, source)
    if cfg.data.sharding == "streaming" and cfg.data.shuffle:
        datasets[TRAIN] = datasets[TRAIN].randomize_block_order(seed=cfg.train.seed)
    spec = dataclasses.replace(checked.pipeline.spec, train_rows=int(train_rows), val_rows=int(val_rows))
    split = [TRAIN] if cfg.data.sharding == "streaming" else []
    return PreparedData(datasets, spec, ray.train.DataConfig(datasets_to_split=split))


def write_stores(cfg: Config, datasets: dict[str, Any], inputs: Optional[list[Any]]) -> tuple[Any, dict[str, int]]:
    """data.sharding='sharded': write each split once as a chunk store (`store.py`) under
    `<run dir>/data/`: Ray Data reads (and preprocesses) in order, the driver writes one
    block at a time. A complete store built from the same inputs (`inputs`: file names,
    sizes and times; None when unknown, e.g. Ray Datasets given from Python) and the same
    data config is reused, so a resume reads exactly the rows it trained on.
    Returns (the stores' directory, rows per split)."""
    from raytrain_ddp.rundir import run_dir_of
    from raytrain_ddp.store import STORE_DIR, fingerprint, read_manifest, write_store

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


def _check_row_counts(cfg: Config, train_rows: int, val_rows: int, source: str) -> None:
    workers = cfg.scaling.max_workers
    if train_rows == 0:
        raise DataError(f"{source}: the training split is empty (data.val_fraction={cfg.data.val_fraction})")
    if train_rows < workers:
        raise DataError(
            f"{source}: {train_rows} training rows is fewer than scaling.num_workers={workers}; "
            "add rows or use fewer workers"
        )
    if train_rows < cfg.train.global_batch_size:
        raise DataError(
            f"{source}: {train_rows} training rows is fewer than one global batch "
            f"(train.global_batch_size={cfg.train.global_batch_size}); lower the batch size or add rows"
        )
    if val_rows and val_rows < workers:
        raise DataError(
            f"{source}: {val_rows} validation rows is fewer than {workers} workers; "
            "raise data.val_fraction or set it to 0"
        )


@dataclass(frozen=True)
class ParquetInfo:
    files: list[str]
    rows: int
    feature_shape: tuple[int, ...]
    num_classes: int
    task: Literal["classification", "lm", "other"]
    val: Optional["ParquetInfo"] = None  # data.val_path's files


def scan_parquet(path: Optional[str], label: str, key: str = "data.path") -> ParquetInfo:
    """A user pipeline's raw parquet (what `data.preprocess` will read): readable files, one
    schema, at least one row; and the classes of `data.label` if it is already an integer
    (or integer list) column. The columns the model sees are checked after preprocess."""
    import pyarrow.compute as pc

    files = _parquet_files(path, key)
    schema, rows, max_label = None, 0, -1
    for file in files:
        pf = _parquet(file)
        if schema is None:
            schema = pf.schema_arrow
        elif not pf.schema_arrow.equals(schema):
            raise DataError(f"{file}: its schema {pf.schema_arrow.names} differs from {files[0]}'s "
                            f"{schema.names}; all files must share one schema")
        rows += pf.metadata.num_rows
        kind = schema.field(label).type if label in schema.names else None
        if kind is not None and (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
            kind = kind.value_type
        if kind is not None and pa.types.is_integer(kind) and pf.metadata.num_rows:
            max_label = max(max_label, _check_label_column(file, label, pf.read(columns=[label]).column(label), True, pc))
    if rows == 0:
        raise DataError(f"{key}={path!r}: parquet input has zero rows")
    return ParquetInfo(files, rows, (), max_label + 1, "other")


def _parquet(file: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{file}: not a readable parquet file ({exc})") from None


def _rows_in(file: str) -> int:
    return _parquet(file).metadata.num_rows


def check_parquet(path: Optional[str], features: str, label: str, *, lm: bool = False,
                  key: str = "data.path") -> ParquetInfo:
    """Validate parquet input with pyarrow metadata and two column scans, before Ray reads it.

    Catches what would otherwise surface as a worker traceback minutes later: missing
    files or columns, schemas that differ between files, non-numeric or ragged features,
    nulls or negative values in the label, and empty inputs. Messages name file and column.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = _parquet_files(path, key)
    first_schema = None
    rows = 0
    width: Optional[int] = None
    max_label = -1
    for file in files:
        try:
            pf = pq.ParquetFile(file)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DataError(f"{file}: not a readable parquet file ({exc})") from None
        schema = pf.schema_arrow
        for column in (features, label):
            if column not in schema.names:
                key = "data.features" if column == features else "data.label"
                raise DataError(
                    f"{file}: column {column!r} ({key}) not found; columns are {schema.names}"
                )
        if first_schema is None:
            first_schema = schema
        else:
            for column in (features, label):
                a, b = first_schema.field(column).type, schema.field(column).type
                if a != b:
                    raise DataError(
                        f"{file}: column {column!r} has type {b}, but {files[0]} has {a}; "
                        "all files must share one schema"
                    )
        if pf.metadata.num_rows == 0:
            continue
        table = pf.read(columns=[features, label])
        rows += table.num_rows
        width = _check_feature_column(file, features, table.column(features), width, lm)
        max_label = max(max_label, _check_label_column(file, label, table.column(label), lm, pc))
    if rows == 0:
        raise DataError(f"{path}: parquet input has zero rows")
    task: Literal["classification", "lm"] = "lm" if lm else "classification"
    return ParquetInfo(files, rows, (int(width or 1),), max_label + 1, task)


def _parquet_files(path: Optional[str], key: str = "data.path") -> list[str]:
    if not path:
        raise DataError(f"{key} is required for data.source='parquet'")
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*.parquet"))
        if not files:
            raise DataError(f"{key}={path!r}: directory holds no *.parquet files")
        return files
    if p.is_file():
        return [str(p)]
    raise DataError(f"{key}={path!r}: no such file or directory")


def _check_feature_column(file: str, name: str, column: pa.ChunkedArray, width: Optional[int], lm: bool) -> int:
    kind = column.type
    value_type = kind.value_type if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind) else kind
    numeric = pa.types.is_integer(value_type) if lm else (pa.types.is_integer(value_type) or pa.types.is_floating(value_type))
    if not numeric:
        need = "integer token ids" if lm else "numbers (a list or fixed-size list of floats/ints)"
        raise DataError(f"{file}: column {name!r} (data.features) has type {kind}; it must hold {need}")
    if column.null_count:
        raise DataError(f"{file}: column {name!r} (data.features) has {column.null_count} null values")
    if value_type is kind:
        lengths = {1}
    elif pa.types.is_fixed_size_list(kind):
        lengths = {kind.list_size}
    else:
        import pyarrow.compute as pc

        lengths = set(pc.unique(pc.list_value_length(column)).to_pylist())
        if None in lengths:
            raise DataError(f"{file}: column {name!r} (data.features) has null lists")
    if len(lengths) != 1:
        raise DataError(
            f"{file}: column {name!r} (data.features) has rows of different lengths {sorted(lengths)[:5]}; "
            "every row must have the same number of features"
        )
    (found,) = lengths
    if width is not None and found != width:
        raise DataError(f"{file}: column {name!r} rows have {found} features, other files have {width}")
    return found


def _check_label_column(file: str, name: str, column: pa.ChunkedArray, lm: bool, pc: Any) -> int:
    kind = column.type
    values = column
    if lm and (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)):
        kind = kind.value_type
        values = pc.list_flatten(column)
    if not pa.types.is_integer(kind):
        raise DataError(f"{file}: column {name!r} (data.label) has type {column.type}; labels must be integers")
    if column.null_count:
        raise DataError(f"{file}: column {name!r} (data.label) has {column.null_count} null values")
    bounds = pc.min_max(values)
    if bounds["min"].as_py() is not None and bounds["min"].as_py() < 0:
        raise DataError(f"{file}: column {name!r} (data.label) has negative values ({bounds['min'].as_py()})")
    return int(bounds["max"].as_py() if bounds["max"].as_py() is not None else -1)


# --------------------------------------------------------------------------- bundled data


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits: real data that ships with the package, no download.

    Read straight from the package's `digits.csv.gz` (what `load_digits` reads, the same
    arrays): importing scikit-learn itself costs ~2 s on a small machine, paid by every run
    on the bundled data before Ray starts. Falls back to `load_digits` if the file moved.
    """
    raw = _digits_table()
    features = (raw[:, :-1] / 16.0).astype(np.float32)  # pixel intensities 0..16 -> 0..1
    return features, raw[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=1)
def _digits_table() -> np.ndarray:
    """The 1,797 x 65 table (64 pixels, then the label) as float64, read once per process."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",")
    else:  # pragma: no cover - a scikit-learn that keeps its data elsewhere
        from sklearn.datasets import load_digits

        bunch = load_digits()
        table = np.column_stack([bunch.data, bunch.target])
    table.setflags(write=False)
    return table


def export_digits(out: str) -> str:
    """Write digits to parquet (`x`: 64 floats, `y`: int) — the worked example for source: parquet."""
    import pyarrow.parquet as pq

    features, labels = load_digits_arrays()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": _fixed_list(features), "y": labels}), path)
    return str(path)


def synthetic_arrays(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Learnable generated data: a fixed random teacher (classification) or an affine
    recurrence over tokens (lm), seeded so every run and every worker sees the same rows."""
    syn = cfg.data.synthetic
    rng = np.random.default_rng(cfg.train.seed + 12345)
    if cfg.model.name == "gpt":
        vocab, length = syn.num_classes, syn.seq_len
        start = rng.integers(0, vocab, size=(syn.rows, 1))
        stride = rng.integers(1, 4, size=(syn.rows, 1))
        tokens = (start + stride * np.arange(length + 1)) % vocab
        return tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)
    features = rng.standard_normal((syn.rows, syn.feature_dim), dtype=np.float32)
    teacher = rng.standard_normal((syn.feature_dim, syn.num_classes), dtype=np.float32)
    return features, (features @ teacher).argmax(axis=1).astype(np.int64)


def _fixed_list(values: np.ndarray) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(np.prod(values.shape[1:])))


def _table(features: np.ndarray, labels: np.ndarray, data_cfg: Any) -> pa.Table:
    label_col = _fixed_list(labels) if labels.ndim > 1 else pa.array(labels)
    return pa.table({data_cfg.features: _fixed_list(features), data_cfg.label: label_col})


def _spec_from_arrays(cfg: Config, features: np.ndarray, labels: np.ndarray) -> tuple[tuple[int, ...], int, str]:
    if cfg.model.name == "gpt":
        if cfg.data.source != "synthetic":
            raise DataError(
                f"model.name='gpt' needs token data (data.source='synthetic' or parquet of token ids), "
                f"not data.source={cfg.data.source!r}"
            )
        return (features.shape[1],), cfg.data.synthetic.num_classes, "lm"
    return _model_shape(cfg, (int(np.prod(features.shape[1:])),)), int(labels.max()) + 1, "classification"


def _model_shape(cfg: Config, flat: tuple[int, ...]) -> tuple[int, ...]:
    """The cnn sees square single-channel images; everything else sees flat vectors."""
    if cfg.model.name != "cnn":
        return flat
    (width,) = flat
    side = int(round(width ** 0.5))
    if side * side != width:
        raise DataError(
            f"model.name='cnn' needs square images: column {cfg.data.features!r} has {width} "
            "values per row, which is not a square number; use model.name=mlp"
        )
    return (1, side, side)


def _split_table(table: pa.Table, cfg: Config) -> tuple[pa.Table, Optional[pa.Table]]:
    """Seeded hold-out split, identical on every run with the same seed."""
    n_val = int(round(table.num_rows * cfg.data.val_fraction))
    if n_val == 0:
        return table, None
    order = np.random.default_rng(cfg.train.seed).permutation(table.num_rows)
    return table.take(order[n_val:]), table.take(order[:n_val])
