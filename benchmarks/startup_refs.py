"""The `startup` section's two references (issue #39), each run as its own command on the
quickstart's job: the same CNN, digits split, global batch 64 = 2 ranks x 16 x 2, AdamW,
warm-up and cosine, 264 steps.

`torchrun_rank` (under `python -m torch.distributed.run --nproc_per_node=2 -m
benchmarks.startup_refs torchrun OUT`): a plain torch DDP script, as a user writes one.
`bare_trainer` (`python -m benchmarks.startup_refs bare OUT`): a bare two-worker Ray Train
`TorchTrainer` on an embedded instance (or, with `RAY_ADDRESS` set, joining that running head)
whose loop only wraps a linear layer in torch DDP and takes one AdamW step (no data, nothing
of ours): Ray Train's own start.
Each writes one JSON object to OUT (rank 0): wall-clock `first_step_t`, `last_step_t`, and
the torchrun script's `step_ms` (every step's time after the first).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "configs" / "quickstart.yaml"


def torchrun_rank(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raytrain_ddp.config import load_config
    from raytrain_ddp.data.columns import arrow_numpy
    from raytrain_ddp.data.sources import bundled_tables
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.models import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(QUICKSTART)
    tables = bundled_tables(cfg)
    columns = arrow_numpy(tables.train)
    x = torch.as_tensor(columns[cfg.data.features], dtype=torch.float32).reshape(-1, *tables.shape)
    y = torch.as_tensor(columns[cfg.data.label], dtype=torch.long)
    torch.manual_seed(cfg.train.seed)
    spec = DataSpec(tables.task, tuple(tables.shape), int(tables.classes), len(y), 0, "digits")
    model = DDP(build_model(cfg, spec))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    micro, accum = cfg.train.micro_batch_size, cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)
    steps_per_epoch = len(y) // cfg.train.global_batch_size
    total = steps_per_epoch * cfg.train.epochs
    warm = cfg.train.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if s < warm else
                                              0.05 + 0.95 * 0.5 * (1 + torch.cos(torch.tensor(3.14159265 * (s - warm) / max(1, total - warm))).item()))
    times, first = [], None
    step = 0
    for epoch in range(cfg.train.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(cfg.train.seed + epoch))
        for s in range(steps_per_epoch):
            began = time.perf_counter()
            rows = order[s * cfg.train.global_batch_size:(s + 1) * cfg.train.global_batch_size]
            mine = rows[rank::world]
            for k in range(accum):
                idx = mine[k * micro:(k + 1) * micro]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx]) / accum
                if k < accum - 1:
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if first is None:
                first = time.time()
            else:
                times.append(1e3 * (time.perf_counter() - began))
    last = time.time()
    if rank == 0:
        Path(out).write_text(json.dumps({"first_step_t": first, "last_step_t": last, "step_ms": times,
                                         "steps": step, "loss": float(loss.item() * accum)}))
    dist.destroy_process_group()


def bare_trainer(out: str) -> None:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    def loop(config: dict) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(8, 8))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if dist.get_rank() == 0:
            Path(config["out"]).write_text(json.dumps({"first_step_t": time.time()}))

    import os

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
    else:
        ray.init(address="local", num_cpus=4, logging_level="WARNING", include_dashboard=True,
                 dashboard_host="127.0.0.1")
    try:
        TorchTrainer(loop, train_loop_config={"out": out},
                     scaling_config=ray.train.ScalingConfig(num_workers=2),
                     run_config=ray.train.RunConfig(storage_path=str(Path(out).parent / "ray_results"))).fit()
    finally:
        ray.shutdown()
    record = json.loads(Path(out).read_text())
    Path(out).write_text(json.dumps({**record, "last_step_t": record["first_step_t"]}))


if __name__ == "__main__":
    {"torchrun": torchrun_rank, "bare": bare_trainer}[sys.argv[1]](sys.argv[2])
