"""The `ray` row's launcher (launch/table.py): Ray -> datasets -> TorchTrainer.fit, for `driver/fit.py`.

Owns: connecting to Ray (embedded or joined), preparing Ray Data's datasets, building the
`TorchTrainer` and running it (`RayLauncher`), and `prepare_job` (your own trainer). Must not touch: what happens
inside a step (`worker/`), how batches are cut (`data/worker_data.py`), gradient
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
* `attempts` in `summary.json` counts worker-group starts of this fit (rank 0 registers
  each with the driver's mailbox), so a run that survived one worker failure has 2; a start
  that a taken port failed and Ray Train started again counts too (`driver/startup.py`).
* The run directory may be in object storage (`run.storage_path: s3://...`): the driver
  reads and writes it through `rundir.Location` (pyarrow.fs) and hands Ray Train the same
  filesystem (`RunConfig(storage_filesystem=...)`); workers never open it -- their
  records come through the mailbox (`driver/stream.py`), their checkpoints go up and
  come back through Ray. A multi-node cluster given a local `run.storage_path` gets a
  warning: unless every node mounts that path, checkpoints would scatter over the nodes.
* The embedded instance is always a new one (`ray.init(address="local")`): a Ray address
  file left by a killed `ray start`, or another local cluster, is neither joined by
  accident nor a traceback. Joining is on purpose (`run.address`, $RAY_ADDRESS) and said.
* Ray Train's controller takes one reported result per poll of the workers, every 2 s by
  default; a checkpoint reported more often waits for it (a synchronous report blocks
  the step loop, an asynchronous one queues, and the run's end waits for the queue).
  The quickstart checkpoints every ~0.3 s of training, so the controller polls every
  `CONTROLLER_POLL_S` (Ray's own `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, which a user's
  setting overrides): a few small RPCs per second.
* One fit at a time per run directory: the fit holds it (`driver/hold.py`) from before
  the resume decision until after its embedded Ray is stopped; `prepare_job` holds it
  until the process exits, since the caller's own fit runs after it returns.
* Ctrl-C during `fit` asks the workers to save the step they are at and stop (`driver/interrupt.py`;
  Ray's own handler would abort the controller and `sys.exit(0)` silently, throwing away
  every step since the last checkpoint), so the driver still writes `summary.json`
  (status `interrupted`) and says where the next run starts; `RayLauncher.close` stops the
  embedded Ray instance, and the CLI exits 130.
* `RAYTRAIN_DDP_*` environment variables of the driver are forwarded to the workers
  (tests name their hooks there: `RAYTRAIN_DDP_HOOKS`, see `worker/hooks.py`).
* The user's model factory, loss and preprocess (`raytrain_ddp.user`) are imported and
  run once on a few rows before Ray starts; their modules travel in the job's
  `runtime_env` (`py_modules`, merged with a submitted job's `working_dir`): Ray accepts
  local paths only at the job level, and every process of the job inherits them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import sys
from typing import Any, Optional

from raytrain_ddp.config import Config
from raytrain_ddp.driver.fit import Start, begin, prepare, recorder_for
from raytrain_ddp.driver import hold, ray_console
from raytrain_ddp.driver.interrupt import Interrupt
from raytrain_ddp.ray_compat import (
    CONTROLLER_POLL_ENV, abort_controller, install_sigint_handler, job_config,
    lean_trainer, local_instance_kwargs, preemption_grace, started_here, startup_timed_out, stop_timed_out_start,
)
from raytrain_ddp.driver.placement import Unschedulable, wait_for_placement, worker_resources
from raytrain_ddp.driver.stream import Recorder, open_mailbox
from raytrain_ddp.errors import START_TRIES, UserError
from raytrain_ddp.job import Job
from raytrain_ddp.rundir import Location, is_object_store

DATA_HEADROOM_CPUS = 2
CONTROLLER_POLL_S = 0.25  # see the module docstring
# NCCL's flight recorder: the last collectives of each rank, dumped when one times out
# (torch >= 2.3 reads these; older ones ignore them). A user's own values win.
NCCL_TRACE_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
POLL_ENV = CONTROLLER_POLL_ENV  # propagated by Ray Train to its controller
ENV_PREFIX = "RAYTRAIN_DDP_"
_PREPARED: dict[str, hold.Hold] = {}  # run dir -> the hold `prepare_job` took in this process


class RayLauncher:
    """Ray Train's `TorchTrainer` places the ranks (launch/base.py's `Launcher`)."""

    def __init__(self, cfg: Config) -> None:
        self.started_here = False
        self.start_: Optional[Start] = None
        self.prepared: Any = None

    def start(self, start: Start, given: Optional[dict[str, Any]]) -> tuple[Any, Any]:
        """Ray connected (the user's modules in the job's runtime_env), the datasets given from
        Python checked through it, Ray Data's datasets prepared; the mailbox actor."""
        import ray.data

        from raytrain_ddp.data.ray_datasets import prepare_datasets
        from raytrain_ddp.driver.memory import check_exact_fits
        from raytrain_ddp.driver.preflight import precheck

        self.start_, cfg = start, start.cfg
        self.started_here = connect_user_code(cfg, start.code)
        warn_local_storage(cfg)
        start.timeline.mark("ray")
        start.timeline.expects_controller = True  # StartupStamps (driver/startup.py) sends each group's start
        start.checked = start.checked or precheck(cfg, start.code, given)
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.prepared = prepare_datasets(cfg, start.checked, start.code, given, fits=check_exact_fits)
        return self.prepared, _mailbox()

    def run(self, job: Job, recorder: Recorder, interrupt: Interrupt) -> tuple[str, Optional[str]]:
        """The trainer built and `fit` once the cluster has placed the workers."""
        from raytrain_ddp.recovery import table

        assert self.start_ is not None
        cfg = table.driver_half(job.cfg).resolve(job.cfg)  # run.recovery=live, or its fallback to replica said in one line
        job = dataclasses.replace(job, cfg=cfg)
        trainer = build_trainer(cfg, self.start_.run_dir, job, self.prepared)
        hand_over_request(self.start_.held, trainer)
        install_sigint_handler(trainer, interrupt.register)  # ours lets the driver finish (the module docstring)
        self.start_.timeline.mark("datasets")
        # A rank's error that retrying cannot help ends the fit now, not after run.max_failures
        # more attempts (Ray Train's failure policy retries every worker error: ours decides).
        recorder.on_deterministic_error = lambda record: _end_fit(interrupt.controller)
        interrupt.listen()  # a Ctrl-C while waiting for placement ends the wait
        if (unplaced := wait_for_placement(cfg, stop=lambda: interrupt.fired)) is not None:
            return "unschedulable", str(Unschedulable(unplaced))
        if interrupt.fired:  # Ctrl-C as the wait ended: no worker is started
            raise KeyboardInterrupt
        result = trainer.fit()
        if result.error is not None:  # pragma: no cover - fit raises in V2, kept for safety
            raise result.error
        return "ok", None

    def close(self) -> None:
        if self.started_here:
            import ray

            ray.shutdown()
            self.started_here = False


def connect_user_code(cfg: Config, code: Any, cpus: Optional[int] = None) -> bool:
    """`connect_ray` with the user's modules in the job's runtime_env (`py_modules`): Ray
    accepts local paths only there, and every worker, data task and actor inherits it.
    Ray already initialised by the caller: the modules travel inside the pickles instead."""
    import ray

    from raytrain_ddp.user import pickle_by_value, runtime_env

    env = runtime_env(code)
    if ray.is_initialized() or (env and _job_has_py_modules()):
        pickle_by_value(code)  # the job's runtime_env is fixed, or Ray cannot merge two py_modules
        env = {}
    return connect_ray(cfg, runtime_env=env or None, cpus=cpus)


def _job_has_py_modules() -> bool:
    """Inside `ray job submit`, whether the job's own runtime_env already names py_modules."""
    return bool(((job_config() or {}).get("runtime_env") or {}).get("py_modules"))


def connect_ray(cfg: Config, runtime_env: Optional[dict[str, Any]] = None, cpus: Optional[int] = None) -> bool:
    """Join `run.address` / $RAY_ADDRESS, or start an embedded instance; True if started here.
    `cpus`: the embedded instance's logical CPUs (default: this fit's workers and the data's)."""
    import ray

    needed = cpus or math.ceil(cfg.scaling.max_workers * cfg.scaling.cpus_per_worker) + DATA_HEADROOM_CPUS
    if ray.is_initialized():  # the caller's Ray (a notebook, or ray.data used before train()): our console too
        ray_console.after_init()
        warn_small_instance(needed)
        return False
    address = cfg.run.address or os.environ.get("RAY_ADDRESS")
    level = ray_console.before_init()  # what of Ray's output reaches the console: ray_console.py
    if address:
        print(f"raytrain-ddp: joining the Ray cluster at {address}", flush=True)
        ray.init(address=address, log_to_driver=True, logging_level=level, runtime_env=runtime_env)
        ray_console.after_init()
        return False
    cores = os.cpu_count() or 1
    # No dashboard unless asked (run.dashboard): it serves jobs and the state API, which only Ray
    # Train's placement-group cleaner reads, and an embedded instance runs no cleaner (ray_compat.lean_trainer).
    # address="local": a new instance even if an address file or another cluster is around.
    _init_local(lean=not cfg.run.dashboard, address="local", num_cpus=max(cores, needed),
                include_dashboard=cfg.run.dashboard,
                dashboard_host="127.0.0.1",
                **local_instance_kwargs("127.0.0.1"), log_to_driver=True, logging_level=level,
                runtime_env=runtime_env)
    ray_console.after_init()
    return True


def warn_small_instance(needed: int) -> None:
    """One line when the Ray this process already started (`ray.init()`, or Ray Data's own
    start when a dataset is made before `train()`: the machine's cores) has fewer CPUs than
    the workers plus Ray Data's tasks need: Ray Data's tasks would wait for the workers' CPUs."""
    import ray

    from raytrain_ddp import ray_compat

    have = ray.cluster_resources().get("CPU", 0)
    if ray_compat.started_here() and have < needed:
        print(f"raytrain-ddp: warning: the Ray instance this process started has {have:g} CPUs; the run needs "
              f"{needed} (its workers + {DATA_HEADROOM_CPUS} for Ray Data's tasks), which may wait for one "
              f"another. Call ray.init(num_cpus={needed}) before making the datasets", file=sys.stderr, flush=True)


class LocalRayDidNotStart(UserError):
    """The embedded Ray instance did not start, `START_TRIES` times (one line, not Ray's traceback)."""


def _init_local(lean: bool = True, **kwargs: Any) -> None:
    """`ray.init` of the embedded instance, again (at most `START_TRIES` tries) if Ray's own 30 s
    wait for its raylet ran out (a loaded machine: docs/design.md#measurements-behind-the-code).
    What a try that timed out started is killed before the next (`ray_compat.stop_timed_out_start`).
    `lean`: without the dashboard's head process and the autoscaler's monitor (`ray_compat.lean_local_node`; `run.dashboard` keeps both)."""
    import ray

    from raytrain_ddp.ray_compat import children, lean_local_node

    for attempt in range(1, START_TRIES + 1):
        before = children()  # what this process ran before the try is not the try's to kill
        try:
            with lean_local_node() if lean else contextlib.nullcontext():
                ray.init(**kwargs)
            return
        except Exception as exc:  # noqa: BLE001 - only Ray's start-up timeout is retried
            if not startup_timed_out(exc):
                raise
            stop_timed_out_start(before)  # its processes would compete with the next try's
            if attempt == START_TRIES:
                raise LocalRayDidNotStart(f"the local Ray instance did not start, {START_TRIES} times: {exc} Is "
                                          "the machine busy? Run the same command again") from None
            print("raytrain-ddp: the local Ray instance did not start within Ray's 30 s (is the machine busy?); "
                  f"starting it once more (try {attempt + 1} of {START_TRIES})", file=sys.stderr, flush=True)


def warn_local_storage(cfg: Config) -> None:
    """Say so when a cluster of several nodes is given a local run.storage_path."""
    import ray

    if is_object_store(cfg.run.storage_path):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        print(f"raytrain-ddp: warning: run.storage_path={cfg.run.storage_path!r} is a local path, but the Ray "
              f"cluster has {len(nodes)} nodes: unless every node mounts it at that path (NFS), checkpoints and "
              "resume break. Use object storage: run.storage_path=s3://BUCKET/PREFIX (or gs://, abfs://)",
              file=sys.stderr, flush=True)


def prepare_job(cfg: Config, *, code: Any = None, datasets: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """What your own `TorchTrainer` needs to run our per-worker loop on `cfg` (docs/byo.md):
    its `train_loop_config`, `datasets` and `dataset_config`. Connects to Ray like a run
    (your modules go into the job's runtime_env), unless Ray is already initialised.

    Give the trainer `RunConfig(name=cfg.name, storage_path=cfg.run.storage_path)`, so that
    checkpoints land where resume looks, and a worker count that `cfg` accepts.
    """
    def replace_earlier(run_dir: Location) -> None:
        if (earlier := _PREPARED.pop(run_dir.uri, None)) is not None:
            earlier.release()  # prepared again in this process (a notebook cell re-run): the new job replaces it

    start = begin(cfg, code, datasets, before_hold=replace_earlier)  # held until this process exits
    cfg, run_dir, held = start.cfg, start.run_dir, start.held
    try:
        prepared, mailbox = RayLauncher(cfg).start(start, datasets)
        job, total_steps = prepare(start, prepared)
    except BaseException:
        held.release()
        raise
    _PREPARED[run_dir.uri] = held
    atexit.register(held.release)  # registered before the recorder's stop, so it runs after it
    # Your fit runs outside our launcher: the records rank 0 sends are taken and written by
    # a recorder in the background until this process exits (printed and in metrics.jsonl).
    job = dataclasses.replace(job, mailbox=mailbox)
    recorder = recorder_for(cfg, job, total_steps).__enter__()
    atexit.register(_finish_outside_fit, recorder, total_steps)  # before Ray's own exit handler (registered earlier)
    return {"train_loop_config": loop_config(job, prepared), "datasets": prepared.datasets,
            "dataset_config": prepared.data_config}


def _finish_outside_fit(recorder: Recorder, total_steps: int) -> None:
    """Your own `TorchTrainer` ran the fit: at exit, write what is left and end the trackers'
    runs -- ok when the records reached the last step (nothing else says how your fit ended),
    aborted when every rank stopped together, else failed."""
    recorder.stop()
    status = "aborted" if recorder.abort is not None else "ok" if recorder.last_step >= total_steps else "failed"
    recorder.close(status)


def nccl_env(use_gpu: bool, environ: Any) -> dict[str, str]:
    """The NCCL flight-recorder settings for the workers (GPU runs only; set values win)."""
    if not use_gpu:
        return {}
    return {k: environ.get(k, v) for k, v in NCCL_TRACE_ENV.items()}


def hand_over_request(held: hold.Hold, trainer: Any) -> None:
    """Name this fit's resource request in the hold, and on a joined cluster cancel the one of
    the dead fit this one took over from (`ray_compat.cancel_autoscaling_request`: else an
    elastic fit waits for Ray to expire the dead fit's reservation; docs/reliability.md).
    An embedded instance died with that fit, and its coordinator with it."""
    from raytrain_ddp.ray_compat import cancel_autoscaling_request, started_here, train_requester

    dead, requester = held.taken_from, train_requester(trainer)
    if dead is not None and dead.requester and dead.requester != requester and not started_here():
        cancel_autoscaling_request(dead.requester)
    if requester:
        held.record_requester(requester)


def _mailbox() -> Any:
    """The driver's mailbox actor (records, stop requests), and the controller's poll set."""
    os.environ.setdefault(POLL_ENV, str(CONTROLLER_POLL_S))  # read by TorchTrainer.fit
    return open_mailbox()


def loop_config(job: Job, prepared: Any) -> dict[str, Any]:
    """The per-worker loop's config: the job, and the in-memory route's shards (object refs)."""
    return {"job": job, **({"shards": prepared.shards} if prepared.shards else {})}


def build_trainer(cfg: Config, run_dir: Location, job: Job, prepared: Any) -> Any:
    """Ray Train's `TorchTrainer` for `job`: our per-worker loop, sizes, storage, failures, callbacks."""
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.v2.api.config import LoggingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_ddp.worker.loop import train_loop_per_worker
    from raytrain_ddp.driver.process_group import ProcessGroupConfig
    from raytrain_ddp.ray_compat import override_on
    from raytrain_ddp.driver.startup import StartHooks, StartupStamps, guarded_start
    from raytrain_ddp.recovery import table
    from raytrain_ddp.recovery.node_loss import NodeLossWatch
    from raytrain_ddp.parallel.watch import process_group_timeout_s

    if not override_on("torch_free_backend"):  # the A/B's other side (docs/compat.md)
        from ray.train.torch import TorchConfig as ProcessGroupConfig  # type: ignore[no-redef]
    pg_timeout_s = process_group_timeout_s(cfg.parallel.collective_timeout_s, cfg.scaling.use_gpu)
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    env_vars.update(nccl_env(cfg.scaling.use_gpu, os.environ))
    recovery = table.driver_half(cfg)(cfg)  # the run's recovery mode, Ray Train's side (recovery/table.py)
    env_vars.update(recovery.env())
    # An embedded instance dies with this process: none of Ray Train's actors for clusters (ray_compat.lean_trainer)
    return (lean_trainer(TorchTrainer) if started_here() else TorchTrainer)(
        train_loop_per_worker,
        train_loop_config=loop_config(job, prepared),
        torch_config=recovery.torch_config(ProcessGroupConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo",
                                                              timeout_s=pg_timeout_s), guarded_start),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
            resources_per_worker=worker_resources(cfg), placement_strategy=cfg.scaling.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s,
        ),
        run_config=RunConfig(
            name=cfg.name, **_storage(run_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
            failure_config=FailureConfig(
                max_failures=cfg.run.max_failures,
                max_preemption_failures=cfg.run.max_preemption_failures,
                **preemption_grace(cfg.run.preemption_grace_s),  # Ray 2.60 only (ray_compat.py)
            ),
            worker_runtime_env={"env_vars": env_vars} if env_vars else None,
            # A survivor's copy of the last step is not cut short by the restart (recovery/replica.py);
            # a lost node is declared dead before the new group is sized (recovery/node_loss.py).
            callbacks=[NodeLossWatch(mailbox=job.mailbox), *recovery.callbacks(),
                       StartHooks(),
                       *([StartupStamps(job.mailbox, job.fit_id)] if job.mailbox is not None else [])],
            logging_config=LoggingConfig(log_level="WARNING"),  # our progress lines say it all
        ),
        datasets=prepared.datasets,
        dataset_config=prepared.data_config,
    )


def _end_fit(controller: Any) -> None:
    """Stop Ray Train's controller (None: not registered, a fit outside the main thread; Ray's
    failure policy then retries it as any other error)."""
    if controller is not None:
        try:
            abort_controller(controller)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _storage(run_dir: Location) -> dict[str, Any]:
    """Where Ray Train keeps checkpoints: the run directory's parent, on its filesystem."""
    parent = run_dir.parent
    if parent.is_local:
        return {"storage_path": parent.path}
    return {"storage_path": parent.path, "storage_filesystem": parent.fs}
