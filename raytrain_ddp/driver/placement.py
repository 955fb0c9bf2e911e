"""Will the worker group fit? Asked before an embedded Ray starts, and answered by the cluster.

Owns: what one worker asks Ray for (`worker_resources`), the check of this machine
before an embedded Ray starts (`check_machine`), and the wait for a cluster to place the
worker group before `TorchTrainer.fit` (`wait_for_placement`): its status lines, its
bound (`scaling.placement_timeout_s`), and the message saying which resource is missing.
Must not touch: training, the run directory, `summary.json` (the launcher records the
outcome).

Why a probe placement group before `fit`: Ray Train waits for its worker group
silently and forever (a group that does not fit is retried every minute, and the
autoscaler's "No available node types can fulfill resource request" repeats in the
log). Reserving the same bundles (`[resources per worker] x scaling.num_workers`, an
elastic run's minimum, placed by `scaling.placement_strategy`, PACK by default as in Ray
Train) ourselves first puts the waiting where we can see it, say what is missing and
stop it: a pending probe is removed on timeout or Ctrl-C, and nothing else of the run
has started yet. Once the probe is placed it is removed and Ray Train places the real
group on the same resources (an autoscaler has started the nodes by then).

A request no node type can ever hold fails at once when the cluster publishes its
node types (an autoscaler's cluster config); without one (a fixed cluster such as
`cluster/local-two-node.sh`) a node could still join, so the wait is bounded by the
timeout instead.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, TextIO

from raytrain_ddp.config import Config
from raytrain_ddp.config.checks import fmt_workers
from raytrain_ddp.errors import UserError

# Embedded Ray gets more logical CPUs than cores (see launcher.py); beyond this factor a
# request is not oversubscription any more but a machine that cannot run it.
CPU_OVERSUBSCRIPTION = 2
FIRST_STATUS_S = 5.0  # the first "still waiting" line comes early, then every STATUS_EVERY_S
STATUS_EVERY_S = 30.0
POLL_S = 1.0


class MachineTooSmall(UserError):
    """The embedded Ray instance of this machine could never place the worker group."""


class Unschedulable(Exception):
    """The cluster did not place the worker group in time (or never can): status 'unschedulable'."""


def worker_resources(cfg: Config) -> dict[str, float]:
    """What one training worker reserves from Ray (also what the probe asks for)."""
    return {"CPU": float(cfg.scaling.cpus_per_worker), **({"GPU": 1.0} if cfg.scaling.use_gpu else {})}


NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/gpus", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def _gpus_here() -> tuple[int, str]:
    """GPUs torch can use here. No GPU driver at all: 0, without the seconds `import torch` costs."""
    if not any(os.path.exists(p) for p in NVIDIA_DRIVER_FILES):
        return 0, "no GPU driver: none of " + ", ".join(NVIDIA_DRIVER_FILES[:3]) + " exists"
    import torch

    count = torch.cuda.device_count()
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count, build + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")


def check_machine(cfg: Config) -> None:
    """Embedded Ray: refuse, before Ray starts, a worker group this machine cannot hold."""
    s = cfg.scaling
    workers = s.min_workers
    join = "or join a cluster that has them (run.address or RAY_ADDRESS)"
    if s.use_gpu:
        gpus, where = _gpus_here()
        if gpus < workers:
            have = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
            raise MachineTooSmall(
                f"scaling.use_gpu=true needs one GPU per worker ({workers} for scaling.num_workers="
                f"{fmt_workers(s.num_workers)}) but this machine has {have} ({where}); set scaling.use_gpu=false"
                f"{f', lower scaling.num_workers to {gpus}' if gpus else ''}, {join}"
            )
    cores = os.cpu_count() or 1
    if s.cpus_per_worker > cores:
        raise MachineTooSmall(
            f"scaling.cpus_per_worker={s.cpus_per_worker:g} is more than this machine's {cores} CPU cores; "
            f"lower it, {join}"
        )
    wanted = workers * s.cpus_per_worker
    if wanted > CPU_OVERSUBSCRIPTION * cores:
        raise MachineTooSmall(
            f"scaling.num_workers={fmt_workers(s.num_workers)} x scaling.cpus_per_worker={s.cpus_per_worker:g} = "
            f"{wanted:g} CPUs, but this machine has {cores} cores (the local Ray instance allows "
            f"{CPU_OVERSUBSCRIPTION}x, {CPU_OVERSUBSCRIPTION * cores}); lower either, {join}"
        )
    if wanted > cores:  # runs, but every worker waits for a core: said once, with what fits
        batch, per = cfg.train.global_batch_size, cfg.train.micro_batch_size
        fits = max((w for w in range(1, int(cores // s.cpus_per_worker) + 1) if batch % (w * per) == 0), default=1)
        print(f"raytrain-ddp: warning: scaling.num_workers={fmt_workers(s.num_workers)} x scaling.cpus_per_worker="
              f"{s.cpus_per_worker:g} = {wanted:g} CPUs on this machine's {cores} cores: the workers will share them "
              f"and every step waits; {fits} fit: {command_with(f'scaling.num_workers={fits}')}",
              file=sys.stderr, flush=True)


def command_with(override: str) -> str:
    """This `raytrain-ddp` command with `override` in place of its key's own (the override alone
    when this process is not the CLI: a Python script's `train()` takes it as an override)."""
    import shlex

    key = override.split("=", 1)[0] + "="
    argv = sys.argv
    cli = os.path.basename(argv[0]) == "raytrain-ddp" or argv[0].endswith(os.path.join("raytrain_ddp", "__main__.py"))
    if not cli or len(argv) < 2:
        return override
    return shlex.join(["raytrain-ddp", *(a for a in argv[1:] if not a.startswith(key)), override])


def wait_for_placement(cfg: Config, out: TextIO = sys.stdout,
                       stop: Callable[[], bool] = lambda: False) -> Optional[str]:
    """Block until the cluster can place the worker group; None when it can, else why not.

    Prints a status line after FIRST_STATUS_S and then every STATUS_EVERY_S while waiting.
    `scaling.placement_timeout_s` bounds the wait (0: forever). `stop()` true (a Ctrl-C
    taken by the driver's handler) ends it within POLL_S with KeyboardInterrupt; either way
    the probe is removed.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    per_worker = worker_resources(cfg)
    workers = cfg.scaling.min_workers
    types = node_types()
    if types is not None and not any(_fits(t["resources"], per_worker) for t in types):
        largest = ", ".join(f"{t['name']} {_res(t['resources'])}" for t in types) or "none"
        return (f"no node type of this cluster can hold one worker {_res(per_worker)} "
                f"({_keys(per_worker)}); node types: {largest}. {_fix(per_worker)}")

    timeout = cfg.scaling.placement_timeout_s
    pg = placement_group([dict(per_worker) for _ in range(workers)], strategy=cfg.scaling.placement_strategy)
    started = time.monotonic()
    next_status = FIRST_STATUS_S
    try:
        # Waited on through `ray.wait` on the probe's ready-ref, not `pg.wait` (one synchronous
        # GCS call that checks no signals): `ray.wait` keeps its timeout on this side and lets
        # KeyboardInterrupt through.
        ready = pg.ready()
        while not ray.wait([ready], timeout=POLL_S)[0]:
            if stop():
                raise KeyboardInterrupt
            waited = time.monotonic() - started
            if timeout and waited >= timeout:
                return (f"the cluster did not place {workers} worker{'s' if workers > 1 else ''} x "
                        f"{_res(per_worker)} within {timeout:g}s (scaling.placement_timeout_s): "
                        f"{_missing(per_worker, workers)}. {_fix(per_worker)}, or raise "
                        "scaling.placement_timeout_s (0 waits forever)")
            if waited >= next_status:
                print(status_line(per_worker, workers, waited, timeout, types), file=out, flush=True)
                next_status += STATUS_EVERY_S
        return None
    finally:
        remove_placement_group(pg)


def status_line(per_worker: dict[str, float], workers: int, waited: float, timeout: float,
                types: Optional[list[dict[str, Any]]]) -> str:
    """One line: what is asked, what the cluster has now, who could add more, how long still."""
    scaler = (f"an autoscaler may add nodes ({len(types)} node types)" if types is not None
              else "no autoscaler: only a node joining by hand can add resources")
    bound = (f"giving up at {timeout:g}s (scaling.placement_timeout_s)" if timeout
             else "waiting without limit (scaling.placement_timeout_s=0)")
    return (f"raytrain-ddp: waiting {waited:.0f}s for the cluster to place {workers} x {_res(per_worker)} "
            f"({_keys(per_worker)}); cluster now: {_cluster_now(per_worker)}; {scaler}; {bound}")


# ------------------------------------------------------------------ what the cluster has


def node_types() -> Optional[list[dict[str, Any]]]:
    """The autoscaler's node types ({name, resources, max_count}), None when none are published.

    Read from the cluster config an autoscaler stores in the GCS (what Ray Train's own
    "insufficient cluster resources" check reads); a fixed cluster has none.
    """
    from raytrain_ddp.ray_compat import autoscaler_node_groups

    groups = autoscaler_node_groups()
    if groups is None:
        return None
    return [{"name": g.name, "resources": dict(g.resources), "max_count": g.max_count}
            for g in groups if g.max_count != 0]


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def _cluster_now(per_worker: dict[str, float]) -> str:
    import ray

    nodes = _alive_nodes()
    free, total = ray.available_resources(), ray.cluster_resources()
    parts = [f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"]
    for key in per_worker:
        largest = max((n.get(key, 0.0) for n in nodes), default=0.0)
        parts.append(f"{key} {free.get(key, 0.0):g} free of {total.get(key, 0.0):g} (largest node {largest:g})")
    return ", ".join(parts)


def _missing(per_worker: dict[str, float], workers: int) -> str:
    """Which resource is short, in the most specific words the cluster's state allows."""
    import ray

    nodes = _alive_nodes()
    for key, amount in per_worker.items():
        largest = max((n.get(key, 0.0) for n in nodes), default=0.0)
        if largest < amount:
            return (f"no node has {key} {amount:g} (largest: {key} {largest:g} on "
                    f"{len(nodes)} node{'s' if len(nodes) != 1 else ''})")
    free = ray.available_resources()
    for key, amount in per_worker.items():
        if free.get(key, 0.0) < amount * workers:
            return f"{key}: {free.get(key, 0.0):g} free, {amount * workers:g} needed (other work holds the rest)"
    return f"the free resources are not on nodes that hold whole workers ({_cluster_now(per_worker)})"


def _fits(node: dict[str, float], per_worker: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in per_worker.items())


def _res(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _keys(per_worker: dict[str, float]) -> str:
    keys = ["scaling.num_workers", "scaling.cpus_per_worker"] + (["scaling.use_gpu"] if "GPU" in per_worker else [])
    return ", ".join(keys)


def _fix(per_worker: dict[str, float]) -> str:
    lower = "scaling.cpus_per_worker" + (" or scaling.use_gpu" if "GPU" in per_worker else "")
    return f"Lower {lower} or scaling.num_workers, or add nodes that fit"
