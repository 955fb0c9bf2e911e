"""The package's layers, from every import in its source (module level and inside functions).

Rules (docs/design.md, "Layers"): no import cycle between the package's parts (its
subpackages and top-level modules), nor between its modules; the package imports the
standard library, its declared dependencies (pyproject.toml, and what they pull in with
the extras named there) and itself, never the checkout (`benchmarks/`, `tests/`: the test
machinery lives in tests/, and `worker/hooks.py` loads the tests' hooks by the file named
in an environment variable, never by an import statement); `parallel` imports only torch
(numpy) and the standard library, nothing of ours outside itself; `ops` is never imported
by the product; `data` <- `worker` <- `driver`; `scaling.local`, `scaling.launcher` and
`run.recovery` are read only by their tables (launch/table.py, recovery/table.py).
The CLI (`cli.py`, and `__main__.py` which runs it) is the top entry point: it is
a node of its own, above `ops`, and it dispatches to `ops` only from inside its command
handlers, never at module level. Every edge is read with `ast.walk`, so an import inside
a function counts as much as one at the top of a file; one under `if TYPE_CHECKING:` never
runs and is no edge.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
ENTRY = {"raytrain_ddp.cli": "cli", "raytrain_ddp.__main__": "cli"}  # the top node
ABOVE_THE_PRODUCT = {"ops", "cli"}
CHECKOUT = {"benchmarks", "tests", "conftest"}  # folders of the repository, never in the wheel
PARALLEL_THIRD_PARTY = {"torch", "numpy"}
# Edges the data room removes (driver/datasets.py, worker/shard.py and store.py move into
# raytrain_ddp/data/). Each is (importing file, imported module). Empty this list after
# merging the data room; nothing else may be added here.
_PENDING_DATA_ROOM: set[tuple[str, str]] = set()  # emptied: the data room is merged


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module of ours (dotted) or a third-party top-level name
    file: str
    line: int
    top_level: bool  # at module level (not inside a function or class body)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def _import_lines(tree: ast.AST, inside: type | tuple[type, ...]) -> set[int]:
    """The lines of the imports inside a node of the kind `inside` (a function; an `if`)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, inside) and (not isinstance(node, ast.If) or _type_checking(node)):
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    lines.add(child.lineno)
    return lines


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _edges_of(path: Path) -> list[Edge]:
    source = _module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    in_functions = _import_lines(tree, (ast.FunctionDef, ast.AsyncFunctionDef))
    never_run = _import_lines(tree, ast.If)
    rel_file = path.relative_to(PACKAGE.parent).as_posix()
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name where there is one, else pkg
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        if targets and node.lineno in never_run:
            continue
        for target in targets:
            edges.append(Edge(source, target, rel_file, node.lineno, node.lineno not in in_functions))
    return edges


@functools.lru_cache(maxsize=1)
def _all_edges() -> list[Edge]:
    return tuple(e for path in sorted(PACKAGE.rglob("*.py")) for e in _edges_of(path))


def _part(module: str) -> str:
    """The node of the package graph: `driver`, `parallel`, `config`, `errors`, ... or `cli`."""
    if module in ENTRY:
        return ENTRY[module]
    return module.split(".")[1] if module.count(".") >= 1 else module


def _ours(edge: Edge) -> bool:
    return edge.target == "raytrain_ddp" or edge.target.startswith("raytrain_ddp.")


def _internal(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if _ours(e) and e.target != "raytrain_ddp"
            and (e.file, e.target) not in _PENDING_DATA_ROOM]


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path [a, b, ..., a], or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_walk_sees_imports_inside_functions():
    """The walker itself: a function-level import is an edge (the circle the issue found was one)."""
    cli = [e for e in _all_edges() if e.file == "raytrain_ddp/cli.py" and not e.top_level]
    assert any(e.target.startswith("raytrain_ddp.ops") for e in cli), cli
    assert not [e for e in _all_edges() if e.file.endswith("parallel/__init__.py") and e.target.startswith(
        "raytrain_ddp.ops")], "parallel/__init__.py must not reach ops (it re-exported verify)"


def test_no_import_cycle_between_the_packages_parts():
    graph: dict[str, set[str]] = {}
    witnesses: dict[tuple[str, str], str] = {}
    for e in _internal(_all_edges()):
        a, b = _part(e.source), _part(e.target)
        if a != b:
            graph.setdefault(a, set()).add(b)
            witnesses.setdefault((a, b), e.where)
    cycle = _cycle(graph)
    assert not cycle, "import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {witnesses[(a, b)]}" for a, b in zip(cycle, cycle[1:]))


def test_parallel_imports_only_torch_and_the_standard_library():
    bad = []
    for e in _all_edges():
        if _part(e.source) != "parallel":
            continue
        top = e.target.split(".")[0]
        if _ours(e):
            if _part(e.target) != "parallel":
                bad.append(f"{e.where}: imports {e.target} (parallel/ imports nothing of ours outside itself)")
        elif top not in PARALLEL_THIRD_PARTY and top not in sys.stdlib_module_names and top != "__future__":
            bad.append(f"{e.where}: imports {e.target} (parallel/ imports only torch and the standard library)")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_the_packages_modules():
    """Within a part too: two modules that import each other (even from inside functions,
    as driver/launcher.py and driver/torchrun.py did) are one module in two files."""
    graph: dict[str, set[str]] = {}
    witnesses: dict[tuple[str, str], str] = {}
    for e in _internal(_all_edges()):
        if e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
            witnesses.setdefault((e.source, e.target), e.where)
    cycle = _cycle(graph)
    assert not cycle, "import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {witnesses[(a, b)]}" for a, b in zip(cycle, cycle[1:]))


def _declared_distributions() -> set[str]:
    """pyproject.toml's requirements (dependencies and every extra), and theirs for the extras
    named there (`ray[train]` brings tensorboardX): normalised distribution names."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + sum(project["optional-dependencies"].values(), [])]
    names = {canonicalize_name(r.name) for r in wanted}
    for req in wanted:
        for sub in md.requires(req.name) or []:
            sub = Requirement(sub)
            if sub.marker is None or any(sub.marker.evaluate({"extra": x}) for x in req.extras):
                names.add(canonicalize_name(sub.name))
    return names


def test_the_package_imports_the_standard_library_its_dependencies_and_itself_only():
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    declared, owners = _declared_distributions(), md.packages_distributions()
    bad = []
    for e in _all_edges():
        top = e.target.split(".")[0]
        if _ours(e) or top in sys.stdlib_module_names or top == "__future__":
            continue
        if top in CHECKOUT:
            bad.append(f"{e.where}: imports {e.target} (the checkout's, never in the wheel)")
        elif not {canonicalize_name(d) for d in owners.get(top, [])} & declared:
            bad.append(f"{e.where}: imports {e.target}, no declared dependency of pyproject.toml")
    assert not bad, "\n".join(bad)
    assert not (PACKAGE / "testing").exists(), "test machinery belongs in tests/, outside the wheel"


def test_only_the_bench_tier_imports_the_benchmarks():
    """The bench's own tests (tests/local/bench/, tests/ray/bench/) import benchmarks/; no other test does (the two-node
    cluster's helper is tests/_two_node.py, which the bench imports from there)."""
    tests = PACKAGE.parent / "tests"
    bad = []
    for path in sorted(tests.rglob("*.py")):
        if path.parent.name == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(tests.parent)}:{node.lineno}: imports {n}" for n in names
                    if n.split(".")[0] == "benchmarks"]
    assert not bad, "\n".join(bad)


# The keys only their table reads (the one place each value is compared): each row says what
# the value means, so nothing else branches on it. (The schema defines them.)
TABLE_KEYS = {("scaling", "local"): "raytrain_ddp/launch/table.py",
              ("scaling", "launcher"): "raytrain_ddp/launch/table.py",
              ("run", "recovery"): "raytrain_ddp/recovery/table.py"}


def test_launcher_and_recovery_keys_are_read_only_by_their_tables():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                owner = TABLE_KEYS.get((node.value.attr, node.attr))
                if owner is not None and rel not in (owner, "raytrain_ddp/config/schema.py"):
                    bad.append(f"{rel}:{node.lineno}: reads {node.value.attr}.{node.attr} (ask {owner})")
    assert not bad, "\n".join(bad)


def test_the_product_never_imports_ops():
    bad = [f"{e.where}: imports {e.target}" for e in _internal(_all_edges())
           if _part(e.source) not in ABOVE_THE_PRODUCT and _part(e.target) == "ops"]
    assert not bad, "the product imports the operator tools:\n" + "\n".join(bad)


def test_the_cli_reaches_ops_only_from_its_command_handlers():
    eager = [f"{e.where}: {e.target}" for e in _all_edges()
             if _part(e.source) == "cli" and _part(e.target) == "ops" and e.top_level]
    assert not eager, "module-level imports of ops in the CLI (import them in the handler):\n" + "\n".join(eager)


def test_hooks_seam_loads_the_tests_hooks_by_file_only():
    hooks = PACKAGE / "worker" / "hooks.py"
    assert not [e for e in _edges_of(hooks) if e.target.split(".")[0] in CHECKOUT]
    assert "spec_from_file_location" in hooks.read_text()


@pytest.mark.parametrize("lower, higher", [("data", "worker"), ("data", "driver"), ("worker", "driver")])
def test_layers_data_worker_driver(lower, higher):
    bad = [f"{e.where}: imports {e.target}" for e in _internal(_all_edges())
           if _part(e.source) == lower and _part(e.target) == higher]
    assert not bad, f"{lower}/ must not import {higher}/:\n" + "\n".join(bad)


def test_pending_allowances_are_still_needed():
    """Each allowance names an edge that still exists: the list only shrinks."""
    present = {(e.file, e.target) for e in _all_edges()}
    stale = sorted(_PENDING_DATA_ROOM - present)
    assert not stale, f"remove these from _PENDING_DATA_ROOM, the edges are gone: {stale}"


def test_config_and_the_registry_load_without_torch():
    """The config reads the strategy table: both stay light (parallel/__init__.py is lazy)."""
    import subprocess

    code = ("import sys, raytrain_ddp.config, raytrain_ddp.parallel.registry, raytrain_ddp.errors; "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'torch or ray imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
