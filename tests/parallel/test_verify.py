"""`raytrain-ddp verify`: the real command on the quickstart config, and on a deliberately
broken wrapper (tests/parallel/_inject/sitecustomize.py) it must fail naming the parameter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = "examples/configs/quickstart.yaml"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


def _verify(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "raytrain_ddp", "verify", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_quickstart_verifies_and_prints_the_table():
    proc = _verify(QUICKSTART)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "model     cnn, 151,306 parameters" in out
    assert "grad diff param diff buffer diff vs 1 proc" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("naive", "bucketed", "native", "zero1", "fsdp")}
    assert set(rows) == {"naive", "bucketed", "native", "zero1", "fsdp"}, out
    for name, cols in rows.items():
        sharded = name in ("zero1", "fsdp")  # no gradient column: parameters every step instead
        assert (cols[1] == "-") == sharded, (name, cols)
        param, buffer, single = map(float, cols[2:5])
        assert max(param, buffer, single, 0.0 if sharded else float(cols[1])) <= 1e-9, (name, cols)
        # bytes per step == gradient bytes (all-reduce), + parameter bytes (zero1: reduce-scatter
        # + all-gather); fsdp gathers once per forward, so at least that
        assert cols[6] == "1.00x" if name != "fsdp" else float(cols[6].rstrip("x")) >= 1.0, (name, cols)
    assert "verdict: OK" in out


def test_a_broken_wrapper_fails_verify_naming_the_parameter():
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "parallel" / "_inject"),
                                          os.environ.get("PYTHONPATH", "")]),
           "RAYTRAIN_DDP_TEST_BREAK": "bucketed:head.4.weight"}
    proc = _verify(QUICKSTART, "train.seed=1", env=env)
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    assert "MISMATCH bucketed: gradient 'head.4.weight' differs from torch DDP by" in proc.stdout, proc.stdout
    assert "MISMATCH naive" not in proc.stdout and "MISMATCH native" not in proc.stdout, proc.stdout
    assert "verdict: FAILED" in proc.stdout


FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    """BatchNorm, two layers sharing one weight, and a layer no forward uses."""

    def __init__(self, spec):
        super().__init__()
        width = 1
        for size in spec.feature_shape:
            width *= size
        self.inp, self.bn = nn.Linear(width, 16), nn.BatchNorm1d(16)
        self.a, self.b, self.dead = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.inp(x.flatten(1))))
        return self.out(torch.tanh(self.b(torch.tanh(self.a(h)))))


def factory(spec):
    return Net(spec)
'''


def test_verify_finds_unused_tied_and_buffers_on_a_users_model(tmp_path):
    """A model factory with BatchNorm, tied and unused parameters: every strategy still matches
    torch DDP (buffers included); verify names the unused layer and says which option to set."""
    pytest.importorskip("raytrain_ddp.user")
    from raytrain_ddp.parallel import verify

    (tmp_path / "verify_models.py").write_text(FACTORY)
    config = tmp_path / "byo.yaml"
    config.write_text("model:\n  name: verify_models:factory\ndata:\n  source: digits\n")
    lines: list[str] = []
    report = verify(config, [], out=lines.append)
    text = "\n".join(lines)
    assert report.unused == {"dead.weight": [0, 1], "dead.bias": [0, 1]}, text
    assert report.tied == [["a.weight", "b.weight"]], text
    for finding in report.findings:
        assert not finding.problems() and finding.single is None, (finding, text)  # BatchNorm: 1 process n/a
        assert finding.broadcast_bytes_per_step > 0, text  # BatchNorm buffers went out from rank 0
    assert len(report.problems) == 1 and "parallel.find_unused_parameters=true" in report.problems[0], text
    assert not report.ok and "verdict: FAILED" in text
