"""Driver halves of `run.recovery: checkpoint` and `replica` (the recovery table: `recovery/table.py`).

Owns: what Ray Train is given for these modes: torch's own backend (`TorchConfig`, one
process group of all workers) and, for `replica`, the callback that lets a survivor finish
writing the last step before Ray stops it (`worker/replica.py`'s `GraceForSurvivors`).
Must not touch: the rest of the trainer (`launcher.py`), what the workers do.
`driver/live.py` holds live's half, with the same four members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


class Restart:
    """`checkpoint`: a lost worker restarts the group from the newest durable checkpoint."""

    def __init__(self, cfg: "Config") -> None:
        self.cfg = cfg

    @staticmethod
    def resolve(cfg: "Config", say: Callable[[str], None] = print) -> "Config":
        """The config the run really uses: this mode always applies."""
        return cfg

    def env(self) -> dict[str, str]:
        return {}

    def torch_config(self, timeout_s: int) -> Any:
        from ray.train.torch import TorchConfig

        return TorchConfig(backend="nccl" if self.cfg.scaling.use_gpu else "gloo", timeout_s=timeout_s)

    def callbacks(self) -> list[Any]:
        return []


class SurvivorsCopy(Restart):
    """`replica`: as `checkpoint`, and Ray's stop of a survivor waits for its copy of the last step."""

    def callbacks(self) -> list[Any]:
        from raytrain_ddp.worker.replica import GraceForSurvivors

        return [GraceForSurvivors()]
