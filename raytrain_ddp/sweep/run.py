"""The sweep's driver: the search space to Ray Tune, trials that fit the cluster, a sweep that resumes.

Owns: the Tune objects built from `SweepConfig` (the space, the searcher, ASHA or none,
the budget), how many trials run at once (`concurrency`, said in the plan line), the
sweep directory (`sweep.json`: outcome, per-trial Tune errors, placement groups left;
`tune/`: Tune's experiment, restored by the same command), and the check that no
placement group outlives the sweep. Must not touch: a trial's fit (`sweep/trial.py`,
the launcher), what the report shows (`sweep/report.py`).

Decisions, and why:

* A trial's own process (its Tune trainable, `sweep/trial.py`) reserves `TRIAL_CPUS` of a CPU: it
  only waits on its fit, whose workers Ray Train places in their own placement group.
  Tune cannot see those, so `max_concurrent_trials` keeps trials from oversubscribing
  the cluster (Ray's #47440): as many as fit, from the cluster's CPUs (GPUs for GPU
  trials) less the data's headroom, over one trial's workers. More than fit (set by
  hand, or an autoscaling cluster's later nodes) wait in each trial's placement wait.
* ASHA's time is the epoch (a trial validates once per epoch); our epoch count goes on
  across a trial's resume, Tune's `training_iteration` does not.
* Resume: Tune's experiment state (`Tuner.restore`) keeps the searcher and the trials'
  states; finished and stopped trials stay so, unfinished and errored ones are run again,
  and each continues from its own run directory by our resume rules (a complete one is
  not trained again: `trial.py`). A Ctrl-C is ours (`TUNE_ENV`): the driver stops, its
  Ray with it, sweep.json says `interrupted`, and the command exits 130.
"""

from __future__ import annotations

import _thread
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

from raytrain_ddp.config import Config
from raytrain_ddp.config.sweep import SweepConfig, planned_trials
from raytrain_ddp.driver import ray_console
from raytrain_ddp.rundir import Location
from raytrain_ddp.sweep.report import SWEEP_FILE
from raytrain_ddp.sweep.trial import TRIALS_DIR, trainable

TRIAL_CPUS = 0.01  # the trial process itself (see the module docstring)
TRIALS_CPU = 1  # kept for all trial processes together when counting what fits
TUNE_DIR = "tune"
STOPPING_S = 60.0  # how long the driver waits for stopped trials' fits to save and return
PG_GONE_S = 10.0  # how long the end of a sweep waits for its placement groups to go before removing them
# Ctrl-C is ours, not Tune's: Tune's handler ends the experiment marking the running trials
# TERMINATED, so a restore would never continue them. A KeyboardInterrupt leaves them
# running in Tune's saved state (as a killed driver does), saved every 2 s.
TUNE_ENV = {"TUNE_DISABLE_SIGINT_HANDLER": "1", "TUNE_GLOBAL_CHECKPOINT_S": "2"}


class CtrlC:
    """Ctrl-C during `Tuner.fit`: a KeyboardInterrupt in the main thread, then again every second
    until fit gives it back. One that lands inside Ray's or Tune's own loop can be swallowed
    there (a sweep interrupted once in the suite ran to its end and exited 0)."""

    REPEAT_S = 1.0

    def __init__(self) -> None:
        self.seen, self._done, self._lock = threading.Event(), threading.Event(), threading.Lock()
        self._previous: Any = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self._done.is_set():  # a repeat that crossed fit giving one back: that one is enough
            return
        if not self.seen.is_set():
            self.seen.set()
            self._thread = threading.Thread(target=self._repeat, name="sweep-ctrl-c", daemon=True)
            self._thread.start()
        raise KeyboardInterrupt

    def _repeat(self) -> None:
        while not self._done.wait(self.REPEAT_S):
            with self._lock:
                if not self._done.is_set():
                    _thread.interrupt_main()

    def __exit__(self, *exc: Any) -> None:
        with self._lock:  # no repeat after this ...
            self._done.set()
        if self._thread is not None:  # ... and one already sent is taken by `_handle` (a no-op now)
            self._thread.join(timeout=5)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def sweep_dir_of(base: Config, sweep: SweepConfig) -> Location:
    return Location.parse(base.run.storage_path) / (sweep.name or base.name)


def per_trial(base: Config) -> tuple[str, float]:
    """What one trial's workers hold: ('GPU', workers) or ('CPU', workers x cpus_per_worker)."""
    workers = base.scaling.max_workers
    if base.scaling.use_gpu:
        return "GPU", float(workers)
    return "CPU", workers * base.scaling.cpus_per_worker


def concurrency(base: Config, sweep: SweepConfig, resources: dict[str, float], headroom: int) -> tuple[int, str]:
    """(trials at once, the reason said in the plan line) for a cluster holding `resources`."""
    kind, need = per_trial(base)
    kept = headroom + TRIALS_CPU if kind == "CPU" else 0
    fits = max(1, math.floor((float(resources.get(kind, 0.0)) - kept) / need + 1e-9))
    why = (f"the cluster's {resources.get(kind, 0):g} {kind}s"
           f"{f' less {kept} for the data and the trial processes' if kept else ''} over {need:g} {kind} per trial")
    if sweep.max_concurrent_trials != "auto":
        n = int(sweep.max_concurrent_trials)
        return n, f"sweep.max_concurrent_trials (fits now: {fits}, from {why}; more wait for workers)"
    return min(fits, planned_trials(sweep)), why


def embedded_cpus(base: Config, sweep: SweepConfig, headroom: int) -> int:
    """The embedded Ray's logical CPUs: this machine's trials' workers, and the data's share."""
    kind, need = per_trial(base)
    cores = os.cpu_count() or 1
    if sweep.max_concurrent_trials != "auto":
        trials = int(sweep.max_concurrent_trials)
    else:
        trials = max(1, math.floor(cores / need)) if kind == "CPU" else 1
    trials = min(trials, planned_trials(sweep))
    return math.ceil(trials * (need if kind == "CPU" else base.scaling.max_workers * base.scaling.cpus_per_worker)
                     ) + TRIALS_CPU + headroom


def param_space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    make = {"choice": tune.choice, "grid": tune.grid_search, "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v), "randint": lambda v: tune.randint(*v)}
    space = {}
    for key, entry in sweep.space.items():
        kind, values = next(iter(entry.items()))
        if kind == "choice" and sweep.search == "grid":
            kind = "grid"
        space[key] = make[kind](values)
    return space


def scheduler(base: Config, sweep: SweepConfig) -> Any:
    if sweep.scheduler == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    # One past the last epoch: ASHA stops a trial that reaches max_t, which would kill a
    # trial's fit between its last validation and its summary.
    max_t = (base.train.epochs if base.train.max_steps is None else 10**6) + 1
    return ASHAScheduler(time_attr="epoch", max_t=max_t, grace_period=sweep.asha.grace_period,
                         reduction_factor=sweep.asha.reduction_factor)


def tuner(base_data: dict[str, Any], base: Config, sweep: SweepConfig, where: Location, at_once: int) -> Any:
    """A new Tuner, or the sweep's own restored (the same command continues it)."""
    from ray import tune

    trial = tune.with_resources(tune.with_parameters(trainable(), base=base_data, sweep_dir=str(where)),
                                {"cpu": TRIAL_CPUS})
    storage = where / TUNE_DIR
    path = storage.path if storage.is_local else storage.uri
    if tune.Tuner.can_restore(path):
        print(f"raytrain-ddp: continuing the sweep in {where}: finished trials are kept, unfinished ones "
              "go on from their checkpoints", flush=True)
        return tune.Tuner.restore(path, trainable=trial, param_space=param_space(sweep),
                                  resume_unfinished=True, resume_errored=True)
    parent = where
    return tune.Tuner(
        trial, param_space=param_space(sweep),
        tune_config=tune.TuneConfig(
            metric=sweep.metric, mode=sweep.mode, scheduler=scheduler(base, sweep),
            num_samples=1 if sweep.search == "grid" else (sweep.num_trials or 10),
            max_concurrent_trials=at_once, time_budget_s=sweep.time_budget_s),
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=parent.path if parent.is_local else parent.uri,
                                  **({} if parent.is_local else {"storage_filesystem": parent.fs}), verbose=0,
                                  # a trial's state is its run directory's checkpoints (sweep/trial.py)
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False)),
    )


def placement_groups_left(timeout_s: float = PG_GONE_S) -> tuple[list[dict[str, Any]], int]:
    """This job's placement groups still held (not REMOVED) at the sweep's end, and how many of
    them the sweep removed itself: (left, removed).

    Once Tune has returned, no trial of this job runs, so whatever of its groups outlives the
    wait is a leak: Ray Train's cleaner only learns a group after the worker group started,
    and a trial stopped while its workers were starting leaves its group held until the job
    ends (docs/usage.md). Other jobs' groups on a shared cluster are not the sweep's to count
    or remove."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from raytrain_ddp.ray_compat import placement_group_job

    job = ray.get_runtime_context().get_job_id()
    deadline, removed = time.monotonic() + timeout_s, 0
    while True:
        left = [{"id": pg_id, "name": pg.get("name"), "state": pg.get("state"), "bundles": pg.get("bundles")}
                for pg_id, pg in ray.util.placement_group_table().items()
                if pg.get("state") != "REMOVED" and placement_group_job(pg_id) == job]
        if not left:
            return left, removed
        if time.monotonic() > deadline:
            if removed:  # removed once already: what is still there is said as left
                return left, removed
            for group in left:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group["id"])))
            removed, deadline = len(left), time.monotonic() + timeout_s
        time.sleep(1.0)


def run_sweep(base: Config, base_data: dict[str, Any], sweep: SweepConfig, code: Any = None) -> dict[str, Any]:
    """Run (or continue) the sweep; returns what sweep.json holds."""
    from raytrain_ddp.driver.launcher import DATA_HEADROOM_CPUS, connect_user_code
    from raytrain_ddp.sweep.report import print_report

    where = sweep_dir_of(base, sweep)
    where.mkdir()
    started_here = connect_user_code(base, code, cpus=embedded_cpus(base, sweep, DATA_HEADROOM_CPUS))
    try:
        import ray

        at_once, why = concurrency(base, sweep, ray.cluster_resources(), DATA_HEADROOM_CPUS)
        print(f"raytrain-ddp: sweep {where.name!r} -> {where}: {planned_trials(sweep)} trials, {sweep.search} "
              f"search over {', '.join(sweep.space) or 'nothing'}, {sweep.scheduler} on {sweep.metric} "
              f"({sweep.mode}); {at_once} at a time ({why})", flush=True)
        started = time.time()
        for name, value in TUNE_ENV.items():
            os.environ.setdefault(name, value)
        ray_console.quiet_sweep()  # the plan line above and the report below: our lines only
        ctrl_c = CtrlC()
        try:
            with ctrl_c:
                grid = tuner(base_data, base, sweep, where, at_once).fit()
            if ctrl_c.seen.is_set():  # swallowed every time until the sweep ended: still ours
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            _interrupted(where, sweep, started)
            raise
        _wait_for_stopping_trials(where)
        outcome = {**_outcome(grid, started), "metric": sweep.metric, "mode": sweep.mode}
        (where / SWEEP_FILE).write_text(json.dumps(outcome, indent=2) + "\n")
    finally:
        if started_here:
            import ray

            ray.shutdown()
    print_report(where)
    return outcome


def _wait_for_stopping_trials(where: Location, timeout_s: float = STOPPING_S) -> None:
    """Tune ends stopped trials without waiting for them; their fits release their holds once
    their workers have saved and returned. Bounded: what is left resumes from its checkpoint."""
    from raytrain_ddp.driver.hold import held_live

    trials = where / TRIALS_DIR
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not trials.exists() or not any(held_live(d) for d, info in trials.children() if info.type.name == "Directory"):
            return
        time.sleep(0.5)


def _interrupted(where: Location, sweep: SweepConfig, started: float) -> None:
    """Ctrl-C: sweep.json says so, and how to go on; Ray's end stops the trials (each resumes
    from its newest checkpoint, `Tuner.restore` from Tune's last saved state)."""
    (where / SWEEP_FILE).write_text(json.dumps({"status": "interrupted", "metric": sweep.metric, "mode": sweep.mode,
                                                "elapsed_s": round(time.time() - started, 1)}, indent=2) + "\n")
    print(f"raytrain-ddp: sweep interrupted; run the same command to continue it ({where})", file=sys.stderr,
          flush=True)


def _outcome(grid: Any, started: float) -> dict[str, Any]:
    """What sweep.json holds: finished or interrupted, Tune's errors by trial, what is left."""
    errors = {}
    for result in grid:
        if result.error is not None:
            trial_id = (result.metrics or {}).get("trial_id") or os.path.basename(str(result.path or ""))
            errors[trial_id] = " ".join(str(result.error).split())[-300:]
    unfinished = len(grid) - grid.num_terminated - grid.num_errors
    return {"status": "interrupted" if unfinished > 0 else "finished", "trials": len(grid),
            "errors": errors,
            "unfinished": unfinished, "elapsed_s": round(time.time() - started, 1),
            **_left(*placement_groups_left())}


def _left(groups: list[dict[str, Any]], removed: int) -> dict[str, Any]:
    return {"placement_groups_left": len(groups), "placement_groups_removed": removed,
            **({"placement_groups": groups} if groups else {})}
