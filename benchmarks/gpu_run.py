"""The GPU machine's one prepared run (`benchmarks/gpu.sh`): sections in order, each in a child
process bounded by the time left, every result written after every section.

Owns: the order of the GPU sections, their deadlines, what comes back (`results-gpu.json`,
`.md`, `.png` and `gpu.log` in the output folder: four files, the device tool returns eight)
and the closing table. Must not touch: how a section measures (`gpu_checks`, `gpu`,
`strategies`, `ingest`). Needs no Ray and no pydantic to start: a section that needs Ray
says "not run: no Ray on this machine"; one that fails is recorded and the rest run.

    python -m benchmarks.gpu_run --out DIR [--dry-run] [--deadline-s 450]

Why children: a section that hangs or crashes (a CUDA error poisons its process) costs its
own time only; each gets min(its cap, the time left), so the run ends inside the deadline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NO_RAY = "not run: no Ray on this machine"
# (name, cap in seconds on the GPU machine, needs Ray); the dry run shares the deadline.
SECTIONS = (("ceilings", 40, False), ("strategies", 90, False), ("gpt", 90, False), ("checkpointing", 40, False),
            ("compile", 150, False), ("local", 150, False), ("ranks", 60, False), ("ingest", 90, True))
RESERVE_S = 20.0  # the last write (a PNG: matplotlib's import) and the table, on a loaded machine
FILES = ("results-gpu.json", "results-gpu.md", "results-gpu.png", "gpu.log")


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install: the same answer
        return False
    return True


def machine(dry: bool) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"dry_run": dry, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "ray": "installed" if ray_available() else "absent",
            "pydantic": "importable" if importlib.util.find_spec("pydantic") else "absent",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_section(name: str, dry: bool, timeout_s: float, log) -> dict[str, Any]:
    """One section in a child process, killed at `timeout_s`; its JSON result or why there is none."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-{name}-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_checks", name, str(result)] + (["--dry-run"] if dry else [])
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the child's own session: it and whatever it started
            out, _ = proc.communicate()
            log(out)
            return {"error": f"timed out after {timeout_s:.0f}s", "section_s": time.monotonic() - started}
        log(out)
        if result.exists():
            data = json.loads(result.read_text())
        else:
            data = {"error": f"exit status {proc.returncode}, no result (see gpu.log)"}
        data["section_s"] = time.monotonic() - started
        return data


def write_all(out: Path, results: dict[str, Any]) -> None:
    """The JSON, the Markdown table and the PNG, rewritten whole (a kill leaves the last full set)."""
    (out / FILES[0]).write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / FILES[1]).write_text(table(results) + "\n")
    try:
        plot(results, out / FILES[2])
    except Exception as exc:  # noqa: BLE001 - a figure is a bonus; the numbers are in the JSON
        results.setdefault("notes", []).append(f"png: {type(exc).__name__}: {exc}")


def rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(section, figure, value) lines of the closing table."""
    out: list[tuple[str, str, str]] = []
    for name, _, _ in SECTIONS:
        data = results.get("sections", {}).get(name)
        if data is None:
            continue
        if "error" in data or "not_run" in data:
            out.append((name, "status", str(data.get("not_run") or "FAILED: " + data["error"])[:90]))
            continue
        for key, value in data.get("figures", {}).items():
            out.append((name, key, f"{value:.4g}" if isinstance(value, float) else str(value)))
    return out


def table(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    head = (f"GPU run{' (DRY RUN on CPU: numbers mean nothing)' if meta.get('dry_run') else ''}: "
            f"{meta.get('device')}, torch {meta.get('torch')}, Ray {meta.get('ray')}")
    lines = [head, "", "| section | figure | value |", "| --- | --- | ---: |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows(results)]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = [(f"{a}: {b}", float(c)) for a, b, c in rows(results) if _number(c)]
    fig, ax = plt.subplots(figsize=(8, 0.3 * max(4, len(numeric)) + 1))
    ax.barh([n for n, _ in numeric][::-1], [v for _, v in numeric][::-1])
    ax.set_xscale("symlog")
    ax.set_title(table(results).splitlines()[0][:100], fontsize=8)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a folder: the four result files go in it")
    parser.add_argument("--dry-run", action="store_true", help="CPU stand-ins at tiny sizes")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="the whole run, from now")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logfile = (out / FILES[3]).open("a")

    def log(text: str) -> None:
        if text:
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
            logfile.write(text if text.endswith("\n") else text + "\n")
            logfile.flush()

    results: dict[str, Any] = {"meta": machine(args.dry_run), "sections": {}}
    has_ray = ray_available()
    write_all(out, results)  # the files exist from the start: a kill later leaves the last full set
    for name, cap, needs_ray in SECTIONS:
        left = deadline - time.monotonic() - RESERVE_S
        if needs_ray and not has_ray:
            results["sections"][name] = {"not_run": NO_RAY}
            log(f"== {name}: {NO_RAY}")
        elif left < 5:
            results["sections"][name] = {"not_run": f"not run: the {args.deadline_s:.0f}s deadline was reached"}
            log(f"== {name}: not run, no time left")
        else:
            log(f"== {name} (at most {min(cap, left):.0f}s)")
            results["sections"][name] = run_section(name, args.dry_run, min(cap, left), log)
            write_all(out, results)  # after every section that ran (a "not run" costs no rewrite)
    write_all(out, results)
    failed = [n for n, d in results["sections"].items() if "error" in d]
    log(table(results))
    log(f"wrote {', '.join(str(out / f) for f in FILES)}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
