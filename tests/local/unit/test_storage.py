"""The run directory through pyarrow.fs: locally and in a real S3-compatible server (moto, 127.0.0.1).

No Ray. Checkpoints are uploaded to the bucket the way Ray Train does it
(`pyarrow.fs.copy_files` from a local staging directory); an upload cut short is an
object set without `state.pt`. The driver's side (resume resolution, the recorder that
writes the records rank 0 sends, the TensorBoard sink) and the worker's (the checkpoint
Ray offers after a restart, read back from the bucket) run against the bucket.

The trackers (TensorBoard, MLflow on a sqlite:/// store, W&B offline) are read back with
their own clients (`tests/_trackers.py`): each step once, the committed line, in the one
run of the fit.
"""

from __future__ import annotations

import io
import json
import struct
import types
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from _moto import s3_bucket
from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp.driver.console import ProgressPrinter
from raytrain_ddp.driver.resume import ResumeError, resolve_resume
from raytrain_ddp.driver.sinks import TensorBoardSink, scalars
from raytrain_ddp.driver.stream import Recorder
from raytrain_ddp.job import Job
from raytrain_ddp.rundir import JsonlFile, Location, read_jsonl, read_metrics, run_dir_of
from raytrain_ddp.worker.checkpointer import find_resume_state

pytestmark = pytest.mark.timeout(120)

FIT = "f" * 32
BUCKET = "raytrain-test"


def _state(step: int, fit_id: str = FIT) -> dict:
    model = torch.nn.Linear(4, 3)
    return {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
            "schedule": {}, "progress": {"step": step, "epoch": 0, "steps_into_epoch": step},
            "rng": ckpt.rng_state(), "run": {"world_size": 2, "fit_id": fit_id}}


def _upload(staging: Path, run_dir: Location, step: int, files: tuple[str, ...] = (ckpt.STATE_FILE, ckpt.MANIFEST_FILE)):
    """Write checkpoint `step` locally and copy `files` of it to the run directory (as Ray's upload does)."""
    name = f"checkpoint_{step:08d}_{FIT[:8]}"
    local = ckpt.save_checkpoint(staging / name, _state(step))
    for file in files:
        pafs.copy_files(str(local / file), (run_dir / name / file).path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=run_dir.fs)
    return run_dir / name


def _events(payload: bytes) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    pos = 0
    while pos < len(payload):
        (length,) = struct.unpack("<Q", payload[pos:pos + 8])
        event = Event.FromString(payload[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A bucket on a moto server; the environment points pyarrow at it for this module only."""
    with s3_bucket(tmp_path_factory.mktemp("moto"), BUCKET) as env:
        yield env


def _recorder_story(run_dir: Location, out: io.StringIO) -> Recorder:
    """What rank 0 of two attempts sends: lines, a restart that redoes steps 3-4, an abort."""
    recorder = Recorder(run_dir, FIT, [ProgressPrinter(total_steps=6, out=out)])
    line = {"epoch": 1, "time": 1.7e9, "loss": 1.0, "lr": 0.1, "samples_per_s": 100.0, "data_wait_fraction": 0.0,
            "checkpoint_blocked_s": 0.0}
    recorder.handle([{"kind": "attempt", "attempt": 1, "seq": 0, "record": {"fit_id": FIT, "attempt": 1, "world_size": 2}},
                     # delivered out of order: seq puts them back
                     {"kind": "metrics", "attempt": 1, "seq": 2, "record": {**line, "step": 2}},
                     {"kind": "metrics", "attempt": 1, "seq": 1, "record": {**line, "step": 1}}])
    recorder.handle([{"kind": "metrics", "attempt": 1, "seq": 3, "record": {**line, "step": 3}},
                     {"kind": "checkpoint", "attempt": 1, "seq": 4, "step": 2, "name": "c2", "blocked_s": 0.02},
                     {"kind": "metrics", "attempt": 1, "seq": 5, "record": {**line, "step": 4}}])
    recorder.handle([{"kind": "attempt", "attempt": 2, "seq": 0, "record": {"fit_id": FIT, "attempt": 2, "world_size": 2}},
                     {"kind": "resumed", "attempt": 2, "seq": 1, "step": 2},
                     {"kind": "metrics", "attempt": 2, "seq": 2, "record": {**line, "step": 3, "attempt": 2}},
                     {"kind": "metrics", "attempt": 2, "seq": 3, "record": {"step": 3, "epoch": 1, "val_loss": 0.5}},
                     {"kind": "abort", "attempt": 2, "seq": 4, "record": {"step": 4, "reason": "non-finite"}}])
    recorder.stop()
    return recorder


def test_local_run_directory_and_recorder(tmp_path):
    run_dir = Location.parse(tmp_path / "runs") / "local"
    assert run_dir.is_local and run_dir.uri == str(tmp_path / "runs" / "local") and run_dir.name == "local"
    assert Location.parse("relative/x").uri == str(Path("relative/x").resolve())
    out = io.StringIO()
    recorder = _recorder_story(run_dir, out)
    assert [r["step"] for r in read_metrics(run_dir.local_path)] == [1, 2, 3, 3]  # 3-4 of attempt 1 dropped
    assert [r["attempt"] for r in read_jsonl(run_dir / "attempts.jsonl")] == [1, 2]
    assert json.loads((run_dir / "abort.json").read_text())["reason"] == "non-finite"
    assert recorder.abort["step"] == 4 and [r["step"] for r in recorder.records] == [1, 2, 3, 3]
    assert recorder.checkpoint_summary() == {"count": 1, "blocked_s_total": 0.02, "blocked_s_mean": 0.02,
                                             "blocked_s_max": 0.02}
    printed = out.getvalue().splitlines()
    assert printed[0].startswith("step 1/6 | epoch 1 | loss 1.0000") and printed[-1] == "step 3/6 | epoch 1 | val_loss 0.5000"
    assert len(printed) == 6  # every line as it arrived, the redone ones too

    # A torn last line (a writer killed mid-line) is dropped, and the file is repaired on the next write.
    path = run_dir.local_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 9, "lo')
    again = JsonlFile(run_dir / "metrics.jsonl")
    again.append([{"step": 4, "loss": 0.5}])
    again.flush()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 3, 4] and path.read_text().endswith("\n")


def test_run_directory_in_a_bucket(s3, tmp_path):
    cfg = load_config(None, [f"run.storage_path=s3://{BUCKET}/runs", "name=remote"])
    run_dir = run_dir_of(cfg)
    assert not run_dir.is_local and run_dir.uri == f"s3://{BUCKET}/runs/remote" and run_dir.path == f"{BUCKET}/runs/remote"
    assert resolve_resume(cfg, run_dir) is None and not run_dir.exists()  # a fresh run

    # Records: appended in memory, each flush one PUT of the whole object; a restart's drop is a rewrite.
    out = io.StringIO()
    recorder = _recorder_story(run_dir, out)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 3]
    assert [r["attempt"] for r in read_jsonl(run_dir / "attempts.jsonl")] == [1, 2]
    assert json.loads((run_dir / "abort.json").read_text())["step"] == 4
    assert recorder.fit_attempts()[-1]["world_size"] == 2
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()  # nothing went to a local "s3:" folder

    # Checkpoints: 10 and 20 complete; 30's upload was cut short (its manifest landed, its state did not).
    good = _upload(tmp_path, run_dir, 10)
    previous = _upload(tmp_path, run_dir, 20)
    cut = _upload(tmp_path, run_dir, 30, files=(ckpt.MANIFEST_FILE,))
    found = ckpt.find_checkpoints(run_dir)
    assert [p.name for p in found] == [cut.name, previous.name, good.name]
    assert all(isinstance(p, Location) and p.uri.startswith(f"s3://{BUCKET}/runs/remote/") for p in found)
    state, where = ckpt.load_latest_valid(found)
    assert state["progress"]["step"] == 20 and where.uri == previous.uri
    assert resolve_resume(cfg, run_dir).uri == previous.uri  # newest *valid*, through the filesystem API
    with pytest.raises(ResumeError, match=rf"{cut.name}/state\.pt: missing"):
        resolve_resume(load_config(None, [f"run.storage_path=s3://{BUCKET}/runs", "name=remote",
                                          f"run.resume={cut.uri}"]), run_dir)
    with pytest.raises(ResumeError, match="already exists"):
        resolve_resume(load_config(None, [f"run.storage_path=s3://{BUCKET}/runs", "name=remote",
                                          "run.resume=never"]), run_dir)

    # A restarted worker: Ray offers its latest reported checkpoint (the cut one, say, after a
    # storage hiccup); the worker reads it from the bucket, refuses it, takes the fit's previous one.
    import ray.train

    offered = types.SimpleNamespace(path=cut.path, filesystem=run_dir.fs)
    original = ray.train.get_checkpoint
    ray.train.get_checkpoint = lambda: offered
    try:
        state, where = find_resume_state(Job(cfg=cfg, spec=None, run_dir=run_dir.uri, fit_id=FIT))
    finally:
        ray.train.get_checkpoint = original
    assert state["progress"]["step"] == 20 and where.uri == previous.uri


def test_tensorboard_sink_writes_event_files_locally_and_to_a_bucket(s3, tmp_path):
    lines = [{"step": 1, "epoch": 1, "time": 1.7e9, "loss": 2.0, "lr": 0.1, "attempt": 1},
             {"step": 2, "epoch": 1, "time": 1.7e9 + 1, "loss": 1.5, "lr": 0.1, "checkpoint_blocked_s": 0.01},
             {"step": 2, "epoch": 1, "time": 1.7e9 + 2, "val_loss": 1.2, "val_accuracy": 0.5}]
    assert scalars(lines[2]) == {"val/loss": 1.2, "val/accuracy": 0.5}
    for run_dir in (Location.parse(tmp_path / "tb"), Location.parse(f"s3://{BUCKET}/tb")):
        sink = TensorBoardSink(run_dir)
        for line in lines:
            sink.record(line)
        sink.close("ok")
        files = [loc for loc, _ in (run_dir / "tensorboard").children() if "tfevents" in loc.name]
        assert len(files) == 1, files
        events = _events(files[0].read_bytes())
        assert events["train/loss"] == [(1, 2.0), (2, 1.5)]
        assert events["val/loss"] == [(2, pytest.approx(1.2))] and events["train/checkpoint_blocked_s"][0][0] == 2
        assert "train/epoch" not in events and "train/attempt" not in events


class _Tracker:
    """A sink that, like TensorBoard / MLflow / W&B, wants committed lines only."""

    committed_only = True

    def __init__(self) -> None:
        self.lines, self.starts, self.closed = [], [], None

    def fit_starts_at(self, step):
        self.starts.append(step)

    def record(self, line):
        self.lines.append(line)

    def flush(self):
        pass

    def close(self, status):
        self.closed = status


def _m(attempt, seq, step, loss=None, **extra):
    record = {"step": step, "epoch": 1, "time": 1.7e9 + step, **({"loss": loss} if loss is not None else {}), **extra}
    return {"kind": "metrics", "attempt": attempt, "seq": seq, "record": record}


def _start(attempt, step):
    return [{"kind": "attempt", "attempt": attempt, "seq": 0, "record": {"fit_id": FIT, "attempt": attempt}},
            {"kind": "resumed", "attempt": attempt, "seq": 1, "step": step}]


def test_trackers_get_each_step_once_the_committed_line(tmp_path, caplog):
    """Lines wait for a checkpoint at or after their step (or the fit's end); redone ones replace them."""
    tracker, live = _Tracker(), io.StringIO()
    recorder = Recorder(Location.parse(tmp_path / "run"), FIT, [ProgressPrinter(total_steps=5, out=live), tracker])
    recorder.handle(_start(1, 0) + [_m(1, 2, 1, 4.0), _m(1, 3, 2, 3.0), _m(1, 4, 2, val_loss=2.5, val_accuracy=0.5),
                                    {"kind": "checkpoint", "attempt": 1, "seq": 5, "step": 2, "name": "c2"},
                                    _m(1, 6, 3, 2.0), _m(1, 7, 4, 1.9)])
    assert [(r["step"], "loss" in r) for r in tracker.lines] == [(1, True), (2, True), (2, False)]  # 3, 4 held
    # attempt 2 resumes at the step-2 checkpoint: 3 and 4 are redone, with other values
    recorder.handle(_start(2, 2) + [_m(2, 2, 3, 2.1), _m(2, 3, 4, 1.8), _m(2, 4, 5, 1.5),
                                    _m(2, 5, 5, val_loss=1.4, val_accuracy=0.75)])
    recorder.stop()
    recorder.close("ok")
    committed = recorder.records
    assert [(r["step"], r.get("loss")) for r in committed] == [(1, 4.0), (2, 3.0), (2, None), (3, 2.1), (4, 1.8),
                                                                 (5, 1.5), (5, None)]
    assert tracker.lines == committed and tracker.starts == [0] and tracker.closed == "ok"
    assert len(live.getvalue().splitlines()) == 9  # the console showed every line as it came, 3 and 4 twice

    # A restart below a reported checkpoint (its asynchronous upload died with the worker):
    # the steps already handed over keep their first point; later ones are the redone lines.
    tracker = _Tracker()
    recorder = Recorder(Location.parse(tmp_path / "fallback"), FIT, [tracker])
    recorder.handle(_start(1, 0) + [_m(1, 2, 1, 4.0), _m(1, 3, 2, 3.0), _m(1, 4, 3, 2.0),
                                    {"kind": "checkpoint", "attempt": 1, "seq": 5, "step": 3, "name": "c3"},
                                    _m(1, 6, 4, 1.9)])
    with caplog.at_level("WARNING"):
        recorder.handle(_start(2, 1) + [_m(2, 2, 2, 3.1), _m(2, 3, 3, 2.1), _m(2, 4, 4, 1.7)])
    recorder.stop()
    assert [(r["step"], r["loss"]) for r in tracker.lines] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.7)]
    assert "below a reported checkpoint" in caplog.text

    # run.validation=async (issue #55): step 2's val line comes from rank 0's validator thread
    # after a later checkpoint; the trackers get nothing past step 2 before it (W&B would refuse it)
    tracker = _Tracker()
    recorder = Recorder(Location.parse(tmp_path / "async"), FIT, [tracker])
    recorder.handle(_start(1, 0) + [_m(1, 2, 1, 4.0), _m(1, 3, 2, 3.0),
                                    {"kind": "checkpoint", "attempt": 1, "seq": 4, "step": 2, "name": "c2"},
                                    {"kind": "validating", "attempt": 1, "seq": 5, "step": 2},
                                    _m(1, 6, 3, 2.0), {"kind": "checkpoint", "attempt": 1, "seq": 7, "step": 3,
                                                       "name": "c3"}, _m(1, 8, 4, 1.9)])
    assert [r["step"] for r in tracker.lines] == [1, 2]
    recorder.handle([_m(1, 9, 2, val_loss=2.5, validation_async_s=0.1)])
    assert [(r["step"], "loss" in r) for r in tracker.lines] == [(1, True), (2, True), (2, False), (3, True)]
    recorder.stop()
    assert [r["step"] for r in tracker.lines] == [1, 2, 2, 3, 4]


def test_tensorboard_shows_one_point_per_step_across_fits(tmp_path):
    """The second fit resumes at step 2 of a run whose first fit reached step 4: TensorBoard's
    own reader shows steps 1-5 once each, 3 and 4 from the second fit."""
    from _trackers import tensorboard_scalars

    run_dir = Location.parse(tmp_path / "run")
    for start, lines in ((0, [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.9)]), (2, [(3, 2.1), (4, 1.8), (5, 1.5)])):
        sink = TensorBoardSink(run_dir)
        recorder = Recorder(run_dir, FIT, [sink])
        recorder.handle(_start(1, start) + [_m(1, 2 + i, step, loss) for i, (step, loss) in enumerate(lines)])
        recorder.stop()
        recorder.close("ok")
    shown = tensorboard_scalars(run_dir.local_path / "tensorboard")
    assert shown["train/loss"] == [(1, 4.0), (2, 3.0), (3, pytest.approx(2.1)), (4, pytest.approx(1.8)), (5, 1.5)]


def test_tensorboard_after_a_killed_driver_shows_every_step_once(tmp_path):
    """Issue #44: the first fit's driver dies (never stopped) with its trackers at the step-3
    checkpoint, metrics.jsonl at 6, and a checkpoint at 5 reported after its last event. The next
    fit resumes at 5: TensorBoard gets 4 and 5 from metrics.jsonl (`trackers.json` said 3), 6 redone."""
    from _trackers import tensorboard_scalars

    run_dir = Location.parse(tmp_path / "run")
    first = Recorder(run_dir, FIT, [TensorBoardSink(run_dir)])
    first.handle(_start(1, 0) + [_m(1, 2 + i, step, 5.0 - step) for i, step in enumerate((1, 2, 3))]
                 + [{"kind": "checkpoint", "attempt": 1, "seq": 5, "step": 3, "name": "c3"}]
                 + [_m(1, 6 + i, step, 5.0 - step) for i, step in enumerate((4, 5, 6))])
    assert json.loads((tmp_path / "run" / "trackers.json").read_text()) == {"step": 3}
    second = Recorder(run_dir, "f2", [TensorBoardSink(run_dir)])
    second.handle(_start(1, 5) + [_m(1, 2, 6, 0.25), _m(1, 3, 7, 0.125)])
    second.stop()
    second.close("ok")
    shown = tensorboard_scalars(run_dir.local_path / "tensorboard")
    assert shown["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0), (5, 0.0), (6, 0.25), (7, 0.125)]


def test_mlflow_sink_one_run_by_id_from_another_thread(tmp_path, monkeypatch):
    """The recorder logs from its own thread: everything lands in the one run created by id,
    and MLflow's thread-local active run is never used. FINISHED / KILLED / FAILED as the fit ended."""
    import threading

    import mlflow  # in the dev extra: a missing one fails, never skips
    from raytrain_ddp.driver.sinks import MlflowSink

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    for status, expected in (("ok", "FINISHED"), ("interrupted", "KILLED"), ("failed", "FAILED")):
        cfg = load_config(None, [f"name=mlflow-{status}", "run.loggers=[jsonl,mlflow]"])
        sink = MlflowSink(cfg, Location.parse(tmp_path / "runs" / cfg.name), fit_id="a" * 32)
        worker = threading.Thread(target=lambda: [sink.record({"step": 1, "time": 1.7e9, "loss": 2.0, "lr": 0.1}),
                                                  sink.record({"step": 2, "time": 1.7e9 + 1, "loss": 1.0,
                                                               "val_loss": 0.5, "attempt": 1})])
        worker.start()
        worker.join(timeout=60)
        sink.close(status)
        assert mlflow.active_run() is None
        experiment = client.get_experiment_by_name(cfg.name)
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1, [(r.info.run_name, r.info.status) for r in runs]
        run = runs[0]
        assert run.info.run_id == sink.run_id and run.info.run_name == cfg.name and run.info.status == expected
        assert run.data.tags["raytrain_ddp.fit_id"] == "a" * 32 and run.data.params["train.lr"] == str(cfg.train.lr)
        assert len(run.data.params) == len(_flat_keys(cfg))
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert [(m.step, m.value, m.timestamp) for m in history] == [(1, 2.0, 1_700_000_000_000),
                                                                     (2, 1.0, 1_700_000_001_000)]
        assert set(run.data.metrics) == {"train/loss", "train/lr", "val/loss"}


def _flat_keys(cfg):
    from raytrain_ddp.driver.resume import flatten
    from raytrain_ddp.driver.sinks import config_tree

    return flatten(config_tree(cfg))


def test_wandb_sink_offline_run_read_back(tmp_path, monkeypatch):
    """An offline W&B run, logged from another thread, read back from its .wandb file."""
    import threading

    import wandb  # noqa: F401 - in the dev extra: a missing one fails, never skips
    from _trackers import wandb_offline_run, wandb_points
    from raytrain_ddp.driver.sinks import WandbSink

    for status, code in (("ok", 0), ("failed", 1)):
        wandb_dir = tmp_path / status
        wandb_dir.mkdir()
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
        monkeypatch.delenv("WANDB_PROJECT", raising=False)
        cfg = load_config(None, [f"name=wandb-{status}", "run.loggers=[jsonl,wandb]"])
        sink = WandbSink(cfg, Location.parse(tmp_path / "runs" / cfg.name), fit_id="b" * 32)
        lines = [{"step": 1, "time": 1.7e9, "loss": 2.0, "lr": 0.1}, {"step": 2, "time": 1.7e9 + 1, "loss": 1.0},
                 {"step": 2, "time": 1.7e9 + 2, "val_loss": 0.5, "val_accuracy": 0.75}]
        worker = threading.Thread(target=lambda: [sink.record(line) for line in lines])
        worker.start()
        worker.join(timeout=60)
        sink.close(status)
        run = wandb_offline_run(wandb_dir)
        assert run["name"] == cfg.name and run["project"] == cfg.name and run["exit_code"] == code
        assert run["config"]["train"]["lr"] == cfg.train.lr and run["config"]["raytrain_ddp"]["fit_id"] == "b" * 32
        assert wandb_points(run, "train/loss") == [(1, 2.0), (2, 1.0)]
        assert wandb_points(run, "val/loss") == [(2, 0.5)] and wandb_points(run, "val/accuracy") == [(2, 0.75)]


def test_check_loggers_names_the_missing_package(monkeypatch):
    """Before Ray starts: a logger whose package is missing is one line naming it and the fix."""
    import importlib.util

    from raytrain_ddp.driver import sinks
    from raytrain_ddp.errors import UserError

    real = importlib.util.find_spec
    missing = {"wandb", "mlflow"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    for logger in ("wandb", "mlflow"):
        with pytest.raises(UserError, match=rf"run.loggers includes '{logger}' but the {logger} package is not "
                                            rf"installed; pip install {logger}, or drop it from run.loggers"):
            sinks.check_loggers(load_config(None, [f"run.loggers=[jsonl,{logger}]"]))
    sinks.check_loggers(load_config(None, ["run.loggers=[jsonl,tensorboard]"]))  # tensorboardX is there


def test_a_fit_in_a_bucket_hands_ray_an_empty_history_and_publishes_a_dead_upload(s3, tmp_path, monkeypatch):
    """Issue #25 on object storage: Ray's snapshot goes (our pruning may have removed what it
    lists), and a staging copy whose asynchronous upload died is uploaded by the next rank 0."""
    import tempfile

    from raytrain_ddp.ray_compat import checkpoint_snapshot_name, forget_earlier_fits
    from raytrain_ddp.worker.checkpointer import STAGING_NAME_SEP, STAGING_PREFIX, publish_orphaned_uploads

    run_dir = Location.parse(f"s3://{BUCKET}/runs/sequence")
    (run_dir / checkpoint_snapshot_name()).write_text('{"checkpoint_results": []}')
    assert forget_earlier_fits(run_dir) and not (run_dir / checkpoint_snapshot_name()).exists()

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, suffix=f"{STAGING_NAME_SEP}checkpoint_00000007_{FIT[:8]}"))
    ckpt.save_checkpoint(staging, _state(7))
    job = Job.__new__(Job)
    object.__setattr__(job, "fit_id", FIT)
    assert [p.name for p in publish_orphaned_uploads(job, run_dir)] == [f"checkpoint_00000007_{FIT[:8]}"]
    assert ckpt.load_checkpoint(run_dir / f"checkpoint_00000007_{FIT[:8]}")["progress"]["step"] == 7
    assert not staging.exists()
