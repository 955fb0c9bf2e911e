"""The pieces issue #25 added to survive faults in sequence, each without Ray's runtime.

- a fit hands Ray an empty checkpoint history (the private names `ray_compat.py`
  relies on are checked by name in `test_ray_compat.py`);
- the driver's Ctrl-C rides on the preemption poll: rank 0 asks, all ranks agree, and
  every boundary after it says "save and stop";
- the mailbox carries the stop request, and the summary counts only what this fit made;
- a Ctrl-C while the cluster has not placed the workers ends the wait (a flag the wait
  polls: Python's KeyboardInterrupt was once lost inside Ray's blocking calls, and the
  two-node test waited 120 s for an exit), and one just before the fit still stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from raytrain_ddp.config import Config
from raytrain_ddp.driver import placement
from raytrain_ddp.driver.interrupt import Interrupt
from raytrain_ddp.driver.stream import Mailbox, Recorder
from raytrain_ddp.rundir import Location
from raytrain_ddp.worker.meter import Outbox
from raytrain_ddp.worker.preemption import PreemptionGuard
from _clock import FakeClock

pytestmark = pytest.mark.timeout(60)


def test_a_fit_hands_ray_an_empty_history(tmp_path):
    from raytrain_ddp.ray_compat import checkpoint_snapshot_name, forget_earlier_fits

    run_dir = Location.parse(tmp_path)
    snapshot = tmp_path / checkpoint_snapshot_name()
    # what Ray left after our pruning removed a checkpoint it lists (the #25 report)
    snapshot.write_text(json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_00000060_x"}]}))
    (tmp_path / "config.yaml").write_text("name: r\n")
    assert forget_earlier_fits(run_dir) and not snapshot.exists()
    assert not forget_earlier_fits(run_dir)  # nothing there: nothing to do
    assert (tmp_path / "config.yaml").exists()  # ours are untouched


def test_ctrl_c_is_agreed_at_the_next_poll_and_sticks_until_the_loop_stops():
    clock, asked = FakeClock(1000.0), []
    stop = {"now": False}

    def stop_source() -> bool:
        asked.append(clock.now)
        return stop["now"]

    guard = PreemptionGuard(is_main=True, world_size=1, poll_interval_s=1.0, source=lambda step: None,
                            clock=clock, monotonic=clock, stop_source=stop_source, log=lambda msg: None)
    answers = []
    for step in range(1, 60):
        clock.now += 0.1
        if step == 25:
            stop["now"] = True  # the driver's Ctrl-C lands between two polls
        answers.append(guard.after_step(step))
    first = answers.index(True) + 1
    assert 25 <= first <= 25 + 11, first  # at the next poll: about a second of steps later
    assert all(answers[first - 1:]) and guard.stopping  # every boundary after it: save and stop
    assert len(asked) < 10  # asked at polls only, not every step


def test_only_rank0_asks_the_driver_and_the_ranks_agree_through_the_max():
    agreed = []

    def agree(values):  # the MAX all-reduce: rank 0's 1.0 wins over rank 1's 0.0
        agreed.append(list(values))
        return [max(v, w) for v, w in zip(values, [0.0, 0.0, 0.0, 1.0])]

    rank1 = PreemptionGuard(is_main=False, world_size=2, source=lambda step: None, agree=agree,
                            stop_source=lambda: pytest.fail("rank 1 must not ask the driver"))
    assert rank1.after_step(1) and rank1.stopping
    assert agreed[0][3] == 0.0


def test_the_mailbox_carries_the_stop_request_to_rank0_only():
    mailbox = Mailbox()
    rank0, rank1 = Outbox(mailbox), Outbox(mailbox, enabled=False)
    assert not rank0.stop_requested()
    asyncio.run(mailbox.request_stop())
    assert rank0.stop_requested() and not rank1.stop_requested()


def test_the_summary_counts_only_the_lines_this_fit_made(tmp_path):
    run_dir = Location.parse(tmp_path)
    earlier = Recorder(run_dir, "fit-1", [])
    earlier.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit-1"}},
                    {"kind": "metrics", "attempt": 1, "seq": 1, "record": {"step": 10, "loss": 0.5}}])
    earlier.stop()
    failed_before_training = Recorder(run_dir, "fit-2", [])
    assert failed_before_training.records and failed_before_training.fit_records() == []
    assert failed_before_training.fit_attempts() == []
    later = Recorder(run_dir, "fit-3", [])
    later.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit-3"}},
                  {"kind": "resumed", "attempt": 1, "seq": 1, "step": 10},
                  {"kind": "metrics", "attempt": 1, "seq": 2, "record": {"step": 11, "loss": 0.4}}])
    assert [r["step"] for r in later.fit_records()] == [11] and len(later.records) == 2


def test_a_staging_copy_whose_upload_died_is_uploaded_by_the_next_rank0(tmp_path, monkeypatch):
    """Seed 0 of the fault-sequence test: rank 2 of 4 died right after the step-10 async save;
    rank 0's upload never ran, and publishing its staging copy failed on a missing directory."""
    import tempfile

    import torch

    from raytrain_ddp import checkpoint as ckpt
    from raytrain_ddp.worker.checkpointer import STAGING_NAME_SEP, STAGING_PREFIX, publish_orphaned_uploads

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def staged(fit: str, step: int, complete: bool = True) -> Path:
        where = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, suffix=f"{STAGING_NAME_SEP}checkpoint_{step:08d}_{fit}"))
        state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "progress": {"step": step, "epoch": 0},
                 "run": {"fit_id": fit}}
        ckpt.save_checkpoint(where, state)
        if not complete:
            (where / ckpt.STATE_FILE).write_bytes(b"truncated")
        return where

    ours, broken, theirs = staged("fit-a", 10), staged("fit-a", 12, complete=False), staged("fit-b", 10)
    run_dir = tmp_path / "runs" / "r"  # not there yet: the copy makes it
    job = type("Job", (), {"fit_id": "fit-a"})()
    published = publish_orphaned_uploads(job, Location.parse(run_dir))
    assert [p.name for p in published] == ["checkpoint_00000010_fit-a"]
    assert ckpt.load_checkpoint(run_dir / "checkpoint_00000010_fit-a")["progress"]["step"] == 10
    assert not ours.exists() and not broken.exists()  # uploaded, or unusable: gone either way
    assert theirs.exists()  # another fit's is not ours to touch


class _Remote:
    def __init__(self) -> None:
        self.calls = 0

    def remote(self) -> None:
        self.calls += 1


def test_ctrl_c_before_the_workers_start_ends_the_placement_wait_and_still_stops_the_fit(monkeypatch, capsys):
    import sys

    import ray
    import ray.util.placement_group  # noqa: F401 - the module, which `ray.util` shadows with its function

    ray_pg = sys.modules["ray.util.placement_group"]

    removed, polls = [], []
    monkeypatch.setattr(ray_pg, "placement_group", lambda bundles, strategy: SimpleNamespace(ready=lambda: "ready"))
    monkeypatch.setattr(ray_pg, "remove_placement_group", removed.append)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: polls.append(timeout) or ([], refs))
    monkeypatch.setattr(placement, "node_types", lambda: None)
    monkeypatch.setattr(placement, "FIRST_STATUS_S", 1e9)

    mailbox = SimpleNamespace(request_stop=_Remote())
    interrupt = Interrupt(mailbox)
    before = signal.getsignal(signal.SIGINT)
    interrupt.listen()
    interrupt.listen()  # idempotent: restore still gives back the handler from before
    try:
        os.kill(os.getpid(), signal.SIGINT)  # taken by our handler: no KeyboardInterrupt here
        assert interrupt.fired and mailbox.request_stop.calls == 0  # no worker to ask yet
        with pytest.raises(KeyboardInterrupt):
            placement.wait_for_placement(Config(), stop=lambda: interrupt.fired)
        assert len(polls) == 1 and len(removed) == 1  # one poll, and the probe withdrawn
        interrupt.register("controller")  # a fit started anyway (Ctrl-C just as the wait ended)
        assert mailbox.request_stop.calls == 1
    finally:
        interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is before
    assert "interrupted while waiting for the cluster to place the workers" in capsys.readouterr().err


def test_a_fit_run_from_another_thread_takes_no_signal_handler():
    import threading

    before, errors = signal.getsignal(signal.SIGINT), []

    def fit_in_a_thread() -> None:  # what a test or a notebook's background fit does
        try:
            interrupt = Interrupt()
            interrupt.listen()
            interrupt.register("controller")
            interrupt.restore()
        except Exception as exc:  # noqa: BLE001 - the failure this test is about
            errors.append(exc)

    thread = threading.Thread(target=fit_in_a_thread)
    thread.start()
    thread.join(timeout=10)
    assert not errors and signal.getsignal(signal.SIGINT) is before, errors


def test_the_embedded_ray_is_started_once_more_when_its_startup_wait_ran_out(monkeypatch, capsys):
    import ray

    from raytrain_ddp.driver import launcher

    timed_out = Exception("The current node timed out during startup. This could happen because some of the "
                          "raylet failed to startup or the GCS has become overloaded.")
    tries = []

    def init(**kwargs):
        tries.append(kwargs)
        if len(tries) <= failures:
            raise timed_out

    monkeypatch.setattr(ray, "init", init)
    stopped = []  # what each timed-out try started is killed (ray_compat.stop_timed_out_start): counted here
    monkeypatch.setattr(launcher, "stop_timed_out_start", lambda before: stopped.append(before))
    failures = 1
    launcher._init_local(address="local", num_cpus=4)
    assert tries == [{"address": "local", "num_cpus": 4}] * 2 and len(stopped) == 1
    assert "did not start within Ray's 30 s (is the machine busy?); starting it once more" in capsys.readouterr().err

    tries.clear()
    failures = 3
    with pytest.raises(launcher.LocalRayDidNotStart, match="did not start, 3 times: The current node timed out"):
        launcher._init_local(address="local")
    assert len(tries) == 3

    def init_fails(**kwargs):
        tries.append(kwargs)
        raise ValueError("bad")

    tries.clear()
    monkeypatch.setattr(ray, "init", init_fails)
    with pytest.raises(ValueError, match="bad"):  # anything else is Ray's own error, not retried
        launcher._init_local(address="local")
    assert len(tries) == 1


def test_a_stop_from_another_thread_is_one_ctrl_c(capsys):
    """`Interrupt.press` and `interrupt._press_on`: a sweep's trial that Tune stops asks
    its workers once, as the first Ctrl-C does, from the thread that watches Tune."""
    import threading

    from raytrain_ddp.driver.interrupt import _press_on

    mailbox = SimpleNamespace(request_stop=_Remote())
    interrupt = Interrupt(mailbox)
    interrupt.register("controller")
    try:
        stop, done = threading.Event(), threading.Event()
        watcher = threading.Thread(target=_press_on, args=(stop, done, interrupt))
        watcher.start()
        stop.set()
        watcher.join(timeout=10)
        interrupt.press()  # a second stop is not a second Ctrl-C (no abort)
        assert not watcher.is_alive() and interrupt.presses == 1 and mailbox.request_stop.calls == 1
        quiet = threading.Thread(target=_press_on, args=(threading.Event(), done, Interrupt(mailbox)))
        done.set()  # the fit ended first: nothing is pressed
        quiet.start()
        quiet.join(timeout=10)
        assert mailbox.request_stop.calls == 1
    finally:
        interrupt.restore()
    assert "the workers save the step they are at" in capsys.readouterr().err


def test_the_fit_sequence_drives_any_launcher_and_its_one_ctrl_c(tmp_path, capsys):
    """driver/fit.run_training with a launcher given (as the CLI gives an early one): its
    members in order (start, run, close), the one Ctrl-C handler asking the ranks through the
    launcher's mailbox, status `interrupted`, summary.json written, the handler and the hold
    given back (issue 53)."""
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.driver.local import LocalLauncher
    from raytrain_ddp.rundir import HOLD_FILE

    calls = []

    class Pressing(LocalLauncher):
        def start(self, start, given):
            calls.append("start")
            return super().start(start, given)

        def run(self, job, recorder, interrupt):
            calls.append("run")
            interrupt.register()
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: taken, the ranks asked to stop
            assert job.mailbox.stop_requested()
            return "ok", None

        def close(self):
            calls.append("close")

    cfg = load_config(Path(__file__).parents[3] / "examples" / "configs" / "tiny.yaml",
                      [f"run.storage_path={tmp_path}", "name=seq", "scaling.num_workers=0"])
    before = signal.getsignal(signal.SIGINT)
    summary = run_training(cfg, launch=Pressing(cfg))
    assert calls == ["start", "run", "close"] and summary["status"] == "interrupted", (calls, summary)
    assert json.loads((tmp_path / "seq" / "summary.json").read_text())["status"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is before and not (tmp_path / "seq" / HOLD_FILE).exists()
    assert "the workers save the step they are at" in capsys.readouterr().err
