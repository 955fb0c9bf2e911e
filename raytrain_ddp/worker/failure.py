"""A rank's error, told to the driver whole, through the run's record stream.

Owns: `tell_driver`, called by the loop as an error leaves it. Ray Train hands the driver
only the first and last 500 characters of a worker's error; the driver's mailbox
(`driver/stream.py`) gets all of it, with whether retrying can help
(`errors.is_deterministic`): a deterministic one stops the fit at once (the driver
aborts Ray Train's controller), without spending `run.max_failures`.
Must not touch: what the driver does with it (`driver/launcher.py`), training.
"""

from __future__ import annotations

import logging
from typing import Any

from raytrain_ddp.errors import is_deterministic, whole_message

logger = logging.getLogger(__name__)
TELL_TIMEOUT_S = 5.0  # the rank is failing anyway: the driver is told, or not, within this


def error_record(exc: BaseException, world_rank: int) -> dict[str, Any]:
    """What the driver is told: the whole message, its type, the rank, whether deterministic."""
    return {"message": whole_message(exc), "type": type(exc).__name__, "rank": world_rank,
            "deterministic": is_deterministic(exc)}


def tell_driver(mailbox: Any, exc: BaseException, world_rank: int) -> None:
    """Send `exc` to the driver's mailbox actor and wait until it landed (a rank being torn
    down may lose a fire-and-forget call). Local mode (no actor) raises in the driver's own
    process: nothing to tell."""
    send = getattr(getattr(mailbox, "error", None), "remote", None)
    if send is None:
        return
    try:
        import ray

        ray.get(send(error_record(exc, world_rank)), timeout=TELL_TIMEOUT_S)
    except Exception as problem:  # noqa: BLE001 - Ray's own, shorter account still reaches the driver
        logger.warning("could not tell the driver of this rank's error: %s", problem)
