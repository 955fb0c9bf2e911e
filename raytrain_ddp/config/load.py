"""Loading a config: YAML file, then the environment's storage path, then `a.b=c` overrides.

Owns: reading the YAML file (the only file this package reads), parsing overrides, and
turning pydantic's errors into one `ConfigError` line naming every offending key. Must
not touch: Ray, torch; the schema itself (`schema.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_ddp.config.schema import Config, ConfigError

STORAGE_ENV = "RAYTRAIN_DDP_STORAGE_PATH"  # run.storage_path when the config does not set it


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (['a', 'b'], parsed c). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. train.lr=0.01)")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key; use key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(f"override {key}={raw!r}: value is not valid YAML ({problem})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None and not _holds_a_value(path[:depth + 1]):
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(path[:depth + 1])} is a value, not a section"
                )
            node = child
        node[path[-1]] = value
    return data


def _holds_a_value(path: list[str]) -> bool:
    """Whether the schema makes `path` a key that holds a value (not a section, nor a mapping)."""
    ann: Any = Config
    for part in path:
        field = ann.model_fields.get(part) if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if field is None:
            return False
        ann = field.annotation
    return not (isinstance(ann, type) and issubclass(ann, BaseModel)) and dict not in (
        get_origin(ann), *map(get_origin, get_args(ann)))


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> Config:
    """Read YAML (or start from defaults), apply overrides, validate; errors name the key."""
    return validate_config(read_config(path, overrides), source=str(path) if path else "<overrides>")


def read_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """The YAML with the overrides applied, not validated: the keys a user set (`load_config`)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, got {type(loaded).__name__}")
        if "sweep" in loaded:
            raise ConfigError(f"config file {str(path)!r} has a sweep: section: run it with `raytrain-ddp sweep "
                              f"{path}`, or train one point of it without that section")
        data = loaded
    storage = os.environ.get(STORAGE_ENV)
    if storage and isinstance(data.get("run", {}), dict) and "storage_path" not in data.get("run", {}):
        data = {**data, "run": {**data.get("run", {}), "storage_path": storage}}  # file and overrides win
    return apply_overrides(data, list(overrides or []))


def validate_config(data: Any, source: str = "<config>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    except (TypeError, ValueError) as exc:  # pydantic wraps most, but be certain
        raise ConfigError(f"{source}: {exc}") from None


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line (the CLI's promise), however many problems: `...: key: problem; key: problem`."""
    problems = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"][:-1])
            msg = f"unknown key; allowed here: {', '.join(allowed)}"
        value = err.get("input")
        shown = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(value, dict) else f" (got {value!r})"
        problems.append(f"{key}: {msg}{shown}" if key else msg)
    return f"invalid configuration in {source}: " + "; ".join(problems)


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}).keys())
