"""CLI surface without Ray: help, config printing, user errors as one line with exit 2."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ddp.cli import main
from raytrain_ddp.config import config_keys

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]


def test_config_command_prints_resolved_config_and_derived_batch(capsys):
    assert main(["config", str(ROOT / "examples/configs/quickstart.yaml"), "train.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.01" in out and "accumulation steps" in out


def test_config_prints_only_the_keys_that_apply_and_all_with_all(capsys):
    """The quickstart (cnn, digits, adamw, cosine) shows no gpt, parquet or sgd keys, and names
    them in one comment line; --all prints config.yaml's every key; choosing gpt / sgd /
    parquet brings theirs back."""
    import yaml

    quickstart = str(ROOT / "examples/configs/quickstart.yaml")
    assert main(["config", quickstart]) == 0
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    assert "d_model" not in shown["model"] and "hidden_sizes" not in shown["model"]
    assert "path" not in shown["data"] and "synthetic" not in shown["data"] and "momentum" not in shown["train"]
    assert shown["train"]["lr"] == 0.003 and shown["parallel"]["shm"] is True
    (note,) = [line for line in out.splitlines() if line.startswith("# not shown")]
    assert "model.d_model" in note and "train.momentum" in note and "config --all" in note
    assert main(["config", quickstart, "--all"]) == 0
    full = yaml.safe_load(capsys.readouterr().out)
    assert full["model"]["d_model"] == 128 and "# not shown" not in str(full)
    assert main(["config", quickstart, "model.name=gpt", "train.optimizer=sgd", "data.source=parquet",
                 "data.path=x.parquet", "train.max_steps=5"]) == 0
    picked = yaml.safe_load(capsys.readouterr().out)
    assert picked["model"]["d_model"] == 128 and picked["train"]["momentum"] == 0.9
    assert picked["data"]["path"] == "x.parquet" and "epochs" not in picked["train"]


def test_user_errors_are_one_line_exit_2(capsys):
    assert main(["config", "missing.yaml"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["config", "train.lr=-3"]) == 2  # no file: the first word is an override
    assert main(["train", "train.lr=-3"]) == 2  # rejected before Ray is touched
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("train.lr") == 2 and "raytrain-ddp: error:" in err


def test_reference_covers_every_key(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    for key in config_keys():
        assert f"`{key}`" in out


def test_configuration_doc_documents_every_key():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in config_keys() if f"`{key}`" not in page]
    assert not missing, (f"docs/configuration.md lacks {missing}; regenerate it: "
                         ".venv/bin/python tests/local/docs/gen_configuration.py")


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "raytrain_ddp", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout and "cluster" in out.stdout


def test_main_in_process_works_without_a_file_behind_stderr_and_leaves_no_signal_handler(capsys, monkeypatch):
    """Under pytest's capture or in a notebook stderr has no fileno: the stacks-on-SIGUSR1 setup
    must neither fail the command (CI of stop 21) nor outlive the call."""
    import faulthandler
    import io

    assert main(["config", str(ROOT / "examples/configs/quickstart.yaml")]) == 0
    assert faulthandler.unregister(signal.SIGUSR1) is False  # main undid its registration
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())  # no file descriptor at all
    assert main(["config", "missing.yaml"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_sigusr1_prints_every_threads_stack_and_the_driver_goes_on():
    """`kill -USR1 <pid>` on a driver that seems stuck says where it waits (docs/usage.md)."""
    code = ("import os, signal, threading, time\n"
            "from raytrain_ddp.cli import _stacks_on_sigusr1\n"
            "_stacks_on_sigusr1()\n"
            "threading.Thread(target=time.sleep, args=(5,), name='waiter', daemon=True).start()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(0.2)\n"
            "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "still running", done.stderr
    assert "Current thread" in done.stderr and done.stderr.count("File ") >= 2, done.stderr  # main + the waiter


def test_verbose_is_accepted_anywhere_on_the_command_line():
    from raytrain_ddp.cli import _flags_first, build_parser

    for argv in (["train", "--verbose", "c.yaml", "train.lr=0.1"], ["train", "c.yaml", "--verbose", "train.lr=0.1"],
                 ["train", "c.yaml", "train.lr=0.1", "--verbose"]):
        args = build_parser().parse_args(_flags_first(argv))
        assert args.verbose and args.config == "c.yaml" and args.overrides == ["train.lr=0.1"], argv


@pytest.mark.parametrize("module", [False, True], ids=["raytrain-ddp", "python -m raytrain_ddp"])
def test_the_command_ends_with_main_s_exit_code_after_the_exit_handlers_and_its_output(module, tmp_path, capsys):
    """`cli.console` ends the process with `os._exit` after `main`: the exit code is main's, the
    exit handlers ran (a file one of them writes exists) and everything printed arrived."""
    import os

    exe = [sys.executable, "-m", "raytrain_ddp"] if module else [str(Path(sys.executable).parent / "raytrain-ddp")]
    marker = tmp_path / "atexit-ran"
    (tmp_path / "sitecustomize.py").write_text(  # an exit handler registered in the command's own process
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).write_text, 'ok')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = ["config", str(ROOT / "examples/configs/quickstart.yaml"), "--all"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    done = subprocess.run([*exe, *args], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout == expected, done.stderr
    assert marker.read_text() == "ok"
    bad = subprocess.run([*exe, "config", args[1], "train.nope=1"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "train.nope" in bad.stderr, bad.stderr
