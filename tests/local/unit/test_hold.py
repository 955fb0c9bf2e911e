"""The run directory's hold (driver/hold.py), locally and in a bucket on moto (127.0.0.1). No Ray.

Each case runs on both stores: take, refuse and release; a holder whose pid is gone on
this host (exited, a zombie, SIGKILLed while holding) is taken over at once; another
host's holder is refused while its heartbeat is fresh and taken over once it is stale;
the heartbeat thread keeps the record fresh and notices a takeover.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from _moto import s3_bucket
from raytrain_ddp.config import load_config
from raytrain_ddp.driver import hold
from raytrain_ddp.driver.resume import resolve_resume
from raytrain_ddp.rundir import HOLD_FILE, run_dir_of

pytestmark = pytest.mark.timeout(120)

BUCKET = "raytrain-hold"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_bucket(tmp_path_factory.mktemp("moto"), BUCKET) as env:
        yield env


@pytest.fixture(autouse=True)
def _quick_settle(monkeypatch):
    monkeypatch.setattr(hold, "SETTLE_S", 0.2)  # the read-back's wait: its value is not what is tested


@pytest.fixture(params=["local", "s3"])
def cfg(request, tmp_path):
    """A run on local disk, or in the bucket under a prefix of its own."""
    if request.param == "s3":
        request.getfixturevalue("s3")
        storage = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    else:
        storage = str(tmp_path / "runs")
    return load_config(None, [f"run.storage_path={storage}", "name=same"])


def _write(cfg, **fields) -> None:
    """A hold record as another fit would leave it."""
    now = time.time()
    record = {"host": "elsewhere", "pid": 4242, "fit_id": "a" * 32, "started": now - 60, "heartbeat": now,
              "pid_start": None, **fields}
    (run_dir_of(cfg) / HOLD_FILE).write_text(json.dumps(record))


class _Clock:
    """The hold module's `time`, whose `sleep` only records how long it was asked to wait."""

    def __init__(self, waits: list[float]) -> None:
        self.waits = waits

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


def _holder(cfg) -> dict:
    return json.loads((run_dir_of(cfg) / HOLD_FILE).read_text())


def test_take_refuse_release(cfg, monkeypatch):
    run_dir = run_dir_of(cfg)
    held = hold.take(cfg, "1" * 32)
    try:
        assert _holder(cfg)["pid"] == os.getpid() and _holder(cfg)["fit_id"] == "1" * 32
        never = load_config(None, [f"run.storage_path={cfg.run.storage_path}", "name=same", "run.resume=never"])
        assert resolve_resume(never, run_dir) is None  # its own hold is not "an existing run"
        # "refused without waiting": neither refusal sleeps (a wall-clock bound failed on a busy
        # machine, where two reads of the bucket alone took over a second)
        waits: list[float] = []
        with monkeypatch.context() as patched:
            patched.setattr(hold, "time", _Clock(waits))
            for attempt in (lambda: hold.take(cfg, "2" * 32), lambda: hold.refuse_if_held(cfg)):
                with pytest.raises(hold.RunHeld) as refused:
                    attempt()
                message = str(refused.value)
                assert "\n" not in message and str(run_dir) in message
                for part in (f"pid {os.getpid()}", "fit 11111111", "started ", "s ago;", "name=same-2",
                             "run.resume=latest", "20 s after its last heartbeat"):
                    assert part in message, message
        assert waits == []  # refused without waiting
        assert _holder(cfg)["fit_id"] == "1" * 32  # the holder's record untouched
    finally:
        held.release()
    assert not (run_dir / HOLD_FILE).exists()
    if run_dir.is_local:
        assert not run_dir.exists()  # nothing else was written: no run directory left behind
    hold.take(cfg, "3" * 32).release()  # free again


def test_a_holder_on_this_host_whose_pid_is_gone_is_taken_over_at_once(cfg, capsys, monkeypatch):
    exited = subprocess.Popen(["true"])
    exited.wait()
    zombie = subprocess.Popen(["sleep", "30"])
    zombie.kill()  # not waited for yet: a zombie, which os.kill(pid, 0) would still find
    me = hold.Holder.me("x")
    try:
        for record in ({"pid": exited.pid}, {"pid": zombie.pid},
                       {"pid": os.getpid(), "pid_start": "1"}):  # our pid, reused by another process
            _write(cfg, host=me.host, **record)  # a fresh heartbeat: only the pid says it is gone
            waits: list[float] = []
            with monkeypatch.context() as patched:  # at once: one read-back wait, nothing more
                patched.setattr(hold, "time", _Clock(waits))
                held = hold.take(cfg, "b" * 32)
            assert waits == [hold.SETTLE_S], waits
            assert _holder(cfg)["fit_id"] == "b" * 32
            held.release()
            assert f"pid {record['pid']} no longer runs" in capsys.readouterr().err
    finally:
        zombie.wait()


def test_another_hosts_holder_is_refused_while_fresh_and_taken_over_once_stale(cfg, capsys):
    _write(cfg, heartbeat=time.time() - hold.STALE_S + 5)
    # 15 s when read at once; a bucket on a loaded machine has taken a second more
    with pytest.raises(hold.RunHeld, match="host elsewhere, pid 4242, fit aaaaaaaa, .* last heartbeat 1[5-7] s ago"):
        hold.take(cfg, "b" * 32)
    assert _holder(cfg)["host"] == "elsewhere"
    _write(cfg, heartbeat=time.time() - hold.STALE_S - 1)
    held = hold.take(cfg, "b" * 32)
    assert _holder(cfg)["fit_id"] == "b" * 32
    assert re.search(r"its last heartbeat is 2[1-3] s old \(stale after 20 s\)", capsys.readouterr().err)
    held.release()


def test_heartbeat_refreshes_and_a_taken_over_hold_is_left_alone(cfg, monkeypatch, capsys):
    monkeypatch.setattr(hold, "HEARTBEAT_S", 0.2)
    held = hold.take(cfg, "c" * 32)
    first = _holder(cfg)["heartbeat"]
    deadline = time.monotonic() + 10
    while _holder(cfg)["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _holder(cfg)["heartbeat"] > first
    deadline = time.monotonic() + 10
    while held.lost is None and time.monotonic() < deadline:
        _write(cfg, fit_id="d" * 32)  # someone judged us stale and took over (again, if a beat just overwrote it)
        time.sleep(0.3)
    assert held.lost is not None and "took this run's hold over" in capsys.readouterr().err
    held.release()
    assert _holder(cfg)["fit_id"] == "d" * 32  # not ours to delete


def test_a_sigkilled_holder_is_taken_over_at_once(cfg, tmp_path, monkeypatch, capsys):
    """A real process takes the hold and is SIGKILLed holding it; the next take does not wait."""
    code = ("import sys, time; from raytrain_ddp.config import load_config; from raytrain_ddp.driver import hold;"
            f"hold.take(load_config(None, {[f'run.storage_path={cfg.run.storage_path}', 'name=same']!r}), 'e' * 32);"
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(hold.RunHeld, match=f"pid {holder.pid}"):
            hold.take(cfg, "f" * 32)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    capsys.readouterr()
    # "at once", without wall clock: its pid is gone (not its heartbeat stale: it beat just now),
    # and the only wait is the one read-back of the record it wrote
    waits: list[float] = []
    with monkeypatch.context() as patched:
        patched.setattr(hold, "time", _Clock(waits))
        held = hold.take(cfg, "f" * 32)
    assert f"pid {holder.pid} no longer runs" in capsys.readouterr().err
    assert waits == [hold.SETTLE_S], waits
    assert _holder(cfg)["fit_id"] == "f" * 32
    held.release()


def test_cli_and_python_api_refuse_a_held_run_before_ray(tmp_path, capsys, monkeypatch):
    """`raytrain-ddp train` and `raytrain_ddp.train(...)` of a run a live fit holds: exit 2 / `RunHeld`, no Ray."""
    import raytrain_ddp
    from raytrain_ddp.cli import main

    import raytrain_ddp.driver.launcher as launcher

    def tripwire(*args, **kwargs):
        raise AssertionError("Ray was contacted before the hold was checked")

    monkeypatch.setattr(launcher, "connect_ray", tripwire)  # (this session's Ray may be up already)
    monkeypatch.setattr(launcher, "connect_user_code", tripwire)
    overrides = [f"run.storage_path={tmp_path}", "name=busy"]
    held = hold.take(load_config(None, overrides), "7" * 32)
    try:
        assert main(["train", *overrides]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("raytrain-ddp: error: run directory ") and "\n" not in err and "fit 77777777" in err
        with pytest.raises(hold.RunHeld, match="fit 77777777"):
            raytrain_ddp.train(overrides=overrides)
        assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [HOLD_FILE]  # nothing else written
    finally:
        held.release()


def test_the_fit_that_takes_over_learns_the_dead_fit_s_resource_request_and_records_its_own(cfg, monkeypatch):
    """hold.json names the fit's request in Ray's autoscaling coordinator; the fit that takes
    the run over from a dead holder gets that holder's record (to cancel its request:
    driver/launcher.hand_over_request), and its own request survives the heartbeat."""
    monkeypatch.setattr(hold, "HEARTBEAT_S", 0.2)
    exited = subprocess.Popen(["true"])
    exited.wait()
    _write(cfg, host=hold.Holder.me("x").host, pid=exited.pid, requester="train-dead")
    held = hold.take(cfg, "e" * 32)
    try:
        assert held.taken_from is not None and held.taken_from.requester == "train-dead"
        held.record_requester("train-mine")
        assert _holder(cfg)["requester"] == "train-mine"
        beat = _holder(cfg)["heartbeat"]
        deadline = time.monotonic() + 10
        while _holder(cfg)["heartbeat"] == beat and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _holder(cfg)["heartbeat"] > beat and _holder(cfg)["requester"] == "train-mine"
    finally:
        held.release()
    fresh = hold.take(cfg, "f" * 32)  # released, not taken over: no dead holder
    assert fresh.taken_from is None
    fresh.release()


def test_a_fit_that_took_over_on_a_joined_cluster_cancels_the_dead_fit_s_request(monkeypatch):
    """`launcher.hand_over_request`: on a joined cluster the dead holder's request is cancelled
    (else an elastic fit waited for Ray to expire it: 167 s measured), on an embedded instance
    (it died with its fit) it is not; the fit's own request is recorded either way."""
    from raytrain_ddp import ray_compat
    from raytrain_ddp.driver import launcher

    cancelled: list[str] = []
    monkeypatch.setattr(ray_compat, "cancel_autoscaling_request", lambda requester: cancelled.append(requester) or True)
    monkeypatch.setattr(ray_compat, "train_requester", lambda trainer: f"train-{trainer}")

    class Held:
        def __init__(self, dead):
            self.taken_from, self.recorded = dead, []

        def record_requester(self, requester):
            self.recorded.append(requester)

    dead = hold.Holder("h", 1, "a" * 32, 0.0, 0.0, requester="train-old")
    for joined, taken_from, expected in ((True, dead, ["train-old"]), (False, dead, []), (True, None, [])):
        monkeypatch.setattr(ray_compat, "started_here", lambda: not joined)
        cancelled.clear()
        held = Held(taken_from)
        launcher.hand_over_request(held, "new")
        assert cancelled == expected and held.recorded == ["train-new"]
