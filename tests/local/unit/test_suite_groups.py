"""`make test`'s test processes take whole files (tests/ray/elastic as one group), so a
module's fixture -- a CLI run, a cluster, a reference fit -- is built once.

Checked with the real pytest-xdist and this suite's own conftest on a few generated test
files: xdist's `--dist loadgroup` had silently stopped grouping under pytest 9.2 (it
rewrites `item._nodeid`, which pytest no longer reads), and the suite built fixtures such
as test_interrupt's CLI run twice.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parents[2]

BODY = '''
import json, os, time
from pathlib import Path
import pytest

LOG = Path(os.environ["GROUPS_LOG"])

@pytest.fixture(scope="module")
def built():
    with LOG.open("a") as f:
        f.write(json.dumps({{"fixture": __name__}}) + "\\n")

@pytest.mark.parametrize("i", range(4))
def test_one(built, i):
    time.sleep(0.05)
    with LOG.open("a") as f:
        f.write(json.dumps({{"file": "{name}", "worker": os.environ["PYTEST_XDIST_WORKER"]}}) + "\\n")
'''


def test_each_file_and_tests_ray_elastic_run_in_one_process_with_one_module_fixture(tmp_path):
    suite = tmp_path / "tests"
    files = ["tests/ray/elastic/test_e1.py", "tests/ray/elastic/test_e2.py", "tests/local/a/test_a.py",
             "tests/local/b/test_b.py", "tests/cluster/test_c.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(BODY.format(name=name))
    for helper in ("conftest.py", "_hooks.py"):  # conftest.py enables the test hooks of _hooks.py
        shutil.copy(TESTS / helper, suite / helper)
    log = tmp_path / "log.jsonl"
    # hypothesis's and anyio's plugins (entry points) are left out: imported in each of the three
    # processes, they were most of this run's CPU and play no part in the scheduling checked here
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio",
                           "--rootdir", str(tmp_path), "tests"], cwd=tmp_path,
                          env={**__import__("os").environ, "GROUPS_LOG": str(log)},
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    workers = {}
    for line in lines:
        if "file" in line:
            workers.setdefault(line["file"], set()).add(line["worker"])
    assert sorted(workers) == sorted(files) and all(len(w) == 1 for w in workers.values()), workers
    assert workers["tests/ray/elastic/test_e1.py"] == workers["tests/ray/elastic/test_e2.py"], workers
    assert len({w for ws in workers.values() for w in ws}) == 2, workers  # both processes had work
    fixtures = [line["fixture"] for line in lines if "fixture" in line]
    assert len(fixtures) == len(files) == len(set(fixtures)), fixtures  # each module's fixture once


def test_the_longest_groups_named_for_the_schedule_still_exist():
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)  # by path: under xdist another module may be `conftest`
    missing = [group for group in conftest.LONGEST_FIRST if not (TESTS.parent / group).exists()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names what is gone: {missing}"


def test_the_folder_gives_the_ray_mark_and_the_tiers_run_cluster_ray_local(tmp_path):
    """`make test-fast` selects tests/local; `-m "not ray"` selects the same tests (the folder
    gives the mark); `make test` starts the cluster tier, then the Ray tier, then the local one;
    a `ray` mark under tests/local is refused."""
    for name in ("tests/local/test_l.py", "tests/ray/test_r.py", "tests/cluster/test_c.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("def test_one():\n    pass\n")
    for helper in ("conftest.py", "_hooks.py"):
        shutil.copy(TESTS / helper, tmp_path / "tests" / helper)

    def collect(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-p", "no:hypothesispytest", "-p", "no:anyio", "--rootdir", str(tmp_path), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    ids = [line for line in collect("tests").stdout.splitlines() if "::" in line]
    assert ids == ["tests/cluster/test_c.py::test_one", "tests/ray/test_r.py::test_one",
                   "tests/local/test_l.py::test_one"], ids
    assert [line for line in collect("-m", "not ray", "tests").stdout.splitlines() if "::" in line] == [
        "tests/local/test_l.py::test_one"]
    (tmp_path / "tests/local/test_l.py").write_text("import pytest\n\n\n@pytest.mark.ray\ndef test_one():\n    pass\n")
    refused = collect("tests")
    assert refused.returncode != 0 and "under tests/local" in refused.stdout + refused.stderr, refused.stdout[-2000:]
