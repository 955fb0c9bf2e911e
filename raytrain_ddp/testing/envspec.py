"""Test-only plans spelled `key=value,key=value` in an environment variable.

Owns: parsing that one format, shared by the fault plan (`testing.hooks.FaultPlan`) and the
simulated preemption signal (`testing.hooks.SimulatedPreemption`), so both read the same way
and both fail loudly on a malformed spec. Must not touch: what the plans mean.
"""

from __future__ import annotations

import os
from typing import Optional


def read_env_spec(name: str, required: tuple[str, ...] = ()) -> Optional[dict[str, str]]:
    """The spec in `$name` as a dict, or None when unset; a missing required key raises."""
    spec = os.environ.get(name)
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    missing = [key for key in required if key not in fields]
    if missing:
        raise ValueError(f"{name}={spec!r}: needs {', '.join(f'{k}=...' for k in missing)}")
    return fields
