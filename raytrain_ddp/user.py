"""The user's model factory, loss, preprocess, optimizer, schedule and metrics: resolving, checking and shipping them.

Owns: turning `model.name`, `train.loss`, `data.preprocess`, `train.optimizer`,
`train.schedule` and `train.metrics` — import paths
`"package.module:attribute"`, or the callables given to `raytrain_ddp.train(...)` — into
one `UserCode`; building the model from it (`build_model`, which `raytrain-ddp verify`
calls too); the driver's check of the whole pipeline on one small batch before any worker
starts (`check_pipeline`: preprocess, columns, factory, forward, loss, metrics), each problem one
`UserError` naming its key; and what travels with the job so that Ray's processes can
import the user's modules (`runtime_env`). Must not touch: Ray's cluster APIs (the
launcher hands `runtime_env()` to Ray), reading data, training.

Where import paths are found: the current directory, the config file's directory (a
model module next to its YAML just works), then `sys.path` as usual. How the code reaches
the workers: `UserCode` is pickled on the driver (functions of importable modules by
reference, those of `__main__` by value) and unpickled only on Ray's workers, whose
`runtime_env` `py_modules` carries every user module that is not installed in
site-packages (a single `.py` file, or its top-level package directory).
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np

from raytrain_ddp.config import BUILTIN_LOSSES, BUILTIN_MODELS, BUILTIN_OPTIMIZERS, BUILTIN_SCHEDULES, Config
from raytrain_ddp.data.columns import column_arrays, user_column_arrays, uses_own_data
from raytrain_ddp.errors import UserError
from raytrain_ddp.job import DataSpec

if TYPE_CHECKING:
    from raytrain_ddp.job import Job

SAMPLE_ROWS = 8  # rows the driver pushes through preprocess, factory, forward and loss


@dataclass(frozen=True)
class UserCode:
    """The callables behind the config's import paths; None: the built-in named in the config."""

    model: Optional[Callable[..., Any]] = None  # factory(spec, **model.kwargs) -> nn.Module
    loss: Optional[Callable[[Any, Any], Any]] = None  # (output, batch) -> scalar tensor
    preprocess: Optional[Callable[[dict], dict]] = None  # numpy batch -> numpy batch (Ray Data)
    optimizer: Optional[Callable[..., Any]] = None  # (model, **train.optimizer_kwargs) -> Optimizer
    schedule: Optional[Callable[..., Any]] = None  # (optimizer, total_steps, **train.schedule_kwargs) -> LRScheduler
    metrics: Optional[Callable[[Any, Any], Any]] = None  # (output, batch) -> {name: mean | (sum, count)}

    @property
    def custom(self) -> bool:
        return any(getattr(self, part) is not None for part in USER_KEYS)

    def build_model(self, cfg: Config, spec: DataSpec) -> Any:
        """The model for `spec`: the factory's (checked to be an nn.Module) or a built-in."""
        from torch import nn

        from raytrain_ddp import models

        if self.model is None:
            return models.build_model(cfg, spec)
        try:
            module = self.model(spec, **cfg.model.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line, not a traceback
            raise UserError(f"model.name={cfg.model.name!r}: the factory raised {_one_line(exc)}") from None
        if not isinstance(module, nn.Module):
            raise UserError(f"model.name={cfg.model.name!r}: the factory returned a {type(module).__name__}, "
                            "not a torch.nn.Module")
        return module

    def build_optimizer(self, cfg: Config, model: Any) -> Any:
        """The user's `train.optimizer(model, **train.optimizer_kwargs)`, checked to be an Optimizer."""
        import torch

        key = f"train.optimizer={cfg.train.optimizer!r}"
        try:
            optimizer = self.optimizer(model, **cfg.train.optimizer_kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line, not a traceback
            raise UserError(f"{key} raised {_one_line(exc)}") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"{key} returned a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        return optimizer

    def build_schedule(self, cfg: Config, optimizer: Any, total_steps: int) -> Any:
        """The user's `train.schedule(optimizer, total_steps, **train.schedule_kwargs)`, checked."""
        import torch

        key = f"train.schedule={cfg.train.schedule!r}"
        try:
            scheduler = self.schedule(optimizer, total_steps, **cfg.train.schedule_kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise UserError(f"{key} raised {_one_line(exc)}") from None
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise UserError(f"{key} returned a {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler")
        return scheduler

    def batch_format(self, cfg: Config) -> Any:
        from raytrain_ddp.batch import BatchFormat

        return BatchFormat.of(cfg, self.loss, self.metrics)

    def dumps(self) -> bytes:
        import ray.cloudpickle

        return ray.cloudpickle.dumps(self)

    @staticmethod
    def for_job(job: "Job") -> "UserCode":
        """On a worker: the driver's resolved code, or (a job built by hand) the config's paths."""
        if job.user_code:
            return pickle.loads(job.user_code)
        return resolve(job.cfg)[1]


# --------------------------------------------------------------------------- resolving


# Each piece of user code: its config key and the built-ins that key may name instead.
USER_KEYS = {
    "model": ("model.name", BUILTIN_MODELS),
    "loss": ("train.loss", BUILTIN_LOSSES),
    "preprocess": ("data.preprocess", ()),
    "optimizer": ("train.optimizer", BUILTIN_OPTIMIZERS),
    "schedule": ("train.schedule", BUILTIN_SCHEDULES),
    "metrics": ("train.metrics", ()),
}


def resolve(cfg: Config, *, config_path: Union[str, os.PathLike, None] = None,
            **given: Optional[Callable]) -> tuple[Config, UserCode]:
    """Import the config's paths; callables given from Python (`model=`, `loss=`, `preprocess=`,
    `optimizer=`, `schedule=`) win and are recorded in the config.

    Returns the config (a copy naming each callable as `module:qualname` when any was
    given, so config.yaml and checkpoints say what trained) and the `UserCode`."""
    add_import_dirs(config_path)
    unknown = sorted(set(given) - set(USER_KEYS))
    if unknown:
        raise TypeError(f"resolve() got unexpected user code {unknown}")
    given = {part: obj for part, obj in given.items() if obj is not None}
    for part, obj in given.items():
        if not callable(obj):
            raise UserError(f"{USER_KEYS[part][0]}: expected a function, got a {type(obj).__name__}")
    if given:
        cfg = cfg.model_copy(deep=True)
        for part, obj in given.items():
            section, key = USER_KEYS[part][0].split(".")
            setattr(getattr(cfg, section), key, import_path_of(obj))
    code = {}
    for part, (key, builtins) in USER_KEYS.items():
        section, name = key.split(".")
        path = getattr(getattr(cfg, section), name)
        if part in given:
            code[part] = given[part]
        elif path and path not in builtins:
            code[part] = import_object(path, key)
    return cfg, UserCode(**code)


def build_model(cfg: Config, spec: DataSpec, *, config_path: Union[str, os.PathLike, None] = None) -> Any:
    """The model a run of `cfg` trains, built on this process (no Ray): for tools such as verify."""
    return resolve(cfg, config_path=config_path)[1].build_model(cfg, spec)


def add_import_dirs(config_path: Union[str, os.PathLike, None] = None) -> None:
    """The current directory and the config file's directory go first on sys.path (as `python -m`)."""
    dirs = [os.getcwd()]
    if config_path is not None:
        dirs.append(str(Path(config_path).resolve().parent))
    for directory in reversed(dirs):
        if directory not in sys.path:
            sys.path.insert(0, directory)


def import_object(path: str, key: str) -> Callable[..., Any]:
    """`package.module:attr` -> the object; every failure is one line naming `key`."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UserError(
                f"{key}={path!r}: no module named {exc.name!r} (looked in the current directory, the "
                "config file's directory and sys.path; is it a file there, or an installed package?)"
            ) from None
        raise UserError(f"{key}={path!r}: importing {module_name!r} failed: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises at import
        raise UserError(f"{key}={path!r}: importing {module_name!r} failed: {_one_line(exc)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"{key}={path!r} is a {type(obj).__name__}, not a function")
    return obj


def import_path_of(obj: Callable[..., Any]) -> str:
    """How a callable is named in the config: `module:qualname` (a lambda: `module:<lambda>`)."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    module = getattr(target, "__module__", None) or "__main__"
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{name}"


# --------------------------------------------------------------------------- shipping


def runtime_env(code: UserCode) -> dict[str, Any]:
    """`{"py_modules": [...]}` for `ray.init` (the job's runtime_env, which every worker, Ray
    Data task and Ray Train actor inherits), or {} when nothing needs to travel."""
    paths = [path for _, path in _modules_to_ship(code)]
    return {"py_modules": sorted(set(paths))} if paths else {}


def pickle_by_value(code: UserCode) -> list[str]:
    """When Ray was started before the run (its job runtime_env is fixed), the user's modules
    travel inside the pickles instead: functions and classes by value. Returns their names."""
    import ray.cloudpickle

    names = sorted({name for name, _ in _modules_to_ship(code)})
    for name in names:
        ray.cloudpickle.register_pickle_by_value(sys.modules[name])
    return names


def _modules_to_ship(code: UserCode) -> list[tuple[str, str]]:
    """(top-level module name, file or package directory) of each user module Ray must carry.

    Skipped: `__main__` (pickled by value), installed packages and the standard library
    (the workers have them), and raytrain_ddp itself.
    """
    from raytrain_ddp.errors import library_dirs

    installed = library_dirs()
    out: list[tuple[str, str]] = []
    for obj in (getattr(code, part) for part in USER_KEYS):
        if obj is None:
            continue
        target = obj.func if isinstance(obj, functools.partial) else obj
        name = getattr(target, "__module__", None)
        if not name or name == "__main__":
            continue
        top_name = name.split(".")[0]
        top = sys.modules.get(top_name)
        if top is None:
            continue
        roots = list(getattr(top, "__path__", [])) or ([top.__file__] if getattr(top, "__file__", None) else [])
        for root in roots:
            path = Path(root).resolve()
            if not any(path == base or base in path.parents for base in installed):
                out.append((top_name, str(path)))
    return out


# --------------------------------------------------------------------------- the driver's check


@dataclass(frozen=True)
class Checked:
    """What the driver learnt from one small batch pushed through the user's pipeline."""

    spec: DataSpec  # the data's spec; a user pipeline's columns, task and feature shape filled in
    params: int  # the model's parameter count (for the plan)


def run_preprocess(cfg: Config, fn: Callable[[dict], dict], batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Apply `data.preprocess` to a numpy batch as Ray Data would; a bad result is one line."""
    key = f"data.preprocess={cfg.data.preprocess!r}"
    try:
        out = fn(dict(batch))
    except Exception as exc:  # noqa: BLE001 - the user's code
        raise UserError(f"{key} raised {_one_line(exc)} on the first {len(next(iter(batch.values())))} rows "
                        f"(columns {sorted(batch)})") from None
    if not isinstance(out, dict) or not out:
        raise UserError(f"{key} returned a {type(out).__name__}; it must return a dict of column -> array")
    lengths = {name: len(np.asarray(value)) for name, value in out.items()}
    if len(set(lengths.values())) != 1:
        raise UserError(f"{key} returned columns of different lengths {lengths}")
    if not next(iter(lengths.values())):
        raise UserError(f"{key} returned no rows for the first {SAMPLE_ROWS} rows of the data")
    return out


def check_pipeline(cfg: Config, code: UserCode, sample: dict[str, np.ndarray], spec: DataSpec, *,
                   require_all_used: bool = True) -> Checked:
    """Push one small batch through preprocess, the factory, the forward, the loss and the
    user's metrics (and build the user's optimizer and schedule once).

    `sample` holds raw rows as Ray Data hands them to `map_batches` (a dict of numpy
    arrays); `spec` is what is known of the data so far. For a user pipeline
    (`uses_own_data`) the processed columns decide the spec's `columns`, task and feature
    shape. Every problem raises a `UserError` naming the key that would fix it.
    `require_all_used=False` skips only the unused-parameter refusal, for a caller that
    reports unused parameters itself (`raytrain-ddp verify`, whose purpose is to name them).
    """
    import dataclasses

    import torch

    from raytrain_ddp.errors import DataError
    from raytrain_ddp.models import checkpoint_activations

    batch = run_preprocess(cfg, code.preprocess, sample) if code.preprocess else sample
    _require_columns(cfg, code, batch)
    batch = {name: np.asarray(column)[:SAMPLE_ROWS] for name, column in batch.items()}  # a preprocess may add rows
    try:
        arrays = user_column_arrays(batch, cfg) if uses_own_data(cfg) else column_arrays(batch, cfg, spec)
    except DataError as exc:
        where = f"data.preprocess={cfg.data.preprocess!r}: " if code.preprocess else ""
        raise UserError(f"{where}{exc}") from None
    except ValueError as exc:  # ragged rows, a reshape that does not fit
        raise UserError(f"data.features={cfg.data.features!r}: {_one_line(exc)}") from None
    if uses_own_data(cfg):
        columns = {name: (tuple(a.shape[1:]), str(a.dtype)) for name, a in arrays.items()}
        task, feature_shape = spec_columns(cfg, columns)
        spec = dataclasses.replace(spec, task=task, feature_shape=feature_shape, columns=columns)
    model = _build_model(cfg, code, spec)
    checkpoint_activations(model, cfg.model.activation_checkpointing)  # none matching: one line, before workers
    model.train()
    fmt = code.batch_format(cfg)
    tensors = fmt.assemble({name: torch.from_numpy(np.array(a)) for name, a in arrays.items()})
    try:
        output = fmt.forward(model, tensors)
    except Exception as exc:  # noqa: BLE001 - the user's model
        raise UserError(f"model.name={cfg.model.name!r}: the forward pass on a batch of {fmt.rows(tensors)} rows "
                        f"({_describe(tensors)}) raised {_one_line(exc)}") from None
    if fmt.user_loss is None and cfg.train.loss == "cross_entropy":
        _check_cross_entropy_shapes(cfg, output, fmt.target(tensors))
    loss = _checked_loss(cfg, fmt, output, tensors)
    _check_scalar(cfg, loss)
    _check_backward(cfg, model, loss, require_all_used)
    if code.metrics is not None:
        _check_metrics(cfg, code.metrics, output, tensors, fmt.rows(tensors))
    if code.optimizer is not None:
        optimizer = code.build_optimizer(cfg, model)
        if code.schedule is not None:
            code.build_schedule(cfg, optimizer, 100)
    elif code.schedule is not None:
        code.build_schedule(cfg, torch.optim.SGD(model.parameters(), lr=cfg.train.lr), 100)
    return Checked(spec, sum(p.numel() for p in model.parameters()))


def _build_model(cfg: Config, code: UserCode, spec: DataSpec) -> Any:
    """The factory on the data's spec; a model that refuses the data's shape is one line naming the key."""
    try:
        return code.build_model(cfg, spec)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model (or ours) refuses the data's shape
        raise UserError(f"model.name={cfg.model.name!r}: building the model for features of shape "
                        f"{tuple(spec.feature_shape)} ({cfg.data.features!r}) raised {_one_line(exc)}"
                        + ("; the built-in cnn takes (channels, height, width) rows: reshape them in "
                           "data.preprocess, or use model.name=mlp" if cfg.model.name == "cnn" else "")) from None


def _check_metrics(cfg: Config, fn: Callable[[Any, Any], Any], output: Any, batch: Any, rows: int) -> None:
    """`train.metrics` on the sample batch: it runs and returns `{name: mean | (sum, count)}`."""
    from raytrain_ddp.batch import metric_sums

    key = f"train.metrics={cfg.train.metrics!r}"
    try:
        values = fn(output, batch)
    except Exception as exc:  # noqa: BLE001 - the user's code
        raise UserError(f"{key} raised {_one_line(exc)}") from None
    try:
        metric_sums(values, rows)
    except ValueError as exc:
        raise UserError(f"{key}: {exc}") from None


def spec_columns(cfg: Config, columns: dict[str, tuple[tuple[int, ...], str]]) -> tuple[str, tuple[int, ...]]:
    """(task, feature_shape) of a user pipeline, from its processed columns."""
    from raytrain_ddp.data.sources import task_set

    label = columns.get(cfg.data.label)
    first = cfg.data.inputs[0] if cfg.data.inputs else cfg.data.features
    feature_shape = columns[first][0] if first in columns else ()
    ints = label is not None and np.dtype(label[1]).kind in "iu"
    return task_set(cfg, ("classification" if label[0] == () else "lm") if ints else "other", "the data"), feature_shape


def _require_columns(cfg: Config, code: UserCode, batch: dict[str, Any]) -> None:
    if cfg.data.inputs:
        needed = {name: "data.inputs" for name in cfg.data.inputs}
        if code.loss is None and cfg.train.loss == "cross_entropy":
            needed[cfg.data.label] = "data.label"
    else:
        needed = {cfg.data.features: "data.features", cfg.data.label: "data.label"}
    for name, key in needed.items():
        if name not in batch:
            if code.preprocess:
                raise UserError(f"data.preprocess={cfg.data.preprocess!r}: its result has no column {name!r} "
                                f"({key}); it returned columns {sorted(batch)}")
            raise UserError(f"{key}={name!r}: the data has no such column; its columns are {sorted(batch)}")


def _check_cross_entropy_shapes(cfg: Config, output: Any, target: Any) -> None:
    import torch

    key = f"train.loss='cross_entropy' with model.name={cfg.model.name!r}"
    if not isinstance(output, torch.Tensor):
        raise UserError(f"{key}: the model returned a {type(output).__name__}, not a tensor of logits "
                        "(use train.loss=model if it returns its own loss, or your own train.loss)")
    if target is None:
        raise UserError(f"{key}: the batch has no label column {cfg.data.label!r} (data.label)")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise UserError(f"{key}: label column {cfg.data.label!r} (data.label) holds {target.dtype}; "
                        "cross_entropy needs integer class ids")
    if output.dim() != target.dim() + 1 or output.shape[:-1] != target.shape:
        raise UserError(
            f"{key}: the model's output has shape {list(output.shape)} but label column {cfg.data.label!r} "
            f"(data.label) has shape {list(target.shape)}; cross_entropy needs output [..., classes] "
            "for labels [...] (check the factory's output, or data.label)"
        )
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= output.shape[-1]):
        raise UserError(f"{key}: label column {cfg.data.label!r} (data.label) holds values up to "
                        f"{int(target.max())} but the model outputs {output.shape[-1]} classes")


def _checked_loss(cfg: Config, fmt: Any, output: Any, tensors: Any) -> Any:
    """The loss on the sample batch; one that raises, or that torch warns would broadcast (mse_loss, l1_loss, ...)."""
    import warnings

    shapes = (f"the model's output {_shape(output)} and label column {cfg.data.label!r} (data.label) "
              f"{_shape(fmt.target(tensors))}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss = fmt.loss(output, tensors)
        except Exception as exc:  # noqa: BLE001 - the user's loss (or a model without its own loss)
            raise UserError(f"train.loss={cfg.train.loss!r} raised {_one_line(exc)} on {shapes}") from None
    if any("different to the input size" in str(w.message) for w in caught):
        raise UserError(f"train.loss={cfg.train.loss!r}: {shapes} differ, and the loss would broadcast one "
                        "against the other; make the model's output the label's shape (or reshape in the loss)")
    return loss


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"of shape {list(shape)}" if shape is not None else f"(a {type(value).__name__})"


def _check_scalar(cfg: Config, loss: Any) -> None:
    import torch

    key = f"train.loss={cfg.train.loss!r}"
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"{key} returned a {type(loss).__name__}; it must return a scalar torch tensor")
    if loss.numel() != 1:
        raise UserError(f"{key} returned a tensor of shape {list(loss.shape)}, not a scalar "
                        "(reduce it, e.g. with .mean())")
    if not loss.requires_grad:
        raise UserError(f"{key} returned a scalar that does not depend on the model's parameters "
                        "(requires_grad is False: was it computed with .detach(), .item() or numpy?)")


def _check_backward(cfg: Config, model: Any, loss: Any, require_all_used: bool = True) -> None:
    """The backward of the sample batch, and what the wrappers check after one on the workers:
    every trainable parameter got a gradient (unless parallel.find_unused_parameters, or a
    caller that reports unused parameters itself says `require_all_used=False`)."""
    from raytrain_ddp.parallel.base import check_every_parameter_used

    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the user's model or loss
        raise UserError(f"train.loss={cfg.train.loss!r}: the backward pass raised {_one_line(exc)}") from None
    if require_all_used:
        check_every_parameter_used(cfg.parallel.strategy, model, cfg.parallel.find_unused_parameters)


def _describe(batch: Any) -> str:
    if isinstance(batch, dict):
        return ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in batch.items())
    x = batch[0]
    return f"x {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message (at the user's file:line in function)`."""
    from raytrain_ddp.errors import in_user_code

    text = str(exc).strip().splitlines()
    head = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return head + in_user_code(exc) + _hint(exc)


def _hint(exc: BaseException) -> str:
    """What a user in this spot usually needs to know."""
    if "object" in str(exc) and isinstance(exc, (TypeError, ValueError)):
        return ("; hint: a parquet list column reaches a preprocess as a numpy object array of rows: "
                "np.stack(batch[column]) makes it one array")
    return ""
