"""No module over 500 lines and no function over 60 without a one-line reason (issue #42; STYLE.md:
"keep modules small and functions short").

A module's reason is a top-level comment `# Over 500 lines: <why>` (by convention right after its
docstring); a function's is `# Over 60 lines: <why>` on the line just above its `def` (or above
its first decorator). A function's length runs from its `def` to its last line; a file's is its
line count. Read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
MAX_FILE, MAX_FUNCTION = 500, 60
FILE_REASON = re.compile(rf"^# Over {MAX_FILE} lines: \S")
FUNCTION_REASON = re.compile(rf"^\s*# Over {MAX_FUNCTION} lines: \S")


def _unexplained(path: Path, where: str) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    bad = []
    if len(lines) > MAX_FILE and not any(FILE_REASON.match(line) for line in lines):
        bad.append(f"{where}: {len(lines)} lines, no '# Over {MAX_FILE} lines: <why>' line")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            above = lines[first - 2] if first >= 2 else ""
            if length > MAX_FUNCTION and not FUNCTION_REASON.match(above):
                bad.append(f"{where}:{node.lineno}: {node.name} is {length} lines, "
                           f"no '# Over {MAX_FUNCTION} lines: <why>' line above it")
    return bad


def test_long_files_and_functions_say_why():
    bad = [line for path in sorted(PACKAGE.rglob("*.py"))
           for line in _unexplained(path, path.relative_to(PACKAGE.parent).as_posix())]
    assert not bad, "split it, or say why in one line:\n" + "\n".join(bad)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    """The walker itself: a reason line counts only where it belongs, and only with a reason."""
    body = "    x = 1\n" * MAX_FUNCTION
    source = tmp_path / "long.py"
    source.write_text("def bare():\n" + body + "\n# Over 60 lines: a reason.\n@staticmethod\ndef kept():\n" + body
                      + "\n# Over 60 lines:\ndef empty_reason():\n" + body + "\ndef short():\n    pass\n"
                      + "y = 0\n" * MAX_FILE)
    found = " ".join(_unexplained(source, "long.py"))
    assert "bare" in found and "empty_reason" in found and "kept" not in found and "short" not in found
    assert "no '# Over 500 lines" in found
    source.write_text("# Over 500 lines: a reason.\n" + "y = 0\n" * MAX_FILE)
    assert _unexplained(source, "long.py") == []
