"""Ingest: how fast batches arrive, and how much of a training step waits for them.

Owns: the `ingest` section: a synthetic parquet file (float32 features, int labels),
samples/s of four readers over it, and the data-wait fraction of a short real training
run. Must not touch: the product's data module beyond calling it; Ray start-up (the
caller owns `ray.init`).

Readers, slowest to fastest in principle:
- `ray_data`: `read_parquet(...).iter_torch_batches(batch_size=B)`, the product's
  streaming path (parquet read and decoded on every pass);
- `ray_data_materialized`: the same after `.materialize()` (blocks already decoded in
  the object store): what Ray Data's iterator itself costs;
- `dataloader_stream`: a torch `IterableDataset` reading the same parquet record batch
  by record batch with pyarrow (`DataLoader(batch_size=None, num_workers=0)`);
- `dataloader_rows`: the tutorial pattern, a map-style `Dataset` over the (pre-read)
  rows, one `__getitem__` per sample and the default collate (`num_workers=0`);
- `in_memory`: the upper bound, tensors already in memory, each batch gathered by a
  shuffled index (what `data.sharding: exact` does every step);
- `sharded`, `sharded_thread`, `sharded_inline`, `sharded_chunk256`, `sharded_rank0_of_2`:
  the product's `data.sharding: sharded` batch path (`WorkerData.train_windows`: chunks
  read from the chunk store, Arrow -> tensors, pinned and copied to the device on CUDA)
  with the default 64-row chunks, as configured by default (in the consumer's thread while
  a step's read is quick, which on this store in the page cache is every step); always
  through the reader thread (what a slow store gets); always in the consumer's thread
  (`data.prefetch_batches: 0`); one chunk per batch; and as rank 0 of 2 (half the rows).
  Each pass is a new epoch of the same `WorkerData`, as in training, so `first_batch_s`
  is the first batch of an epoch with the files already open. The store is written once
  from the parquet files (not timed).
Every pass is timed from its first batch to its end (`samples_per_s`, warm-up excluded)
and from the call to its end (`samples_per_s_total`, start-up included; Ray Data
schedules read tasks on every pass); the median over passes is kept. The file is split
in 8 parquet files so Ray Data really streams (one read task per file).
"""

from __future__ import annotations

import json
import tempfile
import warnings
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from benchmarks.common import Sizes, ratio, stats
from raytrain_ddp.data.columns import stack_column

FEATURES = 256
CLASSES = 16
BATCH = 256
FILES = 8

# Ray Data hands out read-only numpy views; torch warns once per conversion. Readers do
# not write into batches, so the warning is noise here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def write_parquet(path: Path, rows: int, files: int = FILES, seed: int = 0) -> Path:
    """A directory of `files` parquet files, so Ray Data streams several read tasks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=rows, dtype=np.int64)
    path.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for i in range(files):
        lo, hi = i * per_file, min(rows, (i + 1) * per_file)
        flat = pa.FixedSizeListArray.from_arrays(pa.array(x[lo:hi].reshape(-1)), FEATURES)
        pq.write_table(pa.table({"x": flat, "y": y[lo:hi]}), path / f"part-{i:03d}.parquet", row_group_size=2048)
    return path


def _to_tensors(x: Any, y: Any) -> tuple:
    import torch

    x = stack_column(x)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(np.asarray(y))


def _collate(batch: dict[str, np.ndarray]) -> tuple:
    return _to_tensors(batch["x"], batch["y"])


def _time_pass(batches: Iterable) -> dict[str, float]:
    start = time.perf_counter()
    first_at, rows, first_rows = None, 0, 0
    for x, _ in batches:
        n = len(x)
        rows += n
        if first_at is None:
            first_at, first_rows = time.perf_counter(), n
    end = time.perf_counter()
    steady = (rows - first_rows) / max(end - first_at, 1e-9) if first_at is not None else 0.0
    return {"rows": rows, "samples_per_s": steady, "samples_per_s_total": rows / max(end - start, 1e-9),
            "first_batch_s": (first_at or end) - start, "total_s": end - start}


def _one_pass(name: str, make_iter: Callable[[], Iterable], rows: int) -> dict[str, float]:
    result = _time_pass(make_iter())
    if result["rows"] != rows:
        raise RuntimeError(f"ingest reader {name!r} yielded {result['rows']} rows, expected {rows}")
    return {k: round(v, 4) for k, v in result.items()}


def ray_data_iter(path: Path) -> Iterable:
    import ray.data

    return ray.data.read_parquet(str(path)).iter_torch_batches(batch_size=BATCH, collate_fn=_collate_class()())


def ray_data_materialized_iter(ds: Any) -> Iterable:
    return ds.iter_torch_batches(batch_size=BATCH, collate_fn=_collate_class()())


def _collate_class():
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Collate(NumpyBatchCollateFn):  # Ray 2.47+ wants a class, not a function
        def __call__(self, batch: dict[str, np.ndarray]) -> tuple:
            return _collate(batch)

    return Collate


def dataloader_stream_iter(path: Path) -> Iterable:
    import pyarrow.parquet as pq
    import torch

    class ParquetStream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for file in sorted(path.glob("*.parquet")):
                for rb in pq.ParquetFile(file).iter_batches(batch_size=BATCH, columns=["x", "y"]):
                    x = rb.column("x").flatten().to_numpy().reshape(-1, FEATURES)
                    yield _to_tensors(x, rb.column("y").to_numpy())

    return torch.utils.data.DataLoader(ParquetStream(), batch_size=None, num_workers=0)


def dataloader_rows_iter(x: np.ndarray, y: np.ndarray) -> Iterable:
    import torch

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int):
            return torch.from_numpy(x[i]), int(y[i])

    return torch.utils.data.DataLoader(Rows(), batch_size=BATCH, shuffle=True, num_workers=0)


def in_memory_iter(x: Any, y: Any, seed: int) -> Iterable:
    import torch

    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    for start in range(0, len(x), BATCH):
        idx = order[start:start + BATCH]
        yield x[idx], y[idx]


def write_chunk_store(path: Path, out: Path, chunk_rows: int) -> Any:
    """The parquet files as a chunk store (`raytrain_ddp/data/store.py`), in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_ddp.rundir import Location
    from raytrain_ddp.data.store import write_store

    def tables():
        for file in sorted(path.glob("*.parquet")):
            for rb in pq.ParquetFile(file).iter_batches(batch_size=8192, columns=["x", "y"]):
                yield pa.Table.from_batches([rb])

    root = Location.parse(out)
    write_store(root / "train", tables(), chunk_rows, "bench")
    return root


def sharded_reader(root: Any, rows: int, chunk_rows: int, device: str, world: int = 1, rank: int = 0,
                   prefetch: int = 4, inline_read_s: Optional[float] = None) -> Any:
    """A `WorkerData` of `data.sharding: sharded` over the store: micro batch BATCH, one per step.
    `inline_read_s` replaces its threshold for reading in the consumer's thread (0: every read
    counts as slow, so the reader thread takes over from the second step)."""
    import torch

    from raytrain_ddp.config import load_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.data.worker_data import WorkerData

    cfg = load_config(None, ["model.name=mlp", "data.sharding=sharded", f"data.chunk_rows={chunk_rows}",
                             f"train.micro_batch_size={BATCH}", f"train.global_batch_size={BATCH * world}",
                             f"data.prefetch_batches={prefetch}", f"scaling.num_workers={world}"])
    spec = DataSpec("classification", (FEATURES,), CLASSES, rows, 0, "bench", store=root)
    data = WorkerData(cfg, spec, rank, world, torch.device(device))
    if inline_read_s is not None:
        data.inline_read_s = inline_read_s
    return data


_RSS_PROBE = """
import json, sys, time
import torch
torch.set_num_threads(1)
from benchmarks.ingest import sharded_reader, sharded_iter
from raytrain_ddp.rundir import Location
from raytrain_ddp.data.store import read_manifest

def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

root, world = Location.parse(sys.argv[1]), int(sys.argv[2])
rows = read_manifest(root / "train").rows
start = rss_mb()
data = sharded_reader(root, rows, 64, "cpu", world)
warm, peak, seen, began = None, 0.0, 0, time.perf_counter()
for x, _y in sharded_iter(data, 0):
    seen += len(x)
    warm = warm or rss_mb()
    peak = max(peak, rss_mb())
print(json.dumps({"start_mb": start, "after_first_batch_mb": warm, "peak_mb": peak, "rows_read": seen,
                  "samples_per_s": seen / (time.perf_counter() - began)}))
"""


def worker_memory(tmp: Path, rows: int, world: int = 2) -> dict[str, Any]:
    """Resident memory of one rank (rank 0 of `world`, a fresh process) reading its share of a
    `rows` x FEATURES float32 store for one epoch, next to the store's size on disk."""
    import os
    import subprocess
    import sys

    import pyarrow as pa

    from raytrain_ddp.rundir import Location
    from raytrain_ddp.data.store import write_store

    def tables():
        rng = np.random.default_rng(0)
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            x = rng.standard_normal((n, FEATURES), dtype=np.float32)
            yield pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), FEATURES),
                            "y": rng.integers(0, CLASSES, size=n)})

    root = Location.parse(tmp / "memory-store")
    manifest = write_store(root / "train", tables(), 64, "bench-memory")
    data_mb = sum(os.path.getsize(tmp / "memory-store" / "train" / f) for f in manifest.files) / 2**20
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(root), str(world)], capture_output=True,
                         text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed: {out.stderr[-2000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rows": rows, "world_size": world, "store_mb": round(data_mb, 1),
            **{k: round(v, 1) for k, v in found.items()}}


def sharded_iter(data: Any, epoch: int) -> Iterable:
    for window in data.train_windows(epoch):
        yield from window


def read_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)  # a directory reads as one table
    x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES)
    return x, table.column("y").to_numpy()


def readers(sizes: Sizes, tmp: Path, log=print, device: str = "cpu", with_ray: bool = True) -> dict[str, Any]:
    """Samples per second of every reader; `with_ray=False` leaves out the two Ray Data ones
    (the test suite's toy run of this section, without a Ray instance)."""
    import itertools

    import torch

    path = write_parquet(tmp / "ingest", sizes.ingest_rows)
    x, y = read_arrays(path)
    tx, ty = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    makers: dict[str, Callable[[], Iterable]] = {}
    if with_ray:
        import ray.data

        materialized = ray.data.read_parquet(str(path)).materialize()
        makers["ray_data"] = lambda: ray_data_iter(path)
        makers["ray_data_materialized"] = lambda: ray_data_materialized_iter(materialized)
    makers.update({
        "dataloader_stream": lambda: dataloader_stream_iter(path),
        "dataloader_rows": lambda: dataloader_rows_iter(x, y),
        "in_memory": lambda: in_memory_iter(tx, ty, seed=0),
    })
    rows = {name: sizes.ingest_rows for name in makers}
    epochs = itertools.count()
    stores: dict[int, Any] = {}
    # (name, chunk rows, world size, prefetch, inline-read threshold: None = the product's)
    for name, chunk, world, prefetch, inline_s in (("sharded", 64, 1, 4, None), ("sharded_thread", 64, 1, 4, 0.0),
                                                   ("sharded_inline", 64, 1, 0, None),
                                                   ("sharded_chunk256", 256, 1, 4, None),
                                                   ("sharded_rank0_of_2", 64, 2, 4, None)):
        if chunk not in stores:
            stores[chunk] = write_chunk_store(path, tmp / f"store-{chunk}", chunk)
        reader = sharded_reader(stores[chunk], sizes.ingest_rows, chunk, device, world, prefetch=prefetch,
                                inline_read_s=inline_s)
        makers[name] = lambda reader=reader: sharded_iter(reader, next(epochs))
        rows[name] = reader.steps_per_epoch * BATCH
    # Interleave: one pass of each reader per round, so drift hits them alike. One torch
    # thread in the consumer, as in a training worker: with more, every small gather pays
    # an OpenMP fork/join, which on a loaded machine made the in-memory gather 10x slower.
    per_reader: dict[str, list] = {name: [] for name in makers}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(sizes.ingest_passes):
            for name, make in makers.items():
                per_reader[name].append(_one_pass(name, make, rows[name]))
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    for name, passes in per_reader.items():
        out[name] = {"samples_per_s": stats([p["samples_per_s"] for p in passes])["median"],
                     "samples_per_s_total": stats([p["samples_per_s_total"] for p in passes])["median"],
                     "first_batch_s": stats([p["first_batch_s"] for p in passes])["median"],
                     "passes": passes}
    return out


def _wait_run(name: str, tmp: Path, model: dict, data: dict, steps: int, workers: int, micro: int,
              use_gpu: bool, **train: Any) -> dict[str, Any]:
    """A short real run (`run_training`, bucketed, SGD, a line every 5 steps, no checkpoints) and
    its logged data wait: the fields both training runs of this section report."""
    from raytrain_ddp.config import validate_config
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.rundir import METRICS_FILE

    cfg = validate_config({
        "name": name, "model": model, "data": {"val_fraction": 0.0, **data},
        "train": {"max_steps": steps, "global_batch_size": micro * workers, "micro_batch_size": micro,
                  "optimizer": "sgd", "lr": 0.01, **train},
        "parallel": {"strategy": "bucketed"},
        "scaling": {"num_workers": workers, "use_gpu": use_gpu},
        "run": {"storage_path": str(tmp / "runs"), "log_every_steps": 5, "checkpoint_every_steps": 0,
                "resume": "never"},
    }, source="bench")
    started = time.time()
    summary = run_training(cfg)
    elapsed = time.time() - started
    lines = [json.loads(line) for line in (Path(cfg.run.storage_path) / cfg.name / METRICS_FILE).read_text().splitlines()
             if line.strip()]
    train_lines = [line for line in lines if "data_wait_fraction" in line]
    if not train_lines:
        raise RuntimeError(f"training run {cfg.name} logged no data_wait_fraction lines")
    steady = train_lines[1:] if len(train_lines) > 1 else train_lines  # the first interval holds start-up
    return {
        "sharding": data["sharding"], "workers": workers, "micro_batch": micro, "steps": steps,
        "data_wait_fraction": stats([line["data_wait_fraction"] for line in steady])["median"],
        "data_wait_fraction_all": [round(line["data_wait_fraction"], 4) for line in train_lines],
        "samples_per_s": stats([line["samples_per_s"] for line in steady])["median"],
        "first_step_logged_s": train_lines[0]["time"] - started,
        "status": summary.get("status", "ok"), "wall_s": elapsed,
    }


def training_wait(sizes: Sizes, tmp: Path, sharding: str, use_gpu: bool = False,
                  workers: int = 2, micro: int = 64, log=print) -> dict[str, Any]:
    """A short real run (`run_training`, MLP, synthetic data) and its logged data-wait fraction."""
    steps = sizes.train_steps
    data = {"source": "synthetic", "sharding": sharding,
            "synthetic": {"rows": micro * workers * (steps + 4), "feature_dim": 1024, "num_classes": 256}}
    return _wait_run(f"bench-wait-{sharding}", tmp, {"name": "mlp", "hidden_sizes": [1024, 1024, 256]}, data,
                     steps, workers, micro, use_gpu)


IMAGE_SIDE = 64  # PNG-encoded grayscale images of the image training runs


def decode_png(batch: dict) -> dict:
    """`data.preprocess` of the image runs: PNG bytes -> normalised float32 pixels (flat)."""
    import io

    from PIL import Image

    pixels = np.stack([np.asarray(Image.open(io.BytesIO(bytes(png)))) for png in batch["png"]])
    return {"image": (pixels.reshape(len(pixels), -1).astype(np.float32) / 255.0), "label": batch["label"]}


def write_png_parquet(path: Path, rows: int, files: int = FILES, seed: int = 0) -> Path:
    """`rows` PNG-encoded IMAGE_SIDE^2 grayscale images (smoothed noise, so they compress
    like photographs rather than like noise) with an int label, in `files` parquet files."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for i in range(files):
        n = min(per_file, rows - i * per_file)
        coarse = rng.integers(0, 256, size=(n, IMAGE_SIDE // 8, IMAGE_SIDE // 8), dtype=np.uint8)
        pngs = []
        for img in coarse:
            out = io.BytesIO()
            Image.fromarray(img, mode="L").resize((IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BILINEAR).save(out, "PNG")
            pngs.append(out.getvalue())
        pq.write_table(pa.table({"png": pa.array(pngs, pa.binary()),
                                 "label": pa.array(rng.integers(0, CLASSES, size=n), pa.int64())}),
                       path / f"part-{i:02d}.parquet")
    return path


def image_training_wait(sizes: Sizes, tmp: Path, sharding: str, use_gpu: bool = False, workers: int = 2,
                        micro: int = 64) -> dict[str, Any]:
    """A real run whose preprocess is not free (PNG decode on Ray Data's CPU tasks): the data
    wait per step, and the time until the first step (where `exact` and `sharded` pay the
    decode once, up front, and `streaming` pays it every epoch, overlapped with training)."""
    steps, rows = sizes.train_steps, micro * workers * (sizes.train_steps + 4)
    data = tmp / "png"
    if not data.exists():
        write_png_parquet(data, rows)
    spec = {"source": "parquet", "path": str(data), "sharding": sharding,
            "preprocess": "benchmarks.ingest:decode_png", "features": "image", "label": "label"}
    result = _wait_run(f"bench-png-{sharding}", tmp, {"name": "mlp", "hidden_sizes": [512, 256]}, spec, steps,
                       workers, micro, use_gpu, loss="cross_entropy")
    return {**result, "rows": rows, "image": f"{IMAGE_SIDE}x{IMAGE_SIDE} PNG"}


def run(sizes: Sizes, device: str = "cpu", log=print, train_shardings: tuple[str, ...] = ("streaming", "exact"),
        workers: int = 2, micro: int = 64) -> dict[str, Any]:
    log(f"  ingest: {sizes.ingest_rows} rows x {FEATURES} float32, batch {BATCH}, {sizes.ingest_passes} pass(es) ...")
    with tempfile.TemporaryDirectory(prefix="raytrain-ingest-") as name:
        tmp = Path(name)
        section: dict[str, Any] = {"rows": sizes.ingest_rows, "features": FEATURES, "batch": BATCH,
                                   "readers": readers(sizes, tmp, log, device=device)}
        sps = {k: v["samples_per_s"] for k, v in section["readers"].items()}
        section["samples_per_s"] = sps
        section["ray_data_over_in_memory"] = ratio(sps["ray_data"], sps["in_memory"])
        section["ray_data_materialized_over_in_memory"] = ratio(sps["ray_data_materialized"], sps["in_memory"])
        section["ray_data_over_dataloader_stream"] = ratio(sps["ray_data"], sps["dataloader_stream"])
        for name in ("sharded", "sharded_thread", "sharded_inline", "sharded_chunk256", "sharded_rank0_of_2"):
            section[f"{name}_over_in_memory"] = ratio(sps[name], sps["in_memory"])
        section["sharded_first_batch_s"] = section["readers"]["sharded"]["first_batch_s"]
        log(f"  ingest: one rank's resident memory reading its share of a {4 * sizes.ingest_rows}-row store ...")
        section["sharded_memory"] = worker_memory(tmp, 4 * sizes.ingest_rows)
        if "exact" in train_shardings and "sharded" not in train_shardings:  # full runs: all three modes
            train_shardings = (*train_shardings, "sharded")
        section["training"] = {}
        for sharding in train_shardings:
            log(f"  ingest: data wait inside a real {workers}-worker training run (sharding={sharding}) ...")
            try:
                section["training"][sharding] = training_wait(sizes, tmp, sharding, use_gpu=device == "cuda",
                                                              workers=workers, micro=micro, log=log)
            except Exception as exc:  # noqa: BLE001 - keep the reader numbers, flag the section
                section["training"][sharding] = {"error": f"{type(exc).__name__}: {exc}"}
                section["error"] = f"training run (sharding={sharding}) failed: {type(exc).__name__}: {exc}"
                log(f"  ingest: training run (sharding={sharding}) FAILED: {type(exc).__name__}: {exc}")
        if sizes.name == "full":  # a preprocess that is not free: three more runs, full preset only
            section["image_training"] = {}
            for sharding in ("streaming", "exact", "sharded"):
                log(f"  ingest: {IMAGE_SIDE}x{IMAGE_SIDE} PNG decode as data.preprocess, sharding={sharding} ...")
                try:
                    section["image_training"][sharding] = image_training_wait(
                        sizes, tmp, sharding, use_gpu=device == "cuda", workers=workers, micro=micro)
                except Exception as exc:  # noqa: BLE001 - as above
                    section["image_training"][sharding] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"  ingest: image run (sharding={sharding}) FAILED: {type(exc).__name__}: {exc}")
        first = train_shardings[0]
        section["data_wait_fraction"] = section["training"][first].get("data_wait_fraction", float("nan"))
        section["data_wait_sharding"] = first
    return section


if __name__ == "__main__":
    # python -m benchmarks.ingest --memory-rows N   one rank's RSS, a large store
    # python -m benchmarks.ingest --images           the PNG-decode training runs alone
    import argparse

    from benchmarks.common import FULL

    parser = argparse.ArgumentParser(description="parts of the ingest section, alone")
    parser.add_argument("--memory-rows", type=int, help=f"rows of {FEATURES} float32 (1 KiB each)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", action="store_true", help="the image (PNG decode) training runs, full size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="raytrain-ingest-") as name:
        if args.memory_rows:
            print(json.dumps(worker_memory(Path(name), args.memory_rows, args.workers), indent=1))
        if args.images:
            runs = {s: image_training_wait(FULL, Path(name), s, workers=args.workers)
                    for s in ("streaming", "exact", "sharded")}
            print(json.dumps(runs, indent=1))
