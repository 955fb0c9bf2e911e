"""Ray Train's private names the driver relies on, in one room (issue #29 moves the rest here).

Owns: every import of a private Ray Train API made by the driver for the run directory's
bookkeeping. Each name has a test (`tests/unit/test_ray_compat.py`) that fails by name
when a Ray release moves it. Must not touch: training, the worker loop.

Why Ray's checkpoint snapshot is removed before every fit (issue #25): Ray Train V2
keeps `checkpoint_manager_snapshot.json` in the run directory and, when the same
name/storage path is fitted again, restores its list of checkpoints, refusing to start
("You are running in a corrupted run directory") when one of them is gone. Ours go on
purpose: `run.num_to_keep` is applied over all fits (`resume.prune_checkpoints`), a
survivor's copy supersedes a checkpoint, a fit dies between Ray's deletion and its
snapshot write. Which checkpoint a fit starts from is our decision anyway
(`resume.resolve_resume`, made before Ray starts; workers ignore Ray's offers from
earlier fits), so each fit hands Ray an empty history: Ray then only ever lists what this
fit wrote, and its file never contradicts ours.
"""

from __future__ import annotations

from typing import Any


def checkpoint_snapshot_name() -> str:
    """The file name of Ray Train's checkpoint-manager snapshot inside a run directory."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    return CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def forget_earlier_fits(run_dir: Any) -> bool:
    """Remove Ray Train's checkpoint snapshot from `run_dir` (a `rundir.Location`); True if one was there."""
    snapshot = run_dir / checkpoint_snapshot_name()
    if not snapshot.exists():
        return False
    snapshot.delete()
    return True


def install_sigint_handler(trainer: Any, register: Any) -> None:
    """Ray 2.60's `TorchTrainer` calls `_register_sigint_handler(controller)` on the main thread
    to install a SIGINT handler that aborts and then `sys.exit(0)`s; `register` replaces it."""
    trainer._register_sigint_handler = register
