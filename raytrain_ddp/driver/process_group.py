"""The process group's backend as Ray Train's controller sees it: a config whose class imports no torch.

Owns: `ProcessGroupConfig`, what `TorchTrainer(torch_config=...)` is given under `checkpoint` and
`replica` recovery, and `ProcessGroupBackend`, the backend class it names. Must not touch what
the backend does: each call goes to Ray's own torch backend (`ray_compat.torch_backend()`, the
class `TorchConfig.backend_cls` names), given the equal `TorchConfig` (`torch_config`), so the
workers' process group is set up, started and shut down exactly as with `TorchConfig`.

Why: the controller unpickles the backend config and the backend as it starts, before it asks
for the placement group and creates the workers. `TorchConfig`'s module imports torch, about a
second of one core, there, on the start-up's critical path, in a process that never touches a
tensor (docs/design.md#the-controller-loads-torch-off-its-critical-path). These classes are defined in a module
without torch. An unpickled backend starts loading Ray's torch backend on a thread, while the
controller places and starts the workers, and waits for it when the group is up (re-measured: docs/compat.md).
`live` keeps Ray's torchft config (`recovery/live_driver.py`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

from ray.train.backend import Backend, BackendConfig

from raytrain_ddp import ray_compat
from raytrain_ddp.driver.startup import guarded_start

_LOADING: Optional[threading.Thread] = None  # this process's load of Ray's torch backend (controller)
_LOCK = threading.Lock()


def _load_in_background() -> None:
    """Start importing Ray's torch backend (torch with it) on a daemon thread, once per process."""
    global _LOADING
    with _LOCK:
        if _LOADING is None:
            _LOADING = threading.Thread(target=ray_compat.torch_backend, name="raytrain-ddp-torch-backend",
                                        daemon=True)
            _LOADING.start()


def _unpickled_backend() -> "ProcessGroupBackend":
    """What an unpickled `ProcessGroupBackend` is: the backend, Ray's torch backend already loading."""
    _load_in_background()
    return ProcessGroupBackend()


@dataclasses.dataclass
class ProcessGroupConfig(BackendConfig):
    """`TorchConfig`'s fields and meaning (backend None: nccl on GPUs, else gloo; `init_method`
    env or tcp; `timeout_s` for the group's collectives)."""

    backend: Optional[str] = None
    init_method: str = "env"
    timeout_s: int = 1800

    def torch_config(self) -> Any:
        """The equal `TorchConfig` (imports torch: on the driver and the workers)."""
        from ray.train.torch import TorchConfig

        return TorchConfig(**dataclasses.asdict(self))

    @property
    def backend_cls(self) -> type:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> Any:  # read on the driver, which has torch: `TorchConfig`'s own
        return self.torch_config().train_func_context

    @property
    def framework(self) -> Any:
        return ray_compat.torch_framework()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ProcessGroupBackend(Backend):
    """Ray's torch backend, loaded on a thread where this is unpickled (the controller)."""

    share_cuda_visible_devices = True  # as Ray's torch backend: tests/local/unit/test_process_group.py checks

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unpickled_backend, ()

    @staticmethod
    def _hand_on(hook: str, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        """Ray's torch backend's `hook`, given the equal `TorchConfig` (once its load has ended)."""
        if _LOADING is not None:
            _LOADING.join()  # an import: it ends, or failed and the line below raises its error
        getattr(ray_compat.torch_backend()(), hook)(worker_group, backend_config.torch_config())

    def on_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        # a taken port (or a peer not reachable yet): Ray Train starts a new group (driver/startup.py)
        guarded_start(self, lambda: self._hand_on("on_start", worker_group, backend_config), worker_group)

    def on_training_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        self._hand_on("on_training_start", worker_group, backend_config)

    def on_shutdown(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        self._hand_on("on_shutdown", worker_group, backend_config)
