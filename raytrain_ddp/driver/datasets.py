"""Driver-side data: sources, checks before workers start, and the Ray Datasets handed to them.

Owns: turning `cfg.data` into Ray Datasets on the driver (parquet, bundled digits,
synthetic), the `DataSpec` the model is built from, and checking the data before any
worker is paid for (`precheck`). Must not touch: models, optimisation, process groups;
each worker's batches (`worker/shard.py`).

Two sharding modes (`data.sharding`):

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

Only full global batches are trained on: the remainder of an epoch (fewer than
`global_batch_size` rows) is dropped, so every optimizer step averages over exactly the
configured global batch at any worker count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import pyarrow as pa

from raytrain_ddp.config import Config
from raytrain_ddp.errors import DataError
from raytrain_ddp.job import DataSpec
from raytrain_ddp.worker.shard import TRAIN, VAL, stack_column



@dataclass
class PreparedData:
    datasets: dict[str, Any]  # name -> ray.data.Dataset
    spec: DataSpec
    data_config: Any  # ray.train.DataConfig


# --------------------------------------------------------------------------- driver side


def precheck(cfg: Config) -> Optional["ParquetInfo"]:
    """The data checks that need no Ray, run before Ray starts: bad parquet costs nothing.

    Returns the parquet facts so `prepare_datasets` does not scan the files twice.
    """
    if cfg.data.source != "parquet":
        return None
    info = check_parquet(cfg.data.path, cfg.data.features, cfg.data.label, lm=cfg.model.name == "gpt")
    val_rows = int(round(info.rows * cfg.data.val_fraction))
    _check_row_counts(cfg, info.rows - val_rows, val_rows, str(cfg.data.path))
    return info


def prepare_datasets(cfg: Config, checked: Optional["ParquetInfo"] = None) -> PreparedData:
    """Build and check the datasets on the driver; every problem raises `DataError` early."""
    import ray.data
    import ray.train

    if cfg.data.source == "digits":
        features, labels = load_digits_arrays()
        table = _table(features, labels, cfg.data)
        source = "digits (scikit-learn, 1,797 8x8 images)"
    elif cfg.data.source == "synthetic":
        features, labels = synthetic_arrays(cfg)
        table = _table(features, labels, cfg.data)
        source = f"synthetic ({cfg.data.synthetic.rows} rows)"
    else:
        table = None
        source = str(cfg.data.path)

    if table is not None:
        total_rows = table.num_rows
        spec_shape, num_classes, task = _spec_from_arrays(cfg, features, labels)
        train_table, val_table = _split_table(table, cfg)
        datasets = {TRAIN: ray.data.from_arrow(train_table)}
        if val_table is not None:
            datasets[VAL] = ray.data.from_arrow(val_table)
    else:
        info = checked or precheck(cfg)
        assert info is not None
        total_rows, spec_shape, num_classes, task = info.rows, info.feature_shape, info.num_classes, info.task
        spec_shape = _model_shape(cfg, spec_shape)
        full = ray.data.read_parquet(info.files).select_columns([cfg.data.features, cfg.data.label])
        if cfg.data.val_fraction > 0:
            train_ds, val_ds = full.train_test_split(
                test_size=cfg.data.val_fraction, shuffle=True, seed=cfg.train.seed
            )
            datasets = {TRAIN: train_ds, VAL: val_ds}
        else:
            datasets = {TRAIN: full}

    val_rows = datasets[VAL].count() if VAL in datasets else 0  # metadata for in-memory tables
    train_rows = total_rows - val_rows
    _check_row_counts(cfg, train_rows, val_rows, source)

    if cfg.data.sharding == "streaming" and cfg.data.shuffle:
        datasets[TRAIN] = datasets[TRAIN].randomize_block_order(seed=cfg.train.seed)
    split = [TRAIN] if cfg.data.sharding == "streaming" else []
    spec = DataSpec(task, tuple(spec_shape), int(num_classes), int(train_rows), int(val_rows), source)
    return PreparedData(datasets, spec, ray.train.DataConfig(datasets_to_split=split))


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
    task: Literal["classification", "lm"]


def check_parquet(path: Optional[str], features: str, label: str, *, lm: bool = False) -> ParquetInfo:
    """Validate parquet input with pyarrow metadata and two column scans, before Ray reads it.

    Catches what would otherwise surface as a worker traceback minutes later: missing
    files or columns, schemas that differ between files, non-numeric or ragged features,
    nulls or negative values in the label, and empty inputs. Messages name file and column.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = _parquet_files(path)
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


def _parquet_files(path: Optional[str]) -> list[str]:
    if not path:
        raise DataError("data.path is required for data.source='parquet'")
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*.parquet"))
        if not files:
            raise DataError(f"data.path={path!r}: directory holds no *.parquet files")
        return files
    if p.is_file():
        return [str(p)]
    raise DataError(f"data.path={path!r}: no such file or directory")


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
    """scikit-learn's handwritten digits: real data that ships with the package, no download."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = (bunch.data / 16.0).astype(np.float32)  # pixel intensities 0..16 -> 0..1
    return features, bunch.target.astype(np.int64)


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
