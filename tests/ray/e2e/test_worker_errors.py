"""A worker's error reaches the user whole, and one that retrying cannot help is not retried (#45).

One real `raytrain-ddp train` on 2 workers: a model whose auxiliary heads (long names, so
the wrappers' message is over 1,000 characters: Ray Train keeps the first and last 500)
take part in step 1 only, so the driver's precheck passes and both ranks raise
`UnusedParameterError` at step 2. The fit fails in one attempt (run.max_failures=1 is not
spent) with the whole message on the console and in summary.json. The same model with its
heads never used is refused in local mode (`scaling.num_workers=0`) with the same message.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "tiny.yaml"
HEADS = 7  # weight and bias each: 14 unused parameters, 6 named in the message, "and 8 more"

USER_MODEL = f'''
from torch import nn


class WithAuxHeads(nn.Module):
    def __init__(self, spec, aux_calls):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(spec.feature_shape[0], 32), nn.ReLU(), nn.Linear(32, spec.num_classes))
        self.auxiliary_heads = nn.ModuleDict(
            {{f"head_{{i}}_" + "a_rather_long_descriptive_name_for_an_auxiliary_head" * 2: nn.Linear(32, 1)
             for i in range({HEADS})}})
        self.aux_calls, self.calls = aux_calls, 0

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        if self.calls <= self.aux_calls:  # step 1 (2 micro-batches per rank): the heads take part
            out = out + sum(h(self.body[1](self.body[0](x))) for h in self.auxiliary_heads.values()) * 0
        return out


def build(spec, aux_calls=2):
    return WithAuxHeads(spec, aux_calls)
'''


def _train(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-m", "raytrain_ddp", "train", str(TINY), f"name={name}",
                           f"run.storage_path={tmp_path / 'runs'}", "model.name=auxheads:build", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _message(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("raytrain-ddp: error: ")]
    assert len(lines) == 1, stderr[-4000:]
    return lines[0].removeprefix("raytrain-ddp: error: ")


def test_unused_parameter_on_two_workers_fails_once_with_the_whole_message_as_local_mode_does(tmp_path):
    (tmp_path / "auxheads.py").write_text(USER_MODEL)
    done = _train(tmp_path, "aux", "run.max_failures=1", "run.recovery=checkpoint")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    message = _message(done.stderr)
    assert len(message) > 1000 and "truncated" not in message, message
    assert message.startswith(f"{2 * HEADS} trainable parameter(s) got no gradient in a synchronised backward "
                              "(strategy 'bucketed', find_unused_parameters=False): 'auxiliary_heads.head_"), message
    assert f"and {2 * HEADS - 6} more" in message and message.endswith("requires_grad_(False)."), message
    summary = json.loads((tmp_path / "runs" / "aux" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == message, summary
    assert summary["attempts"] == 1, summary  # deterministic: run.max_failures=1 is not spent on it

    local = _train(tmp_path, "aux-local", "scaling.num_workers=0", "model.kwargs={aux_calls: 0}")
    assert local.returncode == 2, local.stdout[-3000:] + local.stderr[-3000:]
    assert "Traceback" not in local.stderr, local.stderr[-3000:]
    one_rank = re.sub(r"rank\(s\) \[[\d, ]+\]", "rank(s) [R]", message)
    assert re.sub(r"rank\(s\) \[[\d, ]+\]", "rank(s) [R]", _message(local.stderr)) == one_rank
