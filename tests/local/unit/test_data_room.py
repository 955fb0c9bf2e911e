"""The data room's place in the layers, read from the code's own imports (issue #29).

`raytrain_ddp.data` is the lowest layer of the product (data <- worker <- driver): it
imports nothing from `worker`, `driver` or `ops`, directly or through the modules it
uses; the driver and `user.py` take the column helpers from it, not from the worker;
and nobody outside it reaches for its private names. Every import counts, including
those inside functions (the product imports torch, Ray and often its own modules lazily).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
ABOVE_DATA = ("raytrain_ddp.worker", "raytrain_ddp.driver", "raytrain_ddp.ops")
# The shared low-level modules the data room may use (besides itself).
DATA_MAY_IMPORT = ("raytrain_ddp.data", "raytrain_ddp.config", "raytrain_ddp.errors", "raytrain_ddp.job",
                   "raytrain_ddp.rundir", "raytrain_ddp.batch", "raytrain_ddp.parallel.collectives")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    where = PACKAGE.parent.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file, at any depth."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if _is_module(f"{base}.{n}")]
            yield from ((sub, [], node.lineno) for sub in submodules)
            rest = [n for n in names if f"{base}.{n}" not in submodules]
            if rest or not submodules:
                yield base, rest, node.lineno


def _product_imports(path: Path) -> list[tuple[str, list[str], int]]:
    return [(m, names, line) for m, names, line in _imports(path) if m == "raytrain_ddp" or m.startswith("raytrain_ddp.")]


def _file_of(module: str) -> Path:
    where = PACKAGE.parent.joinpath(*module.split("."))
    return where / "__init__.py" if where.is_dir() else where.with_suffix(".py")


def _data_files() -> list[Path]:
    files = sorted((PACKAGE / "data").rglob("*.py"))
    assert len(files) >= 6, files  # columns, sources, steps, store, ray_datasets, worker_data
    return files


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_data_imports_nothing_from_worker_driver_or_ops():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in _data_files() for module, _, line in _product_imports(path) if _within(module, ABOVE_DATA)]
    assert not bad, "raytrain_ddp.data is the lowest layer (data <- worker <- driver):\n" + "\n".join(bad)


def test_data_uses_only_the_shared_low_level_modules():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in _data_files() for module, _, line in _product_imports(path)
           if not _within(module, DATA_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_nothing_data_imports_leads_above_it():
    """Through the modules data uses (config, job, batch, ...), transitively: still no worker, driver or ops."""
    seen: dict[str, str] = {_module_name(p): "" for p in _data_files()}
    todo = list(seen)
    while todo:
        module = todo.pop()
        path = _file_of(module)
        if not path.is_file():
            continue
        for target, _, line in _product_imports(path):
            assert not _within(target, ABOVE_DATA), f"{module}:{line} imports {target} (reached from data via {seen[module] or module})"
            if target not in seen:
                seen[target] = seen[module] or module
                todo.append(target)


def _column_helpers() -> set[str]:
    """The public names the data room defines (column helpers, readers, sources)."""
    names: set[str] = set()
    for path in _data_files():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_driver_and_user_take_data_from_the_data_room_not_the_worker():
    helpers = _column_helpers()
    assert {"TRAIN", "VAL", "column_arrays", "user_column_arrays", "stack_column", "arrow_numpy",
            "WorkerData"} <= helpers
    files = sorted((PACKAGE / "driver").rglob("*.py")) + [PACKAGE / "user.py"]
    bad = []
    for path in files:
        for module, names, line in _product_imports(path):
            if module == "raytrain_ddp.worker.shard" or (_within(module, ("raytrain_ddp.worker",))
                                                         and set(names) & helpers):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} takes {names or module} from {module}")
    assert not bad, "data helpers come from raytrain_ddp.data, not the worker:\n" + "\n".join(bad)
    user = _product_imports(PACKAGE / "user.py")
    assert not [m for m, _, _ in user if _within(m, ("raytrain_ddp.worker", "raytrain_ddp.driver"))], user


def test_no_module_outside_data_uses_its_private_names():
    """What verify and local mode once took privately from `driver/datasets.py` is public now."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _within(_module_name(path), ("raytrain_ddp.data",)):
            continue
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("raytrain_ddp.data"):
                bad += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
                aliases |= {a.asname or a.name for a in node.names if _is_module(f"{node.module}.{a.name}")}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.asname and a.name.startswith("raytrain_ddp.data")}
        bad += [f"{path.name}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")]
    assert not bad, "private names of raytrain_ddp.data used outside it:\n" + "\n".join(bad)


def test_the_import_walk_sees_imports_inside_functions():
    """The checks above would pass vacuously if lazy imports were missed."""
    lazy = [m for m, _, _ in _product_imports(PACKAGE / "data" / "ray_datasets.py")]
    assert "raytrain_ddp.data.store" in lazy and "raytrain_ddp.rundir" in lazy  # both inside write_stores
