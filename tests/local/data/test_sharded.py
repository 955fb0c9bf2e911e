"""data.sharding='sharded' without Ray: the chunk store, the order, each rank's share, resume, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
import torch

from raytrain_ddp.config import load_config
from raytrain_ddp.job import DataSpec
from raytrain_ddp.rundir import Location
from raytrain_ddp.config.checks import default_chunk_rows
from raytrain_ddp.data.store import StoreReader, epoch_chunks, read_manifest, write_store
from raytrain_ddp.data.worker_data import WorkerData

pytestmark = pytest.mark.timeout(60)

ROWS = 1000  # not a multiple of the global batch (48) nor of the chunk (4): 20 steps, tails dropped


def _table(rows: int, width: int = 3, start: int = 0) -> pa.Table:
    ids = np.arange(start, start + rows)
    x = np.repeat(ids[:, None], width, axis=1).astype(np.float32)
    return pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width), "y": ids})


def _store(tmp_path, rows: int = ROWS, chunk: int = 4, pieces: int = 7) -> Location:
    root = Location.parse(tmp_path) / "data"
    table = _table(rows)
    step = -(-rows // pieces)
    write_store(root / "train", (table.slice(i, step) for i in range(0, rows, step)), chunk, "fp",
                chunks_per_file=16)  # several files
    write_store(root / "val", [_table(50, start=10_000)], chunk, "fp")
    return root


def _cfg(*extra: str):
    return load_config(None, ["model.name=mlp", "data.sharding=sharded", "data.chunk_rows=4",
                              "train.global_batch_size=48", "train.micro_batch_size=4",
                              "scaling.num_workers=[1, 4]", *extra])


def _workers(cfg, root, world):
    spec = DataSpec("classification", (3,), ROWS, ROWS, 50, "test", store=root)
    return [WorkerData(cfg, spec, rank, world, torch.device("cpu")) for rank in range(world)]


def _ids(window) -> list[list[int]]:
    return [[int(v) for v in y] for (_x, y) in window]


def test_store_roundtrip_chunks_and_manifest(tmp_path):
    root = _store(tmp_path)
    manifest = read_manifest(root / "train")
    assert manifest.rows == ROWS and manifest.chunks == 250 and len(manifest.files) == 16
    reader = StoreReader(root / "train")
    assert reader.chunk(249).column("y").to_pylist() == [996, 997, 998, 999]
    assert reader.table([3, 0]).column("y").to_pylist() == [12, 13, 14, 15, 0, 1, 2, 3]
    short = read_manifest(root / "val")
    assert short.chunks == 13 and short.full_chunks == 12  # the last chunk holds 2 rows
    assert read_manifest(root / "missing") is None
    assert [default_chunk_rows(b) for b in (4, 64, 96, 256, 37, 97)] == [4, 64, 48, 64, 37, 97]


def test_direct_reads_give_the_arrays_arrow_gives_and_step_aside_when_they_cannot(tmp_path):
    """StoreReader.read_arrays (positional reads into the batch's arrays) against the Arrow path
    (`arrow_numpy` of the chunks' table), chunk by chunk in a shuffled order, across files,
    with sliced inputs and a short last chunk; columns that are not plain numbers, or numbers
    with nulls, leave the store on the Arrow path."""
    from raytrain_ddp.data.columns import arrow_numpy

    rng = np.random.default_rng(0)
    rows = 203
    table = pa.table({
        "x": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(rows * 5).astype(np.float32)), 5),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 99, rows * 3), pa.int32()), 3),
        "w": pa.array(rng.standard_normal(rows)),  # float64
        "one": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows, dtype=np.int16)), 1),
        "y": pa.array(rng.integers(0, 7, rows)),
    })
    root = Location.parse(tmp_path) / "mixed"
    write_store(root, (table.slice(i, 37) for i in range(0, rows, 37)), 8, "fp", chunks_per_file=5)
    reader = StoreReader(root)
    order = [int(i) for i in rng.permutation(reader.manifest.chunks)]
    for picks in (order[:4], order[4:5], order, [reader.manifest.chunks - 1, 0]):
        direct, arrow = reader.read_arrays(picks), arrow_numpy(reader.table(picks))
        assert direct is not None and list(direct) == list(arrow)
        for name in arrow:
            assert direct[name].dtype == arrow[name].dtype and direct[name].shape == arrow[name].shape, name
            assert np.array_equal(direct[name], arrow[name]), name

    for name, column in (("text", pa.array([str(i) for i in range(rows)])),
                         ("holes", pa.array([None if i % 50 == 7 else i for i in range(rows)], pa.int64()))):
        where = Location.parse(tmp_path) / name
        write_store(where, [table.append_column(name, column)], 8, "fp")
        reader = StoreReader(where)
        assert reader.read_arrays([0, 1]) is None  # the Arrow path reads these
    plain = [1, 2, 4]  # chunks 1, 2 and 4 of "holes" have no null (rows 7, 57, 107, ... do)
    direct, arrow = reader.read_arrays(plain), arrow_numpy(reader.table(plain))
    assert all(np.array_equal(direct[name], arrow[name]) and direct[name].dtype == arrow[name].dtype for name in arrow)



@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_samples_in_every_step_at_any_world_size(tmp_path, world):
    """Step s's samples are a function of (seed, epoch, s): every world size sees the same
    set, ranks are disjoint, each row once per epoch, and each rank reads only its chunks."""
    cfg = _cfg()
    workers = _workers(cfg, _store(tmp_path), world)
    assert {w.steps_per_epoch for w in workers} == {ROWS // 48}
    streams = [[_ids(window) for window in w.train_windows(epoch=2)] for w in workers]
    order = epoch_chunks(ROWS // 4, cfg.train.seed, 2, True)
    seen_epoch: list[int] = []
    for step in range(ROWS // 48):
        seen = [i for s in streams for micro in s[step] for i in micro]
        assert len(seen) == len(set(seen)) == 48
        expected = {4 * c + k for c in order[step * 12:(step + 1) * 12] for k in range(4)}
        assert set(seen) == expected
        seen_epoch += seen
        for rank, stream in enumerate(streams):  # a rank's share only: 48 / world rows
            assert sum(len(m) for m in stream[step]) == 48 // world
    assert len(seen_epoch) == len(set(seen_epoch)) == 960
    other = [_ids(window) for window in workers[0].train_windows(epoch=3)]
    assert other != streams[0]  # epochs reshuffle


def test_quick_reads_stay_in_the_training_thread_and_slow_ones_move_to_the_reader_thread(tmp_path):
    """The same windows either way; a step read slower than inline_read_s (INLINE_READ_S) moves
    the rest of the epoch to the reader thread (a resume too); prefetch_batches=0 never does."""
    root = _store(tmp_path)
    [quick] = _workers(_cfg("data.prefetch_batches=4"), root, 1)
    quick.inline_read_s = 10.0  # every read counts as quick
    inline = [_ids(window) for window in quick.train_windows(epoch=1)]
    assert quick.read_ahead_steps == 0 and len(inline) == quick.steps_per_epoch

    [slow] = _workers(_cfg("data.prefetch_batches=4"), root, 1)
    slow.inline_read_s = 0.0  # every read counts as slow
    assert [_ids(window) for window in slow.train_windows(epoch=1)] == inline
    assert slow.read_ahead_steps == slow.steps_per_epoch - 2  # a pass's first step is never judged
    assert [_ids(window) for window in slow.train_windows(epoch=1, skip_steps=5)] == inline[5:]
    [never] = _workers(_cfg("data.prefetch_batches=0"), root, 1)
    never.inline_read_s = 0.0
    assert [_ids(window) for window in never.train_windows(epoch=1)] == inline
    assert never.read_ahead_steps == 0


def test_resume_mid_epoch_skips_nothing_and_repeats_nothing(tmp_path):
    cfg = _cfg()
    root = _store(tmp_path)
    (whole,) = _workers(cfg, root, 1)
    full = [_ids(w) for w in whole.train_windows(epoch=0)]
    # 2 workers stop after step 7 (a consumer that breaks: the reader thread stops too) ...
    first = _workers(cfg, root, 2)
    head = []
    for step, window in enumerate(zip(*(w.train_windows(epoch=0) for w in first))):
        if step == 7:
            break
        head.append(sorted(i for w in window for micro in _ids(w) for i in micro))
    # ... and 4 workers resume 7 steps into the epoch (reading in their own thread this time)
    again = _workers(_cfg("data.prefetch_batches=0"), root, 4)
    tail = [sorted(i for w in window for micro in _ids(w) for i in micro)
            for window in zip(*(w.train_windows(epoch=0, skip_steps=7) for w in again))]
    assert len(head) == 7 and len(tail) == len(full) - 7
    assert head + tail == [sorted(i for micro in step for i in micro) for step in full]


def test_user_dict_batches_and_validation_once_across_ranks(tmp_path):
    cfg = _cfg("data.inputs=[x]")
    root = _store(tmp_path)
    spec = DataSpec("other", (), 0, ROWS, 50, "test", columns={"x": ((3,), "float32"), "y": ((), "int64")},
                    store=root)
    workers = [WorkerData(cfg, spec, rank, 2, torch.device("cpu")) for rank in range(2)]
    window = next(workers[0].train_windows(epoch=0))
    assert set(window[0]) == {"x", "y"} and window[0]["x"].dtype == torch.float32
    assert torch.equal(window[0]["x"][:, 0].long(), window[0]["y"])  # rows stay whole
    val = [int(v) for w in workers for batch in w.val_batches() for v in batch["y"]]
    assert sorted(val) == list(range(10_000, 10_050))  # every row once, the short chunk too


def test_chunk_rows_must_divide_the_micro_batch():
    with pytest.raises(ValueError, match="data.chunk_rows=3 must divide train.micro_batch_size=4"):
        _cfg("data.chunk_rows=3")
    with pytest.raises(ValueError, match="data.chunk_rows only applies to data.sharding='sharded'"):
        load_config(None, ["data.chunk_rows=4"])


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from raytrain_ddp.config import load_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.rundir import Location
    from raytrain_ddp.data.store import read_manifest
    from raytrain_ddp.data.worker_data import WorkerData

    def rss_mb():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

    root = Location.parse(sys.argv[1])
    rows = read_manifest(root / "train").rows
    cfg = load_config(None, ["model.name=mlp", "data.sharding=sharded", "train.global_batch_size=256",
                             "train.micro_batch_size=64", "data.val_fraction=0"])
    spec = DataSpec("classification", (1024,), 2, rows, 0, "test", store=root)
    data = WorkerData(cfg, spec, 0, 2, torch.device("cpu"))
    start, before, peak, seen = rss_mb(), None, 0.0, 0
    for epoch in range(2):
        for window in data.train_windows(epoch):
            seen += sum(len(y) for _x, y in window)
            before = before or rss_mb()  # after the first window: libraries and pools warm
            peak = max(peak, rss_mb())
    print(json.dumps({"start_mb": start, "before_mb": before, "peak_mb": peak, "rows_read": seen,
                      "steps": data.steps_per_epoch}))
""")


def test_worker_memory_is_its_window_not_the_data_set(tmp_path):
    """A store 5x the budget (~190 MB of float32 rows against 32 MB): a rank's RSS grows by
    its read-ahead window only, over two epochs of its share (run in a fresh process)."""
    rows, width = 48_000, 1024
    root = Location.parse(tmp_path) / "data"

    def tables():
        for start in range(0, rows, 4000):
            x = np.full((4000, width), 0.5, dtype=np.float32)
            yield pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width),
                            "y": np.arange(start, start + 4000) % 2})

    manifest = write_store(root / "train", tables(), 64, "fp")
    data_mb = sum(os.path.getsize(tmp_path / "data" / "train" / f) for f in manifest.files) / 2**20
    budget_mb = 32
    assert data_mb > 5 * budget_mb
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(root)], capture_output=True, text=True,
                         timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"data {data_mb:.0f} MB; worker RSS {found['start_mb']:.0f} MB at start, {found['before_mb']:.0f} MB "
          f"after its first step, peak {found['peak_mb']:.0f} MB over two epochs")
    assert found["rows_read"] == 2 * found["steps"] * 128  # its half of every step, two epochs
    assert found["peak_mb"] - found["before_mb"] < budget_mb


def test_read_ahead_keeps_order_bounds_its_window_raises_and_stops():
    import threading
    import time as _time

    from raytrain_ddp.data.worker_data import ReadAhead

    reads, lock = [], threading.Lock()

    def read(step):
        with lock:
            reads.append(step)
        return step * 10

    ahead = ReadAhead(read, range(6), 2)
    assert [ahead.next() for _ in range(7)] == [0, 10, 20, 30, 40, 50, None]
    ahead.close()

    slow = ReadAhead(read, range(100, 200), 3)
    _time.sleep(0.2)  # nobody takes anything: the first result is handed over alone, then the reader stops
    assert len([r for r in reads if r >= 100]) == 1
    assert slow.next() == 1000
    _time.sleep(0.2)  # the next group of 3 is read while the consumer works, handed over whole, then it stops
    assert len([r for r in reads if r >= 100]) == 4
    assert [slow.next() for _ in range(3)] == [1010, 1020, 1030]
    _time.sleep(0.2)  # never more than 2 x ahead read and not yet taken
    assert len([r for r in reads if r >= 100]) - 4 <= 2 * 3
    slow.close()  # while the reader waits for room: returns, the thread is gone
    assert not slow._thread.is_alive() and len([r for r in reads if r >= 100]) <= 7

    def broken(step):
        if step == 2:
            raise ValueError("bad chunk")
        return step

    failing = ReadAhead(broken, range(5), 4)
    assert [failing.next(), failing.next()] == [0, 1]
    with pytest.raises(ValueError, match="bad chunk"):
        failing.next()
    failing.close()
