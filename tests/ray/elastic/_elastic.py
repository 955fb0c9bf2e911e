"""Helpers of the elastic tests: one config, checkpoint states, parameter differences.

The reference run is trained once per session; every other run (2 and 4 workers, a
resize, a preemption) must end on the same parameters. The config is the tiny digits MLP
with SGD + momentum in fp32, global batch 64 = micro 16 x {1, 2, 4} workers x {4, 2, 1}
accumulation steps, 12 optimizer steps (inside the first epoch of 22), and a checkpoint
every 6 steps. Workers take half a logical CPU each so 4 of them fit in the session
Ray instance (4 logical CPUs) with room left for Ray Data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config, load_config

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"
STEPS = 12
ATOL = 1e-5


def elastic_cfg(storage: Path, name: str, *overrides: str) -> Config:
    return load_config(TINY, [
        f"run.storage_path={storage}", f"name={name}", "train.optimizer=sgd", "train.precision=fp32",
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "scaling.cpus_per_worker=0.5",
        "run.checkpoint_every_steps=6", "run.log_every_steps=1", "run.num_to_keep=4", *overrides,
    ])


def states_by_step(run_dir: Path) -> dict[int, dict]:
    return {int(s["progress"]["step"]): s for s in (ckpt.load_checkpoint(p) for p in ckpt.find_checkpoints(run_dir))}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def optimizer_difference(a: dict, b: dict) -> float:
    """Largest difference between two optimizer states' tensors (momentum buffers)."""
    diffs = [0.0]
    for (ka, sa), (kb, sb) in zip(sorted(a["state"].items()), sorted(b["state"].items())):
        assert ka == kb and sa.keys() == sb.keys()
        diffs += [(sa[n].double() - sb[n].double()).abs().max().item()
                  for n in sa if isinstance(sa[n], torch.Tensor) and sa[n].dim() > 0]
    return max(diffs)


@dataclass(frozen=True)
class Reference:
    summary: dict
    states: dict[int, dict]  # step -> checkpoint state
