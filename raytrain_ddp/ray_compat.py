"""Every private Ray API this package uses, in one room (issue #29).

Owns: each use of a name Ray does not promise to keep -- imports from `ray._private`,
`ray.train.v2._internal`, `ray.data._internal`, `ray.autoscaler._private`, underscore
attributes and arguments of Ray objects, internal actor / resource / handler / logger /
environment-variable names, and the monkeypatches (each says for how long). Other modules call the functions
below and never spell a private name themselves (`tests/local/unit/test_ray_compat.py` greps
the package for it); each function has a test there that fails by its name when a Ray
release moves what it relies on. Must not touch: training, the worker loop, what is
printed. A leaf: it imports no module of this package and Ray only inside functions, so
the refusals before Ray starts (`preflight.py`) and the worker (`recovery/replica.py`, the
one module below the driver that needs a Ray Train hook) may import it.

Tested with Ray 2.59 and 2.60 (docs/compat.md); where those releases differ, the
branch is here and says which release has what.

Why Ray's checkpoint snapshot is removed before every fit (issue #25): Ray Train V2
keeps `checkpoint_manager_snapshot.json` in the run directory and, when the same
name/storage path is fitted again, restores its list of checkpoints, refusing to start
("You are running in a corrupted run directory") when one of them is gone. Ours go on
purpose: `run.num_to_keep` is applied over all fits (`resume.prune_checkpoints`), a
survivor's copy supersedes a checkpoint, a fit dies between Ray's deletion and its
snapshot write. Which checkpoint a fit starts from is our decision anyway
(`resume.resolve_resume`, made before Ray starts; workers ignore Ray's offers from
earlier fits), so each fit hands Ray an empty history: Ray then only ever lists what this
fit wrote, and its file never contradicts ours.
"""

# Over 500 lines: every private Ray name of the package in one room, each behind a function with its by-name test.
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger(__name__)

# Environment variables Ray sets or reads that are not documented settings.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # the job supervisor's config for a `ray job submit` entrypoint
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # Ray Train V2's controller poll, passed to it
WORKER_NICENESS_ENV = "RAY_worker_niceness"  # the niceness Ray starts worker processes at (15)
WORKER_NICENESS_CONFIG = "worker_niceness"  # the same setting in `ray.init(_system_config=...)`
HEAD_NODE_RESOURCE = "node:__internal_head__"  # the marker resource only the head node has
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"  # "token auth is on/off"
PROGRESS_NOTICE_LOGGER = "ray.data._internal.progress"  # "Progress bars disabled. To enable, ..."
RAY_WORKER_OUTPUT_HANDLER = "ray_print_logs"  # the name of Ray's handler on its worker-output dispatcher
CONTROLLER_RESTART_STATES = ("RestartingState", "ReschedulingState")  # Ray Train V2's controller states
COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray Data's actor: (name, namespace)
PREEMPTION_GRACE_SINCE = (2, 60)  # FailureConfig(preemption_grace_s, relax_collectives_on_preemption)
STARTUP_WITHOUT_ENV = "RAYTRAIN_DDP_STARTUP_WITHOUT"  # a diagnostic (docs/compat.md): start-up overrides left out


def override_on(name: str) -> bool:
    """Whether start-up override `name` applies: yes unless `STARTUP_WITHOUT_ENV` (comma-separated) names
    it, which the startup bench's A/B does (benchmarks/startup.py)."""
    return name not in os.environ.get(STARTUP_WITHOUT_ENV, "").split(",")


def ray_version() -> tuple[int, int]:
    """The installed Ray's (major, minor), read from its metadata: no import of Ray."""
    from importlib.metadata import version

    major, minor = version("ray").split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------ Ray Train: run directory


def checkpoint_snapshot_name() -> str:
    """The file name of Ray Train's checkpoint-manager snapshot inside a run directory."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    return CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def forget_earlier_fits(run_dir: Any) -> bool:
    """Remove Ray Train's checkpoint snapshot from `run_dir` (a `rundir.Location`); True if one was there."""
    snapshot = run_dir / checkpoint_snapshot_name()
    if not snapshot.exists():
        return False
    snapshot.delete()
    return True


# ------------------------------------------------------------------ Ray Train: the controller


def install_sigint_handler(trainer: Any, register: Callable[[Any], None]) -> None:
    """`TorchTrainer.fit` calls `_register_sigint_handler(controller)` on the main thread to
    install a SIGINT handler that aborts and then `sys.exit(0)`s; `register` replaces it
    and receives the controller's actor handle (for `abort_controller`)."""
    trainer._register_sigint_handler = register


def abort_controller(controller: Any) -> None:
    """Ask Ray Train's controller actor to stop the workers and end the fit (what Ray's own
    Ctrl-C handler does); returns without waiting."""
    controller.abort.remote()


def controller_callback_base() -> type:
    """The base class of a Ray Train controller callback (`RunConfig(callbacks=...)`): its
    `after_controller_state_update(previous_state, current_state)` runs in the controller."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def worker_group_callback_base() -> type:
    """The base class of a Ray Train worker-group callback: its `before_worker_group_start`,
    `before_init_train_context(workers)` and `after_worker_group_start` run in the controller
    as a group starts (the start-up timeline's stamps, `driver/startup.py`)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    return WorkerGroupCallback


def worker_callback_base() -> type:
    """The base class of a Ray Train worker callback: its `before_worker_shutdown()` runs in
    each worker when the controller stops the group (up to 5 s before the kill)."""
    from ray.train.v2._internal.execution.callback import WorkerCallback

    return WorkerCallback


def torch_backend() -> type:
    """Ray Train's own torch backend class (what `TorchConfig.backend_cls` names): it sets the
    workers' process group up (`driver/process_group.py` hands it every call). Imports torch."""
    from ray.train.torch import TorchConfig

    return TorchConfig().backend_cls


def torch_framework() -> Any:
    """What `TorchConfig.framework` says (Ray Train's state export reads it in the controller),
    without importing torch: `driver/process_group.py`'s config keeps the controller torch-free."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train V2 (2.60): its drain watcher actor


def lean_trainer(trainer_cls: type) -> type:
    """`trainer_cls` (Ray Train V2's `TorchTrainer`) for an embedded instance, without the actors
    this fit has no use for: each is a fresh Python process importing Ray Train on the start-up's
    critical path (docs/design.md#the-embedded-instance-starts-lean; its figure: docs/compat.md).
    No dataset manager when the fit hands Ray Train no Ray Dataset (`data.sharding: exact` sends
    its shards through the object store). The instance lives and dies with this process, on one
    node with no autoscaler and no drain notices, so it also runs without:
    - the placement-group cleaner (it frees the groups of a controller that died while the
      cluster lived on; here the cluster dies with it);
    - Ray Data's autoscaling coordinator, under a fixed worker count (it asks an autoscaler
      for the workers' resources; there is none);
    - the preemption watcher (it polls for draining nodes; nothing drains this one).
    Falls back to `trainer_cls` itself where this Ray lacks one of the names."""
    if not override_on("lean_trainer"):
        return trainer_cls
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
        from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
    except ImportError:  # pragma: no cover - another Ray: the full start
        return trainer_cls
    if not hasattr(trainer_cls, "_initialize_and_run_controller"):  # pragma: no cover
        return trainer_cls

    class LocalFixedScalingPolicy(FixedScalingPolicy):  # pickled by value into the controller
        """No coordinator client is made, so nothing is sent; the base's cancel skips a missing client."""

        def after_controller_start(self, train_run_context: Any) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

    class LeanTrainer(trainer_cls):  # type: ignore[misc, valid-type]
        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            datasets = getattr(self, "datasets", True)  # a Ray that names them otherwise: keep the manager
            kwargs["callbacks"] = [cb for cb in kwargs.get("callbacks", [])
                                   if not isinstance(cb, PlacementGroupCleanerCallback)
                                   and not (isinstance(cb, DatasetsCallback) and not datasets)]
            policy = kwargs.get("scaling_policy")
            if type(policy) is FixedScalingPolicy:
                kwargs["scaling_policy"] = LocalFixedScalingPolicy(policy.scaling_config)
            before = os.environ.get(PREEMPTION_WATCHER_ENV)
            os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")  # read as the controller's env is built
            try:
                return super()._initialize_and_run_controller(**kwargs)
            finally:
                if before is None:
                    os.environ.pop(PREEMPTION_WATCHER_ENV, None)

    return LeanTrainer


def start_failed(message: str) -> Exception:
    """The error that Ray Train's failure policy retries as a failed worker-group start
    (`WorkerGroupStartupFailedError`: a new group, under `FailureConfig.controller_failure_limit`)."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError

    return WorkerGroupStartupFailedError(message)


def start_failure(state: Any) -> Optional[str]:
    """The message of the failed worker-group start a controller state retries (`start_failed`), else None."""
    error = getattr(getattr(state, "training_failed_error", None), "controller_failure", None)
    return str(error) if type(error).__name__ == "WorkerGroupStartupFailedError" else None


def abandon_group(group: Any) -> None:
    """Stop a worker group whose start failed after its actors were up (its actors and placement
    group go now: Ray Train cleans up only a group that failed before that). A replica group
    (live recovery's replacement) is stopped by Ray's replacement itself."""
    import ray
    from ray.train.v2._internal.execution.worker_group import WorkerGroup

    if isinstance(group, WorkerGroup) and group.has_started():
        for worker in group.get_workers():  # killed first: a peer still waits for the taken port, and
            ray.kill(worker.actor)  # Ray's stop would give it 5 s to finish that wait
        group.abort()


def follow_port_pick(after: Callable[[int], None]) -> None:
    """This process's next pick of a process group's port by Ray's torch backend (its rank 0
    runs `ray.train._internal.utils.get_address_and_port`, found by name) is followed by
    `after(port)`, once: a test's fault plan takes the port there (`tests/_hooks.py`)."""
    import ray.train._internal.utils as ray_utils

    pick = ray_utils.get_address_and_port

    def pick_then(*args: Any, **kwargs: Any) -> Any:
        ray_utils.get_address_and_port = pick
        address, port = pick(*args, **kwargs)
        after(int(port))
        return address, port

    ray_utils.get_address_and_port = pick_then


def is_restart_state(state: Any) -> bool:
    """Whether a controller state (as handed to a controller callback) is about to size a new group."""
    return type(state).__name__ in CONTROLLER_RESTART_STATES


def preemption_grace_supported() -> bool:
    """Whether `FailureConfig` takes `preemption_grace_s` and `relax_collectives_on_preemption`:
    Ray 2.60 does, 2.59 does not (`preflight` refuses `run.preemption_grace_s` > 0 there)."""
    return ray_version() >= PREEMPTION_GRACE_SINCE


def preemption_grace(grace_s: float) -> dict[str, Any]:
    """`FailureConfig`'s preemption-grace arguments: nothing on a Ray without them (grace 0 is
    then what Ray does anyway), else the grace and, with a grace, relaxed collectives."""
    if not preemption_grace_supported():
        return {}
    return {"preemption_grace_s": grace_s, "relax_collectives_on_preemption": grace_s > 0}


# ------------------------------------------------------------------ Ray Data, core, autoscaler


def refresh_autoscaling_coordinator(requester: str, timeout_s: float = 5.0) -> bool:
    """Make Ray Data's autoscaling coordinator re-read the cluster's nodes now (Ray Train's
    elastic sizing reads it; its own tick is 20 s). False, logged, if that failed.

    Ray 2.60 recomputes on request (`get_reserved_resources(requester, recompute=True)`,
    which runs the coordinator's periodic `_tick` at once); 2.59 (and older) lacks `recompute`,
    so its `_tick` is called directly.
    """
    import ray

    try:
        coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        if _coordinator_recomputes():
            ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=timeout_s)
        else:
            ray.get(coordinator._tick.remote(), timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - Ray internals moved: the coordinator's own tick (20 s) remains
        logger.warning("raytrain-ddp: could not refresh Ray's autoscaling coordinator", exc_info=True)
        return False


def train_requester(trainer: Any) -> Optional[str]:
    """The name under which `trainer`'s controller asks Ray Data's autoscaling coordinator
    for its workers' resources (Ray Train V2's `ScalingPolicy.after_controller_start`:
    `train-<run id>`, the id made with the trainer); None where this Ray has no such id."""
    run_id = getattr(getattr(trainer, "train_run_context", None), "run_id", None)
    return f"train-{run_id}" if run_id else None


def cancel_autoscaling_request(requester: str, timeout_s: float = 5.0) -> bool:
    """Cancel `requester`'s resource request in Ray Data's autoscaling coordinator, as Ray
    Train's controller does when it ends gracefully. A SIGKILLed driver's controller never
    does, and its request keeps its workers' resources reserved until it expires (Ray Data's
    AUTOSCALING_REQUESTS_EXPIRE_TIME_S, 180 s in Ray 2.60): an elastic fit that takes the
    run over sizes itself on what is left. False if there is no coordinator or it failed."""
    import ray

    try:
        coordinator = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    except ValueError:  # none on this cluster: no request is held
        return False
    try:
        ray.get(coordinator.cancel_request.remote(requester), timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - the request then expires on Ray's own clock
        logger.warning("raytrain-ddp: could not cancel %s in Ray's autoscaling coordinator", requester, exc_info=True)
        return False


def _coordinator_recomputes() -> bool:
    import inspect

    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as module

    method = getattr(module._AutoscalingCoordinatorActor, "get_reserved_resources", None)
    return method is not None and "recompute" in inspect.signature(method).parameters


def autoscaler_node_groups() -> Optional[list[Any]]:
    """The node groups of the cluster config an autoscaler stores in the GCS (each with
    `name`, `resources`, `max_count`); None when there is none or Ray cannot say."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - an internal API: no answer means "not known"
        return None
    if config is None or not config.node_group_configs:
        return None
    return list(config.node_group_configs)


def autoscaler_config_checks() -> tuple[Callable[[dict], dict], Callable[[dict], None]]:
    """`ray up`'s own (prepare_config, validate_config): provider defaults, then cross-field rules."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    return prepare_config, validate_config


STARTUP_TIMEOUT_TEXT = "timed out during startup"  # ray/_private/node.py: its raylet did not register in 30 s


def startup_timed_out(exc: BaseException) -> bool:
    """Whether `ray.init` of an embedded instance failed because Ray's own wait for its
    raylet to register (30 s, not configurable) ran out: a busy machine, worth one retry."""
    return STARTUP_TIMEOUT_TEXT in str(exc)


def _by_parent() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from /proc (empty where there is none)."""
    below: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) if entry.isdigit() else None
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if ppid is not None:
            below.setdefault(ppid, []).append(int(entry))
    return below


def children() -> frozenset:
    """The pids of this process's children now (`stop_timed_out_start` spares them)."""
    return frozenset(_by_parent().get(os.getpid(), []))


def stop_timed_out_start(before: frozenset = frozenset()) -> int:
    """Kill what a timed-out `ray.init` of an embedded instance left running: its GCS server and
    raylet are this process's children (Ray keeps them until this process exits, and the next
    try's would compete with them for a busy machine's CPUs), the agents the raylet started
    theirs (they do not end with a killed raylet: docs/design.md). Only children running Ray's
    binaries or modules that were not already children `before` the try (another instance this
    process runs, e.g. a test session's, is left alone), and everything below them; returns how many."""
    import signal

    import ray

    ray_dir, below = os.path.dirname(ray.__file__).encode(), _by_parent()

    def runs_ray(pid: int) -> bool:
        try:
            return ray_dir in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            return False

    doomed, todo = [], [pid for pid in below.get(os.getpid(), []) if pid not in before and runs_ray(pid)]
    while todo:
        doomed.append(todo.pop())
        todo += below.get(doomed[-1], [])
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(doomed)


def local_instance_kwargs(ip: str) -> dict[str, Any]:
    """`ray.init` arguments of an embedded instance (private ones): its node address pinned to `ip`,
    and its worker processes at the driver's own niceness (Ray's `worker_niceness`, 15 by
    default). On a cluster Ray lowers its workers' priority to keep its daemons responsive to
    other nodes; an embedded instance's workers are the run itself, as torchrun's ranks are, and
    at 15 any busy process of normal priority on the machine takes their cores (the kernel weighs
    niceness 15 at 36 against 0's 1024: docs/design.md#the-embedded-instance-starts-lean)."""
    return {"_node_ip_address": ip, "_system_config": {WORKER_NICENESS_CONFIG: 0}}


LEAN_NODE_SKIPS = ("start_api_server", "start_monitor")  # ray/_private/node.py: Node's head processes we skip


@contextlib.contextmanager
def lean_local_node() -> Iterator[bool]:
    """While it is open, a head node Ray starts (`ray.init` of an embedded instance) starts
    without two Python processes that serve a cluster, not a fit that dies with its driver:
    - the dashboard's head process: with `include_dashboard=False` Ray still starts it, with
      only its usage-stats module, and waits for it;
    - the autoscaler's monitor: one node, nothing to scale (Ray then stops it at shutdown
      with a graceful wait; re-measured: docs/compat.md).
    Yields False, and changes nothing, where this Ray's `Node` lacks either method. For the
    `with` only: the methods are Ray's own again when it closes."""
    if not override_on("lean_node"):
        yield False
        return
    try:
        from ray._private.node import Node
    except ImportError:  # pragma: no cover - Ray moved it: the full start
        yield False
        return
    saved = {name: Node.__dict__.get(name) for name in LEAN_NODE_SKIPS}
    if not all(callable(method) for method in saved.values()):  # pragma: no cover
        yield False
        return

    def no_api_server(self: Any, **_: Any) -> None:
        self._webui_url = None  # what Ray records when its dashboard did not start

    def no_monitor(self: Any) -> None:
        pass

    Node.start_api_server, Node.start_monitor = no_api_server, no_monitor
    try:
        yield True
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


def started_here() -> bool:
    """Whether this process started the Ray instance it is connected to (an embedded one: `ray.init`
    without an address), not joined a cluster: the node of a connected driver is the head only then."""
    import ray._private.worker as ray_worker

    node = ray_worker._global_node
    return bool(node is not None and node.is_head())


def placement_group_job(group_id_hex: str) -> str:
    """The hex id of the job that created a placement group (`placement_group_table()`'s key):
    a `PlacementGroupID` ends with its `JobID` (Ray's id layout; the table itself has no job)."""
    import ray

    return group_id_hex[-2 * ray.JobID.size():]


def job_config(environ: Any = None) -> Optional[dict[str, Any]]:
    """The job config Ray's job supervisor hands a `ray job submit` entrypoint (runtime_env,
    metadata), None outside a job; {} when it does not parse."""
    raw = (os.environ if environ is None else environ).get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# ------------------------------------------------------------------ the driver's console


def token_notice_logger() -> logging.Logger:
    """The logger of Ray's "token authentication is enabled / disabled" warnings."""
    return logging.getLogger(TOKEN_NOTICE_LOGGER)


def progress_notice_logger() -> logging.Logger:
    """The logger of Ray Data's "Progress bars disabled" warning (we disable them on purpose)."""
    return logging.getLogger(PROGRESS_NOTICE_LOGGER)


def replace_worker_output_handler(name: str, handler: Callable[[dict[str, Any]], None]) -> bool:
    """Swap Ray's handler of the worker output streamed to the driver (`log_to_driver`) for
    `handler` (called with {"lines": [...], "is_err": bool, ...}); False, Ray's handler kept,
    if Ray's dispatcher moved."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # pragma: no cover - Ray moved it: keep Ray's handler
        return False
    if not hasattr(dispatcher, "remove_handler"):  # pragma: no cover
        return False
    dispatcher.remove_handler(RAY_WORKER_OUTPUT_HANDLER)
    dispatcher.remove_handler(name)
    dispatcher.add_handler(name, handler)
    return True


def serve_partial_groups_whole_datasets() -> bool:
    """Make Ray Train's `DatasetsCallback` hand a partial group (a live-recovery replacement,
    recovery/live_driver.py) the full group's dataset-shard provider. Once per process; False if done."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    original = DatasetsCallback.before_init_train_context
    if getattr(original, "_raytrain_live", False):
        return False

    def before_init_train_context(self: Any, workers: list) -> dict:
        provider, world = getattr(self, "_dataset_shard_provider", None), getattr(self, "_raytrain_world", 0)
        if provider is not None and len(workers) < world:
            return {"dataset_shard_provider": [provider] * len(workers)}
        out = original(self, workers)
        self._raytrain_world = len(workers)
        return out

    before_init_train_context._raytrain_live = True  # type: ignore[attr-defined]
    DatasetsCallback.before_init_train_context = before_init_train_context
    return True
