"""Datasets given from Python (`raytrain_ddp.train(datasets=...)`): Ray Datasets as they are,
map-style torch Datasets read once into a table.

Owns: what `datasets=` may hold (`check_given`) and turning each map-style torch
`Dataset` (`__len__`, `__getitem__`) into the Arrow table Ray Data would make of its
samples (`read_map_style`, `map_style_table`), on the driver before Ray starts. From there a
torch Dataset is rows like any other: the seeded hold-out, exact sharding and resume at the
sample (`sources.py`, `in_memory.py`, `ray_datasets.py`), on every launcher. Must not
touch: Ray's cluster APIs (Ray Data's converter only), torch (a sample's tensors become
numpy through `np.asarray`), where the rows go.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from raytrain_ddp.config import Config
from raytrain_ddp.data.columns import TRAIN, VAL
from raytrain_ddp.errors import UserError


def check_given(given: dict[str, Any]) -> None:
    """`raytrain_ddp.train(datasets=...)`: a dict of a 'train' (and maybe a 'val') Ray Dataset,
    or torch Datasets read already (`read_map_style`)."""
    if not isinstance(given, dict) or TRAIN not in given or set(given) - {TRAIN, VAL}:
        found = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise UserError(f"datasets: expected {{'train': Dataset}} and optionally 'val', got {found}")
    for name, ds in given.items():
        if not hasattr(ds, "map_batches") and not isinstance(ds, pa.Table):
            raise UserError(f"datasets[{name!r}] is a {type(ds).__name__}, not a ray.data.Dataset or a map-style "
                            "torch.utils.data.Dataset (__len__ and __getitem__)")


def read_map_style(given: Any, cfg: Config) -> Any:
    """`datasets=` with each map-style torch Dataset read into its table (`map_style_table`);
    Ray Datasets (and anything else, for `check_given` to name) as they are."""
    if not isinstance(given, dict):
        return given
    return {name: map_style_table(name, ds, cfg) if _map_style(ds) else ds for name, ds in given.items()}


def _map_style(ds: Any) -> bool:
    return not hasattr(ds, "map_batches") and hasattr(ds, "__getitem__") and hasattr(ds, "__len__") \
        and not isinstance(ds, (pa.Table, dict, str, bytes))


def map_style_table(name: str, ds: Any, cfg: Config) -> pa.Table:
    """A map-style torch Dataset, read once on the driver in index order, as the Arrow table Ray
    Data makes of the same samples (its converter, no Ray started): an `(x, y)` sample becomes
    the columns `data.features` and `data.label`, a dict sample its own columns. From here it is
    the rows of `datasets=` given from Python: the seeded hold-out, exact sharding and resume at
    the exact sample, on every launcher (no DistributedSampler: each rank's slice is ours)."""
    from ray.data.block import BlockAccessor

    where = f"datasets[{name!r}] ({type(ds).__name__})"
    columns: dict[str, list[np.ndarray]] = {}
    for i in range(len(ds)):
        sample = ds[i]
        if isinstance(sample, (tuple, list)) and len(sample) == 2:
            sample = {cfg.data.features: sample[0], cfg.data.label: sample[1]}
        if not isinstance(sample, dict) or (columns and list(sample) != list(columns)):
            got = (f"of {len(sample)} values" if isinstance(sample, (tuple, list)) else
                   f"of columns {sorted(sample)}, not {sorted(columns)}" if isinstance(sample, dict) else "")
            raise UserError(f"{where}[{i}] is a {type(sample).__name__} {got}".rstrip() + "; every sample must be "
                            "(x, y) (data.features, data.label) or a dict of the same named columns")
        for column, value in sample.items():
            columns.setdefault(column, []).append(np.asarray(value))
    if not columns:
        raise UserError(f"{where} is empty")
    batch = {}
    for column, values in columns.items():
        try:
            batch[column] = np.stack(values)
        except ValueError:
            shapes = sorted({v.shape for v in values}, key=str)[:3]
            raise UserError(f"{where}: column {column!r} has samples of different shapes {shapes}; "
                            "every sample's must be the same") from None
    return BlockAccessor.batch_to_block(batch)
