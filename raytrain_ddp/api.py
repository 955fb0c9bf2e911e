"""The Python entry points: `raytrain_ddp.train(...)` and `raytrain_ddp.prepare_job(...)`.

Owns: turning a config (a YAML path, a dict, a `Config`, or nothing) plus the user's
callables and Ray Datasets into one call of the launcher, exactly as `raytrain-ddp train`
makes it from YAML. Must not touch: anything the launcher or `user.py` decides; this
module only assembles their arguments.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from raytrain_ddp.config import Config, ConfigError, apply_overrides, load_config, validate_config

ConfigLike = Union[str, os.PathLike, dict, Config, None]


def train(config: ConfigLike = None, *, model: Optional[Callable] = None, loss: Optional[Callable] = None,
          datasets: Optional[dict[str, Any]] = None, preprocess: Optional[Callable] = None,
          optimizer: Optional[Callable] = None, schedule: Optional[Callable] = None,
          metrics: Optional[Callable] = None, overrides: Sequence[str] = (), verbose: bool = False) -> dict[str, Any]:
    """Train and return the summary (the run's summary.json).

    config: a YAML file, a dict of keys, a `Config`, or None for the defaults; `overrides`
    are `key.sub=value` strings applied on top. model: `factory(spec, **model.kwargs) ->
    nn.Module`; loss: `(output, batch) -> scalar`; preprocess: a Ray Data batch function
    (dict of numpy arrays in and out); datasets: `{"train": ds, "val": ...}`, each a
    `ray.data.Dataset` or a map-style `torch.utils.data.Dataset` as it is (samples `(x, y)` or
    dicts; read once here, then sharded exactly by us: no DistributedSampler) (without "val",
    data.val_fraction of "train" is held out); optimizer: `fn(model, **train.optimizer_kwargs)
    -> Optimizer`; schedule: `fn(optimizer, total_steps, **train.schedule_kwargs) -> LRScheduler`;
    metrics: `fn(output, batch) -> {name: mean | (sum, count)}`, reported as `val_<name>`.
    Each replaces what the config names; `docs/byo.md` shows a whole run. The console shows
    what `raytrain-ddp train` shows: our lines only, unless `verbose` (Ray's own lines too).
    Ctrl-C saves the step training is at, writes summary.json (status `interrupted`), then
    raises `KeyboardInterrupt` (the CLI exits 130); the same call continues from there.
    """
    first = "raytrain_ddp.driver.fit" not in sys.modules  # this process's first fit: imported below
    from raytrain_ddp.driver.fit import run_training
    from raytrain_ddp.driver.ray_console import VERBOSE_ENV
    from raytrain_ddp.timeline import process_start_time

    code_given = dict(model=model, loss=loss, preprocess=preprocess, optimizer=optimizer, schedule=schedule,
                      metrics=metrics)
    cfg, code, datasets = _resolve(config, overrides, code_given, datasets)
    before = os.environ.get(VERBOSE_ENV)
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    try:
        # The first fit's timeline starts at the process's start: its `imports` phase holds the
        # script's imports and its own work before train(), as the CLI's holds its own.
        summary = run_training(cfg, code=code, datasets=datasets, started_at=process_start_time() if first else None)
    finally:
        if verbose:
            os.environ.pop(VERBOSE_ENV) if before is None else os.environ.__setitem__(VERBOSE_ENV, before)
    if summary.get("status") == "interrupted":  # saved and written; the script stops, as Python code expects
        raise KeyboardInterrupt(f"interrupted at step {summary.get('steps')}; {summary['run_dir']}/summary.json "
                                "says where the same call continues")
    return summary


def prepare_job(config: ConfigLike = None, *, model: Optional[Callable] = None, loss: Optional[Callable] = None,
                datasets: Optional[dict[str, Any]] = None, preprocess: Optional[Callable] = None,
                optimizer: Optional[Callable] = None, schedule: Optional[Callable] = None,
                metrics: Optional[Callable] = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The inputs of your own `TorchTrainer` running `raytrain_ddp.train_loop_per_worker`:
    `train_loop_config`, `datasets`, `dataset_config`, `worker_runtime_env` (docs/byo.md)."""
    from raytrain_ddp.driver.launcher import prepare_job as _prepare_job

    code_given = dict(model=model, loss=loss, preprocess=preprocess, optimizer=optimizer, schedule=schedule,
                      metrics=metrics)
    cfg, code, datasets = _resolve(config, overrides, code_given, datasets)
    return _prepare_job(cfg, code=code, datasets=datasets)


def sweep(config: ConfigLike = None, *, overrides: Sequence[str] = (), verbose: bool = False) -> dict[str, Any]:
    """Run (or continue) the sweep of `config`'s `sweep:` section on Ray Tune; returns the
    outcome (the sweep directory's sweep.json: status, trials, errors, placement groups left).

    config: a YAML file or a dict of keys (with its `sweep:` section); `overrides` are
    `key.sub=value` strings, `sweep.*` among them. Every trial is a full `train` run in
    `<run.storage_path>/<sweep name>/trials/<trial id>`; the same call continues an
    interrupted sweep (docs/usage.md#sweeps). Joins Ray as `train` does.
    """
    from raytrain_ddp.config.sweep import load_sweep, split_sweep
    from raytrain_ddp.driver.ray_console import VERBOSE_ENV
    from raytrain_ddp.sweep.run import run_sweep
    from raytrain_ddp.user import resolve

    path = None
    if isinstance(config, dict):
        from raytrain_ddp.config.sweep import check_space, paths_from_here

        data, sweep_cfg = split_sweep(apply_overrides(copy.deepcopy(config), list(overrides)), "<dict>")
        base = validate_config(paths_from_here(data), "<dict>")

        check_space(base, sweep_cfg)
    else:
        path = Path(config) if config is not None else None
        base, _, sweep_cfg = load_sweep(path, list(overrides))
    from raytrain_ddp.driver.preflight import preflight

    preflight(base)  # a relative storage path under `ray job submit`, a machine too small: before Ray
    base, code = resolve(base, config_path=path)  # import paths next to the YAML too; their modules travel
    before = os.environ.get(VERBOSE_ENV)
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    try:
        return run_sweep(base, base.model_dump(mode="json"), sweep_cfg, code)
    finally:
        if verbose:
            os.environ.pop(VERBOSE_ENV) if before is None else os.environ.__setitem__(VERBOSE_ENV, before)


def _resolve(config: ConfigLike, overrides: Sequence[str], given: dict[str, Any],
             datasets: Any) -> tuple[Config, Any, Any]:
    from raytrain_ddp.user import USER_KEYS, import_path_of, resolve

    # The callables are named in the config before it is validated (model.kwargs needs a
    # factory there, data.source=datasets needs the datasets), then `resolve` uses them.
    named = [f"{USER_KEYS[part][0]}={import_path_of(obj)}" for part, obj in given.items() if callable(obj)]
    overrides = [*overrides, *named, *(["data.source=datasets"] if datasets is not None else [])]
    path = None
    if isinstance(config, Config):
        cfg = validate_config(apply_overrides(config.model_dump(mode="json"), overrides), "<Config>")
    elif isinstance(config, dict):
        cfg = validate_config(apply_overrides(copy.deepcopy(config), overrides), "<dict>")
    else:
        path = Path(config) if config is not None else None
        cfg = load_config(path, overrides)
    cfg, code = resolve(cfg, config_path=path, **given)
    if datasets is not None:  # map-style torch Datasets read here, once, before Ray (data/given.py)
        from raytrain_ddp.data.given import read_map_style
        from raytrain_ddp.launch.table import given_refusal

        refused = given_refusal(cfg, datasets) if isinstance(datasets, dict) else ""
        if refused:
            raise ConfigError(refused)
        datasets = read_map_style(datasets, cfg)
    return cfg, code, datasets
