"""The one typed configuration tree for a training run, and how it is loaded.

Owns nothing itself: it re-exports the public names of its modules, so that
`from raytrain_ddp.config import X` works everywhere. `schema.py` is the typed tree,
`checks.py` the cross-field checks, `load.py` YAML + overrides, `reference.py` the
docs/configuration.md table (`sweep.py` its sweep: section and the page). Must not touch:
Ray, torch (`import raytrain_ddp.config` stays light; a test enforces it).
"""

from raytrain_ddp.config.load import (
    STORAGE_ENV,
    apply_overrides,
    format_validation_error,
    load_config,
    parse_override,
    validate_config,
)
from raytrain_ddp.config.reference import config_keys, reference_table
from raytrain_ddp.config.schema import (
    BUILTIN_LOSSES,
    BUILTIN_MODELS,
    BUILTIN_OPTIMIZERS,
    BUILTIN_SCHEDULES,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    NonFiniteConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    ScalingConfig,
    SyntheticConfig,
    TrainConfig,
)
from raytrain_ddp.config.sweep import reference_markdown  # the page: with the sweep: section's keys

__all__ = [
    "STORAGE_ENV", "apply_overrides", "format_validation_error", "load_config", "parse_override",
    "validate_config", "config_keys", "reference_markdown", "reference_table", "BUILTIN_LOSSES",
    "BUILTIN_MODELS", "BUILTIN_OPTIMIZERS", "BUILTIN_SCHEDULES", "Config", "ConfigError", "DataConfig",
    "ModelConfig", "NonFiniteConfig", "ParallelConfig", "ProfileConfig", "RunConfig", "ScalingConfig",
    "SyntheticConfig", "TrainConfig",
]
