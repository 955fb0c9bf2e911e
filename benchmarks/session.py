"""What a benchmark process sets up around its sections: the progress log, the `meta` block,
a local Ray, the published results file.

Owns: `log` (progress lines on stderr, so stdout stays the report), `meta` (the date, commit,
exact command, machine, versions and load a result was measured under), `start_ray` (the
local Ray instance the Ray sections share, its workers at the driver's priority) and
`results_path` / `publish` (a run's JSON and the table it printed, side by side under
`benchmarks/results/`, named `<section-or-preset>-<date>`: the one home the docs cite).
Shared by `suite` (`raytrain-ddp bench`), `startup`, `soak` and a section run alone
(`python -m benchmarks.checkpoint`), so none imports another. Must not touch: what a
section measures, presets.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp.ray_compat import WORKER_NICENESS_ENV, local_instance_kwargs

__all__ = ["log", "meta", "publish", "results_path", "start_ray"]

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks") / "results"  # relative: the bench runs from the checkout's root


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def results_path(name: str) -> Path:
    """Where a run is published without --out: `benchmarks/results/<name>-<date>.json` (UTC)."""
    return RESULTS / f"{name}-{time.strftime('%Y-%m-%d', time.gmtime())}.json"


def publish(results: dict[str, Any], path: Path, table: str) -> Path:
    """The run's JSON and, beside it (`.md`), the table it printed; returns the table's path."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=float) + "\n")
    md = path.with_suffix(".md")
    m = results.get("meta", {})
    head = (f"`{m.get('command')}` at {m.get('commit')} on {m.get('date')}: {m.get('cpu_count')} cores, "
            f"torch {m.get('torch')}, Ray {m.get('ray')}; the JSON: `{path.name}`")
    md.write_text(f"{head}\n\n{table.strip()}\n")
    return md


def _commit() -> str:
    """HEAD's hash, `+dirty` when tracked files differ from it (the figures are then not HEAD's)."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=20)  # noqa: E731
        head = run("rev-parse", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return f"{head}{'+dirty' if dirty else ''}" if head else "unknown (no git)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def _command() -> str:
    """The command as typed: `python -m benchmarks.<name>` for a section run alone."""
    first = Path(sys.argv[0])
    if first.suffix == ".py" and first.parent.name == "benchmarks":
        return shlex.join(["python", "-m", f"benchmarks.{first.stem}", *sys.argv[1:]])
    return shlex.join([first.name, *sys.argv[1:]])


def meta(preset: str, device: str) -> dict[str, Any]:
    import torch

    try:  # the torch-only sections run without Ray (the GPU machine has none)
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "not installed"

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": _commit(), "command": _command(),
        "preset": preset, "device": device, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "ray": ray_version,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_avg_at_start": list(load),
        "threads_note": "CPU: 2 gloo ranks x torch.set_num_threads(1) on this machine's cores",
        "ray_worker_niceness": os.environ.get(WORKER_NICENESS_ENV, "0 (set by the bench)"),
    }


def start_ray(num_cpus: int, num_gpus: Optional[int] = None) -> float:
    """A local instance whose workers run at the driver's priority; returns seconds to start.

    Ray starts worker processes at niceness 15 unless told otherwise (`ray job submit`
    resets it to 0 for its jobs). The plain torch.distributed processes we compare with run
    at 0, so on a machine shared with anything else the default would measure scheduling
    priority, not orchestration: we set RAY_worker_niceness=0 for a fair A/B.
    """
    import ray

    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if num_gpus is not None:
        kwargs["num_gpus"] = num_gpus
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **local_instance_kwargs("127.0.0.1"),
             log_to_driver=False, configure_logging=True, logging_level="WARNING", **kwargs)
    import ray.data

    # Keep stderr readable: Ray Data logs every execution plan and progress at INFO.
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return time.perf_counter() - started
