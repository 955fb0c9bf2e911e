"""User models through every strategy, without Ray: the examples' ResNet (BatchNorm, (x, y)
batches) and byte GPT (dict batches, keyword inputs, the user's loss).

The product's own pieces run on each rank — `user.resolve` (import paths next to the
example's YAML), `user.check_pipeline` (the spec), `WorkerData` (exact sharding of dict
and tuple batches, from a stand-in for Ray Data's shard), `build_state`, `train_step` —
and after two optimizer steps every strategy on 2 ranks (accumulation 2) holds the
parameters of one process that trained the same global batches (accumulation 4).
One spawn of 2 ranks for all three strategies and both models.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _spawn import run_ranks
from raytrain_ddp.config import load_config
from raytrain_ddp.job import DataSpec, Job
from raytrain_ddp.parallel import REPLICATED_STRATEGIES
from raytrain_ddp.user import check_pipeline, resolve
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.data.worker_data import TRAIN, WorkerData
from raytrain_ddp.worker.state import build_state
from raytrain_ddp.worker.step import train_step

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
STEPS = 2
# SGD, not the examples' AdamW: Adam's first steps move every weight by about +-lr whatever
# its gradient's size, so a BatchNorm weight whose gradient is ~1e-9 flips with the order
# of a float sum (2 ranks x 2 micro-batches vs 4 in a row) and the comparison measured
# that, not the wrappers (3.3e-4 on a 0.088 conv weight, at the last landed commit too, with
# the dependency versions a fresh install takes in December 2026). SGD's
# update is linear in the gradient, so the tolerance below checks the gradients themselves.
SETTINGS = ["train.global_batch_size=32", "train.micro_batch_size=8", "train.warmup_steps=0", "data.shuffle=true",
            "train.optimizer=sgd"]


class _Shard:
    """What `WorkerData` reads from Ray Data: `iter_batches` of numpy dicts."""

    def __init__(self, batch: dict[str, np.ndarray]) -> None:
        self.batch = batch

    def iter_batches(self, batch_size: int, batch_format: str):
        n = len(next(iter(self.batch.values())))
        for start in range(0, n, batch_size):
            yield {k: v[start:start + batch_size] for k, v in self.batch.items()}


def _raw(example: str) -> dict[str, np.ndarray]:
    """64 raw rows as Ray Data hands them to data.preprocess."""
    if example == "images":
        from sklearn.datasets import load_digits

        import digits_png

        digits = load_digits()
        return {"png": np.array([digits_png.render(img) for img in digits.images[:64]], dtype=object),
                "label": digits.target[:64].astype(np.int64)}
    import sysconfig

    files = [f for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")) if f.stat().st_size > 3000][:3]
    return {"path": np.array([f.name for f in files], dtype=object),
            "text": np.array([f.read_bytes()[:3000] for f in files], dtype=object)}


def _config(example: str, strategy: str, world_size: int):
    config = EXAMPLES / example / "config.yaml"
    extra = ["model.kwargs={width: 32, layers: 1, heads: 2}"] if example == "text" else []
    cfg = load_config(config, [*SETTINGS, *extra, f"parallel.strategy={strategy}", f"scaling.num_workers={world_size}"])
    return resolve(cfg, config_path=config)


def _data(example: str) -> tuple[DataSpec, dict[str, np.ndarray]]:
    """The spec the driver would compute, and the rows after data.preprocess."""
    cfg, code = _config(example, "naive", 1)
    raw = _raw(example)
    spec = DataSpec("other", (), 10 if example == "images" else 0, 0, 0, example)
    spec = check_pipeline(cfg, code, {k: v[:8] for k, v in raw.items()}, spec).spec
    rows = code.preprocess(raw)
    return dataclasses.replace(spec, train_rows=len(rows[cfg.data.label])), rows


def _train(world_rank: int, world_size: int, example: str, strategy: str, data_and_spec) -> list[torch.Tensor]:
    sys.path[:0] = [str(EXAMPLES / "images"), str(EXAMPLES / "text")]
    cfg, code = _config(example, strategy, world_size)
    spec, rows = data_and_spec
    rank = Rank(world_rank, world_size, 0, torch.device("cpu"))
    data = WorkerData(cfg, spec, world_rank, world_size, rank.device, shards={TRAIN: _Shard(rows)})
    job = Job(cfg=cfg, spec=spec, run_dir="/nonexistent", fit_id="f" * 32, user_code=code.dumps())
    state = build_state(job, rank, total_steps=STEPS)
    windows = data.train_windows(epoch=0)
    for _ in range(STEPS):
        window = next(windows)
        assert len(window) == data.accumulation_steps and isinstance(window[0], dict if example == "text" else tuple)
        train_step(state, window, data.accumulation_steps, cfg.train, rank)
    return [p.detach().clone() for p in state.module.parameters()]


def _all_strategies(world_rank: int, world_size: int, data: dict) -> dict[tuple[str, str], list[torch.Tensor]]:
    return {(example, strategy): _train(world_rank, world_size, example, strategy, data[example])
            for example in ("images", "text") for strategy in REPLICATED_STRATEGIES}


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


def test_every_strategy_trains_user_models_like_one_process(one_rank_group, monkeypatch):
    for example in ("images", "text"):
        monkeypatch.syspath_prepend(str(EXAMPLES / example))
    data = {example: _data(example) for example in ("images", "text")}
    reference = {example: _train(0, 1, example, "naive", data[example]) for example in ("images", "text")}
    ranks = run_ranks(_all_strategies, 2, data, timeout_s=150, threads=1)
    for (example, strategy), params in ranks[0].items():
        assert len(params) == len(reference[example])
        for got, want, other in zip(params, reference[example], ranks[1][(example, strategy)]):
            assert torch.equal(got, other), (example, strategy)  # ranks agree exactly
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{example} {strategy}")
