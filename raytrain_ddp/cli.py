"""The `raytrain-ddp` command line: parse arguments, dispatch, print user errors cleanly.

Owns: argument parsing, the exit statuses (`EXIT_CODES`, printed by `train --help`) and
turning `UserError` into one readable line and its exit code (2; `NothingToTrain` 3);
SIGTERM unwinds like Ctrl-C.
Must not touch: training logic. Each subcommand imports its module lazily, so
`raytrain-ddp --help` and `cluster validate` stay fast and never start Ray.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from raytrain_ddp.driver.ray_console import VERBOSE_ENV
from raytrain_ddp.errors import UserError

EXIT_CODES = """\
exit status:
  0    trained (or the command succeeded); also the same command on a complete run
  1    the run ended without finishing: failed, aborted (non-finite policy) or unschedulable
       (see summary.json)
  2    bad input: config, data, checkpoint, a machine that cannot run it, or a run directory
       another live fit holds (one line names it)
  3    nothing to train for this command: the run's checkpoint is already at train.epochs /
       train.max_steps and the command asks for something else (another lr, a lower end)
  130  interrupted (Ctrl-C or SIGTERM); everything the run started is stopped
"""


def _config_and_overrides(args: argparse.Namespace) -> tuple[Optional[str], list[str]]:
    """`raytrain-ddp train train.lr=0.1` has no file: the first word is then an override."""
    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.hold import refuse_if_held
    from raytrain_ddp.driver.preflight import preflight
    from raytrain_ddp.driver.torchrun import RankZeroLauncher, follow_rank_0, torchrun_config, under_torchrun
    from raytrain_ddp.launch.table import start_early

    ranks = under_torchrun()  # a user's `torchrun --nproc-per-node=N ... train`: one fit, rank 0 its driver
    if ranks is not None and ranks[0] != 0:
        return follow_rank_0()
    launch = RankZeroLauncher() if ranks is not None else None
    try:
        path, overrides = _config_and_overrides(args)
        cfg = torchrun_config(path, overrides, *ranks[1:]) if ranks else load_config(path, overrides)  # once
        preflight(cfg)  # refusals before the launcher imports torch and Ray
        refuse_if_held(cfg)  # another live fit of this run: exit 2 in about a second (driver/hold.py)
        launch = launch or start_early(cfg)  # scaling.launcher=torchrun: its processes import torch while this one does
        from raytrain_ddp.driver.fit import run_training
        from raytrain_ddp.timeline import process_start_time
        from raytrain_ddp.user import resolve

        cfg, code = resolve(cfg, config_path=path)  # import paths: next to the YAML too
        # preflight ran above, on the same settings; the start-up timeline counts from this process's start
        summary = run_training(cfg, code=code, preflighted=True, started_at=process_start_time(), launch=launch)
    finally:
        if launch is not None:
            launch.close()  # a refusal before the fit (nothing to train, bad data): torchrun waits for no job
    return {"ok": 0, "interrupted": 130}.get(summary.get("status", "ok"), 1)  # see EXIT_CODES


def _cmd_export(args: argparse.Namespace) -> int:
    from raytrain_ddp.export import export_run

    out = export_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from raytrain_ddp.config import load_config, reference_markdown

    if args.reference:
        print(reference_markdown())
        return 0
    from raytrain_ddp.driver.config_view import render

    cfg = load_config(*_config_and_overrides(args))
    print(cfg.to_yaml() if args.all else render(cfg), end="")
    counts = cfg.valid_worker_counts()
    steps = ", ".join(f"{w} workers -> {cfg.accumulation_steps(w)}" for w in counts)
    print(f"# global batch {cfg.train.global_batch_size} = workers x micro-batch "
          f"{cfg.train.micro_batch_size} x accumulation steps ({steps})")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from raytrain_ddp.ops.plot import plot_run

    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def _cmd_goodput(args: argparse.Namespace) -> int:
    import json

    from raytrain_ddp.goodput import format_table, report
    from raytrain_ddp.ops.goodput_plot import plot_goodput
    from raytrain_ddp.rundir import ATTEMPTS_FILE, Location

    where = Location.parse(args.run_dir)
    if not (where / ATTEMPTS_FILE).exists():
        raise UserError(f"{where / ATTEMPTS_FILE} not found: is {args.run_dir!r} a run directory that trained?")
    rep = report(where)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    print(format_table(rep))
    print(f"wrote {plot_goodput(rep, where, args.out)}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from raytrain_ddp.data.sources import export_digits

    out = export_digits(args.out)
    print(f"wrote {out}")
    return 0


def _cmd_cluster_validate(args: argparse.Namespace) -> int:
    from raytrain_ddp.ops.cluster import main as validate_main

    return validate_main(args.files)


def _cmd_verify(args: argparse.Namespace) -> int:
    from raytrain_ddp.ops.verify import main as verify_main

    return verify_main(*_config_and_overrides(args))


def _cmd_bench(args: argparse.Namespace) -> int:
    """The benchmarks live in the checkout (`benchmarks/`), not in the installed package:
    they measure this project, so they run as the checkout's own process (`python -m
    benchmarks.suite` there; the package imports nothing of the checkout), and users of a
    wheel get one line saying where they are."""
    import subprocess

    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / "benchmarks" / "suite.py").is_file():
        raise UserError("raytrain-ddp bench runs from a checkout of raytrain_ddp (its benchmarks/ "
                        "folder is not installed): clone the repository and run `make bench` there")
    out = ["--out", str(Path(args.out).resolve())] if args.out else []  # the caller's directory, not the checkout's
    return subprocess.call([sys.executable, "-m", "benchmarks.suite", *(["--quick"] if args.quick else []), *out,
                            "--device", args.device], cwd=checkout)


def _cmd_sweep(args: argparse.Namespace) -> int:
    """A sweep (`raytrain_ddp/sweep/`), or with --report the table of a sweep directory."""
    if args.report is not None:
        from raytrain_ddp.rundir import Location
        from raytrain_ddp.sweep.report import print_report

        print_report(Location.parse(args.report))
        return 0
    from raytrain_ddp.config.sweep import load_sweep

    path, overrides = _config_and_overrides(args)
    load_sweep(path, overrides)  # a search key or value refused: one line, before torch and Ray are imported
    from raytrain_ddp.api import sweep

    outcome = sweep(path, overrides=overrides)
    return 130 if outcome["status"] == "interrupted" else 0 if not outcome["errors"] else 1


def _add_sweep(sub: Any) -> None:
    sweep = sub.add_parser("sweep", help="search hyperparameters on Ray Tune (the config's sweep: section); "
                           "--report DIR: its trials ranked, their curves, the best config",
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_argument("--verbose", action="store_true", help="also show Ray's own log lines")
    sweep.add_argument("--report", metavar="DIR", default=None,
                       help="print a sweep directory's table, write its curves.png and best.yaml (no Ray)")
    sweep.add_argument("config", nargs="?", default=None, help="YAML config with a sweep: section")
    sweep.add_argument("overrides", nargs="*", help="key.sub=value overrides, sweep.* among them")
    sweep.set_defaults(func=_cmd_sweep)


def _add_checks(sub: Any) -> None:
    """The commands that check or measure an install rather than train: verify, bench."""
    verify = sub.add_parser(
        "verify", help="check every strategy against torch DDP and one process on this config's model "
        "and data (2 local gloo ranks, float64, no Ray); exit 1 naming any parameter that differs")
    verify.add_argument("config", nargs="?", default=None, help="YAML config file (omit for defaults)")
    verify.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    verify.set_defaults(func=_cmd_verify)

    bench = sub.add_parser("bench", help="benchmark strategies, accumulation, Ray overhead and ingest")
    bench.add_argument("--quick", action="store_true", help="small sizes, ~2 minutes")
    bench.add_argument("--out", default=None, help="JSON results file; the printed table (.md) and a PNG "
                       "plot beside it (default: benchmarks/results/<preset>-<date>.json)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bench.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raytrain-ddp",
        description="Data-parallel PyTorch training on Ray clusters.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config (embedded local Ray unless RAY_ADDRESS is set)",
                           epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--verbose", action="store_true",
                       help="also show Ray's own log lines (hidden by default: plan, progress, summary, warnings)")
    train.add_argument("config", nargs="?", default=None, help="YAML config file (omit for all defaults)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.lr=0.01")
    train.set_defaults(func=_cmd_train)

    config = sub.add_parser("config", help="validate a config and print the keys that apply, resolved (no Ray)")
    config.add_argument("config", nargs="?", default=None, help="YAML config file (omit for defaults)")
    config.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    config.add_argument("--reference", action="store_true", help="print every key as a markdown table")
    config.add_argument("--all", action="store_true",
                        help="print every key, those with no effect for these choices too (as config.yaml holds)")
    config.set_defaults(func=_cmd_config)

    plot = sub.add_parser("plot", help="plot loss / validation / throughput of a run directory to a PNG")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)

    goodput = sub.add_parser("goodput", help="where a run's wall time went, over every fit: productive steps, "
                             "start-up, waits, redone work, recovery, idle; interruptions by cause")
    goodput.add_argument("run_dir", help="run directory (a local path or s3://...)")
    goodput.add_argument("--json", action="store_true", help="print the figures as JSON (seconds), no table or picture")
    goodput.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/goodput.png)")
    goodput.set_defaults(func=_cmd_goodput)

    export = sub.add_parser("export", help="write a run's trained model (bare state_dict + config) for use without Ray")
    export.add_argument("run_dir", help="run directory (its newest valid checkpoint is exported)")
    export.add_argument("out", help="output file, e.g. model.pt (load with torch.load(out, weights_only=True))")
    export.set_defaults(func=_cmd_export)

    data = sub.add_parser("data", help="export a bundled data set to parquet")
    data_sub = data.add_subparsers(dest="dataset", required=True)
    digits = data_sub.add_parser("digits", help="scikit-learn's 8x8 handwritten digits (1,797 rows)")
    digits.add_argument("out", help="output parquet file")
    digits.set_defaults(func=_cmd_data)

    cluster = sub.add_parser("cluster", help="cluster files")
    cluster_sub = cluster.add_subparsers(dest="action", required=True)
    validate = cluster_sub.add_parser("validate", help="check cluster YAMLs against Ray's schema and our rules")
    validate.add_argument("files", nargs="*", help="files or directories (default: cluster/)")
    validate.set_defaults(func=_cmd_cluster_validate)

    _add_checks(sub)
    _add_sweep(sub)
    return parser


def _stacks_on_sigusr1() -> bool:
    """`kill -USR1 <pid>` prints every thread's stack to the process's stderr and the run goes on:
    what a driver that seems stuck is waiting for (docs/usage.md#ctrl-c), without a debugger.
    Written to the real fd 2 (`sys.__stderr__`): `sys.stderr` may be a stream with no file
    behind it (pytest's capture, a notebook). True when registered, for `main` to undo."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return False
    import faulthandler

    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # no stderr with a file descriptor: no stacks
        return False
    return True


SWITCHES = ("--verbose",)  # flags without a value, accepted anywhere on the command line


def _flags_first(argv: list[str]) -> list[str]:
    """`train CONFIG --verbose k=v` as `train --verbose CONFIG k=v`: argparse cannot take an
    optional between two runs of one nargs='*' positional (#30)."""
    if not argv:
        return argv
    switches = [a for a in argv[1:] if a in SWITCHES]
    return [argv[0], *switches, *(a for a in argv[1:] if a not in SWITCHES)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(_flags_first(sys.argv[1:] if argv is None else list(argv)))
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # read by the console filter (driver/console.py)
    previous = _terminate_as_interrupt()
    stacks = _stacks_on_sigusr1()
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"raytrain-ddp: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("raytrain-ddp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `raytrain-ddp config ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if stacks:  # `main` called in-process (tests, a notebook) leaves no handler behind
            import faulthandler

            faulthandler.unregister(signal.SIGUSR1)


def _terminate_as_interrupt() -> Any:
    """SIGTERM (`timeout`, a scheduler) unwinds like Ctrl-C, so `finally` blocks stop what the run started."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def console() -> None:
    """The `raytrain-ddp` command: `main`, then the exit handlers, then the end of the process
    without tearing the interpreter down (about 1 s after a fit: torch's and Ray's modules
    finalised one by one; re-measured: docs/compat.md). Everything a
    command writes is closed before `main` returns; the exit handlers (logging, trackers) run here."""
    import atexit

    from raytrain_ddp.ray_compat import override_on

    if not override_on("fast_exit"):
        sys.exit(main())
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    console()
