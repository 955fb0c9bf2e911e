"""The `checkpoint` section: how long one checkpoint holds the step loop, sync vs async upload.

Owns: a `TorchTrainer` run whose workers save checkpoints through the product's own
path (`worker.checkpointer.report_checkpoint`: rank 0 serialises the state into a
staging directory, every rank calls `ray.train.report`), timing each call on rank 0, for
two states: the quickstart's (its CNN with AdamW moments, RNG streams, progress and
config, as a training checkpoint holds them; ~2 MB) and one of >= 100 MB (a 26 M
parameter model). Must not touch: the training loop, the run directory of any run.

How: one run, both states, synchronous and asynchronous uploads interleaved
(sync, async, sync, ...) so drift on a shared machine hits both alike. Between two
checkpoints every worker "trains" for `gap_s` (sleeps): that is the time a background
upload has, as it would behind real steps; the quickstart checkpoints once per epoch,
every ~0.3 s of training on this machine, larger runs far less often. Storage is a local
temporary directory (an upload is a copy). `fit_s` is the whole run, including Ray's
wait for the last uploads before the workers finish.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp.ops.bench.common import Sizes, ratio, stats

LARGE_FEATURES = 5120  # Linear(5120, 5120): 26.2 M parameters, 105 MB in fp32
GAP_S = 1.0


def _quickstart_state(step: int) -> dict[str, Any]:
    import torch

    from raytrain_ddp import checkpoint as ckpt
    from raytrain_ddp.config import load_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.models import build_model

    cfg = load_config(None, ["model.name=cnn", "train.optimizer=adamw"])
    model = build_model(cfg, DataSpec("classification", (1, 8, 8), 10, 1438, 359, "digits"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()  # the moments exist, as after any step
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "progress": {"step": step, "epoch": 0, "steps_into_epoch": step, "nonfinite_steps": 0},
            "rng": ckpt.rng_state(), "run": {"world_size": 2, "config": cfg.to_yaml(), "fit_id": "bench"}}


def _large_state(step: int) -> dict[str, Any]:
    import torch

    model = torch.nn.Linear(LARGE_FEATURES, LARGE_FEATURES)
    return {"model": model.state_dict(), "optimizer": {},
            "progress": {"step": step, "epoch": 0, "steps_into_epoch": step}, "run": {"fit_id": "bench"}}


STATES = {"quickstart": _quickstart_state, "large": _large_state}


def train_fn(config: dict) -> None:
    import torch
    import ray.train

    from raytrain_ddp.worker.checkpointer import report_checkpoint

    torch.set_num_threads(1)
    main = ray.train.get_context().get_world_rank() == 0
    blocked: dict[str, dict[str, list[float]]] = {}
    sizes: dict[str, int] = {}
    index = 0
    for state_name in config["states"]:
        state = STATES[state_name](0) if main else None  # built once: the model does not change
        if main:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            sizes[state_name] = len(buffer.getvalue())  # what state.pt holds
            del buffer
        for i in range(2 * config["per_mode"]):
            mode = "sync" if i % 2 == 0 else "async"
            time.sleep(config["gap_s"])  # the steps between two checkpoints
            index += 1
            started = time.perf_counter()
            report_checkpoint((lambda: state) if main else None, {"step": index},
                              f"checkpoint_{index:08d}_{state_name}_{mode}", asynchronous=mode == "async")
            took = time.perf_counter() - started
            blocked.setdefault(state_name, {}).setdefault(mode, []).append(took)
    if main:
        Path(config["out"]).write_text(json.dumps({"blocked_s": blocked, "state_bytes": sizes}))


def run(sizes: Sizes, world_size: int = 2, log=print) -> dict[str, Any]:
    """Needs `ray.init` done by the caller."""
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_ddp import checkpoint as ckpt

    per_mode = {"smoke": 1, "quick": 3}.get(sizes.name, 6)
    log(f"  checkpoint: blocked time per checkpoint, sync vs async upload, {per_mode} of each per state "
        f"(quickstart, {LARGE_FEATURES ** 2 * 4 / 1e6:.0f} MB) ...")
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-ckpt-") as tmp:
        config = {"states": list(STATES), "per_mode": per_mode, "gap_s": GAP_S, "out": str(Path(tmp) / "out.json")}
        started = time.perf_counter()
        TorchTrainer(
            train_fn, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=world_size, use_gpu=False, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=str(Path(tmp) / "storage"), name="checkpoint",
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        ).fit()
        fit_s = time.perf_counter() - started
        data = json.loads(Path(config["out"]).read_text())
        kept = ckpt.find_checkpoints(Path(tmp) / "storage" / "checkpoint")
        verified = sum(1 for p in kept if ckpt.load_latest_valid([p]) is not None)
    states = {}
    for name, modes in data["blocked_s"].items():
        sync, async_ = stats(modes["sync"]), stats(modes["async"])
        states[name] = {"state_mb": data["state_bytes"][name] / 1e6, "sync": sync, "async": async_,
                        "async_over_sync": ratio(async_["median"], sync["median"])}
    return {"world_size": world_size, "gap_s": GAP_S, "per_mode": per_mode, "states": states, "fit_s": fit_s,
            "kept_verified": verified, "kept": len(kept),
            "note": "seconds ray.train.report (with the state's serialisation) held rank 0's step loop; "
                    "medians over interleaved sync/async checkpoints; storage is a local directory"}


def main(argv: Optional[list[str]] = None) -> int:
    """This section alone: `python -m raytrain_ddp.ops.bench.checkpoint [--quick] [--out FILE]`."""
    import argparse

    import ray

    from raytrain_ddp.ops.bench import report, suite
    from raytrain_ddp.ops.bench.common import FULL, QUICK

    parser = argparse.ArgumentParser(prog="python -m raytrain_ddp.ops.bench.checkpoint")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="JSON results file")
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else "full"
    results: dict[str, Any] = {"meta": suite._meta(preset, "cpu")}
    suite._start_ray(num_cpus=4)
    try:
        results["checkpoint"] = run(QUICK if args.quick else FULL, log=suite._log)
    finally:
        ray.shutdown()
    results["targets"] = report.verdicts(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(report.markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
