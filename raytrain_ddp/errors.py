"""Errors meant for the user, not for a traceback.

The CLI prints any `UserError` as one clear message and exits with status 2. Raise one
(or a subclass) wherever bad input is detected; its message must name the offending key,
file, column or value and say what would be accepted.

An error raised inside the user's own code (a factory, loss, preprocess, optimizer or
schedule) keeps one line, but says where in the user's code it was raised:
`user_frame` finds the innermost frame that is neither ours, Ray's, torch's, another
installed package's nor the standard library's, in a live traceback (the driver's
precheck) or in the text of one (an error that came back from a worker or a Ray Data task).
"""

import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Optional

# The root of the user's errors is defined with the wrappers (the bottom layer, which
# imports nothing of ours outside itself) and re-exported here for everyone else.
from raytrain_ddp.parallel.errors import UserError  # noqa: F401

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def library_dirs() -> set[Path]:
    """Where code that is not the user's lives: the standard library, site-packages, and this
    package (resolved). What `user.runtime_env` does not ship, and what `user_frame` skips."""
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return {Path(p).resolve() for p in paths if p} | {Path(__file__).resolve().parent}


def _is_users(filename: str) -> bool:
    if filename.startswith("<") or not filename.endswith(".py"):
        return False  # <frozen ...>, <string>: not a file the user can open
    path = Path(filename).resolve()
    ours = "raytrain_ddp" in path.parts  # any copy of this package (a worker may import another)
    return not ours and not any(base in path.parents for base in library_dirs())


def user_frame(exc: BaseException) -> Optional[str]:
    """`file.py:LINE in FUNCTION` of the innermost frame of the user's code, or None."""
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    if not any(_is_users(f[0]) for f in frames):  # a remote error carries its traceback as text
        frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME.finditer(str(exc))]
    for filename, line, name in reversed(frames):
        if _is_users(filename):
            relative = os.path.relpath(filename)
            shown = filename if relative.startswith("..") else relative
            return f"{shown}:{line} in {name}"
    return None


def in_user_code(exc: BaseException) -> str:
    """` (at file.py:LINE in FUNCTION)` when the error was raised in the user's code, else ''."""
    where = user_frame(exc)
    return f" (at {where})" if where else ""


# Faults of the machine or the network, not of the user's code, even when raised under it
# (a collective inside a forward, a lost peer): retried by run.max_failures.
_INFRASTRUCTURE = ("CollectiveTimeoutError", "DistError", "DistBackendError", "DistNetworkError",
                   "DistStoreError", "OutOfMemoryError", "RayError", "RayActorError")


def is_deterministic(exc: BaseException) -> bool:
    """Whether retrying cannot help: a `UserError` (a config the model refuses, an unused
    parameter, a model that differs across ranks), or an error raised in the user's own
    code (its innermost frame is theirs) that is no infrastructure fault (`_INFRASTRUCTURE`,
    OSError: a lost peer, a full disk, a busy GPU). Such a failure ends the fit at once."""
    if isinstance(exc, UserError):
        return True
    if isinstance(exc, OSError) or any(c.__name__ in _INFRASTRUCTURE for c in type(exc).__mro__):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _is_users(frames[-1].filename)


START_TRIES = 3  # starts of one fit that a transient start fault may fail before the fit does

# A worker group's start that these failed can succeed when started again with fresh ports:
# (what the error's text says, in torch's, gloo's or the OS's words) -> the cause, as said.
_START_FAULTS = ((("EADDRINUSE", "address already in use"), "a port was taken by another program (EADDRINUSE)"),
                 (("ECONNREFUSED", "connection refused", "connection reset", "DistNetworkError", "DistStoreError",
                   "timed out", "timeout"), "a peer was not reachable yet"))


def start_fault(exc: BaseException) -> Optional[str]:
    """The cause of a worker group's failed start that a start with fresh ports can mend (a
    taken port, a peer not reachable yet), else None. Read from the whole text of the error,
    Ray's wrapping included (the workers' traceback travels as text). Only asked of a failure
    of the start itself (the process group's set-up), which runs none of the user's code."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return next((cause for words, cause in _START_FAULTS if any(w.lower() in text for w in words)), None)


def whole_message(exc: BaseException) -> str:
    """The error as the user needs it, nothing cut: `Type: ` (not for our own `UserError`s,
    whose message is the whole story), every line of the message, and where in the user's
    code it was raised."""
    text = str(exc).strip() or type(exc).__name__
    head = "" if isinstance(exc, UserError) or not str(exc).strip() else f"{type(exc).__name__}: "
    return head + text + in_user_code(exc)


class DataError(UserError, ValueError):
    """A data source that cannot be trained on (missing column, wrong type, too few rows)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (missing, truncated, corrupted or unsafe)."""
