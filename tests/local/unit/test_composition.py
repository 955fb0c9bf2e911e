"""Components are composed at construction: nothing in `worker/` assigns to a method or to a private
attribute of an object it did not create (issue #42; docs/design.md, "Layers").

Read with `ast.walk` over every module of `worker/`: an assignment (or `setattr`) whose target is
`x.attr` with `x` not `self`/`cls` fails when `attr` is private (`_name`), when it names a method
defined by any class of the package, or when the value is a function defined in the same module
or a lambda (a method replaced by a wrapper). A public field of another object that is no
method (`checkpointer.saved_step = step`) is allowed; a private one is flagged even on an object
the function has just built (no exemption is made for that).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
WORKER = PACKAGE / "worker"


def _method_names() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not n.name.startswith("__")}
    return names


def _patches(path: Path, methods: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    bad = []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    pairs.append((t, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant):
            pairs.append((ast.Attribute(value=node.args[0], attr=node.args[1].value), node.args[2]))
        for target, value in pairs:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            why = ("a private attribute" if target.attr.startswith("_") and not target.attr.startswith("__") else
                   "a method" if target.attr in methods else
                   "a function put in its place" if isinstance(value, ast.Lambda) or (
                       isinstance(value, ast.Name) and value.id in functions) else "")
            if why:
                where = path.relative_to(PACKAGE.parent).as_posix() if path.is_relative_to(PACKAGE) else path.name
                bad.append(f"{where}:{node.lineno}: "
                           f"{ast.unparse(target)} = ... ({why} of an object it did not create)")
    return bad


def test_nothing_in_worker_patches_another_components_methods_or_private_attributes():
    methods = _method_names()
    bad = [line for path in sorted(WORKER.rglob("*.py")) for line in _patches(path, methods)]
    assert not bad, "compose at construction instead (a constructor parameter, a public method):\n" + "\n".join(bad)


def test_the_check_sees_what_live_recovery_used_to_do(tmp_path):
    """The walker itself, on the patterns issue #42 found in recovery/live.py."""
    source = tmp_path / "patchy.py"
    source.write_text(
        "def f(checkpointer, guard, log, manager):\n"
        "    def wrapped(*a):\n        pass\n"
        "    checkpointer.save = wrapped\n"
        "    guard.agree = lambda values: values\n"
        "    log.meter._comm_start = {}\n"
        "    setattr(manager, '_quorum_id', 1)\n"
        "    checkpointer.saved_step = 3\n")
    found = _patches(source, {"save"})
    assert len(found) == 4 and all(what in " ".join(found) for what in
                                   ("checkpointer.save", "guard.agree", "log.meter._comm_start", "manager._quorum_id"))
