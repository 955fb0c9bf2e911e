"""Local mode, `scaling.num_workers: 0`: the whole run in this process, with no Ray at all.

Owns: reading the data in-process (the same seeded split and the same batches as the
exact-sharding path: `LocalShard` hands the loop what Ray Data would), a process group
of one, the loop on the main thread through `worker/runtime.LocalRuntime`, and Ctrl-C.
Must not touch: the loop itself, checkpoints' format, resume decisions (the launcher's).

What users get (issue #30): the same loop, wrapper (world size 1), checkpoints, resume
and metrics as a Ray run, without `ray.init`, worker processes or Ray Data tasks, so
`breakpoint()` in a model's forward stops in the user's terminal and start-up costs
imports only. What needs Ray is refused with one line: Ray Datasets given from Python,
and the `streaming` / `sharded` data paths (both read through Ray Data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from typing import Any, Iterator


from raytrain_ddp.config import Config
from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import Location


def run_local(cfg: Config, run_dir: Location, fit_id: str, resume_from: Any, checked: Any,
              code: Any, timeline: Any = None) -> dict[str, Any]:
    """Train `cfg` in this process; returns the summary, as `launcher.run_training` does.
    `timeline`: the fit's start-up timeline (no Ray: `ray` and `datasets` are 0 s)."""
    import torch

    from raytrain_ddp.driver.console import ProgressPrinter
    from raytrain_ddp.data.ray_datasets import PreparedData
    from raytrain_ddp.driver.fit import prepare, report, root_message
    from raytrain_ddp.driver.sinks import make_sinks
    from raytrain_ddp.driver.stream import LocalMailbox, Recorder
    from raytrain_ddp.worker.loop import train_loop_per_worker
    from raytrain_ddp.worker.runtime import LocalRuntime

    if "OMP_NUM_THREADS" not in os.environ:  # as Ray sets it for a worker of scaling.cpus_per_worker CPUs
        torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))  # oversubscribed threads: docs/design.md
    shards, spec = local_data(cfg, checked, code)
    job, _, total_steps = prepare(cfg, run_dir, fit_id, resume_from, checked, code, None,
                                   prepared=PreparedData({}, spec, None))
    job = dataclasses.replace(job, mailbox=LocalMailbox())
    device = torch.device("cuda", 0) if cfg.scaling.use_gpu else torch.device("cpu")
    recorder = Recorder(run_dir, job.fit_id, [ProgressPrinter(total_steps), *make_sinks(cfg, run_dir, job.fit_id)], job.mailbox,
                        write_metrics="jsonl" in cfg.run.loggers, timeline=timeline)
    if timeline is not None:
        timeline.mark("ray", applies=False)
        timeline.mark("datasets", applies=False)  # the rows are read in this process: data_ready
        timeline.attach(run_dir)
    started, status, error = time.time(), "ok", None
    with ctrl_c_stops(job.mailbox) as pressed:
        try:
            with recorder, _one_process_group(device):
                train_loop_per_worker({"job": job, "runtime": LocalRuntime(shards, run_dir, device)})
            status = "interrupted" if pressed else "ok"
        except KeyboardInterrupt:
            status = "interrupted"
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in summary.json and printed, as a Ray run's
            status, error = "failed", root_message(exc)
    return report(cfg, run_dir, job, recorder, status, error, started)


@contextlib.contextmanager
def ctrl_c_stops(mailbox: Any) -> Iterator[list[int]]:
    """The first Ctrl-C asks the loop to save its step and stop (as in a Ray run), the second
    stops at once (KeyboardInterrupt); yields the presses so far."""
    pressed: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt
        print("raytrain-ddp: interrupted: saving the step it is at and stopping (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)
        mailbox.request_stop()

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _one_process_group(device: Any) -> Iterator[None]:
    """A torch.distributed group of one, in memory (a HashStore): the wrappers' collectives run as is."""
    import torch.distributed as dist

    if dist.is_initialized():  # the caller's own (a notebook that set one up): used as is
        yield
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_data(cfg: Config, checked: Any, code: Any) -> tuple[dict[str, Any], Any]:
    """The rows local mode (and torchrun's ranks) read in their processes (`in_memory_shards`),
    after the one line for what needs Ray."""
    from raytrain_ddp.data.in_memory import in_memory_shards
    from raytrain_ddp.user import run_preprocess

    if cfg.data.source == "datasets" and (checked is None or checked.tables is None):
        raise UserError(f"{'scaling.num_workers=0 (local mode)' if cfg.scaling.local else 'scaling.launcher=torchrun'} "
                        "runs without Ray: Ray Datasets given from Python need it; give torch Datasets, write them to "
                        "parquet (data.source=parquet), or use Ray's workers")
    if cfg.data.sharding != "exact":
        raise UserError(f"scaling.num_workers=0 (local mode) reads the data in this process: "
                        f"data.sharding={cfg.data.sharding!r} reads through Ray Data; use data.sharding=exact")
    preprocess = code.preprocess if code is not None else None
    return in_memory_shards(cfg, checked, (lambda batch: run_preprocess(cfg, preprocess, batch)) if preprocess else None)
