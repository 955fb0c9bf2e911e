"""The launcher table: how a fit's ranks start, one row per way, in one place (issue 53).

Owns: one row per launcher and what it supports -- `ray` (Ray Train's `TorchTrainer` places
the workers, on one machine or a cluster), `local` (`scaling.num_workers: 0`: this process
is the only rank, no Ray; driver/local.py), `torchrun` (`scaling.launcher: torchrun`:
`torch.distributed.run` starts this machine's ranks, no Ray; driver/torchrun.py) -- and the
one place `scaling.local` and `scaling.launcher` are read (`of`). The config's checks, the
preflight and a sweep refuse what a row does not support (`refusal`, `sweep_refusal`: one
line naming the launcher, before anything starts); driver/fit.py runs every fit with the
row's `launcher` (launch/base.py's Protocol), which the CLI starts early where the row says
`early_start`. Must not touch: how a launcher runs (driver/), what a recovery mode does
(recovery/table.py reads `recovery` here). The launchers live in driver/, not here: they
use the driver's recorder, hold and placement, and config/ and recovery/ import this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


@dataclass(frozen=True)
class Launcher:
    """One row of the table."""

    name: str
    says: str  # how a config line names it
    sizes: str  # the scaling.num_workers it starts, as a config line says it
    elastic: bool  # scaling.num_workers: [min, max], resized by Ray
    in_process: bool  # num_workers 0: this process is the only rank
    cluster: bool  # its ranks may run on other machines (a joined Ray cluster); else on this one, always
    sharding: tuple[str, ...]  # the data.sharding modes it reads
    reads: str  # where the data is read, as a config line says it
    recovery: tuple[str, ...]  # the run.recovery modes it carries out (elsewhere a lost rank ends the fit)
    datasets: bool  # Ray Datasets given from Python (data.source=datasets)
    early_start: bool  # the CLI starts it before it imports torch (its processes import torch meanwhile)
    ray_history: bool  # Ray Train's checkpoint history is kept in line with ours (local mode never imports Ray)
    sweeps: bool  # a sweep's trials run with it (they run in Ray Tune's actors)
    launcher: str  # "module:class" of its `Launcher` (launch/base.py), built with the config

    def cls(self) -> type:
        module, _, attr = self.launcher.partition(":")
        return getattr(importlib.import_module(module), attr)

    def make(self, cfg: "Config") -> Any:  # a launch/base.py `Launcher` (not imported: data/ and config/ read this table)
        return self.cls()(cfg)


_EXACT = ("exact",)
_TABLE = (
    Launcher("ray", says="scaling.launcher=ray", sizes="one worker or more, or a range", elastic=True,
             in_process=False, cluster=True, sharding=("exact", "streaming", "sharded"), reads="reads through Ray Data",
             recovery=("checkpoint", "replica", "live"), datasets=True, early_start=False, ray_history=True,
             sweeps=True, launcher="raytrain_ddp.driver.launcher:RayLauncher"),
    Launcher("local", says="scaling.num_workers=0 (local mode)", sizes="this process alone", elastic=False,
             in_process=True, cluster=False, sharding=_EXACT, reads="reads the data in this process", recovery=(),
             datasets=False, early_start=False, ray_history=False, sweeps=False,
             launcher="raytrain_ddp.driver.local:LocalLauncher"),
    Launcher("torchrun", says="scaling.launcher=torchrun", sizes="a fixed number of processes", elastic=False,
             in_process=False, cluster=False, sharding=_EXACT, reads="reads the data in memory", recovery=(), datasets=False,
             early_start=True, ray_history=True, sweeps=False, launcher="raytrain_ddp.driver.torchrun:TorchrunLauncher"),
)
LAUNCHERS: dict[str, Launcher] = {row.name: row for row in _TABLE}


def of(cfg: "Config") -> Launcher:
    """The row of `cfg` (the one place scaling.launcher and scaling.local are read)."""
    if cfg.scaling.launcher == "ray" and cfg.scaling.local:
        return LAUNCHERS["local"]
    return LAUNCHERS[cfg.scaling.launcher]


def start_early(cfg: "Config") -> Any:
    """The launcher of `cfg`, started now (before the CLI imports torch) where its row says `early_start`."""
    row = of(cfg)
    return row.make(cfg) if row.early_start else None


def sweep_refusal(cfg: "Config") -> str:
    """Why the trials of a sweep of `cfg` cannot run with its launcher ("" when they can), in one line."""
    row = of(cfg)
    return "" if row.sweeps else (f"{row.says}: a sweep's trials run on Ray workers (in Ray Tune's actors); "
                                  "sweep with scaling.launcher=ray and scaling.num_workers>=1")


def refusal(cfg: "Config") -> str:
    """Why `cfg` asks its launcher for what its row does not support ("" when nothing), in one line."""
    row, scaling, data = of(cfg), cfg.scaling, cfg.data
    if (scaling.elastic and not row.elastic) or scaling.local != row.in_process:
        return f"{row.says} starts {row.sizes}: set scaling.num_workers to a count >= 1, not {scaling.num_workers}"
    if data.sharding not in row.sharding:
        return (f"{row.says} {row.reads}: data.sharding={data.sharding!r} reads through Ray Data; "
                f"use data.sharding={' or '.join(row.sharding)}")
    return ""


def given_refusal(cfg: "Config", given: dict) -> str:
    """Why the launcher of `cfg` cannot take the Ray Datasets in `given` ("" when it can): a
    map-style torch Dataset is read on the driver into rows every launcher takes, a Ray Dataset
    needs Ray. Known only where `datasets=` is given (the Python API), so not a config check."""
    row = of(cfg)
    if row.datasets or not any(hasattr(ds, "map_batches") for ds in given.values()):
        return ""
    return (f"{row.says} runs without Ray: Ray Datasets given from Python need it; give map-style torch "
            "Datasets, write them to parquet (data.source=parquet), or train on Ray (scaling.launcher=ray, "
            "scaling.num_workers>=1)")
