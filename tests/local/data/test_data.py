"""Data checks and batching without Ray workers: parquet validation, sources, windows."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_ddp.config import load_config
from raytrain_ddp.data.sources import check_parquet, export_digits, load_digits_arrays, synthetic_arrays
from raytrain_ddp.job import DataSpec
from raytrain_ddp.data.worker_data import WorkerData
from raytrain_ddp.errors import DataError
from raytrain_ddp.models import build_model, cross_entropy

pytestmark = pytest.mark.timeout(60)


class FakeShard:
    """Stands in for a Ray Data iterator: `iter_batches` over in-memory numpy columns."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def iter_batches(self, batch_size: int, batch_format: str):
        for start in range(0, len(self.x), batch_size):
            yield {"x": self.x[start:start + batch_size], "y": self.y[start:start + batch_size]}


def _write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_digits_export_roundtrip(tmp_path):
    out = export_digits(str(tmp_path / "d" / "digits.parquet"))
    info = check_parquet(out, "x", "y")
    assert info.rows == 1797 and info.feature_shape == (64,) and info.num_classes == 10
    x, y = load_digits_arrays()
    assert x.shape == (1797, 64) and 0.0 <= x.min() and x.max() <= 1.0 and set(y) == set(range(10))
    # Read from the package's file without importing scikit-learn: the arrays load_digits gives.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    assert np.array_equal(x, (bunch.data / 16.0).astype(np.float32)) and x.dtype == np.float32
    assert np.array_equal(y, bunch.target.astype(np.int64)) and y.dtype == np.int64


@pytest.mark.parametrize(
    "columns, needle",
    [
        ({"x": pa.array([[1.0, 2.0]] * 4), "label": pa.array([0, 1, 0, 1])}, "column 'y' (data.label) not found"),
        ({"x": pa.array([[1.0, 2.0]] * 4), "y": pa.array([0, None, 0, 1])}, "'y' (data.label) has 1 null"),
        ({"x": pa.array(["a", "b", "c", "d"]), "y": pa.array([0, 1, 0, 1])}, "'x' (data.features) has type string"),
        ({"x": pa.array([[1.0, 2.0]] * 4), "y": pa.array(["a", "b", "a", "b"])},
         "'y' (data.label) has type string; it must hold numbers: integer class ids, or a float / vector target"),
        ({"x": pa.array([[1.0, 2.0]] * 4), "y": pa.array([[0.5], [1.0, 2.0], [0.0], [1.0]])}, "different lengths"),
        ({"x": pa.array([[1.0, 2.0], [1.0], [1.0, 2.0], [3.0, 4.0]]), "y": pa.array([0, 1, 0, 1])}, "different lengths"),
        ({"x": pa.array([[1.0, 2.0]] * 4), "y": pa.array([0, -1, 0, 1])}, "negative"),
        ({"x": pa.array([], pa.list_(pa.float32())), "y": pa.array([], pa.int64())}, "zero rows"),
    ],
)
def test_bad_parquet_named(tmp_path, columns, needle):
    path = _write(tmp_path / "bad.parquet", **columns)
    with pytest.raises(DataError) as err:
        check_parquet(path, "x", "y")
    assert needle in str(err.value)
    if "zero rows" not in needle:
        assert "bad.parquet" in str(err.value)


def test_any_target_type_from_parquet_as_from_python(tmp_path):
    """#57: integer labels are classes, floats and vectors a regression target, on every route:
    parquet's check (`task_of`), the columns the model gets, and the Python route's `spec_columns`."""
    from raytrain_ddp.data.columns import column_arrays, user_column_arrays
    from raytrain_ddp.data.sources import check_source
    from raytrain_ddp.user import spec_columns

    cfg = load_config(None, ["model.name=my.mod:factory", "train.loss=my.mod:mse"])
    x = pa.array([[1.0, 2.0]] * 4)
    for name, label, task, shape in (("int", pa.array([0, 1, 2, 1]), "classification", ()),
                                     ("float", pa.array([0.5, 1.0, 0.0, 1.5]), "other", ()),
                                     ("vector", pa.array([[0.5, 1.0]] * 4), "other", (2,)),
                                     ("one", pa.array([[0.5]] * 4, pa.list_(pa.float64())), "other", (1,))):
        info = check_parquet(_write(tmp_path / f"{name}.parquet", x=x, y=label), "x", "y")
        assert info.task == task and info.num_classes == (3 if task == "classification" else 0), name
        spec = DataSpec(info.task, (2,), info.num_classes, 4, 0, "t")
        batch = {"x": np.stack(x.to_numpy(zero_copy_only=False)), "y": np.array(label.to_pylist())}
        y = column_arrays(batch, cfg, spec)["y"]
        assert y.dtype == (np.int64 if task == "classification" else np.float32) and y.shape == (4, *shape), name
        assert spec_columns(cfg, {"x": ((2,), "float32"), "y": (shape, str(y.dtype))})[0] == task, name
    # data.task set: integer counts as a regression target, float32 on both routes; classification refuses floats
    counts = _write(tmp_path / "counts.parquet", x=x, y=pa.array([3, 0, 7, 1]))
    regression = load_config(None, ["model.name=my.mod:factory", "train.loss=my.mod:mse", "data.task=regression",
                                    "data.source=parquet", f"data.path={counts}", "data.val_fraction=0",
                                    "train.global_batch_size=4", "train.micro_batch_size=2", "scaling.num_workers=1"])
    info = check_source(regression)
    assert info.task == "other" and spec_columns(regression, {"y": ((), "int64")})[0] == "other"
    assert user_column_arrays({"x": np.ones((4, 2)), "y": np.arange(4)}, regression)["y"].dtype == np.float32
    classify = load_config(None, ["data.task=classification", "data.source=parquet",
                                  f"data.path={tmp_path / 'float.parquet'}"])
    with pytest.raises(DataError, match="data.task=classification: column 'y' \\(data.label\\) of .*float.parquet "
                                        "does not hold integer class ids"):
        check_source(classify)


def test_schemas_must_agree_across_files(tmp_path):
    _write(tmp_path / "a.parquet", x=pa.array([[1.0, 2.0]] * 4), y=pa.array([0, 1, 0, 1]))
    _write(tmp_path / "b.parquet", x=pa.array([[1.0, 2.0]] * 4), y=pa.array(["0", "1", "0", "1"]))
    with pytest.raises(DataError, match=r"b\.parquet: column 'y' has type string, but .*a\.parquet has int64"):
        check_parquet(str(tmp_path), "x", "y")


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        check_parquet(str(tmp_path / "nope"), "x", "y")
    with pytest.raises(DataError, match="no \\*.parquet files"):
        check_parquet(str(tmp_path), "x", "y")


def test_synthetic_is_seeded_and_learnable_shapes():
    cfg = load_config(None, ["data.source=synthetic", "model.name=mlp", "data.synthetic.rows=64",
                             "data.synthetic.feature_dim=16", "data.synthetic.num_classes=4"])
    x1, y1 = synthetic_arrays(cfg)
    x2, y2 = synthetic_arrays(cfg)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.shape == (64, 16) and y1.max() < 4
    gpt = load_config(None, ["data.source=synthetic", "model.name=gpt", "data.synthetic.rows=8",
                             "data.synthetic.seq_len=12", "data.synthetic.num_classes=50"])
    tokens, targets = synthetic_arrays(gpt)
    assert tokens.shape == targets.shape == (8, 12)
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])  # next-token targets


def _worker(cfg, spec, rank, world, x, y):
    return WorkerData(cfg, spec, rank, world, torch.device("cpu"), shards={"train": FakeShard(x, y)})


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_windows_cover_the_same_samples_at_any_world_size(world):
    """The union over ranks of optimizer step s's micro-batches is the same set for every
    world size: the property that makes elastic resizing keep the optimisation identical."""
    cfg = load_config(None, ["model.name=mlp", "train.global_batch_size=24", "train.micro_batch_size=2",
                             "scaling.num_workers=[1, 4]"])
    rows = 100  # not a multiple of the global batch: 4 full steps, 4 rows dropped
    x = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    y = np.arange(rows)
    spec = DataSpec("classification", (1,), rows, rows, 0, "test")
    per_step: list[set[int]] = []
    workers = [_worker(cfg, spec, r, world, x, y) for r in range(world)]
    assert {w.steps_per_epoch for w in workers} == {4}
    assert {w.accumulation_steps for w in workers} == {24 // (2 * world)}
    streams = [list(w.train_windows(epoch=3)) for w in workers]
    for step in range(4):
        seen = [int(v) for s in streams for (xb, _) in s[step] for v in xb.flatten()]
        assert len(seen) == len(set(seen)) == 24  # disjoint across ranks and micro-steps
        per_step.append(set(seen))
    reference = [set(int(v) for v in torch.randperm(rows, generator=torch.Generator().manual_seed(3))[s * 24:(s + 1) * 24])
                 for s in range(4)]
    assert per_step == reference
    # resume mid-epoch: skipping 2 steps yields exactly the remaining windows
    resumed = list(workers[0].train_windows(epoch=3, skip_steps=2))
    assert [torch.equal(a[0][0], b[0][0]) for a, b in zip(resumed, streams[0][2:])] == [True, True]


def test_epochs_reshuffle_but_agree_across_ranks():
    cfg = load_config(None, ["model.name=mlp", "train.global_batch_size=8", "train.micro_batch_size=4"])
    x = np.arange(32, dtype=np.float32).reshape(32, 1)
    spec = DataSpec("classification", (1,), 32, 32, 0, "test")
    a, b = _worker(cfg, spec, 0, 2, x, np.arange(32)), _worker(cfg, spec, 1, 2, x, np.arange(32))
    assert torch.equal(a.epoch_order(32, 0), b.epoch_order(32, 0))
    assert not torch.equal(a.epoch_order(32, 0), a.epoch_order(32, 1))


def test_val_batches_split_rows_once_across_ranks():
    cfg = load_config(None, ["model.name=mlp", "train.global_batch_size=8", "train.micro_batch_size=4"])
    x = np.arange(32, dtype=np.float32).reshape(32, 1)
    spec = DataSpec("classification", (1,), 32, 32, 11, "test")
    seen = []
    for rank in range(2):
        w = WorkerData(cfg, spec, rank, 2, torch.device("cpu"),
                       shards={"train": FakeShard(x, np.arange(32)), "val": FakeShard(x[:11], np.arange(11))})
        seen += [int(v) for xb, _ in w.val_batches() for v in xb.flatten()]
    assert sorted(seen) == list(range(11))


@pytest.mark.parametrize("name, shape, task, classes", [
    ("mlp", (64,), "classification", 10), ("cnn", (1, 8, 8), "classification", 10), ("gpt", (12,), "lm", 50),
])
def test_models_build_and_give_a_finite_loss(name, shape, task, classes):
    cfg = load_config(None, [f"model.name={name}", "model.d_model=32", "model.n_heads=2"])
    spec = DataSpec(task, shape, classes, 100, 0, "test")
    model = build_model(cfg, spec)
    x = torch.randint(0, classes, (3,) + shape) if task == "lm" else torch.rand((3,) + shape)
    y = torch.randint(0, classes, (3,) + shape) if task == "lm" else torch.randint(0, classes, (3,))
    loss = cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)


def test_articles_mlp_shape():
    cfg = load_config(None, ["model.name=mlp"])
    model = build_model(cfg, DataSpec("classification", (1024,), 256, 10, 0, "t"))
    shapes = [tuple(p.shape) for p in model.parameters() if p.dim() == 2]
    assert shapes == [(1024, 1024), (1024, 1024), (256, 1024)]


def test_a_map_style_torch_dataset_becomes_the_rows_ray_data_would_make():
    """#57: `datasets={"train": ds}` takes a torch Dataset as it is: (x, y) or dict samples, any
    shapes (images keep theirs), read in index order; what cannot be rows is one line naming it."""
    from ray.data.block import BlockAccessor

    from raytrain_ddp.data.given import check_given, read_map_style
    from raytrain_ddp.errors import UserError

    cfg = load_config(None)
    images = torch.utils.data.TensorDataset(torch.arange(48.0).reshape(4, 1, 3, 4), torch.tensor([0.5, 1.0, 1.5, 2.0]))
    given = read_map_style({"train": images, "val": [{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 0}]}, cfg)
    check_given(given)
    train = BlockAccessor.for_block(given["train"]).to_batch_format("numpy")
    assert train["x"].shape == (4, 1, 3, 4) and np.array_equal(train["x"][2], images[2][0].numpy())
    assert train["y"].dtype == np.float32 and list(train["y"]) == [0.5, 1.0, 1.5, 2.0]
    assert given["val"].column("y").to_pylist() == [1, 0]
    for bad, says in (([(torch.ones(2), 1, 2)], "datasets['train'] (list)[0] is a tuple of 3 values; every sample must be (x, y)"),
                      ([torch.ones(2)], "datasets['train'] (list)[0] is a Tensor; every sample"),
                      ([{"x": 1}, {"z": 2}], "[1] is a dict of columns ['z'], not ['x']; every sample"),
                      ([(torch.ones(2), 1), (torch.ones(3), 1)], "column 'x' has samples of different shapes")):
        with pytest.raises(UserError, match=re.escape(says)):
            read_map_style({"train": bad}, cfg)
