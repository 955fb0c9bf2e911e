"""The documentation cannot rot: every shell block in README.md, docs/*.md and
benchmarks/README.md is either run here, verbatim, or says why not.

Markers, on the line before the fence:

    <!-- runnable -->                                  run it; it must exit 0
    <!-- runnable: ray timeout=150 exit=2 env=K=V -->  options: `ray` marks a block that
                                                      starts Ray (skipped by `make test-fast`),
                                                      timeout in seconds (default 60), the
                                                      expected exit status, extra environment
    <!-- not-runnable: reason -->                      cluster-only, GPU-only, long, ...

Each runnable block runs with `bash -e -o pipefail` in a fresh temporary copy of the
repository (whose `.venv` points at this interpreter's environment, and whose `bin/` is
first on PATH), so a block may write `runs/` without touching the real tree. A failure
names the file, the line and the tail of the block's output.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
MARKED = {"yaml", "yml"}  # not run, but a block in these languages may carry a not-runnable marker
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(runnable|not-runnable)\s*(?::(.*?))?\s*-->\s*$")
DEFAULT_TIMEOUT = 60
# What a copy of the repository leaves out: environments, history, outputs.
SKIP_TOP = {".git", ".venv", "runs", "data", "build", "dist", ".pytest_cache", ".hypothesis"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None = None  # "runnable", "not-runnable" or None
    reason: str = ""
    timeout: int = DEFAULT_TIMEOUT
    exit: int = 0
    ray: bool = False
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_options(block: Block, options: str) -> None:
    for word in shlex.split(options):
        key, eq, value = word.partition("=")
        if word == "ray":
            block.ray = True
        elif key == "timeout" and eq:
            block.timeout = int(value)
        elif key == "exit" and eq:
            block.exit = int(value)
        elif key == "env" and "=" in value:
            name, _, val = value.partition("=")
            block.env[name] = val
        else:
            raise ValueError(f"{block.where}: unknown runnable option {word!r} "
                             "(known: ray, timeout=N, exit=N, env=K=V)")


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the marker on the line before it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j]]
        block = Block(path, i + 1, lang, "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        if marker:
            block.marker = marker.group(1)
            options = (marker.group(2) or "").strip()
            if block.marker == "runnable":
                parse_options(block, options)
            else:
                block.reason = options
        found.append(block)
        i = j + 1
    return found


ALL = [b for path in DOCS if path.exists() for b in blocks(path)]
RUNNABLE = [b for b in ALL if b.marker == "runnable"]


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


def _copy_repo(dest: Path) -> Path:
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in {"__pycache__"} or n.endswith(".egg-info")}
        if Path(directory) == ROOT:
            skip |= SKIP_TOP & set(names)
            skip |= {n for n in names if n.startswith((".venv-torch-", ".venv-ray-"))}  # `make compat`'s venvs
        return skip

    repo = dest / "repo"
    shutil.copytree(ROOT, repo, ignore=ignore, symlinks=True)
    (repo / ".venv").symlink_to(Path(sys.prefix))  # `.venv/bin/raytrain-ddp` and `source .venv/bin/activate`
    return repo


def _run(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    # A new user's shell: no test hooks or fault plans from this session, no cluster address.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_DDP_") and k != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(block.env)
    script = cwd / ".doc-block.sh"
    script.write_text(block.text)
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(script)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=block.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's whole process group, nothing else
        out, err = proc.communicate()
        pytest.fail(f"{block.where}: block did not finish within {block.timeout}s\n"
                    f"--- block ---\n{block.text}--- output (tail) ---\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _param(b: Block):
    marks = [pytest.mark.timeout(b.timeout + 60)] + ([pytest.mark.ray] if b.ray else [])
    return pytest.param(b, id=b.where, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_runnable_block(block: Block, tmp_path: Path):
    result = _run(block, _copy_repo(tmp_path))
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
        "docs/configuration.md is stale; regenerate it: .venv/bin/python tests/docs/gen_configuration.py")


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
    """A path (`tests/e2e/test_job_submit.py`) or a test (`test_x.py::test_y`) named in the
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
