"""`scaling.launcher: torchrun` starts torchrun before the driver reads the data (`driver/torchrun.py`):
its processes import torch meanwhile and each rank waits for its job. A driver that fails
before the job is written stops them and leaves nothing behind; a rank whose driver is
gone stops waiting."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raytrain_ddp.config import load_config
from raytrain_ddp.driver import local
from raytrain_ddp.driver.fit import run_training
from raytrain_ddp.driver.torchrun import DRIVER_PID_ENV

pytestmark = pytest.mark.timeout(120)

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "tiny.yaml"


def _processes_naming(text: str) -> list[str]:
    """Command lines of the processes whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(cmd)
    return found


def _ours(tmp: Path) -> list[Path]:
    """What a launch (its job and log directory) or torchrun (`torchelastic_*`) left in `tmp`;
    torch's own cache (`torchinductor_<user>`, made by any torch import under load) is not ours."""
    return [p for p in tmp.iterdir() if p.name.startswith(("raytrain_ddp_torchrun_", "torchelastic_"))]


def test_a_driver_that_fails_before_the_job_is_written_stops_torchrun_and_leaves_nothing(tmp_path, monkeypatch):
    def broken(*_args, **_kwargs):
        deadline = time.monotonic() + 60  # torchrun's agent and both ranks are up and waiting
        while len(_processes_naming(str(payloads))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError("the data could not be read")

    payloads = tmp_path / "tmp"  # where the driver puts the ranks' job (tempfile's directory)
    payloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(payloads))  # where the driver puts the ranks' job
    monkeypatch.setattr(local, "local_data", broken)
    cfg = load_config(TINY, [f"run.storage_path={tmp_path}", "name=t", "scaling.launcher=torchrun"])
    with pytest.raises(RuntimeError, match="could not be read"):
        run_training(cfg)
    assert _processes_naming(str(payloads)) == []  # the agent and its ranks: stopped and reaped
    assert _ours(payloads) == []


def test_a_rank_whose_driver_is_gone_stops_waiting_for_its_job(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "import sys; from raytrain_ddp.driver.torchrun import "
                           "_wait_for_payload; _wait_for_payload(sys.argv[1], int(sys.argv[2]))",
                           str(tmp_path / "never.pkl"), str(gone.pid)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, DRIVER_PID_ENV: "0"})
    assert done.returncode == 1 and done.stderr == "", done.stderr  # quietly: the driver's console says why
    assert time.monotonic() - started < 30


def test_the_command_starts_torchrun_before_its_checks_and_a_refusal_stops_it(tmp_path):
    """`raytrain-ddp train ... scaling.launcher=torchrun` starts torchrun before it imports torch
    (`torchrun.start_early`); bad data is then refused in one line, exit 2, and torchrun's
    processes are gone with the command."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": pa.array([[0.0] * 4] * 64), "label": pa.array([1] * 64)}), bad)
    payloads = tmp_path / "tmp"
    payloads.mkdir()
    seen: list[str] = []
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_ddp", "train", str(TINY), f"run.storage_path={tmp_path}",
                             "name=t", "scaling.launcher=torchrun", "data.source=parquet", f"data.path={bad}"],
                            env={**os.environ, "TMPDIR": str(payloads)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        seen += _processes_naming(str(payloads))
        time.sleep(0.05)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "column 'y' (data.label) not found" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert any("torch.distributed.run" in cmd for cmd in seen)  # it had started torchrun
    assert _processes_naming(str(payloads)) == [] and _ours(payloads) == []


def test_a_stop_at_any_moment_of_the_launch_ends_in_seconds_and_leaves_nothing(tmp_path, monkeypatch):
    """`TorchrunLaunch.stop` before the job, at moments from at once to while the agent forks
    its ranks, and on an agent left SIGSTOPped (state `T`: a stop once waited on it for good):
    each ends within its bounds, with no process of the launch and no temp dir left."""
    import signal

    from raytrain_ddp.driver.torchrun import STOP_WAIT_S, TorchrunLaunch

    payloads = tmp_path / "tmp"
    payloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(payloads))  # where the launch puts its job and logs
    cfg = load_config(TINY, [f"run.storage_path={tmp_path}", "name=t", "scaling.launcher=torchrun"])
    for i in range(20):
        launch = TorchrunLaunch(cfg)
        time.sleep((i % 5) * 0.3)  # 0 to 1.2 s: before torchrun runs, while it starts its ranks
        if i % 4 == 3:
            os.killpg(launch.proc.pid, signal.SIGSTOP)  # the agent (and a rank it forks) stopped
        started = time.monotonic()
        launch.stop()
        assert time.monotonic() - started < STOP_WAIT_S, f"stop {i} waited {time.monotonic() - started:.1f} s"
        assert launch.proc.poll() is not None, i
        assert _processes_naming(str(payloads)) == [] and _ours(payloads) == [], i


def test_a_users_torchrun_is_detected_and_its_world_size_is_the_fits(monkeypatch, tmp_path):
    """`torchrun --nproc-per-node=N ... raytrain-ddp train` (docs/usage.md#torchrun): the CLI
    sees torchrun's environment; the fit is that of scaling.launcher=torchrun
    scaling.num_workers=WORLD_SIZE, and a scaling key set otherwise is one line naming both."""
    from raytrain_ddp.driver.torchrun import torchrun_config, under_torchrun
    from raytrain_ddp.config import ConfigError

    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert under_torchrun() is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert under_torchrun() is None  # RANK alone (another tool's): not torchrun's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert under_torchrun() == (0, 4, 4)

    storage = [f"run.storage_path={tmp_path}"]
    cfg = torchrun_config(TINY, [*storage, "scaling.num_workers=4"], 4, 4)
    assert (cfg.scaling.launcher, cfg.scaling.num_workers) == ("torchrun", 4)
    unsized = tmp_path / "unsized.yaml"  # tiny.yaml less its scaling: section
    unsized.write_text(TINY.read_text().replace("scaling:\n  num_workers: 2\n", ""))
    assert torchrun_config(unsized, storage, 4, 4).scaling.num_workers == 4  # not given: WORLD_SIZE
    with pytest.raises(ConfigError) as exc:
        torchrun_config(TINY, storage, 4, 4)  # tiny.yaml says 2
    assert str(exc.value) == ("scaling.num_workers=2 but torchrun started WORLD_SIZE=4 ranks: set "
                              "scaling.num_workers=4, or leave it out (torchrun's count is taken)")
    with pytest.raises(ConfigError, match=r"^scaling.launcher=ray but torchrun started"):
        torchrun_config(TINY, [*storage, "scaling.launcher=ray"], 2, 2)
    with pytest.raises(ConfigError, match=r"^torchrun started 4 ranks, 2 on this machine: .*--nnodes=1"):
        torchrun_config(TINY, storage, 4, 2)
