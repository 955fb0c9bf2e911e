"""What happens when a worker dies: the recovery table (`table.py`), one row per `run.recovery` value."""

from raytrain_ddp.recovery.table import Recovery, driver_half, is_live, of, survivors_copy, worker_half

__all__ = ["Recovery", "driver_half", "is_live", "of", "survivors_copy", "worker_half"]
