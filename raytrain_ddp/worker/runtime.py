"""Where the loop runs: on a Ray Train worker, or in the driver's own process (local mode).

Owns: what the loop asks of its host, and nothing else -- who this rank is (`rank`), its
data shards (`shards`), handing a checkpoint over (`report`), the checkpoint it is offered
(`offered`), the run directory as storage sees it (`run_dir`), and the preemption signal
(`preemption_source`). Must not touch: training, the checkpoint format.

`RayTrainRuntime` is the product's normal host: `ray.train`'s context, dataset shards,
report (Ray uploads the staging copy, in the background when asked) and checkpoints.
`LocalRuntime` is `scaling.num_workers: 0` (issue #30), and each rank of
`scaling.launcher: torchrun` (`driver/torchrun.py`: rank 0 alone writes, as on Ray): no Ray at all --
the driver's main thread runs the loop, shards are in-memory tables, a checkpoint is
copied into the run directory right away, and nobody is ever preempted. So a
`breakpoint()` in a model's forward stops in the user's terminal.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from raytrain_ddp.rundir import Location
from raytrain_ddp.worker.context import Rank

if TYPE_CHECKING:
    from raytrain_ddp.data.in_memory import LocalShard


class Runtime(Protocol):
    """What the loop asks of its host (the module docstring); `RayTrainRuntime` and `LocalRuntime` are two."""

    def rank(self) -> Rank: ...
    def shards(self) -> Optional[dict[str, Any]]: ...
    def report(self, metrics: dict[str, Any], staging: Optional[str], name: str, asynchronous: bool) -> None: ...
    def offered(self) -> Any: ...
    def run_dir(self, job_run_dir: str) -> Location: ...
    def preemption_source(self) -> Callable[[int], Any]: ...


class RayTrainRuntime:
    """A Ray Train worker (the default). `shards`: the in-memory route's object refs
    (`ray_datasets.PreparedData.shards`), else None and the rows come from Ray Data."""

    def __init__(self, shards: Optional[dict[str, Any]] = None) -> None:
        self._shard_refs = dict(shards or {})

    def rank(self) -> Rank:
        return Rank.current()

    def shards(self) -> Optional[dict[str, Any]]:
        if not self._shard_refs:
            return None  # WorkerData asks ray.train for its dataset shards
        import ray

        return dict(zip(self._shard_refs, ray.get(list(self._shard_refs.values()))))

    def report(self, metrics: dict[str, Any], staging: Optional[str], name: str, asynchronous: bool) -> None:
        import ray.train
        from ray.train.v2.api.report_config import CheckpointUploadMode

        checkpoint = ray.train.Checkpoint.from_directory(staging) if staging is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC if asynchronous else CheckpointUploadMode.SYNC,
                         delete_local_checkpoint_after_upload=True)

    def offered(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def run_dir(self, job_run_dir: str) -> Location:
        """The run directory on Ray's storage filesystem (what checkpoints were uploaded to)."""
        import pyarrow.fs as pafs

        try:
            import ray.train

            storage = ray.train.get_context().get_storage()
            fs, path = storage.storage_filesystem, storage.experiment_fs_path
            return Location(fs, path, path if isinstance(fs, pafs.LocalFileSystem) else str(job_run_dir))
        except Exception:  # noqa: BLE001 - outside a Ray Train worker (tests): the driver's path
            return Location.parse(job_run_dir)

    def preemption_source(self) -> Callable[[int], Any]:
        from raytrain_ddp.worker.preemption import ray_source

        return ray_source


class LocalRuntime:
    """`scaling.num_workers: 0`: the driver's process is the only rank (see the module docstring)."""

    def __init__(self, shards: dict[str, "LocalShard"], run_dir: Location, device: torch.device,
                 rank: Optional[Rank] = None) -> None:
        self._shards, self._run_dir, self.device = shards, run_dir, device
        self._rank = rank or Rank(0, 1, 0, device)  # a rank of `scaling.launcher=torchrun`'s group

    def rank(self) -> Rank:
        return self._rank

    def shards(self) -> dict[str, Any]:
        return dict(self._shards)

    def report(self, metrics: dict[str, Any], staging: Optional[str], name: str, asynchronous: bool) -> None:
        if staging is None:
            return
        try:
            (self._run_dir / name).upload_from(staging)  # the manifest verifies it; a copy cut short is skipped
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def offered(self) -> Any:
        return None  # the driver's choice (`job.resume_from`) and this fit's checkpoints are listed instead

    def run_dir(self, job_run_dir: str) -> Location:
        return self._run_dir

    def preemption_source(self) -> Callable[[int], Any]:
        return lambda step: None
