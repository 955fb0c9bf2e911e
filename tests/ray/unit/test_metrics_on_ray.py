"""The metrics recorder against a real Ray instance: it never starts one after `ray.shutdown()`
(the recorder's pieces without Ray: tests/local/unit/test_metrics.py)."""

from __future__ import annotations

import os

import pytest


pytestmark = pytest.mark.timeout(60)


_RECORDER_OUTLIVES_RAY = r"""
import ray, sys, threading, time
from raytrain_ddp.driver.stream import Recorder, open_mailbox
from raytrain_ddp.rundir import Location
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
recorder = Recorder(Location.parse(sys.argv[1]), "f" * 32, [], open_mailbox()).__enter__()
(thread,) = [t for t in threading.enumerate() if t.name == "raytrain-ddp-recorder"]
time.sleep(1.0)
ray.shutdown()
# the event: the thread's next poll found Ray gone and ended (it polls every 0.5 s); a poll in flight
# when Ray shut down waits out its own get timeout (30.5 s), longer on a loaded machine
thread.join(timeout=90)
assert not thread.is_alive(), "the recorder's thread still polls 90 s after ray.shutdown()"
assert not ray.is_initialized(), "the recorder's thread started a new Ray instance"
recorder.stop()  # what atexit does after a user's fit (api.prepare_job)
assert not ray.is_initialized(), "stop() started a new Ray instance"
print("OK")
"""


@pytest.mark.timeout(200)
def test_recorder_outliving_ray_never_starts_a_new_instance(tmp_path):
    """Before: after `ray.shutdown()` the recorder's next mailbox call auto-initialised a new
    local Ray (at interpreter exit, in CI: a Ray started during finalisation, then a crash)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "-c", _RECORDER_OUTLIVES_RAY, str(tmp_path)], capture_output=True,
                          text=True, timeout=170, env=env)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Started a local Ray instance" not in done.stderr
