"""Driver side of `raytrain-ddp train`: config -> Ray -> datasets -> TorchTrainer.fit -> summary.

Owns: connecting to Ray (embedded or joined), building the `TorchTrainer` and running
it, the run directory's `config.yaml` and `summary.json`. Must not touch: what happens
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
  (status `interrupted`) and says where the next run starts; `run_training`'s `finally`
  stops the embedded Ray instance, and the CLI exits 130.
* `RAYTRAIN_DDP_*` environment variables of the driver are forwarded to the workers
  (tests name their hooks there: `RAYTRAIN_DDP_HOOKS`, see `worker/hooks.py`).
* The user's model factory, loss and preprocess (`raytrain_ddp.user`) are imported and
  run once on a few rows before Ray starts; their modules travel in the job's
  `runtime_env` (`py_modules`, merged with a submitted job's `working_dir`): Ray accepts
  local paths only at the job level, and every process of the job inherits them.
"""

# Over 500 lines: one fit's driver path (connect, start, build, run, end) beside the decisions above.
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence

from raytrain_ddp.config import Config
from raytrain_ddp.driver.console import ProgressPrinter
from raytrain_ddp.driver.fit import already_complete, prepare, report, root_message
from raytrain_ddp.driver import hold, ray_console
from raytrain_ddp.driver.interrupt import Interrupt
from raytrain_ddp.launch import table as launchers
from raytrain_ddp.ray_compat import (
    CONTROLLER_POLL_ENV, abort_controller, install_sigint_handler, job_config,
    lean_trainer, local_instance_kwargs, preemption_grace, started_here, startup_timed_out, stop_timed_out_start,
)
from raytrain_ddp.driver.placement import Unschedulable, wait_for_placement, worker_resources
from raytrain_ddp.driver.preflight import preflight
from raytrain_ddp.driver.resume import check_something_to_train, resolve_resume
from raytrain_ddp.driver.sinks import check_loggers, make_sinks
from raytrain_ddp.driver.stream import Recorder, open_mailbox
from raytrain_ddp.errors import START_TRIES, UserError
from raytrain_ddp.job import Job
from raytrain_ddp.rundir import Location, is_object_store, run_dir_of
from raytrain_ddp.timeline import Timeline

DATA_HEADROOM_CPUS = 2
CONTROLLER_POLL_S = 0.25  # see the module docstring
# NCCL's flight recorder: the last collectives of each rank, dumped when one times out
# (torch >= 2.3 reads these; older ones ignore them). A user's own values win.
NCCL_TRACE_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
POLL_ENV = CONTROLLER_POLL_ENV  # propagated by Ray Train to its controller
ENV_PREFIX = "RAYTRAIN_DDP_"
_PREPARED: dict[str, hold.Hold] = {}  # run dir -> the hold `prepare_job` took in this process


@dataclasses.dataclass
class _Start:
    """What a fit knows before Ray starts: the resolved config and code, its run directory
    and id, the hold on that directory, where it resumes from, the checked data."""

    cfg: Config
    code: Any
    run_dir: Location
    fit_id: str
    held: hold.Hold
    resume_from: Any
    checked: Any
    timeline: Timeline


def _start(cfg: Config, code: Any, datasets: Optional[dict[str, Any]], *, preflighted: bool = False,
           before_hold: Optional[Callable[[Location], None]] = None, started_at: Optional[float] = None,
           entered: Optional[float] = None) -> _Start:
    """The preamble `run_training` and `prepare_job` share: the user's code resolved, the
    preflight (once: the CLI runs it before importing torch and Ray, and says so), the run
    directory held, the resume decision, the data checked. The hold is released if a step fails."""
    from raytrain_ddp.driver.preflight import in_process, precheck
    from raytrain_ddp.user import resolve

    if code is None:
        cfg, code = resolve(cfg)  # an import path that does not import fails here
    if not preflighted:
        preflight(cfg)  # a relative storage path under a Ray job, a machine too small (driver/preflight.py)
    run_dir, fit_id = run_dir_of(cfg), uuid.uuid4().hex
    if before_hold is not None:
        before_hold(run_dir)
    held = hold.take(cfg, fit_id)  # another live fit of this run directory: exit 2 here (driver/hold.py)
    try:
        resume_from = resolve_resume(cfg, run_dir)
        # Bad parquet or user code fails here, before Ray or any worker starts (Ray Datasets
        # given from Python are sampled through Ray, once connected: `_checked`; torch ones are read).
        checked = precheck(cfg, code, datasets) if datasets is None or in_process(datasets) else None
    except BaseException:
        held.release()
        raise
    return _Start(cfg, code, run_dir, fit_id, held, resume_from, checked, Timeline(fit_id, started_at, entered))


def _checked(start: _Start, datasets: Optional[dict[str, Any]]) -> Any:
    """The data checks, made once Ray is connected when the datasets were given from Python."""
    from raytrain_ddp.driver.preflight import precheck

    return start.checked or precheck(start.cfg, start.code, datasets)


def run_training(cfg: Config, *, code: Any = None, datasets: Optional[dict[str, Any]] = None,
                 preflighted: bool = False, started_at: Optional[float] = None, sinks: Sequence[Any] = (),
                 stop: Optional[threading.Event] = None, launch: Any = None) -> dict[str, Any]:
    """Train `cfg` to the end; returns the summary (also written to summary.json).

    `code`: the user's model, loss and preprocess (`user.resolve`; by default resolved
    from the config's import paths); `datasets`: Ray Datasets given from Python;
    `preflighted`: the caller ran `preflight(cfg)` already (the CLI does, before imports);
    `started_at`: where the start-up timeline starts (the process's start: the CLI's, the first
    `train()` of a script; default now).
    `sinks`: more takers of the metrics lines (`record`/`flush`/`close`, as `driver/sinks.py`'s;
    a sweep's trial reports to Tune through one: `raytrain_ddp/sweep/trial.py`); `stop`: set
    from another thread, the fit stops as on Ctrl-C (a sweep's trial that Tune stops).
    `launch`: torchrun already started for this fit (`driver/torchrun.start_early`; the
    caller stops it if this returns early, e.g. on a refusal).
    """
    entered = time.time()  # the timeline's `imports` end here, `cli` begins
    start = _start(cfg, code, datasets, preflighted=preflighted, started_at=started_at, entered=entered)
    cfg, started_here, summary = start.cfg, False, None
    try:
        if check_something_to_train(cfg, start.resume_from):  # another command for a finished run: exit 3
            return already_complete(cfg, start.run_dir, start.resume_from)  # the same command: exit 0, before Ray
        check_loggers(cfg)
        start.timeline.mark("cli")
        row = launchers.of(cfg)
        if row.run:  # no Ray: this process (driver/local.py) or this machine's torchrun (driver/torchrun.py)
            summary = row.run_fit()(cfg, start.run_dir, start.fit_id, start.resume_from, start.checked, start.code,
                                    timeline=start.timeline, launch=launch)
            return summary
        started_here = connect_user_code(cfg, start.code)
        warn_local_storage(cfg)
        start.timeline.mark("ray")
        summary = _fit(start, _checked(start, datasets), datasets, sinks, stop)
        return summary
    finally:
        if started_here:
            import ray

            ray.shutdown()
        # last step -> here: fit_end, summary.json's shutdown_s; printed under --verbose
        start.timeline.finish(start.run_dir, summary, verbose=ray_console.verbose())
        start.held.release()  # after Ray: no worker of this fit writes any more


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

    start = _start(cfg, code, datasets, before_hold=replace_earlier)  # held until this process exits
    cfg, run_dir, held = start.cfg, start.run_dir, start.held
    try:
        connect_user_code(cfg, start.code)
        job, prepared, total_steps = prepare(cfg, run_dir, start.fit_id, start.resume_from,
                                              _checked(start, datasets), start.code, datasets)
    except BaseException:
        held.release()
        raise
    _PREPARED[run_dir.uri] = held
    atexit.register(held.release)  # registered before the recorder's stop, so it runs after it
    # Your fit runs outside our launcher: the records rank 0 sends are taken and written by
    # a recorder in the background until this process exits (printed and in metrics.jsonl).
    job = _with_mailbox(job)
    recorder = _recorder(cfg, run_dir, job, total_steps).__enter__()
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


def _fit(start: _Start, checked: Any, given: Optional[dict[str, Any]], sinks: Sequence[Any] = (),
         stop: Optional[threading.Event] = None) -> dict[str, Any]:
    """One fit on Ray: build the trainer, run it, report (summary.json, the printed summary)."""
    from raytrain_ddp.recovery import table
    cfg, run_dir = start.cfg, start.run_dir
    job, prepared, total_steps = prepare(cfg, run_dir, start.fit_id, start.resume_from, checked, start.code, given)
    cfg = table.driver_half(cfg).resolve(cfg)  # run.recovery=live, or its fallback to replica said in one line
    job = _with_mailbox(dataclasses.replace(job, cfg=cfg))
    trainer = build_trainer(cfg, run_dir, job, prepared)
    hand_over_request(start.held, trainer)
    started = time.time()
    interrupt = Interrupt(job.mailbox)  # ours lets the driver finish (see the module docstring)
    install_sigint_handler(trainer, interrupt.register)
    recorder = _recorder(cfg, run_dir, job, total_steps, start.timeline, sinks)
    start.timeline.attach(run_dir)
    start.timeline.expects_controller = True  # StartupStamps (driver/startup.py) sends each group's start
    start.timeline.mark("datasets")
    done = threading.Event()
    if stop is not None:  # the caller's stop, as a Ctrl-C: the workers save their step and return
        threading.Thread(target=_press_on, args=(stop, done, interrupt), daemon=True, name="raytrain-ddp-stop").start()
    try:
        status, error = run_fit(cfg, trainer, recorder, interrupt)
    finally:
        done.set()
    return report(cfg, run_dir, job, recorder, status, error, started)


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


def _press_on(stop: threading.Event, done: threading.Event, interrupt: Interrupt) -> None:
    """Until the fit is done: once `stop` is set, a Ctrl-C of our own (`Interrupt.press`)."""
    while not done.wait(0.25):
        if stop.is_set():
            interrupt.press()
            return


def _with_mailbox(job: Job) -> Job:
    """The job with the driver's mailbox (records, stop requests), and the controller's poll set."""
    os.environ.setdefault(POLL_ENV, str(CONTROLLER_POLL_S))  # read by TorchTrainer.fit
    return dataclasses.replace(job, mailbox=open_mailbox())


def _recorder(cfg: Config, run_dir: Location, job: Job, total_steps: int, timeline: Optional[Timeline] = None,
              sinks: Sequence[Any] = ()) -> Recorder:
    """What takes rank 0's records: the progress lines, metrics.jsonl, the trackers, `sinks` (and the timeline's stamps)."""
    return Recorder(run_dir, job.fit_id, [ProgressPrinter(total_steps), *make_sinks(cfg, run_dir, job.fit_id),
                                          *sinks],
                    job.mailbox, write_metrics="jsonl" in cfg.run.loggers, timeline=timeline)


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
    from raytrain_ddp.driver.startup import StartHooks, StartupStamps, guarded_start
    from raytrain_ddp.recovery import table
    from raytrain_ddp.recovery.node_loss import NodeLossWatch
    from raytrain_ddp.parallel.watch import process_group_timeout_s

    pg_timeout_s = process_group_timeout_s(cfg.parallel.collective_timeout_s, cfg.scaling.use_gpu)
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    env_vars.update(nccl_env(cfg.scaling.use_gpu, os.environ))
    recovery = table.driver_half(cfg)(cfg)  # the run's recovery mode, Ray Train's side (recovery/table.py)
    env_vars.update(recovery.env())
    # Only the actors this fit uses; an embedded instance dies with this process: none of
    # Ray Train's actors for clusters either (ray_compat.lean_trainer)
    return lean_trainer(TorchTrainer, local=started_here())(
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


def run_fit(cfg: Config, trainer: Any, recorder: Recorder, interrupt: Interrupt) -> tuple[str, Optional[str]]:
    """Wait for placement, then `trainer.fit()` with the recorder running: (status, error)."""
    status, error, failure = "ok", None, None
    # A rank's error that retrying cannot help ends the fit now, not after run.max_failures
    # more attempts (Ray Train's failure policy retries every worker error: ours decides).
    recorder.on_deterministic_error = lambda record: _end_fit(interrupt.controller)
    try:
        with recorder:
            try:
                interrupt.listen()  # a Ctrl-C while waiting for placement ends the wait
                if (unplaced := wait_for_placement(cfg, stop=lambda: interrupt.fired)) is not None:
                    raise Unschedulable(unplaced)
                if interrupt.fired:  # Ctrl-C as the wait ended: no worker is started
                    raise KeyboardInterrupt
                result = trainer.fit()
                if result.error is not None:  # pragma: no cover - fit raises in V2, kept for safety
                    raise result.error
                if interrupt.fired:  # the workers stopped where they were, as asked
                    status = "interrupted"
            except Unschedulable as exc:
                status, error = "unschedulable", str(exc)
            except KeyboardInterrupt:
                status = "interrupted"
                interrupt.abort()
            except Exception as exc:  # noqa: BLE001 - reported in summary.json and printed
                status, failure = ("interrupted", None) if interrupt.fired else ("failed", exc)
            finally:
                interrupt.restore()
    except KeyboardInterrupt:  # a second Ctrl-C while the last records were written
        status = "interrupted"
    if failure is not None:  # the ranks' own account, whole, once the recorder has taken everything
        error = recorder.error_to_show(str(failure)) or root_message(failure)
    return status, error


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
