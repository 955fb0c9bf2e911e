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


def listening_sockets(pids) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, command line) of every listening TCP socket the processes `pids` hold."""
    import os
    import socket

    owners: dict[str, tuple[int, str]] = {}
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owners[link[8:-1]] = (pid, cmd)
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little endian
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16), *owners[fields[9]]))
    return found


def in_session(session_id: int) -> list[int]:
    """Every process of session `session_id`, now."""
    import os

    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getsid(int(proc.name)) == session_id:
                    out.append(int(proc.name))
            except OSError:
                continue
    return out


def loopback(address: str) -> bool:
    return address in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def ctrl_c_after_three_steps(proc, metrics: Path, wait_s: float) -> str:
    """Ctrl-C `proc` once `metrics` holds 3 training lines (within `wait_s`); its whole output."""
    import signal
    import time

    from raytrain_ddp.rundir import read_metrics

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len([r for r in read_metrics(metrics) if "loss" in r]) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=120)[0]
