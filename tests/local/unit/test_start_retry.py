"""A worker group's start that a taken port failed is retried (issue #56), piece by piece with
made-up errors, groups and states: which errors are start faults, the guard's hand-over to Ray
Train's retry and its bound, the controller callback's record of the failed start, the
timeline's and the recorder's account of it. The fits that meet a taken port for real:
tests/ray/reliability/test_hard_faults.py (Ray), tests/ray/e2e/test_train.py (torchrun),
tests/ray/elastic/test_live_recovery.py (live's replacement), tests/local/parallel/test_spawn_helper.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_ddp import ray_compat
from raytrain_ddp.driver.startup import START_FAULT, StartupStamps, guarded_start
from raytrain_ddp.driver.stream import Recorder
from raytrain_ddp.errors import START_TRIES, start_fault
from raytrain_ddp.rundir import Location, read_jsonl
from raytrain_ddp.timeline import ATTEMPT_PHASES, FAILED_PHASES, Timeline, format_timeline

pytestmark = pytest.mark.timeout(60)

TAKEN = ("ray::RayTrainWorker.execute() (pid=1)\ntorch.distributed.DistNetworkError: The server socket has failed "
         "to listen on any local network address. port: 40057, useIpv6: false, code: -98, name: EADDRINUSE, "
         "message: address already in use")


def test_start_faults_are_told_from_errors_a_new_start_cannot_mend():
    assert start_fault(RuntimeError(TAKEN)) == "a port was taken by another program (EADDRINUSE)"
    assert start_fault(ConnectionRefusedError("[Errno 111] Connection refused")) == "a peer was not reachable yet"
    assert start_fault(ValueError("The provided init_method (udp) is not supported")) is None


class _Backend:
    pass


def test_the_guard_hands_a_start_fault_to_ray_trains_retry_until_its_tries_are_spent():
    backend, group = _Backend(), object()  # not a Ray WorkerGroup: nothing to stop

    def taken():
        raise RuntimeError(TAKEN)

    for _ in range(START_TRIES - 1):
        with pytest.raises(Exception) as caught:
            guarded_start(backend, taken, group)
        assert type(caught.value).__name__ == "WorkerGroupStartupFailedError"
        assert str(caught.value) == START_FAULT + "a port was taken by another program (EADDRINUSE)"
        assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="EADDRINUSE"):  # the last try: the error as it was, the fit fails
        guarded_start(backend, taken, group)

    def refused():
        raise ValueError("unsupported backend")

    with pytest.raises(ValueError):  # deterministic: at once, no retry
        guarded_start(_Backend(), refused, group)
    guarded_start(_Backend(), lambda: None, group)  # a start that works is left alone


class _Remote:
    def __init__(self, sent, method):
        self.sent, self.method = sent, method

    def remote(self, event):
        self.sent.append((self.method, event))


def test_the_controller_callback_registers_the_failed_start_as_an_attempt():
    sent: list = []
    mailbox = SimpleNamespace(put=_Remote(sent, "put"), attempt=_Remote(sent, "attempt"))
    stamps = StartupStamps(mailbox, "fit1")
    stamps.before_worker_group_start(SimpleNamespace(num_workers=2))
    stamps.before_init_train_context([])
    state = SimpleNamespace(training_failed_error=SimpleNamespace(
        controller_failure=ray_compat.start_failed(START_FAULT + "a peer was not reachable yet")))
    stamps.after_controller_state_update(None, state)
    (m1, attempt), (m2, timeline) = sent
    assert m1 == "attempt" and attempt["start_failed"] == "a peer was not reachable yet"
    assert (attempt["fit_id"], attempt["world_size"], attempt["try"], attempt["tries"]) == ("fit1", 2, 1, START_TRIES)
    assert m2 == "put" and timeline["stamps"]["failed"] >= timeline["stamps"]["workers_up"]
    sent.clear()
    other = SimpleNamespace(training_failed_error=SimpleNamespace(controller_failure=ValueError("x")))
    stamps.after_controller_state_update(None, other)
    assert sent == []  # any other restart is not ours to record


def test_timeline_and_recorder_account_for_the_failed_start(tmp_path, capsys):
    run_dir = Location.parse(tmp_path)
    timeline = Timeline("f", started=100.0, entered=100.0)
    timeline.expects_controller = True
    timeline.attach(run_dir)
    timeline.controller({"begin": 101.0, "workers_up": 103.0, "failed": 106.0})
    failed = [r for r in timeline.rows if r["attempt"] == 1]
    assert [r["phase"] for r in failed] == list(ATTEMPT_PHASES[:FAILED_PHASES]) and all(r["failed"] for r in failed)
    assert failed[-1]["t"] == 106.0
    timeline.controller({"begin": 107.0, "workers_up": 108.0, "process_group": 109.0})
    timeline.worker(2, {"data_ready": 110.0, "model_built": 111.0, "state_restored": 111.0, "first_step": 112.0})
    second = [r for r in timeline.rows if r["attempt"] == 2]
    assert [r["phase"] for r in second] == list(ATTEMPT_PHASES) and second[0]["t"] - second[0]["seconds"] == 107.0
    lines = format_timeline(timeline.summary())
    assert "attempt 1: " in lines[0] and "to its failure (retried)" in lines[0] and "to the first step" in lines[1]

    recorder = Recorder(run_dir, "f", [], write_metrics=False)
    record = {"fit_id": "f", "world_size": 2, "time": 106.0, "start_failed": "a port was taken by another program "
              "(EADDRINUSE)", "try": 1, "tries": START_TRIES}
    recorder.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {**record, "attempt": 1}},
                     {"kind": "attempt", "attempt": 2, "seq": 0,
                      "record": {"fit_id": "f", "world_size": 2, "time": 112.0, "attempt": 2}}])
    recorder.stop()
    attempts = read_jsonl(tmp_path / "attempts.jsonl")
    assert [a.get("cause") for a in attempts] == [None, "start: a port was taken by another program (EADDRINUSE)"]
    assert capsys.readouterr().err == ("raytrain-ddp: the workers' start failed: a port was taken by another "
                                       f"program (EADDRINUSE); starting them again with fresh ports (try 2 of "
                                       f"{START_TRIES})\n")
