"""raytrain_ddp: data-parallel PyTorch training on Ray clusters.

The package is layered so data flows one way: cli -> config -> launcher -> loop ->
{parallel, data, checkpoint, metrics}. `raytrain_ddp.parallel` depends on torch only.

The public Python API, imported on first use (`import raytrain_ddp` loads neither torch
nor Ray):

    train(config, *, model=, loss=, datasets=, preprocess=)   train; returns the summary
    prepare_job(...)                  the inputs of your own TorchTrainer for our loop
    sweep(config, *, overrides=)      a hyperparameter sweep on Ray Tune; returns its outcome
    train_loop_per_worker             that per-worker loop
    load_model(path)                  a model written by `raytrain-ddp export`
    wrap_model(module, strategy)      the data-parallel wrappers (torch only)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "train": "raytrain_ddp.api",
    "prepare_job": "raytrain_ddp.api",
    "sweep": "raytrain_ddp.api",
    "train_loop_per_worker": "raytrain_ddp.worker.loop",
    "load_model": "raytrain_ddp.export",
    "wrap_model": "raytrain_ddp.parallel",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raytrain_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
