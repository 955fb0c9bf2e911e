"""The rank launcher for tests: re-exported from `raytrain_ddp.ops.ranks` (read its docstring).

Kept so tests can `from _spawn import run_ranks` (`tests/` is on sys.path: pyproject.toml's
pytest `pythonpath`). Must not grow code of its own: the package and the tests
share one launcher.
"""

from raytrain_ddp.ops.ranks import RankException, RankFailed, RankTimeout, free_port, run_ranks

__all__ = ["run_ranks", "free_port", "RankFailed", "RankTimeout", "RankException"]
