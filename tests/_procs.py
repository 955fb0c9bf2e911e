"""Processes a test started, from /proc: their stat fields and their descendants.

Tests stop only what they started, by pid: they take the tree below a process they
launched (Ray's daemons included) and check or kill exactly those pids.
"""

from __future__ import annotations

from pathlib import Path


def stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name: [state, ppid, ...]; [] when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(root: int) -> list[int]:
    """Every process below `root`, now."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (fields := stat(int(proc.name))):
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
