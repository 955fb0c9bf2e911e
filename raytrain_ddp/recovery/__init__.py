"""What happens when a worker dies: the recovery table (`table.py`, one row per `run.recovery` value,
the halves' Protocols) and each mode's driver and worker halves."""
