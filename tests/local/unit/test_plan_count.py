"""`print_plan` counts the built-in model's parameters on the meta device, without building it for real (#42)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raytrain_ddp.config import load_config
from raytrain_ddp.driver.console import parameter_count
from raytrain_ddp.models import build_model

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("model, spec", [
    ("mlp", SimpleNamespace(task="classification", feature_shape=(20,), num_classes=4)),
    ("cnn", SimpleNamespace(task="classification", feature_shape=(3, 16, 16), num_classes=10)),
    ("gpt", SimpleNamespace(task="lm", feature_shape=(32,), num_classes=97))])
def test_the_meta_count_is_the_real_count_and_allocates_nothing(monkeypatch, model, spec):
    cfg = load_config("examples/configs/quickstart.yaml", [f"model.name={model}"])
    real = sum(p.numel() for p in build_model(cfg, spec).parameters())
    made: list[torch.device] = []
    original = torch.nn.Parameter.__new__

    def record(cls, data=None, requires_grad=True):
        made.append(data.device if data is not None else torch.device("cpu"))
        return original(cls, data, requires_grad)

    monkeypatch.setattr(torch.nn.Parameter, "__new__", record)
    assert parameter_count(cfg, spec) == real
    assert made and all(d.type == "meta" for d in made)
