"""Checks of a run's surroundings, made before anything touches the run directory or Ray.

Owns: refusing a relative `run.storage_path` inside a submitted Ray job
(`check_storage_under_job`), a setting the installed Ray cannot honour
(`check_ray_supports`) and, for an embedded Ray, a machine that cannot hold the worker
group (`placement.check_machine`). Must not touch: the config's own rules
(`config.py`), data (`datasets.py`), resume decisions (`resume.py`).

Why a relative storage path is refused under `ray job submit`: the job's entrypoint runs
in Ray's unpacked copy of `--working-dir`
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash>/`), so `./runs` would land in a
cache that is deleted with the cluster, and whether a resubmission resumes would depend
on the upload's hash. There is no stable place to resolve it to that is right for every
cluster (each node has its own disk), so the user names one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from raytrain_ddp.config import Config
from raytrain_ddp.driver.ray_compat import PREEMPTION_GRACE_SINCE, job_config, preemption_grace_supported, ray_version
from raytrain_ddp.errors import UserError

JOB_WORKING_DIR_MARK = "working_dir_files"  # .../runtime_resources/working_dir_files/_ray_pkg_<hash>


class StorageError(UserError):
    """`run.storage_path` would put the run somewhere the user cannot find it again."""


def ray_job_id() -> Optional[str]:
    """The submission id when this process is the entrypoint of a `ray job submit`, else None.

    Ray's job supervisor hands the entrypoint its job config (with the submission id in
    its metadata) in an environment variable (`ray_compat.job_config`); a working directory
    inside Ray's unpacked `working_dir_files` says the same when that variable is gone.
    """
    config = job_config()
    if config is not None:
        metadata = config.get("metadata") or {}
        metadata = metadata if isinstance(metadata, dict) else {}
        return str(metadata.get("job_submission_id") or metadata.get("job_name") or "unknown")
    if JOB_WORKING_DIR_MARK in Path.cwd().parts:
        return "unknown"
    return None


def check_storage_under_job(cfg: Config) -> None:
    storage = cfg.run.storage_path
    if "://" in storage or Path(storage).expanduser().is_absolute():
        return
    job = ray_job_id()
    if job is None:
        return
    raise StorageError(
        f"run.storage_path={storage!r} is relative, and this is Ray job {job}, running in a temporary "
        f"copy of the working directory ({Path.cwd()}) that is deleted with the cluster; pass an "
        "absolute path every node can reach, e.g. run.storage_path=/mnt/shared/runs, or s3://bucket/runs"
    )


def check_ray_supports(cfg: Config) -> None:
    """A setting the installed Ray cannot honour is refused by its key, not ignored."""
    if cfg.run.preemption_grace_s > 0 and not preemption_grace_supported():
        need, have = ".".join(map(str, PREEMPTION_GRACE_SINCE)), ".".join(map(str, ray_version()))
        raise UserError(f"run.preemption_grace_s={cfg.run.preemption_grace_s:g} needs Ray >= {need} "
                        f"(FailureConfig.preemption_grace_s); this is Ray {have}: upgrade Ray, or set "
                        "run.preemption_grace_s=0")


def preflight(cfg: Config) -> None:
    """Everything that can be refused from the config and this process alone, in one place."""
    from raytrain_ddp.driver.placement import check_machine

    check_storage_under_job(cfg)
    check_ray_supports(cfg)
    if not _joins_a_cluster(cfg):
        check_machine(cfg)


def _joins_a_cluster(cfg: Config) -> bool:
    """Whether `connect_ray` will join an existing Ray instead of starting one here."""
    if cfg.run.address or os.environ.get("RAY_ADDRESS") or ray_job_id() is not None:
        return True
    ray = sys.modules.get("ray")  # not imported: certainly not initialised
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
