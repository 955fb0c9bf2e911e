"""The documentation's blocks, parsed and run: shared by tests/local/docs/test_doc_blocks.py (the
static checks, the blocks that need no Ray) and tests/ray/docs/test_doc_blocks_ray.py (the `ray`
blocks). Every shell block in README.md, docs/*.md and benchmarks/README.md is either run,
verbatim, or says why not.

Markers, on the line before the fence:

    <!-- runnable -->                                  run it; it must exit 0
    <!-- runnable: ray timeout=150 exit=2 env=K=V -->  options: `ray` marks a block that
                                                      starts Ray (run in tests/ray/docs),
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

ROOT = Path(__file__).resolve().parents[1]
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


def copy_repo(dest: Path) -> Path:
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


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
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


def param(b: Block):
    return pytest.param(b, id=b.where, marks=[pytest.mark.timeout(b.timeout + 60)])
