"""Checks of a run's surroundings, made before anything touches the run directory or Ray.

Owns: refusing a relative `run.storage_path` inside a submitted Ray job
(`check_storage_under_job`), a setting the installed Ray cannot honour
(`check_ray_supports`), for an embedded Ray a machine that cannot hold the worker
group (`placement.check_machine`), and the data's precheck (`precheck`: the data room's
own checks, then the user's pipeline on a few rows). Must not touch: the config's own
rules (`config/`), reading or checking the data itself (`raytrain_ddp/data/`), resume
decisions (`resume.py`).

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
from typing import TYPE_CHECKING, Any, Optional

from raytrain_ddp.config import Config
from raytrain_ddp.ray_compat import PREEMPTION_GRACE_SINCE, job_config, preemption_grace_supported, ray_version
from raytrain_ddp.errors import UserError

if TYPE_CHECKING:
    from raytrain_ddp.data.sources import Prechecked

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
    """Everything that can be refused from the config and this process alone, in one place: the
    machine is checked where the launcher's ranks run on it (launch/table.py: always without Ray)."""
    from raytrain_ddp.driver.placement import check_machine
    from raytrain_ddp.launch import table as launchers

    check_storage_under_job(cfg)
    check_ray_supports(cfg)
    if not (launchers.of(cfg).cluster and _joins_a_cluster(cfg)):
        check_machine(cfg)


def precheck(cfg: Config, code: Any = None, given: Optional[dict[str, Any]] = None, *,
             require_all_used: bool = True) -> "Prechecked":
    """The data checks that need no Ray, run before Ray starts: bad parquet costs nothing.

    With user code (`code.custom`) or a user pipeline, a few raw rows also go through
    preprocess, the model factory, the forward and the loss (`user.check_pipeline`).
    `given`: the Ray Datasets of `raytrain_ddp.train(datasets=...)`, sampled through Ray.
    What it found (`Prechecked`) goes to `prepare_datasets`, which then scans nothing twice.
    `require_all_used=False`: unused parameters are not refused (`verify` reports them).
    """
    from raytrain_ddp.data.columns import uses_own_data
    from raytrain_ddp.data.sources import Prechecked, check_source, sample_and_spec
    from raytrain_ddp.user import SAMPLE_ROWS, check_pipeline

    info = check_source(cfg, given)  # data.source against `given`; parquet files, columns, rows
    if code is None or not (code.custom or uses_own_data(cfg)):
        return Prechecked(info)
    sample, spec = sample_and_spec(cfg, info, given, SAMPLE_ROWS)
    return Prechecked(info, check_pipeline(cfg, code, sample, spec, require_all_used=require_all_used),
                      tables=given if in_process(given) else None)


def in_process(given: Optional[dict[str, Any]]) -> bool:
    """`datasets=` that are torch Datasets read already (tables): checked before Ray, local launchers too."""
    import pyarrow as pa

    return bool(given) and all(isinstance(ds, pa.Table) for ds in given.values())


def _joins_a_cluster(cfg: Config) -> bool:
    """Whether `connect_ray` will join an existing Ray instead of starting one here."""
    if cfg.run.address or os.environ.get("RAY_ADDRESS") or ray_job_id() is not None:
        return True
    ray = sys.modules.get("ray")  # not imported: certainly not initialised
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
