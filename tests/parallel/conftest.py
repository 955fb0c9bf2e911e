"""Makes `tests/` importable so tests can `from _spawn import run_ranks` (the shared rank launcher)."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
