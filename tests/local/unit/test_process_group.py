"""`driver/process_group.py`: Ray Train's controller gets a backend config and backend that
import no torch where they are unpickled, and that set the process group up as `TorchConfig` does.

One fresh interpreter stands in for the controller (a module fixture: one interpreter's
start, not three): it unpickles what the driver pickles, in order -- the config and the
survivors' shutdown grace first, each reporting whether torch was imported by then (it must
not be), then the backend, whose loader imports Ray's torch backend on a thread.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CONTROLLER = r"""
import pickle, sys
torch_free, backend = pickle.loads(sys.stdin.buffer.read())
for blob in torch_free:  # each on its own, in order: torch must still be absent after each
    obj = pickle.loads(blob)
    print(type(obj).__module__, type(obj).__qualname__, "torch" in sys.modules)
pickle.loads(backend)
from raytrain_ddp.driver import process_group
assert process_group._LOADING is not None
process_group._LOADING.join(60)
print("backend", "torch" in sys.modules)
"""


@pytest.fixture(scope="module")
def controller() -> list[tuple[str, ...]]:
    """What one controller-like interpreter printed: (module, qualname, torch loaded) for the
    config and the grace, then ("backend", torch loaded after its loader joined)."""
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.process_group import ProcessGroupBackend, ProcessGroupConfig
    from raytrain_ddp.recovery.restart import SurvivorsCopy

    (grace,) = SurvivorsCopy(load_config(None, [])).callbacks()
    payload = ([pickle.dumps(ProcessGroupConfig(backend="gloo", timeout_s=77)), pickle.dumps(grace)],
               pickle.dumps(ProcessGroupBackend()))
    out = subprocess.run([sys.executable, "-c", CONTROLLER], input=pickle.dumps(payload), capture_output=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return [tuple(line.split()) for line in out.stdout.decode().splitlines()]


def test_the_config_is_torch_config_s_own_fields_and_framework_without_torch(controller):
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
    assert controller[0] == ("raytrain_ddp.driver.process_group", "ProcessGroupConfig", "False")


def test_the_backend_loads_ray_s_torch_backend_on_a_thread_where_it_is_unpickled(controller):
    assert controller[2] == ("backend", "True"), controller


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


def test_replica_s_shutdown_grace_is_unpickled_without_torch(controller):
    from raytrain_ddp.config import load_config
    from raytrain_ddp.recovery.restart import SurvivorsCopy

    (grace,) = SurvivorsCopy(load_config(None, [])).callbacks()
    assert controller[1] == ("raytrain_ddp.recovery.restart", "GraceForSurvivors", "False")
    assert (grace.start_s, grace.finish_s) == (0.25, 4.0)
