"""The documentation cannot rot: every shell block in README.md, docs/*.md and
benchmarks/README.md is either run here, verbatim, or says why not (the blocks marked
`ray` run in tests/ray/docs/test_doc_blocks_ray.py; markers and how a block runs: tests/_doc_blocks.py);
the links, the code tour and the files and tests the docs name exist.
"""


from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from _doc_blocks import ALL, DOCS, FENCE, RUNNABLE, ROOT, SHELL, Block, copy_repo, param, run_block


def test_every_shell_block_says_whether_it_runs():
    problems = []
    for b in ALL:
        if b.marker == "runnable" and b.lang not in SHELL:
            problems.append(f"{b.where}: a ```{b.lang or '(no language)'} block is marked runnable; only shell blocks run")
        elif b.marker == "not-runnable" and not b.reason:
            problems.append(f"{b.where}: not-runnable needs a reason, e.g. <!-- not-runnable: cluster-only -->")
        elif b.marker is None and b.lang in SHELL:
            problems.append(f"{b.where}: ```{b.lang} block has no marker; put <!-- runnable --> or "
                            "<!-- not-runnable: reason --> on the line before it")
    assert not problems, "\n".join(problems)


def test_runnable_blocks_stay_cheap():
    """The doc-test runs on every `make test`: the budget is a minute and a half on 2 cores."""
    ray_blocks = [b.where for b in RUNNABLE if b.ray]
    assert len(ray_blocks) <= 2, f"more than two runnable blocks start Ray: {ray_blocks}"
    assert all(b.timeout <= 180 for b in RUNNABLE), [b.where for b in RUNNABLE if b.timeout > 180]


@pytest.mark.parametrize("block", [param(b) for b in RUNNABLE if not b.ray])
def test_runnable_block(block: Block, tmp_path: Path):
    result = run_block(block, copy_repo(tmp_path))
    assert result.returncode == block.exit, (
        f"{block.where}: block exited {result.returncode}, expected {block.exit}\n"
        f"--- block ---\n{block.text}--- stderr (tail) ---\n{result.stderr[-3000:]}\n"
        f"--- stdout (tail) ---\n{result.stdout[-1500:]}")


def test_configuration_reference_is_current():
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from gen_configuration import PAGE, render
    finally:
        sys.path.pop(0)
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is stale; regenerate it: .venv/bin/python tests/local/docs/gen_configuration.py")


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_resolve():
    problems = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked offline
                file, _, anchor = target.partition("#")
                dest = (doc.parent / file).resolve() if file else doc
                where = f"{doc.relative_to(ROOT)}:{n}"
                if not dest.exists():
                    problems.append(f"{where}: link to missing {file}")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


# docs/code-tour.md's table and the package tree agree, both ways. While the
# layout moves, these known differences are allowed; delete each one as it is resolved.
TOUR_PENDING_MISSING: set[str] = set()  # files the tour may name before they land
TOUR_PENDING_UNLISTED: set[str] = set()  # files that may exist before the tour names them
TOUR_NOT_LISTED = {"__main__.py"}  # and every subpackage's __init__.py


def _tour_paths() -> set[str]:
    """Paths under raytrain_ddp/ named in the first column of the tour table; in a cell such as
    `parallel/naive.py`, `bucketed.py`, later names share the first one's folder."""
    paths = set()
    for line in (ROOT / "docs" / "code-tour.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = None
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            name = name.removeprefix("raytrain_ddp/")
            path = name if folder is None or "/" in name else f"{folder}/{name}"
            folder = folder if folder is not None else (str(Path(path).parent) if "/" in path else "")
            paths.add(path)
    return paths


def test_code_tour_matches_the_tree():
    package = ROOT / "raytrain_ddp"
    listed = _tour_paths()
    missing = sorted(p for p in listed - TOUR_PENDING_MISSING if not (package / p).exists())
    covered = {p.rstrip("/") for p in listed}
    unlisted = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel in TOUR_NOT_LISTED or rel in TOUR_PENDING_UNLISTED or (rel.endswith("/__init__.py")):
            continue
        if rel not in covered and not any(rel.startswith(c + "/") for c in covered):
            unlisted.append(rel)
    assert not missing and not unlisted, (
        f"docs/code-tour.md names files that do not exist: {missing}; "
        f"modules it does not mention: {unlisted}")


NAMED = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|yaml)|test_\w+\.py)(?:::(\w+))?`")


def test_named_files_and_tests_exist():
    """A path (`tests/cluster/test_job_submit.py`) or a test (`test_x.py::test_y`) named in the
    docs exists; a bare test file name is looked up under tests/. Paths inside the package
    may be written relative to raytrain_ddp/."""
    problems = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for name, test in NAMED.findall(line):
                candidates = [ROOT / name, ROOT / "raytrain_ddp" / name]
                if "/" not in name:
                    candidates += list((ROOT / "tests").rglob(name))
                found = [c for c in candidates if c.is_file()]
                where = f"{doc.relative_to(ROOT)}:{n}"
                if not found and name not in TOUR_PENDING_MISSING:
                    problems.append(f"{where}: names {name}, which does not exist")
                elif test and not any(re.search(rf"def {test}\b", f.read_text()) for f in found):
                    problems.append(f"{where}: {name} has no test {test}")
    assert not problems, "\n".join(problems)
