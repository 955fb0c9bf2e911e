"""Where a run starts from, and what a resume may change: decided on the driver, before Ray.

Owns: `run.resume` (which checkpoint a fit starts from) and the rules comparing the
config a checkpoint was trained with to the current one. Must not touch: Ray, workers.
The worker side (`worker/checkpointer.py`) only prefers this fit's own newer
checkpoints after a restart.

`run.resume`, resolved on the driver before any worker starts:
  null    -> continue the run directory's newest *valid* checkpoint, if there is one
             (this is also how re-running after the driver died continues);
  latest  -> the same, but an error when there is none;
  PATH    -> exactly that checkpoint (verified first);
  never   -> start fresh; an existing, non-empty run directory is an error.
  Ray Train V2 on its own reloads the run's checkpoint snapshot whenever the same
  name/storage_path is reused and offers its latest checkpoint to the workers; the
  workers ignore offers from earlier fits (each fit has a `fit_id` recorded in every
  checkpoint's manifest) and use the one chosen here, so the four modes above hold. A
  restart after a worker failure inside this fit continues from this fit's latest
  checkpoint.
What a resume may change (`check_resume_config`; every checkpoint records its config):
  how the run is executed is free (`scaling.*` -- the worker count above all --,
  `run.*`, `parallel.*`, `train.micro_batch_size`, `data.prefetch_batches`): the loop
  re-derives accumulation from the actual worker count and the optimisation is the
  same. `train.epochs` / `train.max_steps` are free too (the LR schedule stretches to the
  new total). `model.*` is refused (the weights would not fit). The keys that decide
  which samples form step s of an epoch (`data.*`, `train.global_batch_size`,
  `train.seed`) are refused mid-epoch -- the recorded position would point into another
  order -- and allowed at an epoch boundary. Any other change (optimizer, lr, schedule
  shape, precision, clipping) is allowed and printed as a warning: the run continues,
  but not on the trajectory of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import Config
from raytrain_ddp.errors import CheckpointError, UserError
from raytrain_ddp.rundir import HOLD_FILE, Location, unused_name


class ResumeError(UserError):
    """`run.resume` cannot be honoured (no checkpoint, a bad path, an existing run)."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a fit starts, resolved once (`resume_point`): the checkpoint (None: a fresh start),
    its manifest (read once) and its `state.pt` (loaded once, to verify it), carried to the
    plan, the resume checks, config-history, the summary and the finished-run answer."""

    checkpoint: Any = None  # a `Path` for a local checkpoint, else a `Location`
    manifest: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.manifest.get("step", 0))

    @property
    def epoch(self) -> int:
        return int(self.manifest.get("epoch", 0))


def newest(run_dir: Any) -> ResumePoint:
    """The run directory's newest valid checkpoint (`state.pt` verified and loaded once), or none."""
    found = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    return ResumePoint() if found is None else ResumePoint(found[1], ckpt.read_manifest(found[1]), found[0])


def resume_point(cfg: Config, run_dir: Union[Path, Location]) -> ResumePoint:
    """The checkpoint this run starts from, per `run.resume` (see the module docstring).

    Listing and verifying go through pyarrow.fs, so `run_dir` may be local or in object
    storage; the checkpoint is a `Path` for a local one, else a `Location`.
    """
    mode = cfg.run.resume
    where = Location.parse(run_dir)
    if mode == "never":
        if any(child.name != HOLD_FILE for child, _ in where.children()):  # this fit's hold is no content
            resumable = newest(where).checkpoint is not None
            raise ResumeError(
                f"run.resume=never but run directory {where} already exists; start a new run under "
                f"another name ({unused_name(cfg)}){', continue it (run.resume=latest)' if resumable else ''}"
                ", or delete it"
            )
        return ResumePoint()
    if mode in (None, "latest"):
        point = newest(where)
        if point.checkpoint is None and mode == "latest":
            raise ResumeError(f"run.resume=latest but {where} holds no valid checkpoint; "
                              "train without run.resume first, or pass run.resume=PATH")
    else:
        try:
            path = Location.parse(mode)
            state = ckpt.load_checkpoint(path)
        except (CheckpointError, OSError, ValueError) as exc:
            raise ResumeError(f"run.resume={mode!r}: {exc}") from None
        path = path.parent if path.is_file() else path
        point = ResumePoint(path, ckpt.read_manifest(path), state)
    if point.checkpoint is None:
        return point
    check_resume_config(cfg, point.state, point.checkpoint)
    return dataclasses.replace(point, checkpoint=point.checkpoint.plain())


def resolve_resume(cfg: Config, run_dir: Union[Path, Location]) -> Optional[Union[Path, Location]]:
    """The checkpoint of `resume_point` (None: a fresh start)."""
    return resume_point(cfg, run_dir).checkpoint


RESUME_FREE = ("name", "scaling.", "run.", "parallel.", "train.micro_batch_size", "train.epochs",
               "train.max_steps", "train.nonfinite.", "data.prefetch_batches",
               "train.compile", "model.activation_checkpointing")  # how the step computes, not what
RESUME_REFUSED = ("model.",)
RESUME_EPOCH_BOUNDARY = ("data.", "train.global_batch_size", "train.seed")


def check_resume_config(cfg: Config, state: dict[str, Any], path: Any) -> list[str]:
    """Refuse resumes that cannot continue the run; warn about ones that change it.

    Returns the warned keys (see the module docstring for the three classes).
    """
    recorded = state.get("run", {}).get("config")
    if not isinstance(recorded, str):
        return []
    progress = state.get("progress", {})
    old, new, changed = changes(recorded, cfg.to_yaml())
    mid_epoch = int(progress.get("steps_into_epoch", 0)) > 0

    def shown(keys: list[str]) -> str:
        return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)

    refused = [k for k in changed if k.startswith(RESUME_REFUSED) and not k.startswith(RESUME_FREE)]
    if mid_epoch:
        refused += [k for k in changed if k.startswith(RESUME_EPOCH_BOUNDARY)]
    if refused:
        raise ResumeError(
            f"cannot resume from {path} (step {progress.get('step')}, "
            f"{progress.get('steps_into_epoch')} steps into epoch {int(progress.get('epoch', 0)) + 1}): "
            f"{shown(refused)}. Model keys must match the checkpoint; data order keys may change "
            f"only at an epoch boundary. Restore the old values, or start a new run under another "
            f"name ({unused_name(cfg)})"
        )
    warned = [k for k in changed if not k.startswith(RESUME_FREE + RESUME_EPOCH_BOUNDARY)]
    finished = trained_to_the_end(cfg, int(progress.get("step", 0)), int(progress.get("epoch", 0)))
    if warned and not finished:  # a finished run stops with "nothing to train" instead
        print(f"raytrain-ddp: warning: resuming {path} with a different optimisation "
              f"({shown(warned)}); the run will not follow the trajectory of an uninterrupted one",
              file=sys.stderr, flush=True)
    return warned


def changes(before: Optional[str], after: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Two configs' YAML texts flattened, and the keys whose values differ (none without `before`)."""
    import yaml

    old, new = (flatten(yaml.safe_load(before)) if before else {}), flatten(yaml.safe_load(after))
    return old, new, sorted(k for k in old.keys() | new.keys() if before and old.get(k) != new.get(k))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config tree as {"train.lr": 0.1, ...} (dotted keys, as overrides spell them)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


# ------------------------------------------------------------------ before Ray: anything to do?


class NothingToTrain(UserError):
    """The chosen checkpoint already reached the configured end: exit code 3, before Ray starts."""

    exit_code = 3


def check_something_to_train(cfg: Config, resume: ResumePoint) -> bool:
    """True when the run is complete and this is the command that trained it: nothing to do,
    exit 0 (a job-retry policy that reruns until exit 0 stops here). Raise `NothingToTrain`
    when the checkpoint is at its end but the command asks for something else (another lr,
    a lower `train.max_steps`): exit 3, the command cannot be honoured. False otherwise.

    Decided from the checkpoint's manifest (its step, completed epochs and config) and the
    config alone, so a finished run re-run with new settings stops before Ray starts
    and before its `config.yaml` could be rewritten. The worker loop stops at the same
    point: `train.max_steps` reached, or (without it) `train.epochs` epochs completed.
    """
    if resume.checkpoint is None:
        return False
    step, epoch, resume_from = resume.step, resume.epoch, resume.checkpoint
    if not trained_to_the_end(cfg, step, epoch):
        return False
    if same_command(cfg, resume.state):
        return True
    max_steps, epochs = cfg.train.max_steps, cfg.train.epochs
    reached = f"train.max_steps={max_steps}" if max_steps is not None else f"train.epochs={epochs}"
    extend = f"train.max_steps={2 * max_steps}" if max_steps is not None else f"train.epochs={2 * epochs}"
    raise NothingToTrain(
        f"run {cfg.name!r} is already trained to {reached} (checkpoint {resume_from}: step {step}, "
        f"epoch {epoch}): nothing to train. Extend it ({extend}) or start a new run ({unused_name(cfg)})"
    )


# How a run is executed, not what it trains: a complete run re-run with other values of these
# is still "the same command" (the worker count of a retried job may differ, say).
EXECUTION_ONLY = ("scaling.", "run.", "parallel.", "train.micro_batch_size", "data.prefetch_batches")


def same_command(cfg: Config, state: dict[str, Any]) -> bool:
    """Whether `cfg` asks for what the checkpoint (its loaded `state`) was trained to: its recorded
    config, execution keys aside (`EXECUTION_ONLY`). A checkpoint without a recorded config counts as the same."""
    recorded = state.get("run", {}).get("config")
    return not isinstance(recorded, str) or all(k.startswith(EXECUTION_ONLY) for k in changes(recorded, cfg.to_yaml())[2])


def trained_to_the_end(cfg: Config, step: int, epoch: int) -> bool:
    """Where the worker loop would stop at once: `train.max_steps` reached, or (without it)
    `train.epochs` epochs completed."""
    if cfg.train.max_steps is not None:
        return step >= cfg.train.max_steps
    return epoch >= cfg.train.epochs


# ------------------------------------------------------------------ the record of what trained


CONFIG_HISTORY_FILE = "config-history.jsonl"


def record_config(cfg: Config, run_dir: Any, resume: ResumePoint, fit_id: str) -> None:
    """Before a fit trains: `config.yaml` becomes this fit's config, `config-history.jsonl` gains a line.

    Each line: the fit, when, which checkpoint it continued (and at which step), the keys
    it changed against the previous fit's config, and the whole config. So
    `config.yaml` says what the newest checkpoints were trained with, and the history
    says what each stretch of the run was trained with. `run_dir` is a `Path` or a
    `rundir.Location` (only `/`, `exists`, `read_text` and `write_text` are used).
    """
    import json
    import time

    from raytrain_ddp.rundir import CONFIG_FILE

    text = cfg.to_yaml()
    config_file, history = run_dir / CONFIG_FILE, run_dir / CONFIG_HISTORY_FILE
    old, new, keys = changes(config_file.read_text() if config_file.exists() else None, text)
    changed = {k: [old.get(k), new.get(k)] for k in keys}
    where = resume.checkpoint
    line = json.dumps({"fit_id": fit_id, "time": time.time(), "resumed_from": str(where) if where else None,
                       "from_step": resume.step, "changed": changed, "config": text})
    before = history.read_text() if history.exists() else ""
    history.write_text(before + line + "\n")
    config_file.write_text(text)


def restore_config_if_untrained(run_dir: Any, fit_id: str, latest: Optional[ResumePoint] = None) -> None:
    """After a fit: if it wrote no checkpoint, `config.yaml` goes back to the newest checkpoint's config.

    A fit that failed, was unschedulable or interrupted before its first checkpoint
    trained nothing that is kept, so the run directory's description must not change.
    `latest`: the newest valid checkpoint, when the caller has it (else found now).
    """
    from raytrain_ddp.rundir import CONFIG_FILE

    run = (latest if latest is not None else newest(run_dir)).state.get("run", {})
    if run.get("fit_id") != fit_id and isinstance(run.get("config"), str):
        (run_dir / CONFIG_FILE).write_text(run["config"])


def prune_checkpoints(run_dir: Any, keep: int) -> list[str]:
    """Keep the newest `keep` valid checkpoints of the run directory, over all fits; returns the removed.

    Ray Train's `CheckpointConfig(num_to_keep)` counts only the current fit's
    checkpoints, so every resume would leave the previous fit's behind. Damaged
    checkpoints newer than the kept ones stay (`load_latest_valid` reports them); every
    checkpoint older than the `keep`-th valid one goes.
    """
    import shutil

    candidates = ckpt.find_checkpoints(run_dir)
    if len(candidates) <= keep:  # the usual case after a fresh run: nothing to verify or remove
        return []
    removed, valid = [], 0
    for candidate in candidates:
        if valid >= keep:
            if isinstance(candidate, Path):
                shutil.rmtree(candidate, ignore_errors=True)
            else:  # a rundir.Location in object storage
                candidate.fs.delete_dir(candidate.path)
            removed.append(str(candidate))
            continue
        try:
            ckpt.load_checkpoint(candidate)
            valid += 1
        except CheckpointError:
            continue
    return removed
