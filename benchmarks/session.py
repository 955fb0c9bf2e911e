"""What a benchmark process sets up around its sections: the progress log, the `meta` block, a local Ray.

Owns: `log` (progress lines on stderr, so stdout stays the report), `meta` (the machine,
versions and load a result was measured under) and `start_ray` (the local Ray instance
the Ray sections share, its workers at the driver's priority). Shared by `suite`
(`raytrain-ddp bench`) and a section run alone (`python -m benchmarks.checkpoint`),
so neither imports the other. Must not touch: what a section measures, presets, where
results go (suite owns those).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from typing import Any, Optional

from raytrain_ddp.ray_compat import WORKER_NICENESS_ENV, local_instance_kwargs

__all__ = ["log", "meta", "start_ray"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def meta(preset: str, device: str) -> dict[str, Any]:
    import torch

    try:  # the torch-only sections run without Ray (the GPU machine has none)
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "not installed"

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
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
