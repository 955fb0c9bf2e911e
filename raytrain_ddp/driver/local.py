"""Local mode, `scaling.num_workers: 0`: the `local` row's launcher (launch/table.py), the whole
run in this process, with no Ray at all.

Owns: reading the data in-process (the same seeded split and the same batches as the
exact-sharding path: `LocalShard` hands the loop what Ray Data would), a process group
of one, the loop on the main thread through `worker/runtime.LocalRuntime`.
Must not touch: the loop itself, checkpoints' format, resume decisions, Ctrl-C (driver/fit.py's).

What users get (issue #30): the same loop, wrapper (world size 1), checkpoints, resume
and metrics as a Ray run, without `ray.init`, worker processes or Ray Data tasks, so
`breakpoint()` in a model's forward stops in the user's terminal and start-up costs
imports only. What needs Ray is refused with one line by the config's checks (its row of
the launcher table, launch/table.py): Ray Datasets given from Python, and the `streaming` /
`sharded` data paths (both read through Ray Data).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

from raytrain_ddp.config import Config


class LocalLauncher:
    """This process is the only rank (launch/base.py's `Launcher`)."""

    def __init__(self, cfg: Config) -> None:
        self.shards: Any = None
        self.run_dir: Any = None

    def start(self, start: Any, given: Optional[dict[str, Any]]) -> tuple[Any, Any]:
        """The rows read here, once (no Ray: the timeline's `ray` and `datasets` are 0 s); this process's mailbox."""
        from raytrain_ddp.data.ray_datasets import PreparedData
        from raytrain_ddp.driver.stream import LocalMailbox

        start.timeline.mark("ray", applies=False)
        start.timeline.mark("datasets", applies=False)  # the rows are read in this process: data_ready
        self.shards, spec = local_data(start.cfg, start.checked, start.code)
        self.run_dir = start.run_dir
        return PreparedData({}, spec, None), LocalMailbox()

    def run(self, job: Any, recorder: Any, interrupt: Any) -> tuple[str, Optional[str]]:
        """The loop on this thread, in a process group of one."""
        import torch

        from raytrain_ddp.worker.loop import train_loop_per_worker
        from raytrain_ddp.worker.runtime import LocalRuntime

        if "OMP_NUM_THREADS" not in os.environ:  # as Ray sets it for a worker of scaling.cpus_per_worker CPUs
            torch.set_num_threads(max(1, int(job.cfg.scaling.cpus_per_worker)))  # oversubscribed threads: docs/design.md
        device = torch.device("cuda", 0) if job.cfg.scaling.use_gpu else torch.device("cpu")
        interrupt.register()
        with _one_process_group(device):
            train_loop_per_worker({"job": job, "runtime": LocalRuntime(self.shards, self.run_dir, device)})
        return "ok", None

    def close(self) -> None:
        pass


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
    """The rows local mode (and torchrun's ranks) read in their processes (`in_memory_shards`);
    what needs Ray was refused by the config's checks (launch/table.py)."""
    from raytrain_ddp.data.in_memory import in_memory_shards
    from raytrain_ddp.user import run_preprocess

    preprocess = code.preprocess if code is not None else None
    return in_memory_shards(cfg, checked, (lambda batch: run_preprocess(cfg, preprocess, batch)) if preprocess else None)
