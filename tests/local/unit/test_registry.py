"""The strategy registry is the one place that says what a strategy is.

A strategy name written as a string anywhere else in the package (docstrings and comments
aside) fails, naming file:line; the config's choices, `wrap_model`'s options, recovery
and verify are checked to read the table.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from _source import docstring_ids

from raytrain_ddp.parallel import registry

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
REGISTRY = PACKAGE / "parallel" / "registry.py"
# The benchmarks name the strategies they measure: their measurement points and the keys of
# their results files (benchmarks/*.json, read back by benchmarks/report.py) are data about
# named strategies, not the list of what a strategy is (their lists of strategies do read
# the registry: benchmarks/accumulation.py, memory.py). Nothing else may be added here.
_NAMED_MEASUREMENTS = ("benchmarks/gpu.py", "benchmarks/ingest.py",
                       "benchmarks/report.py", "benchmarks/strategies.py")




def test_strategy_names_are_written_only_in_the_registry():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY or path.relative_to(PACKAGE.parent).as_posix() in _NAMED_MEASUREMENTS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docs = docstring_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in registry.NAMES and id(node) not in docs:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, ("strategy names outside parallel/registry.py (read the registry instead):\n"
                       + "\n".join(found))


def test_the_table():
    assert registry.NAMES == ("naive", "bucketed", "native", "zero1", "fsdp")
    assert registry.REPLICATED + registry.SHARDED == registry.NAMES
    assert registry.DEFAULT in registry.NAMES and registry.TUNERS == ("bucketed",)
    assert all(set(s.precision) <= set(registry.PRECISIONS) for s in registry.STRATEGIES.values())
    with pytest.raises(ValueError, match="parallel.strategy='zero3' is not one of"):
        registry.get("zero3", "parallel.strategy")


def test_each_row_loads_its_class_and_options_are_wrap_models():
    from raytrain_ddp.parallel import wrap_model

    keywords = set(inspect.signature(wrap_model).parameters) - {"module", "strategy", "process_group"}
    for spec in registry.STRATEGIES.values():
        assert spec.load().strategy == spec.name
        if spec.local:
            assert spec.load_local().strategy == spec.name
        assert set(spec.options) | set(registry.COMMON_OPTIONS) <= keywords, spec.name
        init = set(inspect.signature(spec.load().__init__).parameters)
        assert set(spec.options) | set(registry.COMMON_OPTIONS) <= init, spec.name


def test_config_and_recovery_read_the_registry():
    from raytrain_ddp.config import ParallelConfig, config_keys, load_config

    field = ParallelConfig.model_fields["strategy"]
    assert field.annotation.__args__ == registry.NAMES and field.default == registry.DEFAULT
    parallel_keys = {k.removeprefix("parallel.") for k in config_keys() if k.startswith("parallel.")}
    for spec in registry.STRATEGIES.values():  # every option that is a config key is named as one
        assert {o for o in spec.options if o in parallel_keys} <= parallel_keys
        load_config(None, [f"parallel.strategy={spec.name}"])
    source = (PACKAGE / "recovery" / "table.py").read_text()  # the recovery table reads the capability flag
    assert "registry.get(cfg.parallel.strategy).replicated" in source
