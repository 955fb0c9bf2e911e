"""Driver half of `run.recovery: live` (issue #28; a `DriverRecovery` of `table.py`): which runs get it, Ray's replica-group backend.

Owns: deciding whether a run's `run.recovery: live` can be honoured (`resolve`: sharded
strategies, elastic ranges and a single worker fall back to `replica`, each with one line
saying so; a missing torchft is an error naming the key), and the `TorchftConfig` that
makes Ray Train 2.60 manage one replica group per worker (`torch_config`): when a worker
dies, Ray's controller replaces only that group (`WorkerGroup.replace_replica_group`) and
the others keep running. Must not touch: what the workers do (`live.py`), the
rest of the trainer's construction (`launcher.py`).

The lighthouse (torchft's quorum server) runs in an actor on the driver's node, created by
Ray's `_TorchftBackend`, listening on that node's address only (`lighthouse_host`; the
workers are told it, `worker_env`); its `min_replicas` is the worker count, so a quorum never forms
without every worker: the survivors wait for the replacement instead of shrinking the
global batch (docs/reliability.md#live-recovery). Its heartbeat timeout is short (1 s)
so a dead worker stops counting as a member soon after its death, never later than the
replacement can arrive.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ray.train.v2.torch.torchft_config import TorchftConfig

from raytrain_ddp import ray_compat
from raytrain_ddp.config import Config, ConfigError
from raytrain_ddp.recovery import table
from raytrain_ddp.recovery.live_group import LIGHTHOUSE_HOST_ENV
from raytrain_ddp.recovery.restart import SurvivorsCopy
from raytrain_ddp.torchft_compat import bracketed

HEARTBEAT_TIMEOUT_MS = 1000  # a lost worker leaves the lighthouse's members within ~1 s
QUORUM_TICK_MS = 20  # how often the lighthouse looks for a complete quorum


def fallback_reason(cfg: Config) -> str:
    """Why `run.recovery: live` cannot apply to `cfg` ("" when it can)."""
    if not table.is_live(cfg):
        return ""
    refusal = table.live_refusal(cfg.parallel.strategy)
    if refusal:
        return f"parallel.strategy={cfg.parallel.strategy} {refusal}"
    if cfg.scaling.elastic:
        return "scaling.num_workers is a range, and Ray replaces single workers only in fixed-size groups"
    if cfg.scaling.num_workers < 2:
        return "one worker has no survivor to wait for it"
    if cfg.data.sharding == "streaming":
        return ("data.sharding=streaming splits one Ray Data stream over the workers, and a replacement "
                "cannot take over a split mid-epoch")
    return ""


def resolve(cfg: Config, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Config:
    """`cfg` with the recovery mode the run will really use: `live` when it applies, else `replica`
    (said in one line). `live` without torchft installed is a `ConfigError` naming the key."""
    if not table.is_live(cfg):
        return cfg
    reason = fallback_reason(cfg)
    if reason:
        say(f"raytrain-ddp: run.recovery=live falls back to run.recovery={table.FALLBACK}: {reason}")
        return table.falling_back(cfg)
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"run.recovery=live needs the torchft package ({exc}); install it with "
                          "pip install 'raytrain-ddp[live]', or set run.recovery=replica") from exc
    return cfg


def lighthouse_host() -> str:
    """Where torchft's servers listen: 127.0.0.1 in an instance this process started (embedded:
    one node, this machine), else this node's address as Ray knows it (its IP on a cluster).
    Not every interface (torchft's default): they serve without any token (docs/security.md).
    Not Ray's node address in the embedded instance either: Ray rewrites a node address of
    127.0.0.1 to the machine's primary one (docs/design.md#measurements-behind-the-code). The lighthouse runs on
    this node (Ray places it with the controller, which Ray Train puts on the driver's node);
    the workers bind their managers to the same answer for their node (`worker_env`)."""
    import ray

    return "127.0.0.1" if ray_compat.started_here() else ray.util.get_node_ip_address()


def worker_env(host: str) -> dict[str, str]:
    """What the workers need to reach a lighthouse bound to `host` (it advertises the host name)."""
    return {LIGHTHOUSE_HOST_ENV: host}


_BASE = TorchftConfig(lighthouse_kwargs={}).backend_cls  # Ray's torchft backend (its class has no public name)


class GuardedTorchftBackend(_BASE):  # type: ignore[misc, valid-type]
    """Ray's torchft backend, whose start of a group (or of a replacement) that a taken port failed
    is retried by Ray Train (the config's `guard`: `driver/startup.guarded_start`, issue #56)."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        backend_config.guard(self, lambda: _BASE.on_start(self, worker_group, backend_config), worker_group)


class GuardedTorchftConfig(TorchftConfig):
    """Ray's `TorchftConfig`, naming `GuardedTorchftBackend` and carrying its start guard."""

    def __init__(self, guard: Callable[..., None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.guard = guard

    @property
    def backend_cls(self) -> type:
        return GuardedTorchftBackend


class LiveDatasets(ray_compat.controller_callback_base()):  # type: ignore[misc]
    """Ray Train controller callback: a replacement worker reads the datasets the group started with.

    Ray 2.60 builds a new `DatasetManager` for every group it starts, sized by that group's
    workers; for a one-worker replacement that is a manager of world size 1, and the newcomer
    (world rank >= 1) fails in `get_dataset_shard` with `IndexError` (issue #28). For
    datasets that are not split (`data.sharding: exact`, the default; `sharded` reads no Ray
    dataset) every rank's iterator is the whole dataset, so the full group's provider serves a
    newcomer as it served its predecessor (`ray_compat.serve_partial_groups_whole_datasets`).
    Runs in the controller's process, patching Ray's callback there only, once.
    """

    def after_controller_start(self, train_run_context: Any) -> None:
        ray_compat.serve_partial_groups_whole_datasets()


class Live(SurvivorsCopy):
    """The driver half of `run.recovery: live`: Ray's torchft backend with a lighthouse on
    `lighthouse_host()`, its address in the workers' environment, and the survivors' copy (the
    fallback when no replacement comes) plus `LiveDatasets`."""

    resolve = staticmethod(resolve)

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.host = lighthouse_host()

    def env(self) -> dict[str, str]:
        return worker_env(self.host)

    def torch_config(self, own: Any, guard: Callable[..., None]) -> Any:
        """Ray Train's torchft backend: one replica group per worker, a lighthouse for all of them
        on `self.host`, the launcher's backend name and timeout."""
        lighthouse = {"bind": f"{bracketed(self.host)}:0", "min_replicas": int(self.cfg.scaling.num_workers),
                      "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS}
        return GuardedTorchftConfig(guard, lighthouse_kwargs=lighthouse, backend=own.backend, timeout_s=own.timeout_s)

    def callbacks(self) -> list[Any]:
        return [*super().callbacks(), LiveDatasets()]
