"""Config: typed, validated, errors name the key; the public key set is frozen."""

import re

import pytest

from raytrain_ddp.config import ConfigError, config_keys, load_config

pytestmark = pytest.mark.timeout(30)


def test_defaults_validate_and_roundtrip(tmp_path):
    cfg = load_config(None)
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_overrides_apply_with_yaml_types():
    cfg = load_config(None, ["train.lr=0.01", "scaling.num_workers=[1, 2]", "train.clip_grad_norm=null"])
    assert cfg.train.lr == 0.01
    assert cfg.scaling.num_workers == (1, 2) and cfg.scaling.elastic
    assert cfg.valid_worker_counts() == [1, 2]
    assert cfg.accumulation_steps(2) == 2 and cfg.accumulation_steps(1) == 4


def test_elastic_range_must_keep_global_batch_exact():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["scaling.num_workers=[1, 4]"])
    msg = str(err.value)
    assert "worker counts [3]" in msg and "valid counts are [1, 2, 4]" in msg and "[1, 2]" in msg
    cfg = load_config(None, ["scaling.num_workers=[1, 4]", "train.global_batch_size=192"])
    assert cfg.valid_worker_counts() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr=-1", "train.lr"),
        ("train.bogus=1", "train.bogus: unknown key"),
        ("model.name=resnet", "model.name"),
        ("scaling.num_workers=3", "scaling.num_workers=3"),
        ("data.source=parquet", "data.path"),
        ("parallel.strategy=zero3", "parallel.strategy"),
        ("scaling.num_workers=[4, 2]", "scaling.num_workers"),
        ("train.precision=fp16", "train.precision"),
        ("name=../etc", "name"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_one_checkpoint_cadence_at_a_time():
    assert load_config(None, ["run.checkpoint_every_epochs=5"]).run.checkpoint_every_epochs == 5
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run.checkpoint_every_epochs=5", "run.checkpoint_every_steps=20"])
    assert str(err.value).splitlines() == ["invalid configuration in <overrides>: run: run.checkpoint_every_epochs=5 and run.checkpoint_every_steps=20 "
                                           "are two cadences: set one of the two"], str(err.value)


def test_fp16_is_allowed_with_sharded_optimizer_state_on_gpu():
    """zero1 agrees on non-finite shards and FSDP2 on found_inf (docs/parallel.md, audit item 4)."""
    for strategy in ("zero1", "fsdp"):
        load_config(None, [f"parallel.strategy={strategy}", "train.precision=bf16"])
        cfg = load_config(None, [f"parallel.strategy={strategy}", "train.precision=fp16", "scaling.use_gpu=true"])
        assert cfg.train.precision == "fp16"
        with pytest.raises(ConfigError, match="scaling.use_gpu"):  # CPU autocast has no fp16
            load_config(None, [f"parallel.strategy={strategy}", "train.precision=fp16"])


def _refuses_ray_datasets(overrides: list[str], needle: str) -> None:
    """Ray Datasets from Python are refused by the launcher's row; map-style torch Datasets are not."""
    from raytrain_ddp.launch.table import given_refusal

    class RayDatasetLike:
        def map_batches(self, *a, **k): ...

    cfg = load_config(None, [*overrides, "data.source=datasets"])
    said = given_refusal(cfg, {"train": RayDatasetLike()})
    assert needle + ": Ray Datasets given from Python need it" in said and "\n" not in said, said
    assert given_refusal(cfg, {"train": [(1.0, 2.0)]}) == ""
    assert given_refusal(load_config(None, ["data.source=datasets"]), {"train": RayDatasetLike()}) == ""


def test_torchrun_launcher_needs_a_fixed_count_and_exact_data():
    for overrides, needle in ((["scaling.num_workers=[1,2]"], "scaling.num_workers"),
                              (["scaling.num_workers=0"], "scaling.num_workers"),
                              (["data.sharding=streaming"], "data.sharding=exact")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, ["scaling.launcher=torchrun", "train.global_batch_size=64", *overrides])
    _refuses_ray_datasets(["scaling.launcher=torchrun", "train.global_batch_size=64"], "launcher=torchrun runs without Ray")
    assert load_config(None, ["scaling.launcher=torchrun"]).scaling.launcher == "torchrun"


def test_local_mode_refuses_what_needs_ray_by_its_launcher_row_before_anything_starts():
    """The launcher table's `local` row (launch/table.py): exact data read in this process, no
    Ray Datasets; each row's launcher resolves, with launch/base.py's members."""
    from raytrain_ddp.launch import table as launchers

    with pytest.raises(ConfigError, match=re.escape("(local mode) reads the data in this process")):
        load_config(None, ["scaling.num_workers=0", "data.sharding=streaming"])
    _refuses_ray_datasets(["scaling.num_workers=0"], "(local mode) runs without Ray")
    assert launchers.of(load_config(None, ["scaling.num_workers=0"])).name == "local"
    assert [all(callable(getattr(row.cls(), m, None)) for m in ("start", "run", "close"))
            for row in launchers.LAUNCHERS.values()] == [True, True, True]


def test_batch_error_suggests_valid_values():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["scaling.num_workers=3"])
    msg = str(err.value)
    assert "valid train.global_batch_size" in msg and "48" in msg


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_public_key_set_is_frozen():
    """Growing the config surface is a deliberate act: update this list with the docs."""
    contract = {
        "name", "model.name", "data.source", "data.path", "data.features", "data.label",
        "data.val_fraction", "train.epochs", "train.max_steps", "train.global_batch_size",
        "train.micro_batch_size", "train.optimizer", "train.lr", "train.warmup_steps",
        "train.precision", "train.clip_grad_norm", "train.seed", "parallel.strategy",
        "parallel.bucket_cap_mb", "scaling.num_workers", "scaling.use_gpu", "run.storage_path",
        "run.log_every_steps", "run.checkpoint_every_steps", "run.num_to_keep",
        "run.max_failures", "run.resume",
        # issue #30: your optimizer, schedule and metrics
        "train.optimizer_kwargs", "train.no_decay", "train.schedule", "train.schedule_kwargs", "train.metrics",
        # issue #39: the workers of one machine started by torchrun, no Ray
        "scaling.launcher",
        # issue #39: the embedded instance's dashboard, off unless asked
        "run.dashboard",
        # issue #55: the step GPU users expect
        "train.compile", "train.compile_backend", "model.activation_checkpointing",
        # issue #57: "save every N epochs"; the task a target is, inferred or set
        "run.checkpoint_every_epochs", "data.task",
        # issue #55: validation off the training path
        "run.validation",
    }
    keys = set(config_keys())
    assert contract <= keys
    assert len(keys) == 85, sorted(keys - contract)
