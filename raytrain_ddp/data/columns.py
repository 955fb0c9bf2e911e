"""The columns of a batch: which ones a micro-batch is built from, and as what arrays.

Owns: the split names (`TRAIN`, `VAL`); whether batches come from the user's pipeline
(`uses_own_data`); turning a numpy batch (as Ray Data, the chunk store or local mode hand
it over) into the arrays the model takes (`column_arrays`, `user_column_arrays`,
`stack_column`); a pyarrow table as Ray Data's numpy batch (`arrow_numpy`). The lowest
room of the data layer: the driver's checks, `user.check_pipeline`, `raytrain-ddp verify`
and each worker's reader all cut columns here, so they agree. Must not touch: Ray's
cluster APIs, torch, models, where the rows come from (`sources.py`, `ray_datasets.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raytrain_ddp.config import Config
from raytrain_ddp.errors import DataError
from raytrain_ddp.job import DataSpec

TRAIN = "train"
VAL = "val"


def uses_own_data(cfg: Config) -> bool:
    """Batches come from the user's pipeline (preprocess, dict batches or Python datasets):
    columns keep their dtypes and `DataSpec.columns` describes them."""
    return bool(cfg.data.preprocess or cfg.data.inputs or cfg.data.source == "datasets")


def column_arrays(batch: dict[str, np.ndarray], cfg: Config, spec: DataSpec) -> dict[str, np.ndarray]:
    """The columns a micro-batch is built from, as arrays the model takes.

    Built-in data (`spec.columns` empty): `data.features` as float32 in `spec.feature_shape`
    (int64 token ids for "lm") and `data.label` as int64 (float32, its shape kept, for a
    regression target: task "other"). A user pipeline: see
    `user_column_arrays`.
    """
    if spec.columns:
        return user_column_arrays(batch, cfg)
    features, label = cfg.data.features, cfg.data.label
    x = stack_column(batch[features])
    if spec.task == "lm":
        x = x.astype(np.int64, copy=not x.flags.writeable)
    else:  # arrays this process owns are not copied again (Ray Data's are read-only views)
        x = x.astype(np.float32, copy=not x.flags.writeable).reshape((len(x),) + spec.feature_shape)
    y = stack_column(batch[label])  # class or token ids as int64; any other target as float32 (sources.task_of)
    return {features: x, label: y.astype(np.float32 if spec.task == "other" else np.int64, copy=not y.flags.writeable)}


def user_column_arrays(batch: dict[str, np.ndarray], cfg: Config) -> dict[str, np.ndarray]:
    """A user pipeline's columns (after `data.preprocess`): `data.features` and `data.label`
    for (x, y) batches, every column for dict batches; each keeps its dtype, except float64,
    which becomes float32 (the dtype of the model's parameters), and the label of
    `data.task: regression`, float32 whatever its type."""
    names = list(batch) if cfg.data.inputs else [cfg.data.features, cfg.data.label]
    out = {}
    for name in names:
        array = stack_column(np.asarray(batch[name]))
        if array.dtype == np.float64 or (name == cfg.data.label and cfg.data.task == "regression"):
            array = array.astype(np.float32)  # data.task regression: integer targets too
        if array.dtype.kind not in "biuf":
            raise DataError(
                f"column {name!r} holds {array.dtype} values; every column of a batch must be numeric "
                "(turn it into numbers, or drop it, in data.preprocess)"
            )
        out[name] = array
    return out


def stack_column(column: np.ndarray) -> np.ndarray:
    """Parquet list columns arrive as object arrays of arrays; make them one 2-D array."""
    if column.dtype == object:
        return np.stack(column) if len(column) else column
    return column


def arrow_numpy(table: Any) -> dict[str, np.ndarray]:
    """A pyarrow table as Ray Data's numpy batch: fixed-size lists of numbers become 2-D
    arrays directly (one copy); anything else (tensor extension columns, ragged lists) goes
    through Ray Data's own conversion, so every mode sees the same arrays."""
    import pyarrow as pa

    out: dict[str, np.ndarray] = {}
    rest = []
    for name in table.column_names:
        column = table.column(name)
        kind = column.type
        if pa.types.is_fixed_size_list(kind) and (pa.types.is_integer(kind.value_type)
                                                   or pa.types.is_floating(kind.value_type)):
            size = kind.list_size  # a chunk's values without pyarrow.compute's list_flatten
            parts = [c.values.slice(c.offset * size, len(c) * size).to_numpy(zero_copy_only=False)
                     for c in column.chunks]
            out[name] = np.concatenate(parts).reshape(len(column), size)  # one copy, writable
        elif (pa.types.is_integer(kind) or pa.types.is_floating(kind)) and column.null_count == 0:
            out[name] = np.concatenate([c.to_numpy(zero_copy_only=False) for c in column.chunks])
        else:
            rest.append(name)
    if rest:
        from ray.data.block import BlockAccessor

        out.update(BlockAccessor.for_block(table.select(rest)).to_batch_format("numpy"))
    return {name: out[name] for name in table.column_names}


def num_rows(columns: dict[str, Any]) -> int:
    """Rows of a dict of equally long columns (0 when there are none)."""
    return len(next(iter(columns.values()))) if columns else 0
