"""Driver side of `raytrain-ddp train`: config -> Ray -> datasets -> TorchTrainer.fit -> summary.

Owns: connecting to Ray (embedded or joined), choosing the checkpoint a run starts from
(`run.resume`), the run directory's `config.yaml` and `summary.json`, the printed plan,
progress and summary. Must not touch: what happens inside a step (`loop.py`), how
batches are cut (`data.py`), gradient synchronisation (`parallel/`).

Decisions, and why:

* Embedded Ray gets more logical CPUs than the machine has cores: the training workers
  plus two for Ray Data's read/transform tasks. With exactly one logical CPU per core, on
  a 2-core machine the two workers hold every CPU and Ray Data's tasks wait forever.
  Oversubscribing logical CPUs is safe here: our workers spend much of their time in
  collectives and data tasks are short. Joined clusters (`RAY_ADDRESS`, `run.address`,
  inside `ray job submit`) are used as they are.
* Resume semantics (`run.resume`), resolved here, before any worker starts:
  null    -> continue the run directory's newest *valid* checkpoint, if there is one
             (this is also how re-running after the driver died continues);
  latest  -> the same, but an error when there is none;
  PATH    -> exactly that checkpoint (verified first);
  never   -> start fresh; an existing, non-empty run directory is an error.
  Ray Train V2 on its own reloads the run's checkpoint snapshot whenever the same
  name/storage_path is reused and offers its latest checkpoint to the workers; the
  workers ignore offers from earlier fits (each fit has a `fit_id` recorded in every
  checkpoint's manifest) and use the one chosen here, so the four modes above hold. A
  restart after a worker failure inside this fit continues from this fit's latest
  checkpoint.
* What a resume may change (`check_resume_config`; every checkpoint records its config):
  how the run is executed is free (`scaling.*` -- the worker count above all --,
  `run.*`, `parallel.*`, `train.micro_batch_size`, `data.prefetch_batches`): the loop
  re-derives accumulation from the actual worker count and the optimisation is the
  same. `train.epochs` / `train.max_steps` are free too (the LR schedule stretches to the
  new total). `model.*` is refused (the weights would not fit). The keys that decide
  which samples form step s of an epoch (`data.*`, `train.global_batch_size`,
  `train.seed`) are refused mid-epoch -- the recorded position would point into another
  order -- and allowed at an epoch boundary. Any other change (optimizer, lr, schedule
  shape, precision, clipping) is allowed and printed as a warning: the run continues,
  but not on the trajectory of an uninterrupted run.
* Elastic runs (`scaling.num_workers: [min, max]`) hand the range to Ray Train with
  `elastic_resize_monitor_interval_s = scaling.resize_interval_s`; preemption settings
  map to `FailureConfig(max_preemption_failures, preemption_grace_s,
  relax_collectives_on_preemption = preemption_grace_s > 0)` (grace only helps if Ray's
  checkpoint report may finish without the preempted ranks).
* `attempts` in `summary.json` counts worker-group starts of this fit (rank 0 appends
  to `attempts.jsonl` at every start), so a run that survived one worker failure has 2.
* `RAYTRAIN_DDP_*` environment variables of the driver are forwarded to the workers
  (tests use `RAYTRAIN_DDP_FAULT`; see `loop.py`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.errors import CheckpointError, UserError
from raytrain_ddp.metrics import METRICS_FILE, ProgressPrinter, final_metrics, read_jsonl, read_metrics
from raytrain_ddp.worker import ABORT_FILE, ATTEMPTS_FILE, Job

DATA_HEADROOM_CPUS = 2
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
ENV_PREFIX = "RAYTRAIN_DDP_"


class ResumeError(UserError):
    """`run.resume` cannot be honoured (no checkpoint, a bad path, an existing run)."""


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.storage_path).expanduser().resolve() / cfg.name


def run_training(cfg: Config) -> dict[str, Any]:
    """Train `cfg` to the end; returns the summary (also written to summary.json)."""
    from raytrain_ddp.data import precheck

    run_dir = run_dir_of(cfg)
    resume_from = resolve_resume(cfg, run_dir)
    checked = precheck(cfg)  # bad parquet fails here, before Ray or any worker starts
    started_here = connect_ray(cfg)
    try:
        return _fit(cfg, run_dir, resume_from, checked)
    finally:
        if started_here:
            import ray

            ray.shutdown()


def resolve_resume(cfg: Config, run_dir: Path) -> Optional[Path]:
    """The checkpoint this run starts from, per `run.resume` (see the module docstring)."""
    mode = cfg.run.resume
    if mode == "never":
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ResumeError(
                f"run.resume=never but run directory {run_dir} already exists; "
                "choose another name, delete it, or use run.resume=latest"
            )
        return None
    if mode in (None, "latest"):
        found = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
        if found is None:
            if mode == "latest":
                raise ResumeError(
                    f"run.resume=latest but {run_dir} holds no valid checkpoint; "
                    "train without run.resume first, or pass run.resume=PATH"
                )
            return None
        check_resume_config(cfg, found[0], found[1])
        return found[1]
    path = Path(mode).expanduser().resolve()
    try:
        state = ckpt.load_checkpoint(path)
    except CheckpointError as exc:
        raise ResumeError(f"run.resume={mode!r}: {exc}") from None
    path = path.parent if path.is_file() else path
    check_resume_config(cfg, state, path)
    return path


RESUME_FREE = ("name", "scaling.", "run.", "parallel.", "train.micro_batch_size", "train.epochs",
               "train.max_steps", "train.nonfinite.", "data.prefetch_batches")
RESUME_REFUSED = ("model.",)
RESUME_EPOCH_BOUNDARY = ("data.", "train.global_batch_size", "train.seed")


def check_resume_config(cfg: Config, state: dict[str, Any], path: Path) -> list[str]:
    """Refuse resumes that cannot continue the run; warn about ones that change it.

    Returns the warned keys (see the module docstring for the three classes).
    """
    import yaml

    if not isinstance(state.get("config"), str):  # checkpoints written before configs were kept
        return []
    old, new = _flat(yaml.safe_load(state["config"])), _flat(yaml.safe_load(cfg.to_yaml()))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    mid_epoch = int(state.get("steps_into_epoch", 0)) > 0

    def shown(keys: list[str]) -> str:
        return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)

    refused = [k for k in changed if k.startswith(RESUME_REFUSED)]
    if mid_epoch:
        refused += [k for k in changed if k.startswith(RESUME_EPOCH_BOUNDARY)]
    if refused:
        raise ResumeError(
            f"cannot resume from {path} (step {state.get('step')}, "
            f"{state.get('steps_into_epoch')} steps into epoch {int(state.get('epoch', 0)) + 1}): "
            f"{shown(refused)}. Model keys must match the checkpoint; data order keys may change "
            "only at an epoch boundary. Restore the old values, or start a new run "
            "(another name, or run.resume=never)"
        )
    warned = [k for k in changed if not k.startswith(RESUME_FREE + RESUME_EPOCH_BOUNDARY)]
    if warned:
        print(f"raytrain-ddp: warning: resuming {path} with a different optimisation "
              f"({shown(warned)}); the run will not follow the trajectory of an uninterrupted one",
              file=sys.stderr, flush=True)
    return warned


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def connect_ray(cfg: Config) -> bool:
    """Join `run.address` / $RAY_ADDRESS, or start an embedded instance; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    cores = os.cpu_count() or 1
    needed = math.ceil(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + DATA_HEADROOM_CPUS
    # The dashboard stays on (bound to 127.0.0.1): Ray Train's placement-group cleaner
    # polls the state API it serves, and warns every few seconds without it.
    ray.init(num_cpus=max(cores, needed), include_dashboard=True, dashboard_host="127.0.0.1",
             _node_ip_address="127.0.0.1", log_to_driver=True, logging_level="WARNING")
    return True


def _fit(cfg: Config, run_dir: Path, resume_from: Optional[Path], checked: Any = None) -> dict[str, Any]:
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.api.config import LoggingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_ddp.data import prepare_datasets
    from raytrain_ddp.loop import train_loop_per_worker

    ray.data.DataContext.get_current().enable_progress_bars = False
    prepared = prepare_datasets(cfg, checked)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
    for stale in (SUMMARY_FILE, ABORT_FILE):
        (run_dir / stale).unlink(missing_ok=True)

    steps_per_epoch = prepared.spec.train_rows // cfg.train.global_batch_size
    total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    job = Job(cfg=cfg, spec=prepared.spec, run_dir=str(run_dir), fit_id=uuid.uuid4().hex,
              resume_from=str(resume_from) if resume_from else None)
    print_plan(cfg, prepared.spec, run_dir, steps_per_epoch, total_steps, resume_from)

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


def print_plan(cfg: Config, spec: Any, run_dir: Path, steps_per_epoch: int, total_steps: int,
               resume_from: Optional[Path]) -> None:
    """The derived numbers, up front (nanoGPT-style): what one step means and how many."""
    from raytrain_ddp.models import build_model

    workers = cfg.scaling.max_workers
    k = cfg.accumulation_steps(workers)
    params = sum(p.numel() for p in build_model(cfg, spec).parameters())
    lines = [
        f"raytrain-ddp: run {cfg.name!r} -> {run_dir}",
        f"  data      {spec.source}: {spec.train_rows:,} train / {spec.val_rows:,} val rows, task {spec.task}",
        f"  model     {cfg.model.name}, {params:,} parameters, strategy {cfg.parallel.strategy}, "
        f"precision {cfg.train.precision}",
        f"  batch     global {cfg.train.global_batch_size} = {workers} workers x micro {cfg.train.micro_batch_size}"
        f" x {k} accumulation steps",
        f"  schedule  {steps_per_epoch} steps/epoch, {total_steps} steps, lr {cfg.train.lr:g} "
        f"(warmup {cfg.train.warmup_steps}, cosine to {cfg.train.min_lr_ratio:g}x)",
        f"  resume    {_describe_resume(resume_from, total_steps)}",
    ]
    if cfg.scaling.elastic:
        lines[3] += f" (elastic {cfg.scaling.min_workers}-{workers} workers; accumulation re-derived on resize)"
    print("\n".join(lines), flush=True)


def _describe_resume(resume_from: Optional[Path], total_steps: int) -> str:
    if resume_from is None:
        return "fresh start"
    step = int(ckpt.read_manifest(resume_from).get("step", 0))
    text = f"from {resume_from} (step {step})"
    if step >= total_steps:
        text += (f"; already at step {step} of {total_steps}: nothing to train "
                 "(raise train.epochs or train.max_steps to continue, or pick a new name)")
    return text


def print_summary(summary: dict[str, Any]) -> None:
    fm = summary["final_metrics"]
    parts = [f"status {summary['status']}", f"{summary['steps']} steps", f"{summary['epochs']} epochs",
             f"{summary['attempts']} attempt(s)", f"{summary['elapsed_s']:.1f}s"]
    if "loss" in fm:
        parts.append(f"loss {fm['loss']:.4f}")
    if "val_loss" in fm:
        parts.append(f"val_loss {fm['val_loss']:.4f}")
    if "val_accuracy" in fm:
        parts.append(f"val_accuracy {100 * fm['val_accuracy']:.2f}%")
    out = sys.stdout if summary["status"] == "ok" else sys.stderr
    print("raytrain-ddp: " + " | ".join(parts), file=out, flush=True)
    if summary.get("error"):
        print(f"raytrain-ddp: error: {summary['error']}", file=out, flush=True)
    print(f"raytrain-ddp: run directory {summary['run_dir']}", flush=True)
    if summary.get("checkpoint"):
        print(f"raytrain-ddp: latest checkpoint {summary['checkpoint']}", flush=True)


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
