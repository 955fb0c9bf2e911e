"""`driver/process_group.py`: Ray Train's controller gets a backend config and backend that
import no torch where they are unpickled, and that set the process group up as `TorchConfig` does.

Fresh interpreters stand in for the controller: each unpickles what the driver pickles and
reports whether torch was imported (it must not be, until the backend's loader runs).
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

UNPICKLE = r"""
import pickle, sys
obj = pickle.loads(sys.stdin.buffer.read())
print(type(obj).__module__, type(obj).__qualname__, "torch" in sys.modules)
"""


def _unpickled_elsewhere(obj) -> tuple[str, str, bool]:
    out = subprocess.run([sys.executable, "-c", UNPICKLE], input=pickle.dumps(obj), capture_output=True, timeout=90)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    module, name, torch_loaded = out.stdout.decode().split()
    return module, name, torch_loaded == "True"


def test_the_config_is_torch_config_s_own_fields_and_framework_without_torch():
    from ray.train.torch import TorchConfig

    from raytrain_ddp.driver.process_group import ProcessGroupBackend, ProcessGroupConfig

    ours = ProcessGroupConfig(backend="gloo", timeout_s=77)
    theirs = TorchConfig(backend="gloo", timeout_s=77)
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(TorchConfig)]
    assert ours.torch_config() == theirs and ours.to_dict() == theirs.to_dict()
    assert ours.framework == theirs.framework and ours.train_func_context is theirs.train_func_context
    assert ours.backend_cls is ProcessGroupBackend
    for flag in ("share_cuda_visible_devices", "has_replica_groups"):
        assert getattr(ProcessGroupBackend, flag) == getattr(theirs.backend_cls, flag), flag
    assert _unpickled_elsewhere(ours) == ("raytrain_ddp.driver.process_group", "ProcessGroupConfig", False)


def test_the_backend_loads_ray_s_torch_backend_on_a_thread_where_it_is_unpickled():
    from raytrain_ddp.driver.process_group import ProcessGroupBackend

    script = r"""
import pickle, sys, time
backend = pickle.loads(sys.stdin.buffer.read())
from raytrain_ddp.driver import process_group
assert process_group._LOADING is not None
process_group._LOADING.join(60)
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(ProcessGroupBackend()),
                         capture_output=True, timeout=90)
    assert out.returncode == 0 and out.stdout.decode().split() == ["True"], out.stderr.decode()[-3000:]


def test_the_backend_hands_every_call_to_ray_s_torch_backend_with_the_equal_torch_config(monkeypatch):
    from ray.train.torch import TorchConfig

    from raytrain_ddp import ray_compat
    from raytrain_ddp.driver.process_group import ProcessGroupBackend, ProcessGroupConfig

    calls = []

    class Recording:
        def __getattr__(self, hook):
            return lambda group, config: calls.append((hook, group, config))

    monkeypatch.setattr(ray_compat, "torch_backend", lambda: Recording)
    config = ProcessGroupConfig(backend="gloo", timeout_s=5)
    backend = ProcessGroupBackend()
    backend.on_start("group", config)
    backend.on_training_start("group", config)
    backend.on_shutdown("group", config)
    expected = TorchConfig(backend="gloo", timeout_s=5)
    assert calls == [(hook, "group", expected) for hook in ("on_start", "on_training_start", "on_shutdown")]


def test_replica_s_shutdown_grace_is_unpickled_without_torch():
    from raytrain_ddp.config import load_config
    from raytrain_ddp.recovery.restart import SurvivorsCopy

    (grace,) = SurvivorsCopy(load_config(None, [])).callbacks()
    assert _unpickled_elsewhere(grace) == ("raytrain_ddp.recovery.restart", "GraceForSurvivors", False)
    assert (grace.start_s, grace.finish_s) == (0.25, 4.0)
