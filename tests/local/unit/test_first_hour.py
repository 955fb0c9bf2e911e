"""A new user's first hour, without Ray: what is refused before Ray starts and how it is said.

A GPU request on this GPU-less machine, a relative storage path inside a Ray job, a
finished run re-run with new settings (exit 3, `config.yaml` untouched), hints that
name a command that works, the run directory's record of what trained, checkpoints kept
over all fits, where `bench` and `data digits` write, and the console filter for Ray's
worker output. Each case goes through the same functions `raytrain-ddp train` uses.
"""

from __future__ import annotations

import json
import os
import resource
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp import ray_compat
from raytrain_ddp.driver import preflight, ray_console
from raytrain_ddp.cli import main
from raytrain_ddp.driver.resume import (
    CONFIG_HISTORY_FILE, NothingToTrain, ResumeError, check_something_to_train, prune_checkpoints, record_config,
    ResumePoint, resolve_resume, restore_config_if_untrained, resume_point,
)
from raytrain_ddp.rundir import CONFIG_FILE, read_metrics

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"
QUICKSTART = REPO / "examples" / "configs" / "quickstart.yaml"


def _cfg(storage: Path, *overrides: str):
    return load_config(TINY, [f"run.storage_path={storage}", *overrides])


def _save(run_dir: Path, cfg, step: int, epoch: int, fit_id: str, into: int = 0) -> Path:
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
             "schedule": {}, "progress": {"step": step, "epoch": epoch, "steps_into_epoch": into},
             "rng": ckpt.rng_state(), "run": {"world_size": 2, "fit_id": fit_id, "config": cfg.to_yaml()}}
    return ckpt.save_checkpoint(run_dir / f"checkpoint_{step:08d}_e{epoch}s{into}_{fit_id[:8]}", state)


def test_gpu_request_on_this_machine_exits_2_at_once_naming_the_key(tmp_path):
    assert not torch.cuda.is_available(), "this test describes a GPU-less machine"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "raytrain_ddp", "train", str(QUICKSTART), "scaling.use_gpu=true",
                           f"run.storage_path={tmp_path}"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds, not wall: "at once" holds on a loaded machine too (as test_sweep_config's typo check)
    elapsed = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "scaling.use_gpu=true" in lines[0] and "no GPU" in lines[0], done.stderr
    assert elapsed < 10, f"took {elapsed:.1f}s"
    assert not (tmp_path / "quickstart").exists()  # refused before anything was written


@pytest.fixture
def no_ray(monkeypatch):
    """An embedded start, even when this test session already has Ray up (`ray_cluster` is
    session-scoped): in-process `main` would otherwise join that instance. Reaching Ray
    at all fails the test: these refusals come before it."""
    from raytrain_ddp.driver import launcher

    def _reached(*_args, **_kwargs):
        raise AssertionError("reached Ray: the refusal should have come before it")

    monkeypatch.setattr(preflight, "_joins_a_cluster", lambda cfg: False)
    monkeypatch.setattr(launcher, "connect_ray", _reached)


def test_too_many_cpus_for_this_machine_names_the_keys(tmp_path, capsys, no_ray):
    assert main(["train", str(TINY), f"run.storage_path={tmp_path}", "scaling.cpus_per_worker=4096"]) == 2
    assert "scaling.cpus_per_worker=4096" in capsys.readouterr().err
    assert main(["train", str(TINY), f"run.storage_path={tmp_path}", "scaling.num_workers=64",
                 "train.global_batch_size=1024"]) == 2
    err = capsys.readouterr().err
    assert "scaling.num_workers=64" in err and "scaling.cpus_per_worker=1" in err and len(err.splitlines()) == 1


def test_relative_storage_path_is_refused_inside_a_ray_job(tmp_path, monkeypatch, capsys):
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}, "metadata": {"job_submission_id": "raysubmit_1"}}
    monkeypatch.setenv(ray_compat.JOB_CONFIG_ENV, json.dumps(job_config))
    monkeypatch.chdir(tmp_path)
    assert preflight.ray_job_id() == "raysubmit_1"
    assert main(["train", str(TINY), "run.storage_path=./runs"]) == 2
    err = capsys.readouterr().err
    assert "run.storage_path='./runs' is relative" in err and "raysubmit_1" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    preflight.check_storage_under_job(_cfg(tmp_path / "abs"))  # an absolute path is fine
    preflight.check_storage_under_job(_cfg(Path("ignored"), "run.storage_path=s3://bucket/runs"))

    # Without the variable, Ray's unpacked working directory gives it away.
    monkeypatch.delenv(ray_compat.JOB_CONFIG_ENV)
    assert preflight.ray_job_id() is None
    unpacked = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    unpacked.mkdir(parents=True)
    monkeypatch.chdir(unpacked)
    with pytest.raises(preflight.StorageError, match="run.storage_path='runs'"):
        preflight.check_storage_under_job(_cfg(Path("runs")))


def test_finished_run_rerun_exits_3_before_ray_and_keeps_its_config(tmp_path, capsys, no_ray):
    trained = _cfg(tmp_path)
    run_dir = tmp_path / "tiny"
    _save(run_dir, trained, step=44, epoch=2, fit_id="a" * 32)
    (run_dir / CONFIG_FILE).write_text(trained.to_yaml())

    assert main(["train", str(TINY), f"run.storage_path={tmp_path}", "train.lr=0.001", "scaling.num_workers=1"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nothing to train" in err and "train.epochs=4" in err and "name=tiny-2" in err
    assert (run_dir / CONFIG_FILE).read_text() == trained.to_yaml()  # still what the checkpoint was trained with

    # Both hinted commands get past the check.
    extended = _cfg(tmp_path, "train.epochs=4")
    check_something_to_train(extended, resume_point(extended, run_dir))
    renamed = _cfg(tmp_path, "name=tiny-2")
    assert resolve_resume(renamed, tmp_path / "tiny-2") is None
    # max_steps: the same rule counted in steps
    with pytest.raises(NothingToTrain, match=r"train\.max_steps=20\b.*train\.max_steps=40"):
        check_something_to_train(_cfg(tmp_path, "train.max_steps=20"), resume_point(trained, run_dir))


def test_the_same_command_on_a_complete_run_exits_0_and_says_it_is_complete(tmp_path, capsys, no_ray):
    """Issue #44: a job-retry policy that reruns until exit 0 stops here. A killed driver had
    written neither the last step's metrics line nor summary.json: both are there after."""
    trained = _cfg(tmp_path, "scaling.num_workers=2")
    run_dir = tmp_path / "tiny"
    line = {"step": 44, "epoch": 2.0, "time": 1.0, "loss": 0.25}
    state = {"model": {}, "optimizer": {}, "schedule": {}, "progress": {"step": 44, "epoch": 2, "steps_into_epoch": 0},
             "rng": ckpt.rng_state(), "run": {"world_size": 2, "fit_id": "a" * 32, "config": trained.to_yaml()}}
    ckpt.save_checkpoint(run_dir / "checkpoint_00000044_e2s0_aaaaaaaa", state, lines=[line])
    (run_dir / CONFIG_FILE).write_text(trained.to_yaml())
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**line, "step": s}) + "\n" for s in range(1, 44)))

    # the same command, with another worker count (how it runs, not what it trains)
    assert main(["train", str(TINY), f"run.storage_path={tmp_path}", "scaling.num_workers=1"]) == 0
    out = capsys.readouterr().out
    assert "run 'tiny' is complete: trained to train.epochs=2" in out and "step 44" in out, out
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 45))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 44 and summary["final_metrics"]["loss"] == 0.25
    assert check_something_to_train(trained, resume_point(trained, run_dir)) is True
    assert main(["train", str(TINY), f"run.storage_path={tmp_path}"]) == 0  # and again: still complete
    assert (run_dir / CONFIG_FILE).read_text() == trained.to_yaml()


def test_a_fit_interrupted_as_it_trained_its_last_step_is_complete(tmp_path, capsys):
    """Issue #44: a Ctrl-C at step 70 of 120, the workers at step 120 by the next poll: before,
    `status interrupted` and "the same command continues from step 120", which then exited 3."""
    from raytrain_ddp.driver.fit import report
    from raytrain_ddp.driver.stream import Recorder
    from raytrain_ddp.job import DataSpec, Job
    from raytrain_ddp.rundir import Location

    cfg = _cfg(tmp_path)  # tiny: 1,438 rows, global batch 64 -> 22 steps per epoch, 2 epochs
    run_dir = tmp_path / "tiny"
    spec = DataSpec("classification", (64,), 10, 1438, 359, "digits")
    for step, epoch, ended in ((30, 1, "interrupted"), (44, 2, "ok")):
        _save(run_dir, cfg, step=step, epoch=epoch, fit_id="b" * 32)
        job = Job(cfg=cfg, spec=spec, run_dir=str(run_dir), fit_id="b" * 32)
        recorder = Recorder(Location.parse(run_dir), job.fit_id, [])
        summary = report(cfg, Location.parse(run_dir), job, recorder, "interrupted", None, time.time())
        assert summary["status"] == ended and summary["checkpoint_step"] == step, summary
        assert json.loads((run_dir / "summary.json").read_text())["status"] == ended
    out = capsys.readouterr()
    assert "continues from step 30" in out.err and "continues from step 44" not in out.err + out.out, out
    assert "the interrupt came as the run trained its last step: the run is complete" in out.err


def test_model_change_hint_names_a_command_that_works(tmp_path):
    trained = _cfg(tmp_path)
    run_dir = tmp_path / "tiny"
    _save(run_dir, trained, step=10, epoch=0, fit_id="b" * 32, into=10)
    changed = _cfg(tmp_path, "model.hidden_sizes=[64]")
    with pytest.raises(ResumeError) as refused:
        resolve_resume(changed, run_dir)
    message = str(refused.value)
    assert "model.hidden_sizes" in message and "run.resume=never" not in message
    hint = re.search(r"\bname=[\w.-]+", message).group(0)
    followed = _cfg(tmp_path, "model.hidden_sizes=[64]", hint)
    assert resolve_resume(followed, tmp_path / followed.name) is None  # a fresh start, no error


def test_config_history_and_restore_after_a_fit_that_trained_nothing(tmp_path):
    first = _cfg(tmp_path)
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    record_config(first, run_dir, ResumePoint(), "a" * 32)
    checkpoint = _save(run_dir, first, step=44, epoch=2, fit_id="a" * 32)
    second = _cfg(tmp_path, "train.lr=0.001", "train.epochs=4")
    record_config(second, run_dir, ResumePoint(checkpoint, ckpt.read_manifest(checkpoint)), "b" * 32)
    assert (run_dir / CONFIG_FILE).read_text() == second.to_yaml()
    history = [json.loads(line) for line in (run_dir / CONFIG_HISTORY_FILE).read_text().splitlines()]
    assert [h["fit_id"] for h in history] == ["a" * 32, "b" * 32]
    assert history[0]["changed"] == {} and history[0]["config"] == first.to_yaml()
    assert history[1]["changed"] == {"train.epochs": [2, 4], "train.lr": [0.01, 0.001]}
    assert history[1]["from_step"] == 44 and history[1]["resumed_from"] == str(checkpoint)

    # The second fit wrote no checkpoint (failed, unschedulable, interrupted): config.yaml
    # goes back to what the newest checkpoint was trained with.
    restore_config_if_untrained(run_dir, "b" * 32)
    assert (run_dir / CONFIG_FILE).read_text() == first.to_yaml()


def test_num_to_keep_holds_over_all_fits(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "tiny"
    old = [_save(run_dir, cfg, step, 0, "a" * 32, into=step) for step in (15, 20)]
    new = [_save(run_dir, cfg, step, 1, "b" * 32, into=step - 22) for step in (25, 30)]
    damaged = _save(run_dir, cfg, 35, 1, "b" * 32, into=13)
    (damaged / ckpt.STATE_FILE).write_bytes(b"torn")
    removed = prune_checkpoints(run_dir, keep=2)
    assert sorted(removed) == sorted(str(p) for p in old)
    assert sorted(p.name for p in ckpt.find_checkpoints(run_dir)) == sorted(p.name for p in [*new, damaged])



def test_worker_output_filter_keeps_our_lines_once(capsys, monkeypatch):
    monkeypatch.delenv(ray_console.VERBOSE_ENV, raising=False)
    lines = ray_console.WorkerLines()
    batch = {"pid": 1, "is_err": False, "lines": [
        "[rank 0] attempt 1: 2 workers on cpu", "Progress bars disabled. To enable, set ...",
        "[2026-11-30 19:31:18,924 E 15112 15217] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher'"]}
    lines(batch)
    lines(dict(batch, ip="10.0.0.2"))  # the same line from the second node
    lines({"pid": 2, "is_err": True, "lines": ["RayDeprecationWarning: `ExecutionOptions.exclude_resources`"]})
    out = capsys.readouterr()
    assert out.out == "[rank 0] attempt 1: 2 workers on cpu\n" and out.err == ""


def test_user_errors_are_one_line_even_with_several_problems(tmp_path, capsys):
    assert main(["config", str(TINY), "train.lr=-1", "bogus.key=1", "scaling.num_workers=3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "train.lr" in err and "bogus" in err, err
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    assert main(["config", str(broken)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_resume_never_on_an_existing_run_hints_only_what_works(tmp_path):
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    (run_dir / CONFIG_FILE).write_text("a failed first attempt left this\n")
    with pytest.raises(ResumeError) as refused:
        resolve_resume(_cfg(tmp_path, "run.resume=never"), run_dir)
    assert "name=tiny-2" in str(refused.value) and "run.resume=latest" not in str(refused.value)  # nothing to continue

    checkpoint = _save(run_dir, _cfg(tmp_path), step=10, epoch=0, fit_id="c" * 32, into=10)
    with pytest.raises(ResumeError, match=r"continue it \(run\.resume=latest\)"):
        resolve_resume(_cfg(tmp_path, "run.resume=never"), run_dir)
    assert resolve_resume(_cfg(tmp_path, "run.resume=latest"), run_dir) == checkpoint  # the hint works


def test_ray_token_notice_dropped_but_its_warning_kept_and_verbose_keeps_all(monkeypatch):
    import logging

    monkeypatch.delenv(ray_console.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")  # what before_init sets when piped; restored after the test
    assert ray_console.before_init() == "WARNING"
    logger = ray_compat.token_notice_logger()

    def passes(message: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None)
        return all(f.filter(record) for f in logger.filters)

    assert not passes("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    assert passes("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    monkeypatch.setenv(ray_console.VERBOSE_ENV, "1")
    assert ray_console.before_init() == "INFO"


def test_a_ray_this_process_started_too_small_for_the_run_is_said_with_the_fix(monkeypatch, capsys):
    """#45: Ray Data starts a Ray of the machine's cores when a dataset is made before train()."""
    import ray

    from raytrain_ddp.driver import launcher

    monkeypatch.setattr(ray_compat, "started_here", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    launcher.warn_small_instance(4)
    err = capsys.readouterr().err
    assert "has 2 CPUs; the run needs 4" in err and "ray.init(num_cpus=4)" in err, err
    launcher.warn_small_instance(2)
    assert capsys.readouterr().err == ""


def test_more_workers_than_cores_warns_once_with_the_command_that_fits(tmp_path, capsys, monkeypatch, no_ray):
    """#57: 4 workers on a 2-core machine's embedded instance ran oversubscribed with no word."""
    from raytrain_ddp.driver import placement

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(AssertionError, match="reached Ray"):
        main(["train", str(TINY), f"run.storage_path={tmp_path}", "scaling.num_workers=4"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["raytrain-ddp: warning: scaling.num_workers=4 x scaling.cpus_per_worker=1 = 4 CPUs on this "
                      "machine's 2 cores: the workers will share them and every step waits; 2 fit: "
                      "scaling.num_workers=2"], warned
    monkeypatch.setattr(sys, "argv", ["/venv/bin/raytrain-ddp", "train", "tut.yaml", "scaling.num_workers=4"])
    assert placement.command_with("scaling.num_workers=2") == "raytrain-ddp train tut.yaml scaling.num_workers=2"


def test_a_sweeps_console_is_its_plan_and_report(monkeypatch, capsys):
    """#57: Tune's box, its TensorBoard hint and every trial's own lines stay behind --verbose."""
    import logging

    installed = []
    monkeypatch.setattr(ray_compat, "replace_worker_output_handler", lambda name, handler: installed.append(handler))
    monkeypatch.delenv(ray_console.VERBOSE_ENV, raising=False)
    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    monkeypatch.setattr(logging.getLogger("ray.tune"), "level", logging.NOTSET)
    ray_console.quiet_sweep()
    assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0" and logging.getLogger("ray.tune").level == logging.ERROR
    [handler] = installed
    handler({"lines": ["raytrain-ddp: status ok | 44 steps | goodput 0% (run 0%)", "[rank 0] attempt 1"], "is_err": False})
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(ray_console.VERBOSE_ENV, "1")
    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT")
    ray_console.quiet_sweep()
    assert "RAY_AIR_NEW_OUTPUT" not in os.environ and len(installed) == 1
