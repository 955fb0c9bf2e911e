"""`cluster/local-two-node.sh`'s wait for its nodes, with a stand-in Python (no Ray): a probe
whose own Ray driver died connecting (CI saw "Failed to get the system config from raylet
because it is dead" while the second node registered) is run again until the timeout; a
start-up that timed out (3) is not; nothing is retried past the timeout. Each start of the
cluster picks its ports afresh, and a start that failed on a port taken meanwhile is told apart."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = Path(__file__).resolve().parents[3] / "cluster" / "local-two-node.sh"
FAKE = """#!/usr/bin/env bash
# A probe: fails (exit 1) until it has run $FAILS times, then succeeds; counts its runs in $COUNT.
n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$COUNT"
cat > /dev/null
(( n > FAILS )) && { echo "local-two-node: 2 nodes alive"; exit 0; }
exit "${STATUS:-1}"
"""


def _wait_for_nodes(tmp_path: Path, fails: int, status: int = 1, timeout_s: int = 20) -> tuple[int, str, int]:
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / "env").write_text("export RAY_ADDRESS=127.0.0.1:1\n")
    count = tmp_path / "count"
    count.unlink(missing_ok=True)
    env = {**os.environ, "RAY": "/bin/true", "PYTHON": str(fake), "RT2N_UP_TIMEOUT_S": str(timeout_s),
           "FAILS": str(fails), "STATUS": str(status), "COUNT": str(count)}
    done = subprocess.run(["bash", "-c", f'source "{SCRIPT}"; wait_for_nodes "{state}" 2'], env=env,
                          capture_output=True, text=True, timeout=50)
    return done.returncode, done.stderr, int(count.read_text())


def test_a_probe_whose_driver_died_is_run_again(tmp_path):
    rc, err, runs = _wait_for_nodes(tmp_path, fails=2)
    assert rc == 0 and runs == 3 and err.count("probing again") == 2, err


def test_a_timed_out_start_is_not_probed_again_and_nothing_outlives_the_timeout(tmp_path):
    rc, err, runs = _wait_for_nodes(tmp_path, fails=5, status=3)
    assert rc == 3 and runs == 1, err
    started = time.monotonic()
    rc, err, runs = _wait_for_nodes(tmp_path, fails=1000, timeout_s=3)
    assert rc == 1 and 2 <= runs <= 5 and time.monotonic() - started < 15, (rc, runs, err)


def test_each_start_picks_fresh_ports_and_a_taken_port_is_recognised(tmp_path):
    """`cmd_up` calls `write_start_commands` before each try: new ports in head.cmd, node.cmd
    and env each time; `port_taken` finds Ray's bind error in either node's log."""
    state = tmp_path / "state"
    state.mkdir()
    script = (f'source "{SCRIPT}"; for i in 1 2; do write_start_commands "{state}"; echo "$GCS $DASH"; '
              f'cat "{state}/head.cmd" > "{state}/head.cmd.$i"; done; '
              f'port_taken "{state}" && echo taken-before; '
              f'echo "OSError: [Errno 98] Address already in use" > "{state}/node.log"; '
              f'port_taken "{state}" && echo taken-after; rm "{state}/node.log"; '
              f'echo "ValueError: Failed to bind to 127.0.0.1:9 because it\'s already occupied." > "{state}/head.log"; '
              f'port_taken "{state}" && echo taken-checked')
    done = subprocess.run(["bash", "-c", script], env={**os.environ, "RAY": "/bin/true"}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    first, second = (lines[0], lines[1]), (lines[2], lines[3])
    assert first != second, lines  # a new GCS / dashboard port pair (15 random free ports each time)
    assert f"--port={second[0]}" in (state / "head.cmd.2").read_text()
    assert f"--dashboard-port={second[1]}" in (state / "head.cmd.2").read_text()
    assert f"RAY_ADDRESS=127.0.0.1:{second[0]}" in (state / "env").read_text()
    assert f"--address=127.0.0.1:{second[0]}" in (state / "node.cmd").read_text()
    assert lines[4:] == ["taken-after", "taken-checked"], lines  # bound meanwhile; taken before Ray's own check
