"""What `raytrain-ddp config` prints: the keys that apply to this config, and which do not.

Owns: the rules that say when a key has an effect (`model.d_model` only for `gpt`,
`data.path` only for parquet, `train.momentum` only for `sgd`, ...). Must not touch: the
config itself (config.yaml in a run directory keeps every key, so a run is reproducible
whatever its defaults become), validation.
"""

from __future__ import annotations

from typing import Any, Callable

import yaml

from raytrain_ddp.config import BUILTIN_MODELS, BUILTIN_OPTIMIZERS, BUILTIN_SCHEDULES, Config
from raytrain_ddp.parallel import registry


def _strategy_takes(cfg: Config, option: str) -> bool:
    return option in registry.get(cfg.parallel.strategy, "parallel.strategy").options


# key -> when it has an effect. A key not listed always applies.
APPLIES: dict[str, Callable[[Config], bool]] = {
    "model.kwargs": lambda c: c.model.name not in BUILTIN_MODELS,
    "model.hidden_sizes": lambda c: c.model.name == "mlp",
    "model.d_model": lambda c: c.model.name == "gpt",
    "model.n_layers": lambda c: c.model.name == "gpt",
    "model.n_heads": lambda c: c.model.name == "gpt",
    "model.dropout": lambda c: c.model.name in BUILTIN_MODELS,
    "data.path": lambda c: c.data.source == "parquet",
    "data.val_path": lambda c: c.data.source == "parquet",
    "data.val_fraction": lambda c: c.data.val_path is None,
    "data.shuffle_buffer": lambda c: c.data.sharding == "streaming",
    "data.chunk_rows": lambda c: c.data.sharding == "sharded",
    "data.synthetic": lambda c: c.data.source == "synthetic",
    "data.synthetic.seq_len": lambda c: c.model.name == "gpt",
    "data.synthetic.feature_dim": lambda c: c.model.name != "gpt",
    "train.epochs": lambda c: c.train.max_steps is None,
    "train.optimizer_kwargs": lambda c: c.train.optimizer not in BUILTIN_OPTIMIZERS,
    "train.no_decay": lambda c: c.train.optimizer in BUILTIN_OPTIMIZERS,
    "train.weight_decay": lambda c: c.train.optimizer in BUILTIN_OPTIMIZERS,
    "train.momentum": lambda c: c.train.optimizer == "sgd",
    "train.schedule_kwargs": lambda c: c.train.schedule not in BUILTIN_SCHEDULES,
    "train.warmup_steps": lambda c: c.train.schedule in BUILTIN_SCHEDULES,
    "train.min_lr_ratio": lambda c: c.train.schedule in ("cosine", "linear"),
    # parallel.*: the options the strategy's row of the registry takes (parallel/registry.py)
    "parallel.bucket_cap_mb": lambda c: _strategy_takes(c, "bucket_cap_mb"),
    "parallel.first_bucket_mb": lambda c: _strategy_takes(c, "first_bucket_mb"),
    "parallel.compress": lambda c: _strategy_takes(c, "compress"),
    "parallel.shm": lambda c: _strategy_takes(c, "shm") and not c.scaling.use_gpu,
    "scaling.resize_interval_s": lambda c: isinstance(c.scaling.num_workers, tuple),
    "run.expected_mtbf_s": lambda c: c.run.checkpoint_every_steps == "auto",
}


def applicable(cfg: Config) -> tuple[dict[str, Any], list[str]]:
    """(the config as a nested dict of the keys that apply, the dotted keys left out)."""
    data = yaml.safe_load(cfg.to_yaml())
    left_out: list[str] = []

    def prune(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        kept = {}
        for name, value in node.items():
            key = f"{prefix}{name}"
            rule = APPLIES.get(key)
            if rule is not None and not rule(cfg):
                left_out.append(key)
                continue
            kept[name] = prune(value, key + ".") if isinstance(value, dict) and key not in _LEAF_DICTS else value
        return kept

    return prune(data, ""), left_out


_LEAF_DICTS = {"model.kwargs", "train.optimizer_kwargs", "train.schedule_kwargs"}  # values, not sections


def render(cfg: Config) -> str:
    """The YAML of the keys that apply, then one comment line naming those left out."""
    kept, left_out = applicable(cfg)
    text = yaml.safe_dump(kept, sort_keys=False)
    if left_out:
        text += (f"# not shown, no effect with these choices: {', '.join(left_out)} "
                 "(raytrain-ddp config --all prints every key)\n")
    return text
