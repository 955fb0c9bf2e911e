"""What Ray Train's orchestration costs: one training function, two launchers.

Owns: the `ray_overhead` section: `train_fn` (forward / backward / step on a fixed model
over the gloo group it finds already initialised) run (a) by plain `torch.distributed`
processes started like torchrun does (fresh interpreters, env:// rendezvous on
127.0.0.1) and (b) by Ray Train's `TorchTrainer` with the same number of workers.
Must not touch: the product's launcher or loop (this isolates orchestration from them).

Both measure the same way: steady-state step time inside the function (rank 0,
warm-up excluded; the all-reduce keeps ranks in step), and start-up time = wall clock
from the driver's launch call to the end of the first step (processes, imports, process
group, model, first step). The Ray instance is started once before (clusters are
long-lived); `ray.init` time is reported separately. Runs alternate plain / Ray so drift
hits both alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Sizes, free_port, ratio, stats
from raytrain_ddp.parallel import registry


def train_fn(config: dict) -> None:
    """The function both launchers run; results go to a file (Ray V2 keeps metrics only with checkpoints)."""
    import torch
    import torch.distributed as dist

    from benchmarks.strategies import build_model, make_batch
    from raytrain_ddp.models import cross_entropy
    from raytrain_ddp.parallel import wrap_model

    torch.set_num_threads(1)
    world_rank, world_size = dist.get_rank(), dist.get_world_size()
    base = build_model("mlp")
    model = wrap_model(base, config["strategy"], bucket_cap_mb=25.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_batch(base, "mlp", config["batch"], seed=3000 + world_rank, device=torch.device("cpu"))
    step_ms, first_step_end = [], None
    for step in range(config["warmup"] + config["steps"]):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x), y).backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if first_step_end is None:
            first_step_end = time.time()
        if step >= config["warmup"]:
            step_ms.append(elapsed * 1e3)
    dist.barrier()
    if world_rank == 0:
        out = Path(config["out"])
        out.write_text(json.dumps({"step_ms": step_ms, "first_step_end": first_step_end,
                                   "world_size": world_size, "threads": torch.get_num_threads()}))


def _worker_main(world_rank: int, world_size: int, port: int, config_json: str) -> None:
    """Entry of one plain torch.distributed process (what torchrun would start)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(world_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(world_rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    train_fn(json.loads(config_json))
    dist.barrier()
    dist.destroy_process_group()


def run_plain(config: dict, world_size: int, timeout_s: float = 300.0) -> dict[str, Any]:
    port = free_port()
    launched = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.ray_overhead", str(r),
                               str(world_size), str(port), json.dumps(config)], env=env)
             for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"plain torch.distributed run did not finish within {timeout_s:.0f}s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"plain torch.distributed ranks exited with codes {codes}")
    return _read(config["out"], launched)


def run_ray(config: dict, world_size: int, storage: str) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    launched = time.time()
    trainer = TorchTrainer(
        train_fn, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=world_size, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=storage, name=f"ray_overhead_{int(launched * 1000)}"),
    )
    trainer.fit()
    return _read(config["out"], launched)


def _read(path: str, launched: float) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    return {"step_ms": data["step_ms"], "startup_s": data["first_step_end"] - launched,
            "threads": data["threads"]}


def run(sizes: Sizes, world_size: int = 2, rounds: int = 1, strategy: str = registry.DEFAULT,
        ray_init_s: float = float("nan"), log=print) -> dict[str, Any]:
    """Needs `ray.init` done by the caller (its time is passed in as `ray_init_s`)."""
    log(f"  ray_overhead: plain torch.distributed vs TorchTrainer, {world_size} workers x {rounds} round(s) ...")
    plain_steps, ray_steps, plain_start, ray_start = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp:
        for r in range(rounds):
            config = {"strategy": strategy, "batch": sizes.mlp_batch, "warmup": sizes.ray_warmup,
                      "steps": sizes.ray_steps}
            order = ("plain", "ray") if r % 2 == 0 else ("ray", "plain")
            for kind in order:
                config["out"] = str(Path(tmp) / f"{kind}-{r}.json")
                if kind == "plain":
                    res = run_plain(config, world_size)
                    plain_steps += res["step_ms"]
                    plain_start.append(res["startup_s"])
                else:
                    res = run_ray(config, world_size, storage=str(Path(tmp) / "ray"))
                    ray_steps += res["step_ms"]
                    ray_start.append(res["startup_s"])
    plain, ray_ = stats(plain_steps), stats(ray_steps)
    return {
        "model": "mlp", "strategy": strategy, "world_size": world_size, "per_rank_batch": sizes.mlp_batch,
        "threads_per_rank": 1, "rounds": rounds, "steps_per_run": sizes.ray_steps,
        "plain_step_ms": plain["median"], "ray_step_ms": ray_["median"],
        "ray_over_plain": ratio(ray_["median"], plain["median"]),
        "plain_spread_ms": plain, "ray_spread_ms": ray_,
        "plain_startup_s": stats(plain_start)["median"], "ray_startup_s": stats(ray_start)["median"],
        "ray_init_s": ray_init_s,
        "startup_note": "launch call to end of first step; Ray instance already running (ray_init_s separate)",
    }


if __name__ == "__main__":  # one plain torch.distributed rank: RANK WORLD PORT CONFIG_JSON
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
