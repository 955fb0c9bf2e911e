"""The exact route's rows in memory: read once on the driver, the same rows and split everywhere.

Owns: reading `cfg.data` (bundled digits and synthetic, parquet with its hold-out, a user's
preprocess) into per-split column dicts (`LocalShard`: Ray Data's `iter_batches` over
numpy columns), and the `DataSpec` they make. Local mode and torchrun's ranks read these
shards in their processes; a Ray run with `data.sharding: exact` of built-in data hands
them to its workers through Ray's object store (`ray_datasets.prepare_datasets`), with no
Ray Data pipeline to start. Must not touch: Ray, the loop, the cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import numpy as np

from raytrain_ddp.config import Config
from raytrain_ddp.job import DataSpec


class LocalShard:
    """An in-memory table that reads like Ray Data's iterator (`iter_batches(..., batch_format="numpy")`)."""

    def __init__(self, columns: dict[str, Any]) -> None:
        self.columns = columns
        self.rows = len(next(iter(columns.values()))) if columns else 0

    def iter_batches(self, batch_size: int, batch_format: str = "numpy") -> Iterator[dict[str, Any]]:
        for start in range(0, self.rows, batch_size):
            yield {name: column[start:start + batch_size] for name, column in self.columns.items()}


def in_memory_shards(cfg: Config, checked: Any, preprocess: Optional[Callable[[dict], dict]] = None
                     ) -> tuple[dict[str, Any], DataSpec]:
    """The train (and val) rows as in-memory shards (`LocalShard`), and the data's spec,
    read here with pyarrow: the rows of every exact route. `preprocess`: a user pipeline's
    function over each split's numpy columns (the caller's `user.run_preprocess`)."""
    import pyarrow.parquet as pq

    from raytrain_ddp.data.columns import TRAIN, VAL, arrow_numpy, uses_own_data
    from raytrain_ddp.data.sources import bundled_tables, check_row_counts, model_shape, split_table

    own = uses_own_data(cfg)
    bundled = bundled_tables(cfg)  # digits, synthetic: the same tables and split as a Ray run's
    if bundled is not None:
        train, val = bundled.train, bundled.val
        shape, classes, task, source = bundled.shape, bundled.classes, bundled.task, bundled.source
    elif checked.tables is not None:  # torch Datasets given from Python, read on the driver: the same split
        train, val = checked.tables[TRAIN], checked.tables.get(VAL)
        if val is None:
            train, val = split_table(train, cfg)
        source = checked.pipeline.spec.source
    else:
        info = checked.parquet
        columns = None if own else [cfg.data.features, cfg.data.label]
        table = pq.read_table(info.files, columns=columns)
        if info.val is not None:
            train, val = table, pq.read_table(info.val.files, columns=columns)
        else:  # the seeded hold-out of the built-in data (Ray Data's train_test_split is Ray's)
            train, val = split_table(table, cfg)
        shape, classes, task = model_shape(cfg, info.feature_shape), info.num_classes, info.task
        source = str(cfg.data.path)
    # A preprocess gets the columns exactly as Ray Data's map_batches would hand them over
    # (Ray's converter); the loop's own columns need only the numbers (no Ray imported).
    to_numpy = _numpy if own else arrow_numpy
    splits = {TRAIN: to_numpy(train), **({VAL: to_numpy(val)} if val is not None and val.num_rows else {})}
    if own:
        for name, batch in splits.items():
            if preprocess is not None:
                batch = preprocess(batch)
            keep = list(batch) if cfg.data.inputs else [cfg.data.features, cfg.data.label]
            splits[name] = {column: np.asarray(batch[column]) for column in keep}
    rows = {name: len(next(iter(batch.values()))) for name, batch in splits.items()}
    check_row_counts(cfg, rows[TRAIN], rows.get(VAL, 0), source)
    if own:
        spec = dataclasses.replace(checked.pipeline.spec, train_rows=rows[TRAIN], val_rows=rows.get(VAL, 0))
    else:
        spec = DataSpec(task, tuple(shape), int(classes), rows[TRAIN], rows.get(VAL, 0), source)
    return {name: LocalShard(batch) for name, batch in splits.items()}, spec


def _numpy(table: Any) -> dict[str, np.ndarray]:
    """A table as Ray Data's `batch_format="numpy"` hands it over (the same converter; no Ray is contacted)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(table).to_batch_format("numpy")
