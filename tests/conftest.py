"""Shared fixtures: one lazy local Ray instance per session, and process-group hygiene.

The suite is tiered by cost, by folder (the folder is the truth): tests/local/ starts no Ray
(`make test-fast` runs it), tests/ray/ uses the session's embedded instance or runs the CLI
on an embedded one, tests/cluster/ starts its own head or nodes. Collection gives every test
under tests/ray and tests/cluster the `ray` marker (so `-m "not ray"` still selects the local
tier) and refuses a `ray` mark or the `ray_cluster` fixture in tests/local.

`ray_cluster` starts Ray only when a test asks for it and shuts it down at the end of the
session. It mirrors what `raytrain-ddp train` does on this machine: more logical CPUs than
cores (workers + Ray Data tasks), no dashboard head nor autoscaler monitor, node bound to
127.0.0.1, workers at this process's niceness.

Test hooks: every run started from this session (in process, or as a child process that
inherits the environment) loads `tests/_hooks.py:from_env` on its workers (by the file's
path: Ray's workers and torchrun's ranks need no `sys.path` of ours), so a test injects a
fault by setting `RAYTRAIN_DDP_FAULT` / `RAYTRAIN_DDP_PREEMPT`; without those the hooks do
nothing. The test machinery lives here in tests/, never in the package.

`_no_leaked_process_group` (autouse) fails any test that leaves a torch.distributed
process group initialised in the test process, and tears it down so the next test
starts clean.
"""

from __future__ import annotations

import os

import pytest

# tests/ and the checkout are on sys.path by pyproject.toml's pytest `pythonpath`, set there only.

from _hooks import ENABLE as _TEST_HOOKS  # noqa: E402

os.environ.update(_TEST_HOOKS)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if ray.is_initialized():  # someone else started it: use it, do not stop it
        yield ray
        return
    from raytrain_ddp.ray_compat import lean_local_node, local_instance_kwargs

    with lean_local_node():  # as an embedded run has it: no dashboard, no autoscaler monitor,
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,  # workers at our niceness
                 logging_level="WARNING", **local_instance_kwargs("127.0.0.1"))
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised (call destroy_process_group)")


TIERS = ("cluster", "ray", "local")  # tests/<tier>/..., the order `make test` starts them in


def _tier(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "local"


def _group(nodeid: str) -> str:
    """The unit `make test` hands one test process: a test file, or all of tests/ray/elastic
    (its session fixture, the reference run, is built once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/ray/elastic" if path.startswith("tests/ray/elastic/") else path


# Within its tier, the groups that run for minutes on 2 cores, started first so that neither
# process is left with one of them at the end while the other idles (the local tier, many
# short files, fills the tail). Only a scheduling hint; tests/local/unit/test_suite_groups.py
# checks that each still exists.
LONGEST_FIRST = ("tests/cluster/test_local_two_node.py", "tests/ray/e2e/test_byo.py", "tests/ray/elastic")


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test`: `-n 2`), whole groups (`_group`) go to one process,
    so a module's fixtures (a finished run, the two-node cluster, a CLI run with its
    Ctrl-C) are built once, in the order `pytest_collection_modifyitems` leaves them.
    xdist's own `--dist loadgroup` reads `xdist_group` marks by rewriting `item._nodeid`,
    which pytest 9.2 no longer reads, and its scope reordering (most tests first) would put
    the many quick unit files before the few long Ray ones."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return FileGroups(config, log)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marker this adds
def pytest_collection_modifyitems(config, items):
    """The `ray` marker from the folder; then cluster, Ray, local tiers in that order, each
    tier's longest groups (`LONGEST_FIRST`) at its head: starting them early keeps both test
    processes busy to the end. Stable: file order otherwise."""
    misplaced = []
    for item in items:
        if _tier(item.nodeid) != "local":
            item.add_marker(pytest.mark.ray)
        elif item.get_closest_marker("ray") or "ray_cluster" in getattr(item, "fixturenames", ()):
            misplaced.append(item.nodeid)
    if misplaced:  # `make test-fast` (tests/local) must not start Ray
        raise pytest.UsageError(f"tests that start Ray (a `ray` mark or the ray_cluster fixture) under tests/local; "
                                f"move them to tests/ray or tests/cluster: {misplaced}")

    def key(item) -> tuple[int, int]:
        group = _group(item.nodeid)
        return (TIERS.index(_tier(item.nodeid)),
                LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST))

    items.sort(key=key)
