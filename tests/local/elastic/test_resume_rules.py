"""What a resume may change (driver.resume.check_resume_config), without Ray: the worker
count is free, the model never, the data order only at an epoch boundary, the rest warns."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ddp.config import load_config
from raytrain_ddp.driver.resume import ResumeError, check_resume_config

pytestmark = pytest.mark.timeout(30)

BASE = ["model.name=mlp", "model.hidden_sizes=[16]", "train.global_batch_size=64", "train.micro_batch_size=16",
        "scaling.num_workers=2"]


def _state(steps_into_epoch: int, *overrides: str) -> dict:
    return {"progress": {"step": 10, "epoch": 0, "steps_into_epoch": steps_into_epoch},
            "run": {"config": load_config(None, BASE + list(overrides)).to_yaml()}}


def _check(state: dict, *overrides: str) -> list[str]:
    return check_resume_config(load_config(None, BASE + list(overrides)), state, Path("/ckpt"))


def test_execution_keys_are_free_even_mid_epoch(capsys):
    state = _state(3)
    assert _check(state, "scaling.num_workers=[1, 2]", "train.micro_batch_size=8", "parallel.strategy=native",
                  "run.checkpoint_every_steps=5", "train.epochs=20", "scaling.resize_interval_s=60") == []
    assert capsys.readouterr().err == ""


def test_model_change_is_refused_naming_the_key():
    with pytest.raises(ResumeError, match=r"model\.hidden_sizes: \[16\] -> \[32\].*Model keys must match"):
        _check(_state(0), "model.hidden_sizes=[32]")


def test_data_order_keys_only_at_an_epoch_boundary():
    for key in ("train.global_batch_size=128", "train.seed=7", "data.val_fraction=0.1"):
        with pytest.raises(ResumeError, match=r"3 steps into epoch 1.*only at an epoch boundary"):
            _check(_state(3), key)
        assert _check(_state(0), key) == []


def test_optimisation_changes_are_allowed_with_a_warning(capsys):
    assert _check(_state(3), "train.lr=0.1", "train.optimizer=sgd") == ["train.lr", "train.optimizer"]
    err = capsys.readouterr().err
    assert "train.lr: 0.003 -> 0.1" in err and "not follow the trajectory" in err


def test_checkpoints_without_a_recorded_config_are_not_checked():
    assert check_resume_config(load_config(None, BASE), {"step": 1, "steps_into_epoch": 1}, Path("/c")) == []
