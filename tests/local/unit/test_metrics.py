"""Metrics sink, step meter, driver progress and plot: no Ray, no torch.distributed."""

from __future__ import annotations

import asyncio
import io
import time

import pytest

from raytrain_ddp.errors import UserError
from raytrain_ddp.driver.console import ProgressPrinter, final_metrics, format_record
from raytrain_ddp.driver.stream import Mailbox
from raytrain_ddp.rundir import JsonlFile, Location
from raytrain_ddp.worker.meter import Outbox, StepMeter
from raytrain_ddp.ops.plot import plot_run
from _clock import FakeClock

pytestmark = pytest.mark.timeout(60)


def test_rank0_outbox_numbers_attempts_and_keeps_the_order_of_its_sends():
    mailbox = Mailbox()  # in process: the actor's class, called directly
    box = Outbox(mailbox)
    assert box.start_attempt({"fit_id": "f"}) == 1 and Outbox(mailbox).start_attempt({"fit_id": "f"}) == 2
    box.send("metrics", record={"step": 1})
    box.send("resumed", step=0)
    Outbox(mailbox, enabled=False).send("metrics", record={"step": 99})  # not rank 0: nothing
    box.flush()
    events = asyncio.run(mailbox.take(0.0))
    assert [(e["kind"], e.get("attempt"), e["seq"]) for e in events] == [
        ("attempt", 1, 0), ("attempt", 2, 0), ("metrics", 1, 1), ("resumed", 1, 2)]


def test_recorder_restores_rank0s_order_across_takes_and_gives_up_on_a_lost_event():
    """Ray runs an async actor's calls in any order: step 10's put can be taken by the driver
    before step 9's has arrived (seen in CI: metrics.jsonl read 1..8, 10, 9, 11, 12)."""
    from raytrain_ddp.driver.stream import Reorder

    now = [0.0]
    order = Reorder(gap_timeout_s=5.0, clock=lambda: now[0])

    def ev(attempt, seq):
        return {"kind": "metrics", "attempt": attempt, "seq": seq}

    def seqs(events):
        return [(e["attempt"], e["seq"]) for e in events]

    assert seqs(order.push([{"kind": "attempt", "attempt": 1, "seq": 0}, ev(1, 1)])) == [(1, 0), (1, 1)]
    assert order.push([ev(1, 3)]) == []  # 2 is still on its way: 3 waits, across takes
    now[0] = 4.0
    assert order.push([ev(1, 4)]) == []
    assert seqs(order.push([ev(1, 2)])) == [(1, 2), (1, 3), (1, 4)]
    # a gap that stays open past the timeout: what waited goes on, in order, and later ones follow
    assert order.push([ev(1, 7), ev(1, 6)]) == []
    now[0] = 8.9
    assert order.push([]) == []
    now[0] = 9.0
    assert seqs(order.push([])) == [(1, 6), (1, 7)]
    assert seqs(order.push([ev(1, 8)])) == [(1, 8)]
    assert seqs(order.push([ev(1, 5)])) == [(1, 5)]  # the late one still counts, after the others
    # a new attempt: the old one's held events go first; old events arriving late pass straight on
    assert order.push([ev(1, 10)]) == []
    assert seqs(order.push([ev(2, 1), {"kind": "attempt", "attempt": 2, "seq": 0}])) == [(1, 10), (2, 0), (2, 1)]
    assert seqs(order.push([ev(1, 9)])) == [(1, 9)]
    # the end of the fit: everything held, gaps skipped
    assert order.push([ev(2, 3), ev(2, 5)]) == []
    assert seqs(order.release_all()) == [(2, 3), (2, 5)] and order.release_all() == []


def test_mailbox_flush_waits_for_the_puts_it_names_even_when_it_overtakes_them():
    async def story():
        mailbox = Mailbox()
        flushed = asyncio.ensure_future(mailbox.flush(1, 2, timeout_s=5.0))  # overtakes put 2
        await mailbox.put({"kind": "metrics", "attempt": 1, "seq": 1})
        await asyncio.sleep(0.02)
        assert not flushed.done()
        await mailbox.put({"kind": "metrics", "attempt": 1, "seq": 2})
        assert await asyncio.wait_for(flushed, 5.0) is True
        assert await mailbox.flush(1, 3, timeout_s=0.05) is False  # one never sent: bounded, not a hang

    asyncio.run(story())


def test_final_metrics_overlays_last_validation_on_last_train_line():
    records = [{"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 1.5, "val_accuracy": 0.5},
               {"step": 2, "loss": 1.0, "lr": 0.1}]
    assert final_metrics(records) == {"step": 2, "loss": 1.0, "lr": 0.1, "val_loss": 1.5, "val_accuracy": 0.5}
    assert final_metrics([]) == {}


def test_step_meter_averages_over_the_window_and_ignores_paused_time(monkeypatch):
    clock = FakeClock(100.0)
    monkeypatch.setattr("raytrain_ddp.worker.meter.time.perf_counter", clock)
    meter = StepMeter(global_batch_size=64, wait_seconds=0.0, comm={"allreduce_calls": 0, "allreduce_bytes": 0})
    clock.now += 0.020
    meter.step_done()
    meter.pause(wait_seconds=0.005)
    clock.now += 0.050  # validation: neither step time nor data wait
    meter.resume(wait_seconds=0.5)
    clock.now += 0.020
    meter.step_done()
    out = meter.summarize(wait_seconds=0.51, comm={"allreduce_calls": 4, "allreduce_bytes": 400})
    assert out["allreduce_calls"] == 2 and out["allreduce_bytes"] == 200
    # two steps of 20 ms each: 3,200 samples/s; the 50 ms pause is not counted
    assert out["samples_per_s"] == pytest.approx(64 * 2 / 0.040)
    # 15 ms of the 40 ms waited for data; the 495 ms waited while paused is excluded
    assert out["data_wait_fraction"] == pytest.approx(0.015 / 0.040)
    again = meter.summarize(wait_seconds=0.51, comm={"allreduce_calls": 4, "allreduce_bytes": 400})
    assert again["allreduce_calls"] == 0 and again["samples_per_s"] == 0


def test_step_meter_reports_exposed_communication_where_the_wrapper_times_it():
    """comm_ms, exposed_comm_ms and comm_overlap_fraction per step, from comm_stats' seconds."""
    start = {"allreduce_calls": 0, "allreduce_bytes": 0}
    meter = StepMeter(global_batch_size=8, wait_seconds=0.0, comm=start)  # no sync yet: no timing keys
    for _ in range(2):
        time.sleep(0.01)
        meter.step_done()
    out = meter.summarize(0.0, {**start, "comm_s": 0.006, "exposed_comm_s": 0.002})
    step_ms = 1e3 * 8 / out["samples_per_s"]
    assert out["comm_ms"] == pytest.approx(3.0) and out["exposed_comm_ms"] == pytest.approx(1.0)
    assert out["comm_overlap_fraction"] == pytest.approx(2 / 3)
    assert 0.0 <= out["comm_overlap_fraction"] <= 1.0 and out["exposed_comm_ms"] <= step_ms
    meter.step_done()
    again = meter.summarize(0.0, {**start, "comm_s": 0.006, "exposed_comm_s": 0.002})
    assert again["comm_ms"] == 0.0 and "comm_overlap_fraction" not in again  # nothing sent: no fraction
    assert "comm_ms" not in meter.summarize(0.0, start)  # a wrapper that does not time (zero1, GPU)


def test_plan_says_when_the_bucket_layout_is_tuned(tmp_path, capsys):
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.console import print_plan
    from raytrain_ddp.job import DataSpec

    spec = DataSpec("classification", (8,), 3, 64, 16, "test")
    for overrides, expected in (([], None), (["parallel.bucket_cap_mb=auto"], "bucket_cap_mb auto"),
                                (["parallel.bucket_cap_mb=auto", "parallel.compress=auto"],
                                 "bucket_cap_mb auto and compress auto")):
        print_plan(load_config(None, ["model.name=mlp", *overrides]), spec, tmp_path, 10, 20, None, params=100)
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  parallel")]
        assert lines == ([] if expected is None else [lines[0]]) and (expected is None or expected in lines[0])


def test_format_and_progress_printer_prints_each_record_as_it_arrives():
    out = io.StringIO()
    printer = ProgressPrinter(total_steps=20, out=out)
    printer.record({"step": 10, "epoch": 1, "time": 1.7e9, "loss": 0.25, "lr": 1e-3, "samples_per_s": 1234.5,
                    "data_wait_fraction": 0.1, "checkpoint_blocked_s": 0.01})
    printer.record({"step": 10, "epoch": 1, "val_loss": 0.2, "val_accuracy": 0.955})
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 10/20 | epoch 1 | loss 0.2500 | lr 1.00e-03 | 1,234 samples/s | data wait 10%",
        "step 10/20 | epoch 1 | val_loss 0.2000 | val_accuracy 95.50%",
    ]
    assert "non-finite steps 2" in format_record({"step": 3, "loss": float("nan"), "nonfinite_steps": 2})


def test_plot_writes_a_png_and_rejects_an_empty_run(tmp_path):
    writer = JsonlFile(Location.parse(tmp_path / "metrics.jsonl"))
    for step in range(1, 11):
        writer.append([{"step": step, "epoch": 1, "loss": 2.0 / step, "samples_per_s": 1000.0 + step}])
        if step % 5 == 0:
            writer.append([{"step": step, "epoch": 1, "val_loss": 1.0 / step, "val_accuracy": 0.5 + step / 40}])
    writer.flush()
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(UserError, match="no metrics to plot"):
        plot_run(tmp_path / "empty")


def test_a_restart_from_a_survivors_copy_fills_in_the_lines_a_lost_rank0_never_delivered(tmp_path):
    """Rank 0 completed step 3 (train and validation line) and died before its sends arrived;
    the survivor's copy of step 3 carries both lines and the restarted group hands them on.
    A line that did arrive is never written twice."""
    from raytrain_ddp.driver.stream import Recorder
    from raytrain_ddp.rundir import read_metrics

    train = {"epoch": 1, "time": 1.7e9, "lr": 0.1, "attempt": 1}
    step3 = [{**train, "step": 3, "loss": 0.7}, {"step": 3, "epoch": 1, "time": 1.7e9, "val_loss": 0.6}]
    for delivered, expected in ((0, [1, 2, 3, 3, 4]), (1, [1, 2, 3, 3, 4]), (2, [1, 2, 3, 3, 4])):
        run_dir = Location.parse(tmp_path / f"run{delivered}")
        recorder = Recorder(run_dir, "fit", [])
        recorder.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit", "world_size": 2}},
                         *({"kind": "metrics", "attempt": 1, "seq": s, "record": {**train, "step": s, "loss": 1.0}}
                           for s in (1, 2)),
                         *({"kind": "metrics", "attempt": 1, "seq": 3 + i, "record": r}
                           for i, r in enumerate(step3[:delivered]))])
        recorder.handle([{"kind": "attempt", "attempt": 2, "seq": 0, "record": {"fit_id": "fit", "world_size": 1}},
                         {"kind": "resumed", "attempt": 2, "seq": 1, "step": 3,
                          "origin": {"resumed_from": "replica"}, "lines": step3 + [{**train, "step": 2, "loss": 9.0}]},
                         {"kind": "metrics", "attempt": 2, "seq": 2,
                          "record": {**train, "step": 4, "loss": 0.5, "attempt": 2}}])
        recorder.stop()
        records = read_metrics(run_dir.local_path)
        assert [r["step"] for r in records] == expected, delivered
        assert records[2] == step3[0] and records[3] == step3[1]  # the copy's lines, in order, once
        assert records[1]["loss"] == 1.0  # a line of another step in the copy is not taken

    # The copy was of an epoch's last step, taken before validation finished: the restarted
    # group validates again, and its line replaces the earlier one (one line per step and kind).
    recorder = Recorder(Location.parse(tmp_path / "run0"), "fit", [])  # the file above, read back
    recorder.handle([{"kind": "attempt", "attempt": 3, "seq": 0, "record": {"fit_id": "fit", "world_size": 2}},
                     {"kind": "resumed", "attempt": 3, "seq": 1, "step": 3, "lines": step3},
                     {"kind": "metrics", "attempt": 3, "seq": 2, "record": {**step3[1], "val_loss": 0.55}}])
    recorder.stop()
    records = read_metrics(tmp_path / "run0")
    assert [(r["step"], "val_loss" in r) for r in records] == [(1, False), (2, False), (3, False), (3, True)]
    assert records[3]["val_loss"] == 0.55


def test_a_checkpoint_carries_the_lines_since_the_previous_one_and_fills_a_killed_drivers_gap(tmp_path):
    """A driver killed between a checkpoint's upload and its next write of metrics.jsonl (an
    object store's file is rewritten about once a second) left lines 3..5 unwritten; the
    checkpoint at step 5 carries them and the next run's resume writes them, in order, once."""
    from raytrain_ddp.driver.stream import Recorder
    from raytrain_ddp.rundir import read_metrics

    line = {"epoch": 0.1, "time": 1.7e9, "lr": 0.1, "attempt": 1}
    run_dir = Location.parse(tmp_path / "run")
    first = Recorder(run_dir, "fit1", [])
    first.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit1", "world_size": 2}},
                  *({"kind": "metrics", "attempt": 1, "seq": s, "record": {**line, "step": s, "loss": 1.0}}
                    for s in (1, 2))])
    first.stop()  # what the killed driver had written
    carried = [{**line, "step": s, "loss": 1.0 / s} for s in (5, 3, 4)] + [{"step": 5, "epoch": 0.1, "val_loss": 0.5}]
    carried.append({**line, "step": 1, "loss": 99.0})  # already written: not taken again
    second = Recorder(Location.parse(tmp_path / "run"), "fit2", [])
    second.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit2", "world_size": 2}},
                   {"kind": "resumed", "attempt": 1, "seq": 1, "step": 5, "origin": {"resumed_from": "checkpoint"},
                    "lines": carried},
                   {"kind": "metrics", "attempt": 1, "seq": 2, "record": {**line, "step": 6, "loss": 0.1}}])
    second.stop()
    records = read_metrics(tmp_path / "run")
    assert [(r["step"], "val_loss" in r) for r in records] == \
        [(1, False), (2, False), (3, False), (4, False), (5, False), (5, True), (6, False)]
    assert records[0]["loss"] == 1.0 and records[2]["loss"] == pytest.approx(1 / 3)


def test_rank0s_checkpoints_carry_each_line_until_the_driver_wrote_it():
    """Issue #44: each checkpoint carries every line the driver has not said it wrote durably
    (before, each line went into one checkpoint only, so a driver killed with two checkpoints
    reported since its last write of metrics.jsonl lost the older one's lines)."""
    import threading
    import types

    import torch

    from raytrain_ddp.driver.stream import LocalMailbox
    from raytrain_ddp.worker.meter import Outbox, RunLog

    mailbox = LocalMailbox()
    log = RunLog.__new__(RunLog)
    log.rank = types.SimpleNamespace(is_main=True)
    log.step_lines, log.unsaved_lines, log._unsaved_lock = [], [], threading.Lock()
    log.outbox = Outbox(mailbox)
    log.outbox.attempt = 2
    for step in (1, 2, 3):
        log._line({"step": step, "loss": torch.tensor(0.5)})
    assert [r["step"] for r in log.lines_to_save()] == [1, 2, 3]
    assert [r["step"] for r in log.lines_to_save()] == [1, 2, 3]  # not written yet: carried again
    mailbox.set_durable(1, 3)  # another attempt's history: says nothing about this one's lines
    assert [r["step"] for r in log.lines_to_save()] == [1, 2, 3]
    mailbox.set_durable(2, 2)
    assert [r["step"] for r in log.lines_to_save()] == [3]
    assert log.step_lines[0]["loss"] == 0.5  # plain numbers, as metrics.jsonl holds them


def test_the_recorder_says_how_far_metrics_jsonl_holds_the_attempt_after_its_resume(tmp_path):
    from raytrain_ddp.driver.stream import LocalMailbox, Recorder

    mailbox = LocalMailbox()
    line = {"epoch": 0.1, "time": 1.0}
    rec = Recorder(Location.parse(tmp_path / "run"), "fit1", [], mailbox)
    rec.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": "fit1", "world_size": 2}}])
    assert mailbox.durable_for(1) == 0  # no resume applied yet: the file may still hold lines it redoes
    rec.handle([{"kind": "resumed", "attempt": 1, "seq": 1, "step": 0, "origin": {}, "lines": []},
                *({"kind": "metrics", "attempt": 1, "seq": s + 1, "record": {**line, "step": s, "loss": 1.0}}
                  for s in (1, 2))])
    assert mailbox.durable_for(1) == 2 and mailbox.durable_for(2) == 0
    rec.stop()


def test_recover_lines_puts_a_killed_drivers_unwritten_lines_back_in_step_order(tmp_path):
    import json

    from raytrain_ddp import checkpoint as ckpt
    from raytrain_ddp.driver.fit import recover_lines
    from raytrain_ddp.rundir import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 4)))
    state = {"model": {}, "optimizer": {}, "progress": {"step": 5, "epoch": 0}, "run": {"fit_id": "f"}}
    state.update({k: {} for k in ckpt.REQUIRED_KEYS if k not in state})
    carried = [{"step": s, "loss": 0.5} for s in (3, 4, 5, 6)] + [{"step": 5, "val_loss": 0.2}]
    where = ckpt.save_checkpoint(run / "checkpoint_00000005", state, lines=carried)
    assert recover_lines(Location.parse(run), where) == 3  # 3, 5 and 5's validation; 4 is there, 6 is past it
    records = read_metrics(run)
    assert [(r["step"], "val_loss" in r) for r in records] == \
        [(1, False), (2, False), (3, False), (4, False), (5, False), (5, True)]
    assert records[3]["loss"] == 1.0 and recover_lines(Location.parse(run), where) == 0


def test_plan_names_the_schedule_that_will_run(tmp_path, capsys):
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.console import print_plan
    from raytrain_ddp.job import DataSpec

    spec = DataSpec("classification", (8,), 3, 64, 16, "test")
    for overrides, expected in (([], "(warmup 0, cosine to 0.1x)"),
                                (["train.schedule=constant", "train.warmup_steps=5"], "(warmup 5, then constant)"),
                                (["train.schedule=linear", "train.min_lr_ratio=0.5"], "(warmup 0, linear to 0.5x)"),
                                (["train.schedule=my.mod:fn"], "(your schedule my.mod:fn)")):
        print_plan(load_config(None, ["model.name=mlp", *overrides]), spec, tmp_path, 10, 20, None, params=100)
        [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  schedule")]
        assert line.endswith(expected), line
