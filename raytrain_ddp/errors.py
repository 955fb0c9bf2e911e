"""Errors meant for the user, not for a traceback.

The CLI prints any `UserError` as one clear message and exits with status 2. Raise one
(or a subclass) wherever bad input is detected; its message must name the offending key,
file, column or value and say what would be accepted.
"""


class UserError(Exception):
    """Bad input from the user: the message is the whole story."""


class DataError(UserError, ValueError):
    """A data source that cannot be trained on (missing column, wrong type, too few rows)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (missing, truncated, corrupted or unsafe)."""
