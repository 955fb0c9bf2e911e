"""The `sweep:` section of a config: what `raytrain-ddp sweep` searches, and how.

Owns: `SweepConfig` (every key typed and documented, in docs/configuration.md under
`sweep.`), the search-space entries (`{loguniform: [lo, hi]}`, ...), `load_sweep` (the
YAML's `sweep:` section apart from the training config it varies) and `check_space`:
every searched key is a config key and every value its distribution can draw is one the
key accepts -- one line naming the key, before Ray starts. Must not touch: Ray, torch
(Tune's objects are built from these in `raytrain_ddp/sweep/`).

Why a section beside `Config` and not inside it: a trial is a plain training run, its
config.yaml holds no sweep, and `train` takes the best trial's config as it is.
"""

from __future__ import annotations

import copy
import difflib
import itertools
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raytrain_ddp.config.load import apply_overrides, validate_config
from raytrain_ddp.config.reference import config_keys, reference_table
from raytrain_ddp.config.schema import Config, ConfigError

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
DICT_KEYS = ("model.kwargs", "train.optimizer_kwargs", "train.schedule_kwargs")  # their sub-keys may be searched


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AshaConfig(_Section):
    grace_period: int = Field(1, ge=1, description="ASHA: validations (epochs) every trial runs before it may "
                              "be stopped.")
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: 1/reduction_factor of the trials at a rung "
                                    "go on to the next.")


class SweepConfig(_Section):
    """How a sweep searches; the config around it is each trial's starting point."""

    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                                description="The sweep directory is `<run.storage_path>/<name>` (default: the "
                                "config's `name`); each trial's run directory is `trials/<trial id>` in it.")
    space: dict[str, dict[str, list[Any]]] = Field(
        default_factory=dict, description="The search space: `config.key: {kind: values}`, kind one of choice "
        "[a, b, ...], grid [a, b, ...] (every value, crossed with the other grids), uniform [low, high], "
        "loguniform [low, high], randint [low, high) -- e.g. `train.lr: {loguniform: [1.0e-4, 1.0e-2]}`.")
    metric: str = Field("val_loss", min_length=1, description="The validation metric trials are ranked and "
                        "stopped by (a key of the validation lines: val_loss, val_accuracy, your val_<name>).")
    mode: Literal["min", "max"] = Field("min", description="Whether a lower or a higher metric is better.")
    search: Literal["random", "grid"] = Field(
        "random", description="random: `num_trials` draws from the space (grid entries crossed, each "
        "`num_trials` times); grid: every combination once (choice entries count as grids; no continuous ones).")
    scheduler: Literal["asha", "none"] = Field("asha", description="asha: stop trials that are behind at each "
                                               "rung (Tune's ASHA, time in epochs); none: every trial runs to "
                                               "the end.")
    asha: AshaConfig = Field(default_factory=AshaConfig)
    num_trials: Optional[int] = Field(None, ge=1, description="Trials to run (random search; default 10). Grid "
                                      "search runs its grid once.")
    time_budget_s: Optional[float] = Field(None, gt=0, description="Wall-time budget of the sweep: no trial "
                                           "starts after it, running ones are stopped (they can be resumed).")
    max_concurrent_trials: Union[int, Literal["auto"]] = Field(
        "auto", description="Trials at once. auto: as many as the cluster holds now, from its CPUs (GPUs with "
        "scaling.use_gpu) and one trial's workers, said in the plan line; more than fit queue for workers "
        "(an autoscaling cluster adds them).")

    @field_validator("max_concurrent_trials")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if value != "auto" and value < 1:
            raise ValueError(f"must be 'auto' or at least 1 (got {value!r})")
        return value


def split_sweep(data: dict[str, Any], source: str) -> tuple[dict[str, Any], SweepConfig]:
    """(the training config's keys, the validated sweep section) of one YAML mapping."""
    data = copy.deepcopy(data)
    raw = data.pop("sweep", None) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid configuration in {source}: sweep: must be a mapping of keys")
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in ("sweep", *err["loc"]))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                section = AshaConfig if err["loc"][:1] == ("asha",) else SweepConfig
                msg = f"unknown key; allowed here: {', '.join(section.model_fields)}"
            problems.append(f"{key}: {msg}")
        raise ConfigError(f"invalid configuration in {source}: " + "; ".join(problems)) from None
    return data, sweep


def load_sweep(path: Optional[Union[str, Path]], overrides: list[str] = ()) -> tuple[Config, dict[str, Any], SweepConfig]:
    """The config file and `key=value` overrides (`sweep.x=...` among them) -> (the base
    Config, its plain data, the SweepConfig), the search space checked."""
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys")
    data = apply_overrides(copy.deepcopy(data), list(overrides))
    source = str(path) if path is not None else "<overrides>"
    base_data, sweep = split_sweep(data, source)
    base = _with_storage_env(paths_from_here(base_data), source)
    check_space(base, sweep)
    return base, base.model_dump(mode="json"), sweep


def paths_from_here(data: dict[str, Any]) -> dict[str, Any]:
    """`data.path` and `data.val_path` relative to where the command ran, as `train` reads them:
    a trial runs in Tune's own working directory, so each gets the absolute path."""
    section = data.get("data") or {}
    for key in ("path", "val_path"):
        value = section.get(key)
        if isinstance(value, str) and value and "://" not in value and not Path(value).expanduser().is_absolute():
            section = {**section, key: str(Path.cwd() / value)}
    return {**data, "data": section} if section else data


def _with_storage_env(data: dict[str, Any], source: str) -> Config:
    """Validated as `load_config` does: $RAYTRAIN_DDP_STORAGE_PATH unless the file sets it."""
    import os

    from raytrain_ddp.config.load import STORAGE_ENV

    storage = os.environ.get(STORAGE_ENV)
    if storage and "storage_path" not in (data.get("run") or {}):
        data = {**data, "run": {**(data.get("run") or {}), "storage_path": storage}}
    return validate_config(data, source)


def _is_key(key: str) -> bool:
    return key in config_keys() or any(key.startswith(d + ".") and len(key) > len(d) + 1 for d in DICT_KEYS)


def check_space(cfg: Config, sweep: SweepConfig) -> None:
    """Refuse a launcher a sweep cannot run with (its row of launch/table.py), a space that is not
    config keys, or values its key refuses: one line naming it."""
    from raytrain_ddp.launch.table import sweep_refusal

    if refused := sweep_refusal(cfg):
        raise ConfigError(refused)
    keys, base = config_keys(), cfg.model_dump(mode="json")
    for key, entry in sweep.space.items():
        where = f"sweep.space.{key}"
        if key in ("name", "run.storage_path") or key.startswith("sweep"):
            raise ConfigError(f"{where}: {key} is set by the sweep for each trial and cannot be searched")
        if not _is_key(key):
            near = difflib.get_close_matches(key, keys, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else "; see docs/configuration.md"
            raise ConfigError(f"{where}: {key!r} is not a config key{hint}")
        if len(entry) != 1 or next(iter(entry)) not in KINDS:
            raise ConfigError(f"{where}: must be one of {{{': [...]}, {'.join(KINDS)}: [...]}} (got {entry!r})")
        kind, values = next(iter(entry.items()))
        for value in _drawable(where, kind, values, sweep.search):
            _accepted(base, key, value, where)
    data = base.get("data", {})
    if sweep.metric.startswith("val_") and not data.get("val_fraction") and not data.get("val_path") and not any(
            value for value in next(iter(sweep.space.get("data.val_fraction", {None: [0]}).values()))):
        raise ConfigError(f"sweep.metric: {sweep.metric} comes from validation, but data.val_fraction=0 and no "
                          "data.val_path hold out any rows, so no trial could ever be ranked; set data.val_fraction "
                          "(e.g. 0.2) or data.val_path")
    if sweep.search == "grid" and sweep.num_trials is not None:
        raise ConfigError("sweep.num_trials: grid search runs every combination of its grid once; leave "
                          "num_trials unset (or use search: random)")


def _drawable(where: str, kind: str, values: list[Any], search: str) -> list[Any]:
    """The values to check: each choice, or both ends of a range."""
    if kind in ("choice", "grid"):
        if not values:
            raise ConfigError(f"{where}: {kind} needs at least one value")
        return list(values)
    if search == "grid":
        raise ConfigError(f"{where}: {kind} is continuous; grid search takes choice or grid entries only")
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: {kind} takes [low, high] numbers (got {values!r})")
    low, high = values
    if not low < high:
        raise ConfigError(f"{where}: {kind} needs low < high (got {values!r})")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0 (got {values!r})")
    if kind == "randint":
        if not (isinstance(low, int) and isinstance(high, int)):
            raise ConfigError(f"{where}: randint takes integers [low, high) (got {values!r})")
        return [low, high - 1]
    return [low, high]


def _accepted(base: dict[str, Any], key: str, value: Any, where: str) -> None:
    data = with_values(base, {key: value})
    try:
        validate_config(data, where)
    except ConfigError as exc:
        raise ConfigError(f"{where}: the value {value!r} is refused: "
                          f"{str(exc).split(': ', 1)[-1]}") from None


def with_values(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`base` with each dotted key set to its value (the trial's config data)."""
    data = copy.deepcopy(base)
    for key, value in values.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = copy.deepcopy(value)
    return data


def grid_size(sweep: SweepConfig) -> int:
    """Combinations of the grid entries (choice entries too under grid search)."""
    grids = [v for e in sweep.space.values() for k, v in e.items()
             if k == "grid" or (k == "choice" and sweep.search == "grid")]
    return len(list(itertools.product(*grids))) if grids else 1


def planned_trials(sweep: SweepConfig) -> int:
    """How many trials the sweep runs (its budget in trials; wall time may end it earlier)."""
    if sweep.search == "grid":
        return grid_size(sweep)
    return (sweep.num_trials or 10) * grid_size(sweep)


def reference_markdown() -> str:
    """docs/configuration.md's table: every training key, then the `sweep:` section's (`raytrain-ddp sweep` only)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | `{default}` | {desc} |"
              for key, default, desc in reference_table() + reference_table(SweepConfig, "sweep.")]
    return "\n".join(lines)
