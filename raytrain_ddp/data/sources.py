"""Where the rows come from, and the checks that need no Ray: parquet, digits, synthetic.

Owns: the parquet scan and its checks (`check_parquet` for the built-in columns,
`scan_parquet` for a user pipeline's raw files; every message names the file, the column
and its key), the row counts a run needs (`check_row_counts`), the bundled sources
(scikit-learn's digits, read without importing scikit-learn; seeded synthetic rows) as
arrays and tables with their seeded hold-out split (`bundled_tables`), what task a label
makes (`task_of`, `task_set`: one rule for every route), the model's input shape
(`model_shape`), and what the driver's precheck needs of the data (`check_source`,
`sample_and_spec`; the precheck itself, which also runs the user's pipeline, is the
driver's: `driver/preflight.precheck`). Must not touch: Ray's cluster APIs (a few rows of
given Ray Datasets are read through Ray Data), models, user code, training; building the
Ray Datasets (`ray_datasets.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import pyarrow as pa

from raytrain_ddp.config import BUILTIN_MODELS, Config
from raytrain_ddp.data.columns import TRAIN, VAL, uses_own_data
from raytrain_ddp.data.given import check_given
from raytrain_ddp.errors import DataError, UserError
from raytrain_ddp.job import DataSpec


@dataclass(frozen=True)
class Prechecked:
    """What the driver's checks found (`driver/preflight.precheck`), so `prepare_datasets` scans nothing twice."""

    parquet: Optional["ParquetInfo"] = None  # data.path's files (source: parquet)
    pipeline: Any = None  # `user.Checked` (spec without row counts, parameters) when user code runs
    tables: Optional[dict[str, pa.Table]] = None  # map-style torch Datasets' rows (`given.py`): no Ray needed


def check_source(cfg: Config, given: Optional[dict[str, Any]] = None) -> Optional["ParquetInfo"]:
    """The data's own checks before Ray starts (bad parquet costs nothing): `data.source`
    against `given` (the Ray Datasets of `raytrain_ddp.train(datasets=...)`), then for
    parquet the files, columns and, for the built-in columns, the row counts. Returns the
    parquet files' `ParquetInfo` (None for the other sources)."""
    own = uses_own_data(cfg)
    if (given is None) != (cfg.data.source != "datasets"):
        raise UserError("data.source='datasets' means Ray Datasets given from Python: "
                        "raytrain_ddp.train(config, datasets={'train': ..., 'val': ...})")
    if cfg.data.source != "parquet":
        return None
    if own:
        info = scan_parquet(cfg.data.path, cfg.data.label)
    else:
        info = check_parquet(cfg.data.path, cfg.data.features, cfg.data.label, lm=cfg.model.name == "gpt")
    if cfg.data.val_path:
        val = (scan_parquet(cfg.data.val_path, cfg.data.label, key="data.val_path") if own else
               check_parquet(cfg.data.val_path, cfg.data.features, cfg.data.label,
                             lm=cfg.model.name == "gpt", key="data.val_path"))
        info = dataclasses.replace(info, val=val)
    if not own:  # a user pipeline's task comes from its processed columns (`user.spec_columns`)
        info = dataclasses.replace(info, task=task_set(cfg, info.task, str(cfg.data.path)))
    if not own and info.task == "other" and cfg.model.name in BUILTIN_MODELS:
        raise DataError(f"{cfg.data.path}: column {cfg.data.label!r} (data.label) holds a float or vector target "
                        f"(regression); model.name={cfg.model.name!r} is a classifier: give your own model "
                        "('package.module:factory') and train.loss (docs/byo.md)")
    if info.val is not None and info.val.task != info.task:
        raise DataError(f"{cfg.data.val_path}: column {cfg.data.label!r} (data.label) is a {info.val.task} target, "
                        f"{cfg.data.path}'s a {info.task} one; data.val_path must hold the same kind of labels")
    if not own:  # a preprocess may change the row counts: checked once it has run
        val_rows = info.val.rows if info.val else int(round(info.rows * cfg.data.val_fraction))
        check_row_counts(cfg, info.rows - (0 if info.val else val_rows), val_rows, str(cfg.data.path))
    return info


def sample_and_spec(cfg: Config, info: Optional["ParquetInfo"], given: Optional[dict[str, Any]], rows: int
                    ) -> tuple[dict[str, np.ndarray], DataSpec]:
    """`rows` raw rows (as Ray Data hands them to map_batches) and what is known of the spec."""
    from ray.data.block import BlockAccessor  # a converter only: Ray is not contacted

    own = uses_own_data(cfg)
    if given is not None:
        check_given(given)
        read = cfg.data.sharding == "exact" or isinstance(given[TRAIN], pa.Table)  # in memory anyway
        whole = dataset_table(given[TRAIN]) if read else None
        if whole is not None:  # the sample and the classes from the rows: no Ray Data execution
            sample = BlockAccessor.for_block(whole.slice(0, rows)).to_batch_format("numpy")
        else:
            sample = given[TRAIN].take_batch(rows, batch_format="numpy")
        label = sample.get(cfg.data.label)
        classes = 0
        if label is not None and label.ndim == 1 and label.dtype.kind in "iu":
            import pyarrow.compute as pc

            top = pc.max(whole.column(cfg.data.label)).as_py() if whole is not None else given[TRAIN].max(cfg.data.label)
            classes = int(top) + 1
        kind = "torch" if isinstance(given[TRAIN], pa.Table) else "Ray"
        return sample, DataSpec("other", (), classes, 0, 0, f"{kind} Datasets given from Python")
    if info is not None:
        first = next(f for f in info.files if _rows_in(f))
        table = pa.Table.from_batches([next(_parquet(first).iter_batches(batch_size=rows))])
        shape = () if own else model_shape(cfg, info.feature_shape)
        spec = DataSpec(info.task, shape, info.num_classes, 0, 0, str(cfg.data.path))
    else:
        features, labels = load_digits_arrays() if cfg.data.source == "digits" else synthetic_arrays(cfg)
        table = arrays_table(features, labels, cfg.data).slice(0, rows)
        shape, classes, task = spec_from_arrays(cfg, features, labels)
        spec = DataSpec(task, () if own else tuple(shape), classes, 0, 0, cfg.data.source)
    return BlockAccessor.for_block(table).to_batch_format("numpy"), spec


def dataset_table(ds: Any) -> pa.Table:
    """A Ray Dataset's rows as one Arrow table, in block order (its blocks read through Ray);
    a torch Dataset's table (`given.py`) as it is."""
    if isinstance(ds, pa.Table):
        return ds
    import ray

    blocks = [b for b in ray.get(list(ds.to_arrow_refs())) if b.num_rows]
    return pa.concat_tables(blocks) if blocks else ds.schema().base_schema.empty_table()


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
    table = arrays_table(features, labels, cfg.data)
    shape, classes, task = spec_from_arrays(cfg, features, labels)
    return Bundled(table, *split_table(table, cfg), tuple(shape), classes, task, source)


def check_row_counts(cfg: Config, train_rows: int, val_rows: int, source: str) -> None:
    """Enough rows for the run: a training split of at least one global batch and one row per
    worker, and a validation split (if any) of one row per worker; `source` names the data."""
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
    return ParquetInfo(files, rows, (int(width or 1),), max_label + 1, task_of(first_schema.field(label).type, lm))


def task_of(label_type: pa.DataType, lm: bool = False) -> Literal["classification", "lm", "other"]:
    """The one rule of every route (parquet as Ray Datasets given from Python, `user.spec_columns`):
    integer labels are class ids (token ids: lm); any other numbers -- a float, a vector -- are
    a target the loss takes as they are ("other": regression, multi-target). `data.task` decides
    over it: `task_set`."""
    if lm:
        return "lm"
    return "classification" if pa.types.is_integer(label_type) else "other"


def task_set(cfg: Config, inferred: str, where: str) -> str:
    """`data.task` over what the labels say: regression takes any numbers ("other"),
    classification integer class ids only (one line naming the key otherwise)."""
    if cfg.data.task is None or inferred == "lm":
        return inferred
    if cfg.data.task == "classification" and inferred != "classification":
        raise DataError(f"data.task=classification: column {cfg.data.label!r} (data.label) of {where} does not hold "
                        "integer class ids; leave data.task unset (regression), or make the labels integers")
    return "classification" if cfg.data.task == "classification" else "other"


def parquet_bytes(files: list[str]) -> int:
    """The uncompressed size of parquet files, from their footers (no data read)."""
    import pyarrow.parquet as pq

    total = 0
    for file in files:
        meta = pq.ParquetFile(file).metadata
        total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return total


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
    elif not lm and (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)):
        kind = kind.value_type  # a vector target: numbers, one per output
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)) or (lm and not pa.types.is_integer(kind)):
        need = "integer token ids" if lm else "numbers: integer class ids, or a float / vector target"
        raise DataError(f"{file}: column {name!r} (data.label) has type {column.type}; it must hold {need}")
    if column.null_count:
        raise DataError(f"{file}: column {name!r} (data.label) has {column.null_count} null values")
    if task_of(column.type, lm) == "other":  # a regression target: no classes; a vector, one length
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            lengths = set(pc.unique(pc.list_value_length(column)).to_pylist())
            if len(lengths) != 1:
                raise DataError(f"{file}: column {name!r} (data.label) has rows of different lengths "
                                f"{sorted(lengths, key=str)[:5]}; every target must have the same length")
        return -1
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


def arrays_table(features: np.ndarray, labels: np.ndarray, data_cfg: Any) -> pa.Table:
    """Bundled arrays as the table Ray Data (or local mode) reads: `data.features`, `data.label`."""
    label_col = _fixed_list(labels) if labels.ndim > 1 else pa.array(labels)
    return pa.table({data_cfg.features: _fixed_list(features), data_cfg.label: label_col})


def spec_from_arrays(cfg: Config, features: np.ndarray, labels: np.ndarray) -> tuple[tuple[int, ...], int, str]:
    """Bundled arrays' (model input shape, classes, task)."""
    if cfg.model.name == "gpt":
        if cfg.data.source != "synthetic":
            raise DataError(
                f"model.name='gpt' needs token data (data.source='synthetic' or parquet of token ids), "
                f"not data.source={cfg.data.source!r}"
            )
        return (features.shape[1],), cfg.data.synthetic.num_classes, "lm"
    return model_shape(cfg, (int(np.prod(features.shape[1:])),)), int(labels.max()) + 1, "classification"


def model_shape(cfg: Config, flat: tuple[int, ...]) -> tuple[int, ...]:
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


def split_table(table: pa.Table, cfg: Config) -> tuple[pa.Table, Optional[pa.Table]]:
    """Seeded hold-out split, identical on every run with the same seed."""
    n_val = int(round(table.num_rows * cfg.data.val_fraction))
    if n_val == 0:
        return table, None
    order = np.random.default_rng(cfg.train.seed).permutation(table.num_rows)
    return table.take(order[n_val:]), table.take(order[:n_val])
