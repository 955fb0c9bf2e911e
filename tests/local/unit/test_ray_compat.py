"""Every private Ray name `ray_compat.py` relies on is still where it looks, and no
other module of the package spells one (issue #29).

Each test checks one function of ray_compat against the installed Ray, without a cluster,
and fails by name: "ray_compat.X: <what> is gone in ray <version>". When a Ray release
moves something, the failing test names the function to change; `make compat` runs these
on every Ray version the project supports.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
from _compat import attr_or_fail, ray_gone as _gone
import ray

from _source import docstring_ids

from raytrain_ddp import ray_compat

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(ray_compat.__file__).resolve().parent


def _attr(function: str, dotted: str) -> Any:
    """Import `module.path:attr.attr`, failing by the name of the ray_compat function that uses it."""
    return attr_or_fail(_gone, function, dotted)


def _params(obj: Any) -> list[str]:
    return list(inspect.signature(obj).parameters)


# ------------------------------------------------------------------ Ray Train


def test_checkpoint_snapshot_name():
    name = _attr("checkpoint_snapshot_name", "ray.train.v2._internal.constants:CHECKPOINT_MANAGER_SNAPSHOT_FILENAME")
    assert ray_compat.checkpoint_snapshot_name() == name == "checkpoint_manager_snapshot.json"


def test_install_sigint_handler():
    trainer_cls = _attr("install_sigint_handler", "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer")
    from ray.train.torch import TorchTrainer

    if not callable(getattr(TorchTrainer, "_register_sigint_handler", None)):
        pytest.fail(_gone("install_sigint_handler", "TorchTrainer._register_sigint_handler"))
    assert "self._register_sigint_handler(" in inspect.getsource(trainer_cls), \
        _gone("install_sigint_handler", "DataParallelTrainer's call of self._register_sigint_handler(controller)")
    trainer, seen = TorchTrainer.__new__(TorchTrainer), []
    ray_compat.install_sigint_handler(trainer, seen.append)
    trainer._register_sigint_handler("controller")
    assert seen == ["controller"]


def test_abort_controller():
    controller = _attr("abort_controller", "ray.train.v2._internal.execution.controller.controller:TrainController")
    assert callable(getattr(controller, "abort", None)), _gone("abort_controller", "TrainController.abort")

    class Handle:
        class abort:  # noqa: N801 - an actor method's shape
            calls: list[int] = []

            @classmethod
            def remote(cls) -> None:
                cls.calls.append(1)

    ray_compat.abort_controller(Handle())
    assert Handle.abort.calls == [1]


def test_controller_callback_base():
    base = _attr("controller_callback_base", "ray.train.v2._internal.execution.callback:ControllerCallback")
    assert ray_compat.controller_callback_base() is base
    hook = getattr(base, "after_controller_state_update", None)
    assert hook is not None and _params(hook)[1:] == ["previous_state", "current_state"], \
        _gone("controller_callback_base", "ControllerCallback.after_controller_state_update(previous_state, current_state)")


def test_worker_group_callback_base():
    base = _attr("worker_group_callback_base", "ray.train.v2._internal.execution.callback:WorkerGroupCallback")
    assert ray_compat.worker_group_callback_base() is base
    for hook in ("before_worker_group_start", "before_init_train_context", "after_worker_group_start"):
        assert callable(getattr(base, hook, None)), _gone("worker_group_callback_base", f"WorkerGroupCallback.{hook}")


def test_worker_callback_base():
    base = _attr("worker_callback_base", "ray.train.v2._internal.execution.callback:WorkerCallback")
    assert ray_compat.worker_callback_base() is base
    assert callable(getattr(base, "before_worker_shutdown", None)), \
        _gone("worker_callback_base", "WorkerCallback.before_worker_shutdown")


def test_torch_backend():
    from ray.train.torch import TorchConfig

    backend = ray_compat.torch_backend()
    assert backend is TorchConfig().backend_cls and callable(getattr(backend, "on_start", None)), \
        _gone("torch_backend", "TorchConfig().backend_cls.on_start")


def test_torch_framework():
    _attr("torch_framework", "ray.train.v2._internal.util:TrainingFramework.TORCH")
    from ray.train.torch import TorchConfig

    assert ray_compat.torch_framework() == TorchConfig().framework, _gone("torch_framework", "TorchConfig().framework")


def test_is_restart_state():
    for name in ray_compat.CONTROLLER_RESTART_STATES:
        cls = _attr("is_restart_state", f"ray.train.v2._internal.execution.controller.state:{name}")
        assert ray_compat.is_restart_state(object.__new__(cls))
    running = _attr("is_restart_state", "ray.train.v2._internal.execution.controller.state:RunningState")
    assert not ray_compat.is_restart_state(object.__new__(running))


def test_start_failed_and_start_failure():
    cls = _attr("start_failed", "ray.train.v2._internal.exceptions:WorkerGroupStartupFailedError")
    policy = _attr("start_failed", "ray.train.v2._internal.execution.failure_handling.default:RETRYABLE_CONTROLLER_ERRORS")
    assert cls in policy, _gone("start_failed", "a retried WorkerGroupStartupFailedError")
    assert type(ray_compat.start_failed("x")) is cls
    errored = _attr("start_failure", "ray.train.v2._internal.execution.controller.state:ReschedulingState")
    assert "training_failed_error" in _params(errored), _gone("start_failure", "ReschedulingState.training_failed_error")
    error = ray.train.ControllerError(ray_compat.start_failed("the start"))
    assert ray_compat.start_failure(errored(training_failed_error=error)) == "the start", \
        _gone("start_failure", "ControllerError.controller_failure")


def test_abandon_group():
    group = _attr("abandon_group", "ray.train.v2._internal.execution.worker_group:WorkerGroup")
    for name in ("has_started", "get_workers", "abort"):
        assert callable(getattr(group, name, None)), _gone("abandon_group", f"WorkerGroup.{name}")
    ray_compat.abandon_group(object())  # not a worker group (a replica group): left alone


def test_follow_port_pick():
    utils = _attr("follow_port_pick", "ray.train._internal.utils:get_address_and_port")
    source = inspect.getsource(_attr("follow_port_pick", "ray.train.torch.config:_TorchBackend.on_start"))
    assert "execute_single" in source and "get_address_and_port" in source, \
        _gone("follow_port_pick", "_TorchBackend.on_start's execute_single(0, get_address_and_port)")
    seen: list[int] = []
    ray_compat.follow_port_pick(seen.append)
    import ray.train._internal.utils as ray_utils  # noqa: F401 - as the pickled function is found

    address, port = ray_utils.get_address_and_port()
    assert seen == [port] and ray_utils.get_address_and_port is utils  # once, then Ray's own again


def test_stop_timed_out_start():
    """Kills only this process's children that run Ray and were not its children before the try
    (a child that does not run Ray is left alone, and so is one that ran before: the test
    session's own Ray instance, whose GCS and raylet are this process's children too)."""
    import subprocess
    import sys

    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", ray.__file__])
    before = ray_compat.children()
    assert earlier.pid in before
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # a Ray child with a child of its own (an agent): both go
    ray_child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen("
                                  "[sys.executable, '-c', 'import time; time.sleep(30)']); print(p.pid, flush=True); "
                                  "time.sleep(30)", ray.__file__], stdout=subprocess.PIPE, text=True)
    grandchild = int(ray_child.stdout.readline())
    try:
        assert ray_compat.stop_timed_out_start(before) == 2
        assert ray_child.wait(timeout=10) == -9 and other.poll() is None and earlier.poll() is None
        deadline = time.monotonic() + 10
        while Path(f"/proc/{grandchild}/stat").exists() and " Z " not in Path(f"/proc/{grandchild}/stat").read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{grandchild}/stat").exists() or " Z " in Path(f"/proc/{grandchild}/stat").read_text()
    finally:
        for proc in (other, ray_child, earlier):
            proc.kill()
            proc.wait()


def test_controller_poll_env():
    name = _attr("CONTROLLER_POLL_ENV", "ray.train.v2._internal.constants:HEALTH_CHECK_INTERVAL_S_ENV_VAR")
    assert ray_compat.CONTROLLER_POLL_ENV == name


def test_preemption_grace():
    from ray.train import FailureConfig

    has = {"preemption_grace_s", "relax_collectives_on_preemption"} <= set(_params(FailureConfig))
    assert ray_compat.preemption_grace_supported() == has, \
        f"ray_compat.preemption_grace_supported: says {not has}, but ray {ray.__version__}'s FailureConfig differs"
    assert ray_compat.ray_version() == tuple(int(x) for x in ray.__version__.split(".")[:2])
    if has:
        assert ray_compat.preemption_grace(5.0) == {"preemption_grace_s": 5.0, "relax_collectives_on_preemption": True}
        FailureConfig(**ray_compat.preemption_grace(0.0))
    else:  # Ray 2.59: nothing to pass, and a grace is refused before Ray starts, by its key
        from raytrain_ddp.config import load_config
        from raytrain_ddp.driver.preflight import check_ray_supports
        from raytrain_ddp.errors import UserError

        assert ray_compat.preemption_grace(5.0) == {}
        check_ray_supports(load_config(None, []))
        with pytest.raises(UserError, match=r"run.preemption_grace_s=5 needs Ray >= 2.60 .* run.preemption_grace_s=0"):
            check_ray_supports(load_config(None, ["run.preemption_grace_s=5"]))


def test_lean_trainer():
    """The names the lean start relies on, and what it does to the controller's arguments: no
    dataset manager without datasets, no cleaner, a fixed policy that sends no resource request,
    no preemption watcher (set only for the call)."""
    import os

    from ray.train.torch import TorchTrainer

    fn = "lean_trainer"
    datasets_cb = _attr(fn, "ray.train.v2._internal.callbacks.datasets:DatasetsCallback")
    cleaner_cb = _attr(fn, "ray.train.v2._internal.callbacks.placement_group_callback:PlacementGroupCleanerCallback")
    fixed = _attr(fn, "ray.train.v2._internal.execution.scaling_policy.fixed:FixedScalingPolicy")
    for method in ("after_controller_start", "_maybe_send_resource_request", "_cancel_resource_request"):
        assert callable(getattr(fixed, method, None)), _gone(fn, f"FixedScalingPolicy.{method}")
    assert "_coordinator_client is None" in inspect.getsource(fixed._cancel_resource_request), \
        _gone(fn, "FixedScalingPolicy._cancel_resource_request's skip of a missing client")
    assert _attr(fn, "ray.train.v2._internal.constants:ENABLE_PREEMPTION_WATCHER_ENV_VAR") \
        == ray_compat.PREEMPTION_WATCHER_ENV
    run = _attr(fn, "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer._initialize_and_run_controller")
    assert "get_env_vars_to_propagate()" in inspect.getsource(run), _gone(fn, "the controller's env built in the call")
    source = inspect.getsource(_attr(fn, "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer.fit"))
    assert "scaling_policy=" in source and "callbacks=" in source, _gone(fn, "fit's scaling_policy= / callbacks=")
    init = inspect.getsource(_attr(fn, "ray.train.v2.api.data_parallel_trainer:DataParallelTrainer.__init__"))
    assert "self.datasets = " in init, _gone(fn, "DataParallelTrainer.datasets")

    seen = {}

    class Base:
        datasets: dict = {}

        def _initialize_and_run_controller(self, **kwargs):
            seen.update(kwargs, env=os.environ.get(ray_compat.PREEMPTION_WATCHER_ENV))
            return "result"

    lean = ray_compat.lean_trainer(Base)
    assert lean is not Base and issubclass(lean, Base)

    class Keep:
        pass

    policy = fixed(ray.train.ScalingConfig(num_workers=2))
    cleaner, data, keep = cleaner_cb.__new__(cleaner_cb), datasets_cb.__new__(datasets_cb), Keep()
    os.environ.pop(ray_compat.PREEMPTION_WATCHER_ENV, None)
    assert lean()._initialize_and_run_controller(callbacks=[cleaner, data, keep], scaling_policy=policy) == "result"
    assert seen["callbacks"] == [keep] and seen["env"] == "0"
    assert ray_compat.PREEMPTION_WATCHER_ENV not in os.environ
    swapped = seen["scaling_policy"]
    assert isinstance(swapped, fixed) and swapped.scaling_config is policy.scaling_config
    swapped.after_controller_start(None)
    swapped.before_controller_abort()  # cancels nothing: no coordinator client was made
    assert swapped.make_decision_for_non_running_worker_group().num_workers == 2  # no coordinator asked
    with_data = lean()
    with_data.datasets = {"train": object()}
    with_data._initialize_and_run_controller(callbacks=[cleaner, data], scaling_policy=policy)
    assert seen["callbacks"] == [data]
    assert TorchTrainer in ray_compat.lean_trainer(TorchTrainer).__mro__
    os.environ[ray_compat.STARTUP_WITHOUT_ENV] = "lean_node,lean_trainer"  # the startup bench's A/B
    try:
        assert ray_compat.lean_trainer(Base) is Base
    finally:
        del os.environ[ray_compat.STARTUP_WITHOUT_ENV]


# ------------------------------------------------------------------ Ray Data, core, autoscaler


def test_worker_niceness_env():
    name = _attr("WORKER_NICENESS_ENV", "ray._private.ray_constants:RAY_WORKER_NICENESS")
    assert ray_compat.WORKER_NICENESS_ENV == name


def test_refresh_autoscaling_coordinator():
    module = "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator"
    create = _attr("refresh_autoscaling_coordinator", f"{module}:get_or_create_autoscaling_coordinator")
    source = inspect.getsource(create)
    name, namespace = ray_compat.COORDINATOR
    assert f'name="{name}"' in source and f'namespace="{namespace}"' in source, \
        _gone("refresh_autoscaling_coordinator", f"the coordinator actor named {ray_compat.COORDINATOR}")
    actor = _attr("refresh_autoscaling_coordinator", f"{module}:_AutoscalingCoordinatorActor")
    if ray_compat._coordinator_recomputes():  # Ray 2.60
        assert "recompute" in _params(actor.get_reserved_resources), \
            _gone("refresh_autoscaling_coordinator", "get_reserved_resources(requester_id, recompute=...)")
    else:  # Ray 2.59: the periodic refresh, called once
        # Ray's tracing can add a `_ray_trace_ctx` keyword to an actor class's methods (seen with
        # Ray 2.59 when this file ran beside the Ray tier's compatibility subset)
        params = [p for p in _params(actor._tick) if p != "_ray_trace_ctx"]
        assert params == ["self"], _gone("refresh_autoscaling_coordinator", "_AutoscalingCoordinatorActor._tick()")


def test_train_requester():
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    policy = _attr("train_requester", "ray.train.v2._internal.execution.scaling_policy.scaling_policy:ScalingPolicy")
    assert 'f"train-{train_run_context.run_id}"' in inspect.getsource(policy.after_controller_start), \
        _gone("train_requester", "ScalingPolicy.after_controller_start's requester id train-<run id>")
    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
    assert ray_compat.train_requester(trainer) == f"train-{trainer.train_run_context.run_id}", \
        _gone("train_requester", "the trainer's train_run_context.run_id")
    assert ray_compat.train_requester(object()) is None


def test_autoscaler_node_groups(monkeypatch):
    state = _attr("autoscaler_node_groups", "ray._private.state:state")
    assert callable(getattr(state, "get_cluster_config", None)), _gone("autoscaler_node_groups", "state.get_cluster_config")
    # no autoscaler here, whether this process's Ray is up (no config stored) or not (no GCS): "not known"
    assert ray_compat.autoscaler_node_groups() is None
    groups = [object(), object()]  # what an autoscaler stores: its node groups, handed on as they are
    with monkeypatch.context() as patched:
        patched.setattr(state, "get_cluster_config", lambda: type("Config", (), {"node_group_configs": groups})())
        assert ray_compat.autoscaler_node_groups() == groups
        patched.setattr(state, "get_cluster_config", lambda: 1 / 0)  # an internal API failing: never an error
        assert ray_compat.autoscaler_node_groups() is None


def test_autoscaler_config_checks():
    _attr("autoscaler_config_checks", "ray.autoscaler._private.util:prepare_config")
    _attr("autoscaler_config_checks", "ray.autoscaler._private.util:validate_config")
    prepare, validate = ray_compat.autoscaler_config_checks()
    assert callable(prepare) and callable(validate)


def test_lean_local_node():
    from ray._private.node import Node

    for name in ray_compat.LEAN_NODE_SKIPS:
        assert callable(Node.__dict__.get(name)), _gone("lean_local_node", f"Node.{name}")
    assert "_webui_url" in inspect.getsource(Node.start_api_server), _gone("lean_local_node", "Node._webui_url")
    own = {name: Node.__dict__[name] for name in ray_compat.LEAN_NODE_SKIPS}
    with ray_compat.lean_local_node() as lean:
        assert lean and all(Node.__dict__[name] is not own[name] for name in own)
        node = object.__new__(Node)
        assert Node.start_api_server(node, include_dashboard=False, raise_on_failure=False) is None
        assert node._webui_url is None and Node.start_monitor(node) is None
    assert {name: Node.__dict__[name] for name in own} == own  # Ray's own again
    import os

    os.environ[ray_compat.STARTUP_WITHOUT_ENV] = "lean_node"  # the startup bench's A/B: Ray's own start
    try:
        with ray_compat.lean_local_node() as lean:
            assert lean is False and {name: Node.__dict__[name] for name in own} == own
    finally:
        del os.environ[ray_compat.STARTUP_WITHOUT_ENV]


def test_local_instance_kwargs():
    source = inspect.getsource(_attr("local_instance_kwargs", "ray._private.worker:init"))
    for name in ray_compat.local_instance_kwargs("127.0.0.1"):  # private: read from **kwargs
        assert f'kwargs.pop("{name}"' in source, _gone("local_instance_kwargs", f"ray.init({name}=...)")


def test_started_here():
    _attr("started_here", "ray._private.worker:_global_node")
    assert "is_head" in dir(_attr("started_here", "ray._private.node:Node")), _gone("started_here", "Node.is_head")
    assert ray_compat.started_here() is ray.is_initialized()  # this session starts its own Ray, or none yet


def test_job_config():
    name = _attr("job_config", "ray._private.runtime_env.constants:RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert ray_compat.JOB_CONFIG_ENV == name
    assert ray_compat.job_config({}) is None
    assert ray_compat.job_config({name: '{"metadata": {"job_submission_id": "raysubmit_1"}}'}) == \
        {"metadata": {"job_submission_id": "raysubmit_1"}}
    assert ray_compat.job_config({name: "not json"}) == {} == ray_compat.job_config({name: "[1]"})


def test_head_node_resource():
    for where in ("ray._common.constants", "ray._private.ray_constants"):
        try:
            name = getattr(importlib.import_module(where), "HEAD_NODE_RESOURCE_NAME", None)
        except ImportError:
            continue
        if name is not None:
            assert ray_compat.HEAD_NODE_RESOURCE == name
            return
    pytest.fail(_gone("HEAD_NODE_RESOURCE", "HEAD_NODE_RESOURCE_NAME"))


# ------------------------------------------------------------------ the driver's console


def test_token_notice_logger():
    module = _attr("token_notice_logger", ray_compat.TOKEN_NOTICE_LOGGER)
    assert ray_compat.token_notice_logger() is logging.getLogger(module.__name__)
    assert "logging.getLogger(__name__)" in inspect.getsource(module), \
        _gone("token_notice_logger", f"the logger of {ray_compat.TOKEN_NOTICE_LOGGER}")


def test_progress_notice_logger():
    module = _attr("progress_notice_logger", ray_compat.PROGRESS_NOTICE_LOGGER)
    assert ray_compat.progress_notice_logger() is logging.getLogger(module.__name__)
    source = inspect.getsource(module)
    assert "logging.getLogger(__name__)" in source and "Progress bars disabled" in source, \
        _gone("progress_notice_logger", f"the logger of {ray_compat.PROGRESS_NOTICE_LOGGER}")


def test_replace_worker_output_handler():
    dispatcher = _attr("replace_worker_output_handler", "ray._private.ray_logging:global_worker_stdstream_dispatcher")
    for method in ("add_handler", "remove_handler"):
        assert callable(getattr(dispatcher, method, None)), \
            _gone("replace_worker_output_handler", f"global_worker_stdstream_dispatcher.{method}")
    worker = _attr("replace_worker_output_handler", "ray._private.worker")
    assert f'"{ray_compat.RAY_WORKER_OUTPUT_HANDLER}"' in inspect.getsource(worker), \
        _gone("replace_worker_output_handler", f"Ray's handler named {ray_compat.RAY_WORKER_OUTPUT_HANDLER!r}")
    lines: list[dict] = []
    try:
        assert ray_compat.replace_worker_output_handler("raytrain_ddp_test", lines.append)
        dispatcher.emit({"lines": ["x"]})
        assert lines == [{"lines": ["x"]}]
    finally:
        dispatcher.remove_handler("raytrain_ddp_test")


# ------------------------------------------------------------------ nobody else spells a private name

# Ray's internal names as strings: env vars, actor / logger / handler / resource names.
_INTERNAL_STRINGS = re.compile(r"ray\._private|\._internal\.|_raylet|__internal_head__|RAY_JOB_CONFIG_JSON_ENV_VAR|"
                               r"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S|RAY_worker_niceness|ray_print_logs|"
                               r"AutoscalingCoordinator")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))


def private_ray_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each private Ray name the source spells, docstrings and comments aside."""
    tree, found = ast.parse(source), []
    docs = docstring_ids(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray" and _private(node.module):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "ray" and _private(a.name)]
        elif isinstance(node, ast.Attribute) and _dotted(node).startswith("ray.") and _private(_dotted(node)):
            found.append((node.lineno, _dotted(node)))
        elif isinstance(node, ast.Call) and _dotted(node.func).split(".")[0] == "ray":
            found += [(node.lineno, f"{_dotted(node.func)}({k.arg}=...)") for k in node.keywords
                      if k.arg and _private(k.arg)]
        elif isinstance(node, ast.Attribute) and node.attr == "_register_sigint_handler":
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and _INTERNAL_STRINGS.search(node.value)):
            found.append((node.lineno, repr(node.value)))
    return found


def test_the_grep_finds_what_it_should():
    assert private_ray_uses("from ray._private.state import state")
    assert private_ray_uses("import ray.train.v2._internal.constants")
    assert private_ray_uses("ray.init(_node_ip_address='x')")
    assert private_ray_uses("x = ray._private.worker.global_worker")
    assert private_ray_uses("t._register_sigint_handler = f")
    assert private_ray_uses("os.environ['RAY_JOB_CONFIG_JSON_ENV_VAR']")
    assert not private_ray_uses('"""mentions ray._private in a docstring"""\nimport ray.train\nray.init(address="local")')


def test_no_private_ray_name_outside_ray_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "ray_compat.py":
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                      for line, what in private_ray_uses(path.read_text())]
    assert not offenders, ("private Ray names outside ray_compat.py (add a named function there, "
                           "with a test in this file):\n" + "\n".join(offenders))


def test_declared_ray_range_is_what_make_compat_runs():
    """pyproject's Ray floor is the oldest Ray `make compat` runs, its cap above the newest,
    and the installed Ray inside the range (docs/compat.md)."""
    root = PACKAGE.parent
    floor, cap = re.search(r'"ray\[[\w,]+\]>=([\d.]+),<([\d.]+)"', (root / "pyproject.toml").read_text()).groups()
    versions = re.search(r"^COMPAT_RAY +\?= (.+)$", (root / "Makefile").read_text(), re.M).group(1).split()

    def minor(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    assert versions[0].startswith(floor + "."), (floor, versions)  # the floor is the oldest tested
    assert all(minor(v) < minor(cap) for v in versions) and minor(versions[-1]) == minor(cap)[:1] + (minor(cap)[1] - 1,)
    assert minor(floor) <= minor(ray.__version__) < minor(cap)


def test_serve_partial_groups_whole_datasets():
    callback = _attr("serve_partial_groups_whole_datasets",
                     "ray.train.v2._internal.callbacks.datasets:DatasetsCallback")
    hook = getattr(callback, "before_init_train_context", None)
    assert hook is not None and _params(hook)[1:] == ["workers"], \
        _gone("serve_partial_groups_whole_datasets", "DatasetsCallback.before_init_train_context(workers)")
    assert "_dataset_shard_provider" in inspect.getsource(callback), \
        _gone("serve_partial_groups_whole_datasets", "DatasetsCallback._dataset_shard_provider")


def test_startup_timed_out():
    import inspect

    import ray._private.node as node

    assert ray_compat.STARTUP_TIMEOUT_TEXT in inspect.getsource(node), \
        _gone("startup_timed_out", f"the message {ray_compat.STARTUP_TIMEOUT_TEXT!r} of ray/_private/node.py")
    assert ray_compat.startup_timed_out(Exception("The current node timed out during startup. This could ..."))
    assert not ray_compat.startup_timed_out(ValueError("anything else"))
