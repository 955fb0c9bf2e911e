"""`benchmarks/gpu.sh --dry-run` on a machine made to look like the GPU machine (issue #41).

As there: `import ray` fails, and pydantic is missing until gpu.sh installs it from the
carried wheels (here: this venv's own, repacked offline by `tests/_wheels.py`;
`--prepare` fetches the GPU machine's). The run must write its four files into the `--out`
folder, install pydantic from the wheels, mark the Ray section "not run: no Ray on this
machine", and finish with its table. On a loaded machine later sections may be cut by the
deadline ("not run: ... deadline", or "timed out"): the deadline working, and gpu.sh's exit
status says so (1, naming the sections that timed out, as it would on the GPU machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _wheels import repack

REPO = Path(__file__).resolve().parents[3]
SHIM = REPO / "tests" / "device_like"
HIDE = "ray,pydantic,pydantic_core,annotated_types,typing_inspection"
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")

pytestmark = [pytest.mark.bench, pytest.mark.timeout(480)]  # gpu.sh's whole dry run: make test, not test-fast


def test_gpu_sh_dry_run_without_ray_and_pydantic(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for name in WHEELS:
        repack(name, wheels)
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(wheels), "GPU_SITE": str(tmp_path / "site"),
           "PYTHONPATH": str(SHIM), "RAYTRAIN_DDP_HIDE": HIDE, "GPU_DEADLINE_S": "240", "TMPDIR": str(tmp_path)}
    for module in ("ray", "pydantic"):  # as on the GPU machine, before gpu.sh
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "hidden: as on the GPU machine" in probe.stderr

    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=330)
    text = proc.stdout + proc.stderr
    assert "installing the carried wheels" in text, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "results-gpu.json", "results-gpu.md",
                                                      "results-gpu.png"], text[-3000:]
    results = json.loads((out / "results-gpu.json").read_text())
    meta, sections = results["meta"], results["sections"]
    assert meta["dry_run"] and meta["ray"] == "absent" and meta["pydantic"] == "importable"
    assert list(sections) == ["ceilings", "strategies", "gpt", "checkpointing", "compile", "local", "ranks", "ingest"]
    assert sections["ingest"] == {"not_run": "not run: no Ray on this machine"}
    assert "not run: no Ray on this machine" in (out / "gpu.log").read_text()
    for name, data in sections.items():  # ran, or cut by the deadline on a loaded machine
        cut = "timed out" in data.get("error", "") or "deadline" in data.get("not_run", "")
        assert "figures" in data or cut or name == "ingest", (name, data)
        if "figures" in data:
            assert "error" not in data, (name, data)
    assert "| section | figure | value |" in proc.stdout  # the closing table
    # a section the deadline cut is a failed section to gpu.sh (exit 1, named), as on the GPU machine
    cut = [name for name, data in sections.items() if "timed out" in data.get("error", "")]
    assert proc.returncode == (1 if cut else 0), text[-3000:]
    assert (f"; failed: {cut}" in proc.stdout) == bool(cut), text[-3000:]
