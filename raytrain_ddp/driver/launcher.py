"""Driver side of `raytrain-ddp train`: config -> Ray -> datasets -> TorchTrainer.fit -> summary.

Owns: connecting to Ray (embedded or joined), building the `TorchTrainer` and running
it, the run directory's `config.yaml` and `summary.json`. Must not touch: what happens
inside a step (`worker/`), how batches are cut (`worker/shard.py`), gradient
synchronisation (`parallel/`). Where a run starts from is `resume.py`'s decision; what
is printed is `console.py`'s.

Decisions, and why:

* Embedded Ray gets more logical CPUs than the machine has cores: the training workers
  plus two for Ray Data's read/transform tasks. With exactly one logical CPU per core, on
  a 2-core machine the two workers hold every CPU and Ray Data's tasks wait forever.
  Oversubscribing logical CPUs is safe here: our workers spend much of their time in
  collectives and data tasks are short. Joined clusters (`RAY_ADDRESS`, `run.address`,
  inside `ray job submit`) are used as they are.
* Elastic runs (`scaling.num_workers: [min, max]`) hand the range to Ray Train with
  `elastic_resize_monitor_interval_s = scaling.resize_interval_s`; preemption settings
  map to `FailureConfig(max_preemption_failures, preemption_grace_s,
  relax_collectives_on_preemption = preemption_grace_s > 0)` (grace only helps if Ray's
  checkpoint report may finish without the preempted ranks).
* `attempts` in `summary.json` counts worker-group starts of this fit (rank 0 appends
  to `attempts.jsonl` at every start), so a run that survived one worker failure has 2.
* `RAYTRAIN_DDP_*` environment variables of the driver are forwarded to the workers
  (tests name their hooks there: `RAYTRAIN_DDP_HOOKS`, see `worker/hooks.py`).
* The user's model factory, loss and preprocess (`raytrain_ddp.user`) are imported and
  run once on a few rows before Ray starts; their modules travel in the job's
  `runtime_env` (`py_modules`, merged with a submitted job's `working_dir`): Ray accepts
  local paths only at the job level, and every process of the job inherits them.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.driver.console import ProgressPrinter, final_metrics, print_plan, print_summary
from raytrain_ddp.driver.resume import resolve_resume
from raytrain_ddp.job import Job
from raytrain_ddp.rundir import (
    ABORT_FILE, ATTEMPTS_FILE, CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl, read_metrics, run_dir_of,
)

DATA_HEADROOM_CPUS = 2
ENV_PREFIX = "RAYTRAIN_DDP_"


def run_training(cfg: Config, *, code: Any = None, datasets: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train `cfg` to the end; returns the summary (also written to summary.json).

    `code`: the user's model, loss and preprocess (`user.resolve`; by default resolved
    from the config's import paths); `datasets`: Ray Datasets given from Python.
    """
    from raytrain_ddp.driver.datasets import precheck
    from raytrain_ddp.user import resolve

    if code is None:
        cfg, code = resolve(cfg)  # an import path that does not import fails here
    run_dir = run_dir_of(cfg)
    resume_from = resolve_resume(cfg, run_dir)
    # Bad parquet or user code fails here, before Ray or any worker starts (Ray Datasets
    # given from Python are sampled through Ray, once connected).
    checked = precheck(cfg, code) if datasets is None else None
    started_here = connect_user_code(cfg, code)
    try:
        return _fit(cfg, run_dir, resume_from, checked or precheck(cfg, code, datasets), code, datasets)
    finally:
        if started_here:
            import ray

            ray.shutdown()


def connect_user_code(cfg: Config, code: Any) -> bool:
    """`connect_ray` with the user's modules in the job's runtime_env (`py_modules`): Ray
    accepts local paths only there, and every worker, data task and actor inherits it.
    Ray already initialised by the caller: the modules travel inside the pickles instead."""
    import ray

    from raytrain_ddp.user import pickle_by_value, runtime_env

    env = runtime_env(code)
    if ray.is_initialized() or (env and _job_has_py_modules()):
        pickle_by_value(code)  # the job's runtime_env is fixed, or Ray cannot merge two py_modules
        env = {}
    return connect_ray(cfg, runtime_env=env or None)


def _job_has_py_modules() -> bool:
    """Inside `ray job submit`, whether the job's own runtime_env already names py_modules."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    injected = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    return bool((injected.get("runtime_env") or {}).get("py_modules"))


def connect_ray(cfg: Config, runtime_env: Optional[dict[str, Any]] = None) -> bool:
    """Join `run.address` / $RAY_ADDRESS, or start an embedded instance; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
        return False
    cores = os.cpu_count() or 1
    needed = math.ceil(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + DATA_HEADROOM_CPUS
    # The dashboard stays on (bound to 127.0.0.1): Ray Train's placement-group cleaner
    # polls the state API it serves, and warns every few seconds without it.
    ray.init(num_cpus=max(cores, needed), include_dashboard=True, dashboard_host="127.0.0.1",
             _node_ip_address="127.0.0.1", log_to_driver=True, logging_level="WARNING", runtime_env=runtime_env)
    return True


def prepare_job(cfg: Config, *, code: Any = None, datasets: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What your own `TorchTrainer` needs to run our per-worker loop on `cfg` (docs/byo.md):
    its `train_loop_config`, `datasets` and `dataset_config`. Connects to Ray like a run
    (your modules go into the job's runtime_env), unless Ray is already initialised.

    Give the trainer `RunConfig(name=cfg.name, storage_path=cfg.run.storage_path)`, so that
    checkpoints land where resume looks, and a worker count that `cfg` accepts.
    """
    from raytrain_ddp.driver.datasets import precheck
    from raytrain_ddp.user import resolve

    if code is None:
        cfg, code = resolve(cfg)
    run_dir = run_dir_of(cfg)
    resume_from = resolve_resume(cfg, run_dir)
    checked = precheck(cfg, code) if datasets is None else None
    connect_user_code(cfg, code)
    job, prepared, _ = _prepare(cfg, run_dir, resume_from, checked or precheck(cfg, code, datasets), code, datasets)
    return {"train_loop_config": {"job": job}, "datasets": prepared.datasets, "dataset_config": prepared.data_config}


def _prepare(cfg: Config, run_dir: Path, resume_from: Optional[Path], checked: Any, code: Any,
             given: Optional[dict[str, Any]]) -> tuple[Job, Any, int]:
    """Datasets, the run directory's config.yaml, the `Job` and the plan printed: (job, prepared, total steps)."""
    import ray.data

    from raytrain_ddp.driver.datasets import prepare_datasets

    ray.data.DataContext.get_current().enable_progress_bars = False
    prepared = prepare_datasets(cfg, checked, code, given)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
    for stale in (SUMMARY_FILE, ABORT_FILE):
        (run_dir / stale).unlink(missing_ok=True)

    steps_per_epoch = prepared.spec.train_rows // cfg.train.global_batch_size
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    job = Job(cfg=cfg, spec=prepared.spec, run_dir=str(run_dir), fit_id=uuid.uuid4().hex,
              resume_from=str(resume_from) if resume_from else None,
              user_code=code.dumps() if code.custom else None)
    params = checked.pipeline.params if checked.pipeline else None
    print_plan(cfg, prepared.spec, run_dir, steps_per_epoch, total_steps, resume_from, params)
    return job, prepared, total_steps


def _fit(cfg: Config, run_dir: Path, resume_from: Optional[Path], checked: Any, code: Any,
         given: Optional[dict[str, Any]]) -> dict[str, Any]:
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.api.config import LoggingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_ddp.worker.loop import train_loop_per_worker

    job, prepared, total_steps = _prepare(cfg, run_dir, resume_from, checked, code, given)
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": job},
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo",
                                 timeout_s=int(math.ceil(cfg.parallel.collective_timeout_s))),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if cfg.scaling.use_gpu else {})},
            elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s,
        ),
        run_config=RunConfig(
            name=cfg.name, storage_path=str(run_dir.parent),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
            failure_config=FailureConfig(
                max_failures=cfg.run.max_failures,
                max_preemption_failures=cfg.run.max_preemption_failures,
                preemption_grace_s=cfg.run.preemption_grace_s,
                relax_collectives_on_preemption=cfg.run.preemption_grace_s > 0,
            ),
            worker_runtime_env={"env_vars": env_vars} if env_vars else None,
            logging_config=LoggingConfig(log_level="WARNING"),  # our progress lines say it all
        ),
        datasets=prepared.datasets,
        dataset_config=prepared.data_config,
    )
    started = time.time()
    status, error = "ok", None
    with ProgressPrinter(run_dir / METRICS_FILE, total_steps):
        try:
            result = trainer.fit()
            if result.error is not None:  # pragma: no cover - fit raises in V2, kept for safety
                raise result.error
        except Exception as exc:  # noqa: BLE001 - reported in summary.json and printed
            status, error = "failed", _root_message(exc)
    abort = run_dir / ABORT_FILE
    if status == "ok" and abort.exists():
        status, error = "aborted", json.loads(abort.read_text()).get("reason")
    summary = build_summary(job, status=status, error=error, elapsed_s=time.time() - started)
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    return summary


def build_summary(job: Job, *, status: str, error: Optional[str], elapsed_s: float) -> dict[str, Any]:
    run_dir = Path(job.run_dir)
    latest = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    manifest = ckpt.read_manifest(latest[1]) if latest else {}
    attempts = [r for r in read_jsonl(run_dir / ATTEMPTS_FILE) if r.get("fit_id") == job.fit_id]
    records = read_metrics(run_dir / METRICS_FILE)
    # steps done: the checkpoint's, or further if steps ran after it (an abort, a failure)
    steps = max([int(manifest.get("step", 0))] + [int(r.get("step", 0)) for r in records[-1:]])
    summary: dict[str, Any] = {
        "status": status,
        "run_dir": str(run_dir),
        "steps": steps,
        "epochs": int(manifest.get("epoch", 0)),
        "attempts": len(attempts),
        "final_metrics": final_metrics(records),
        "checkpoint": str(latest[1]) if latest else None,
        "resumed_from": job.resume_from,
        "workers": attempts[-1]["world_size"] if attempts else None,
        "elapsed_s": round(elapsed_s, 2),
        "fit_id": job.fit_id,
    }
    if error:
        summary["error"] = error
    return summary


def _root_message(exc: BaseException) -> str:
    """Ray wraps worker errors a few layers deep; the innermost message is the useful one."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        nxt = exc.__cause__ or getattr(exc, "cause", None)
        if nxt is None or nxt is exc:
            break
        exc = nxt
    text = str(seen[-1]).strip()
    return text.splitlines()[-1] if text else type(seen[-1]).__name__
