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
from typing import Optional

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _library_dirs() -> tuple[str, ...]:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    ours = os.path.dirname(os.path.abspath(__file__))
    return tuple(os.path.abspath(p) + os.sep for p in paths | {ours} if p)


def _is_users(filename: str) -> bool:
    if filename.startswith("<") or not filename.endswith(".py"):
        return False  # <frozen ...>, <string>: not a file the user can open
    path = os.path.abspath(filename)
    ours = f"{os.sep}raytrain_ddp{os.sep}" in path  # any copy of this package (a worker may import another)
    return not ours and not path.startswith(_library_dirs())


def user_frame(exc: BaseException) -> Optional[str]:
    """`file.py:LINE in FUNCTION` of the innermost frame of the user's code, or None."""
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    if not any(_is_users(f[0]) for f in frames):  # a remote error carries its traceback as text
        frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME.finditer(str(exc))]
    for filename, line, name in reversed(frames):
        if _is_users(filename):
            shown = os.path.relpath(filename) if not os.path.relpath(filename).startswith("..") else filename
            return f"{shown}:{line} in {name}"
    return None


def in_user_code(exc: BaseException) -> str:
    """` (at file.py:LINE in FUNCTION)` when the error was raised in the user's code, else ''."""
    where = user_frame(exc)
    return f" (at {where})" if where else ""


class UserError(Exception):
    """Bad input from the user: the message is the whole story."""


class DataError(UserError, ValueError):
    """A data source that cannot be trained on (missing column, wrong type, too few rows)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (missing, truncated, corrupted or unsafe)."""
