"""The errors the wrappers raise, and `UserError`, the root of every error meant for the user.

Owns: `UserError` (bad input from the user: the message is the whole story; the CLI
prints it as one line) and the wrappers' errors. `UserError` is defined here, at the
bottom of the layers, because the wrappers raise user errors and `parallel/` imports
nothing of ours outside itself; `raytrain_ddp.errors` re-exports it for everyone else.
Must not touch: torch or anything else: standard library only (the config imports it).
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: the message is the whole story."""


class PeerLost(RuntimeError):
    """A collective failed on this rank because a peer is gone (or hangs): not this rank's own fault.

    Raised where our code meets a failed collective (`wait_work`, torch DDP's comm hook, the
    agreement helpers of `collectives.py`); recovery (`recovery/replica.py`, `recovery/live.py`)
    recognises a lost peer by this type.
    """


class CollectiveTimeoutError(PeerLost):
    """A collective did not finish in time, or failed; the message names the operation.

    Usually a peer rank died, hangs, or skipped a step (ranks must run the same number
    of synced backward passes). Raised on the rank that was left waiting.
    """


class RanksDisagreeError(RuntimeError):
    """Every rank reached the same collective, and their values differ (`check_same`).

    The collective itself succeeded: no peer is lost. The ranks' own state is wrong (a bug,
    or input that gives the ranks different counts), so recovery must not read it as a
    lost peer and keep the survivors' state.
    """


class ModelMismatchError(UserError, RuntimeError):
    """Ranks hold different models (structure, or weights with verify_init=True)."""


class UnusedParameterError(UserError, RuntimeError):
    """A trainable parameter got no gradient in a synced backward, without find_unused_parameters."""


class RequiresGradChangeError(UserError, RuntimeError):
    """`requires_grad` changed after wrapping in a way the strategy cannot follow (native only)."""
