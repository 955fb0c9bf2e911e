"""The run directory through pyarrow.fs: locally and in a real S3-compatible server (moto, 127.0.0.1).

No Ray. Checkpoints are uploaded to the bucket the way Ray Train does it
(`pyarrow.fs.copy_files` from a local staging directory); an upload cut short is an
object set without `state.pt`. The driver's side (resume resolution, the recorder that
writes the records rank 0 sends, the TensorBoard sink) and the worker's (the checkpoint
Ray offers after a restart, read back from the bucket) run against the bucket.
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


def test_mlflow_sink_logs_params_and_metrics(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # heavy: only where installed (not a dev dependency)
    from raytrain_ddp.driver.sinks import MlflowSink

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local file store: no server,
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # and no database (mlflow-skinny has none)
    cfg = load_config(None, ["name=mlflow-run", "run.loggers=[jsonl,mlflow]"])
    sink = MlflowSink(cfg, Location.parse(tmp_path / "runs" / "mlflow-run"))
    run_id = sink.run.info.run_id
    sink.record({"step": 1, "time": 1.7e9, "loss": 2.0})
    sink.record({"step": 2, "time": 1.7e9 + 1, "loss": 1.0, "val_loss": 0.5})
    sink.close("ok")
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == str(cfg.train.lr)
    history = mlflow.MlflowClient().get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]


def test_a_fit_in_a_bucket_hands_ray_an_empty_history_and_publishes_a_dead_upload(s3, tmp_path, monkeypatch):
    """Issue #25 on object storage: Ray's snapshot goes (our pruning may have removed what it
    lists), and a staging copy whose asynchronous upload died is uploaded by the next rank 0."""
    import tempfile

    from raytrain_ddp.driver.ray_compat import checkpoint_snapshot_name, forget_earlier_fits
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
