"""The user's model, loss and preprocess without Ray: import paths, the batch helper, the
driver's pipeline check, what travels with the job, and `raytrain-ddp export` files.

The bad-input cases go through the real command (`cli.main`) with Ray replaced by
a tripwire: each is one line naming its key, exit status 2, no traceback, and Ray is
never contacted. One case also runs as a separate `raytrain-ddp` process pointed at an
address where nothing listens, as `tests/local/reliability/test_input_rejection.py` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.batch import BatchFormat
from raytrain_ddp.config import ConfigError, load_config
from raytrain_ddp.cli import main
from raytrain_ddp.errors import UserError
from raytrain_ddp.export import export_run, load_model
from raytrain_ddp.job import DataSpec
from raytrain_ddp.user import UserCode, import_path_of, resolve, runtime_env
from raytrain_ddp.data.worker_data import TRAIN, VAL, WorkerData

pytestmark = pytest.mark.timeout(120)

CLI = Path(sys.executable).parent / "raytrain-ddp"

USER_MODULE = """
import numpy as np
import torch
from torch import nn

def build(spec, hidden=8):
    return nn.Sequential(nn.Linear(spec.feature_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, spec.num_classes))

def not_a_module(spec):
    return {"weights": 1}

def two_by_five(spec):
    return nn.Sequential(nn.Linear(spec.feature_shape[0], 10), nn.Unflatten(1, (2, 5)))

def three_classes(spec):
    return nn.Linear(spec.feature_shape[0], 3)

def per_sample_loss(output, batch):
    return nn.functional.cross_entropy(output, batch[1], reduction="none")

def detached_loss(output, batch):
    return nn.functional.cross_entropy(output, batch[1]).detach()

def rename(batch):
    return {"pixels": batch["x"], "y": batch["y"]}

def boom(batch):
    return {"x": batch["x"] / batch["missing"], "y": batch["y"]}

def scale(batch):
    return {"x": np.stack(batch["x"]) * 2.0, "y": batch["y"]}

class Named(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        self.linear = nn.Linear(width, classes)

    def forward(self, x):
        return self.linear(x)

def named(spec):
    return Named(spec.feature_shape[0], spec.num_classes)

NOT_CALLABLE = 3

def metrics_ok(output, batch):
    pred = output.argmax(-1)
    return {"err": (pred != batch[1]).float().mean(), "hits": ((pred == batch[1]).sum(), len(batch[1]))}

def metrics_list(output, batch):
    return [1.0]

def metrics_vector(output, batch):
    return {"per_class": output.mean(0)}

def metrics_boom(output, batch):
    return {"x": 1 / 0}

def metrics_clash(output, batch):
    return {"accuracy": 1.0}

def outputs(spec, n=1):
    return nn.Linear(spec.feature_shape[0], n)

def mse(output, batch):
    return nn.functional.mse_loss(output, batch[1])

def nll(output, batch):
    return nn.functional.nll_loss(output, batch[1].long())
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A module in a temporary directory that is on no path, and a config beside it."""
    (tmp_path / "usermods.py").write_text(USER_MODULE)
    (tmp_path / "broken.py").write_text("raise RuntimeError('cannot even import')\n")
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  name: 'usermods:build'\ndata:\n  source: digits\n")
    monkeypatch.chdir(tmp_path.parent)  # neither cwd nor sys.path holds it
    yield tmp_path
    for name in ("usermods", "broken"):
        sys.modules.pop(name, None)


def test_import_paths_resolve_next_to_the_config_and_are_shipped(user_dir):
    cfg, code = resolve(load_config(user_dir / "run.yaml"), config_path=user_dir / "run.yaml")
    assert code.model.__name__ == "build" and code.loss is None and code.preprocess is None
    assert runtime_env(code) == {"py_modules": [str(user_dir / "usermods.py")]}
    # installed packages stay home; a module of one's own travels (this test file, too)
    assert runtime_env(UserCode(model=nn.Linear, loss=torch.nn.functional.mse_loss)) == {}
    assert runtime_env(UserCode(loss=lambda o, b: o)) == {"py_modules": [str(Path(__file__).resolve())]}
    spec = DataSpec("classification", (64,), 10, 100, 0, "t")
    model = code.build_model(load_config(None, ["model.name=usermods:build", "model.kwargs={hidden: 5}"]), spec)
    assert model[0].out_features == 5


def test_config_takes_builtin_names_or_import_paths():
    assert load_config(None, ["model.name=pkg.mod:make", "train.loss=model", "data.preprocess=a.b:c"]).model.name == "pkg.mod:make"
    for override, needle in [("model.name=resnet", "model.name"), ("train.loss=mse", "train.loss"),
                             ("data.preprocess=decode", "data.preprocess"),
                             ("model.kwargs={a: 1}", "model.kwargs is for a model factory"),
                             ("data.val_path=v.parquet", "data.val_path needs data.source='parquet'")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [override])


def test_resolve_records_python_callables_in_the_config():
    def factory(spec):
        return nn.Linear(2, 2)

    cfg, code = resolve(load_config(None), model=factory, loss=lambda o, b: o.sum())
    assert cfg.model.name == f"{__name__}:test_resolve_records_python_callables_in_the_config.<locals>.factory"
    assert cfg.train.loss.endswith(":test_resolve_records_python_callables_in_the_config.<locals>.<lambda>")
    assert code.model is factory and import_path_of(factory) == cfg.model.name
    with pytest.raises(UserError, match="train.loss: expected a function, got a int"):
        resolve(load_config(None), loss=3)


@pytest.fixture
def no_ray(monkeypatch):
    """Reaching Ray at all is a failure: the checks must come first."""
    import raytrain_ddp.driver.launcher as launcher

    def tripwire(*args, **kwargs):
        raise AssertionError("Ray was contacted before the user's code was checked")

    monkeypatch.setattr(launcher, "connect_ray", tripwire)
    monkeypatch.setattr(launcher, "connect_user_code", tripwire)


BAD_INPUTS = [
    (["model.name=nosuchmodule:build"], "model.name='nosuchmodule:build': no module named 'nosuchmodule'"),
    (["model.name=broken:build"], "model.name='broken:build': importing 'broken' failed: RuntimeError: cannot even import"),
    (["model.name=usermods:missing"], "module 'usermods' has no attribute 'missing'"),
    (["model.name=usermods:NOT_CALLABLE"], "model.name='usermods:NOT_CALLABLE' is a int, not a function"),
    (["model.name=usermods:not_a_module"], "the factory returned a dict, not a torch.nn.Module"),
    (["model.kwargs={bogus: 1}"], "model.name='usermods:build': the factory raised TypeError: build() got an unexpected"),
    (["data.preprocess=usermods:rename"],
     "data.preprocess='usermods:rename': its result has no column 'x' (data.features); it returned columns ['pixels', 'y']"),
    # the user's file:line, not ours (issue #30)
    (["data.preprocess=usermods:boom"], "usermods.py:28 in boom) on the first 8 rows"),
    (["train.loss=usermods:per_sample_loss"], "train.loss='usermods:per_sample_loss' returned a tensor of shape [8], not a scalar"),
    (["train.loss=usermods:detached_loss"], "does not depend on the model's parameters"),
    (["model.name=usermods:three_classes"], "but the model outputs 3 classes"),
    (["data.inputs=[x]", "model.name=usermods:named", "data.preprocess=usermods:scale"], None),  # dict batches, model(x=...): a good pipeline gets as far as Ray
    # train.metrics: run on the sample batch, its result checked (issue #30)
    (["train.metrics=usermods:metrics_ok"], None),
    (["train.metrics=usermods:metrics_list"],
     "train.metrics='usermods:metrics_list': returned a list; it must return a dict of name -> value"),
    (["train.metrics=usermods:metrics_vector"], "metric 'per_class' is a Tensor of shape (10,); it must be one number"),
    (["train.metrics=usermods:metrics_boom"], "train.metrics='usermods:metrics_boom' raised ZeroDivisionError"),
    (["train.metrics=usermods:metrics_clash"], "metric 'accuracy' would replace the built-in val_accuracy"),
    (["model.name=cnn", "data.preprocess=usermods:scale"], "the built-in cnn takes (channels, height, width) rows: reshape them in data.preprocess"),
    (["model.name=usermods:two_by_five"], "the model's output has shape [8, 2, 5] but label column 'y' (data.label) has shape [8]"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUTS)
def test_bad_user_code_is_one_line_before_ray(user_dir, no_ray, capsys, overrides, message):
    argv = ["train", str(user_dir / "run.yaml"), f"run.storage_path={user_dir / 'runs'}", *overrides]
    if message is None:  # the good case reaches Ray (the tripwire), so it passed every check
        with pytest.raises(AssertionError, match="Ray was contacted"):
            main(argv)
        return
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("raytrain-ddp: error: "), err
    assert message in err, err
    assert "Traceback" not in err and not (user_dir / "runs").exists()


REGRESSION_MISTAKES = [  # #57: a float (B, 1) target from parquet, as a torchrun tutorial has it
    (["model.kwargs={n: 5}", "train.loss=usermods:mse"],
     "train.loss='usermods:mse': the model's output of shape [8, 5] and label column 'y' (data.label) of shape "
     "[8, 1] differ, and the loss would broadcast one against the other; make the model's output the label's "
     "shape (or reshape in the loss)"),
    (["model.kwargs={n: 5}", "train.loss=usermods:nll"],
     "train.loss='usermods:nll' raised RuntimeError: 0D or 1D target tensor expected, multi-target not supported "
     "(at {dir}/usermods.py:69 in nll) on the model's output of shape [8, 5] and label column 'y' (data.label) of shape [8, 1]"),
    (["model.name=mlp", "model.kwargs={}"], "{path}: column 'y' (data.label) holds a float or vector target (regression); "
     "model.name='mlp' is a classifier: give your own model ('package.module:factory') and train.loss (docs/byo.md)"),
    (["train.loss=usermods:mse"], None),  # the shapes agree: it gets as far as Ray
]


@pytest.mark.parametrize("overrides, message", REGRESSION_MISTAKES)
def test_regression_mistakes_are_one_line_before_ray(user_dir, no_ray, capsys, overrides, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = user_dir / "tut.parquet"
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"x": rng.standard_normal((128, 3)).tolist(), "y": rng.standard_normal((128, 1)).tolist()}), path)
    argv = ["train", str(user_dir / "run.yaml"), f"run.storage_path={user_dir / 'runs'}", "data.source=parquet",
            f"data.path={path}", "model.name=usermods:outputs", *overrides]
    if message is None:
        with pytest.raises(AssertionError, match="Ray was contacted"):
            main(argv)
        return
    assert main(argv) == 2
    assert capsys.readouterr().err == f"raytrain-ddp: error: {message.format(path=path, dir=user_dir.name)}\n"
    assert not (user_dir / "runs").exists()


def test_cli_process_rejects_a_bad_loss_without_a_traceback(user_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_DDP_")}
    env["RAY_ADDRESS"] = "127.0.0.1:9"  # discard port: joining Ray here would fail differently
    done = subprocess.run([str(CLI), "train", str(user_dir / "run.yaml"), f"run.storage_path={user_dir / 'runs'}",
                           "train.loss=usermods:per_sample_loss"], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "not a scalar" in done.stderr, done.stderr[-2000:]


def test_batch_format_tuple_dict_and_the_models_own_loss():
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    tuple_fmt = BatchFormat("x", "y")
    output, loss = tuple_fmt.run(model, tuple_fmt.assemble({"x": x, "y": y}))
    assert torch.equal(output, model(x)) and torch.allclose(loss, nn.functional.cross_entropy(model(x), y))
    assert tuple_fmt.rows((x, y)) == 5 and tuple_fmt.target((x, y)) is y

    class HFStyle(nn.Module):  # takes named inputs, returns its own loss, as Hugging Face models do
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, input_ids, labels):
            logits = self.linear(input_ids)
            return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}

    hf = HFStyle()
    dict_fmt = BatchFormat(label="labels", inputs=("input_ids", "labels"), loss_name="model")
    batch = dict_fmt.assemble({"input_ids": x, "labels": y, "weights": torch.ones(5)})
    output, loss = dict_fmt.run(hf, batch)
    assert set(batch) == {"input_ids", "labels", "weights"} and dict_fmt.rows(batch) == 5
    assert torch.equal(loss, output["loss"]) and dict_fmt.target(batch) is y


class _Shard:
    def __init__(self, batch):
        self.batch = batch

    def iter_batches(self, batch_size, batch_format):
        n = len(next(iter(self.batch.values())))
        for start in range(0, n, batch_size):
            yield {k: v[start:start + batch_size] for k, v in self.batch.items()}


def test_exact_sharding_slices_dict_batches_like_tuples():
    rows = 40
    batch = {"input_ids": np.arange(rows * 3).reshape(rows, 3), "labels": np.arange(rows, dtype=np.int64),
             "weight": np.linspace(0, 1, rows)}  # float64 -> float32
    spec = DataSpec("classification", (3,), 40, rows, 10, "t",
                    {"input_ids": ((3,), "int64"), "labels": ((), "int64"), "weight": ((), "float32")})
    cfg = load_config(None, ["data.inputs=[input_ids]", "data.label=labels", "train.global_batch_size=16",
                             "train.micro_batch_size=4", "scaling.num_workers=[1, 2]"])
    one = WorkerData(cfg, spec, 0, 1, torch.device("cpu"), shards={TRAIN: _Shard(batch), VAL: _Shard(batch)})
    two = [WorkerData(cfg, spec, r, 2, torch.device("cpu"), shards={TRAIN: _Shard(batch), VAL: _Shard(batch)})
           for r in range(2)]
    assert one.steps_per_epoch == two[0].steps_per_epoch == 2
    for step, (w1, *w2) in enumerate(zip(one.train_windows(1), *(d.train_windows(1) for d in two))):
        assert len(w1) == 4 and all(len(w) == 2 for w in w2)
        for micro in range(4):  # rank r's micro-batch m is one process's micro-batch m * W + r
            mine = w2[micro % 2][micro // 2]
            assert set(mine) == {"input_ids", "labels", "weight"} and mine["weight"].dtype == torch.float32
            for key in mine:
                assert torch.equal(mine[key], w1[micro][key]), (step, micro, key)
    val = [torch.cat([b["labels"] for b in d.val_batches()]) for d in two]
    assert sorted(torch.cat(val).tolist()) == list(range(rows))  # every row once over the ranks


def test_export_holds_the_bare_model_config_and_spec(tmp_path):
    spec = DataSpec("classification", (4,), 3, 10, 2, "t")
    cfg = load_config(None, ["model.name=pkg:factory"])
    model = nn.Linear(4, 3)
    state = {"model": model.state_dict(), "optimizer": {}, "progress": {"step": 7, "epoch": 1, "steps_into_epoch": 0},
             "run": {"config": cfg.to_yaml(), "spec": spec.state_dict(), "fit_id": "f" * 32, "world_size": 2}}
    ckpt.save_checkpoint(tmp_path / "run" / "checkpoint_00000007_e1s0_ffffffff", state)
    out = export_run(tmp_path / "run", tmp_path / "model.pt")
    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 7 and exported["config"] == cfg.to_yaml()
    assert DataSpec.from_state_dict(exported["spec"]) == spec
    loaded = load_model(out, factory=lambda spec: nn.Linear(spec.feature_shape[0], spec.num_classes))
    assert torch.equal(loaded.weight, model.weight) and not loaded.training
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "x.pt")]) == 2


def test_import_raytrain_ddp_stays_light():
    code = textwrap.dedent("""
        import sys, raytrain_ddp
        assert callable(raytrain_ddp.train) and callable(raytrain_ddp.prepare_job)
        assert "ray" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
