"""Memory stays flat over a long run: worker RSS after N steps vs after 10N steps (issue #6, item 10).

A benchmark, not a test: timing-free, but too long for the suite. It trains the tiny
config (mlp on digits, 2 workers, checkpoint every 10 steps, validation every epoch) for
10N+ steps on an embedded Ray instance, watches rank 0's metrics.jsonl from the driver and
reads each training worker's resident set size from /proc when step N and step 10N
are first seen. Workers are found through Ray's state API (class RayTrainWorker).

    .venv/bin/python -m benchmarks.memory_flat --steps 50   # -> benchmarks/results/memory-flat-<date>.json

Reads the RSS of processes on this machine only (single-node runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raytrain_ddp.config import load_config  # noqa: E402
from raytrain_ddp.driver.fit import run_training  # noqa: E402
from raytrain_ddp.rundir import read_metrics  # noqa: E402


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _worker_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address
    actors = list_actors(address=address, filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
                         raise_on_missing_output=False)
    return sorted(int(a.pid) for a in actors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="N: RSS is read after N and after 10N steps")
    parser.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/memory-flat-<date>.json)")
    args = parser.parse_args()
    n = args.steps
    storage = Path(tempfile.mkdtemp(prefix="memory_flat_"))
    steps_per_epoch = 22
    epochs = math.ceil(10 * n / steps_per_epoch) + 1
    cfg = load_config(REPO / "examples/configs/tiny.yaml",
                      [f"run.storage_path={storage}", "name=memory", f"train.epochs={epochs}", "run.log_every_steps=1",
                       "run.dashboard=true"])  # the workers' pids come from the state API
    metrics = storage / "memory" / "metrics.jsonl"
    samples: dict[int, dict] = {}
    done = threading.Event()
    result: dict = {}

    def train() -> None:
        try:
            result["summary"] = run_training(cfg)
        finally:
            done.set()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    targets = [n, 10 * n]
    while not done.is_set() and targets:
        steps = [r["step"] for r in read_metrics(metrics) if "loss" in r] if metrics.exists() else []
        if steps and steps[-1] >= targets[0]:
            try:
                pids = _worker_pids()
                samples[targets[0]] = {"step": steps[-1], "rss_mb": {str(p): round(_rss_mb(p), 1) for p in pids}}
                targets.pop(0)
            except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
                print(f"memory_flat: sampling failed ({exc}); retrying", file=sys.stderr)
        time.sleep(0.1)
    thread.join()
    summary = result.get("summary", {})
    out = {"n": n, "steps_total": summary.get("steps"), "status": summary.get("status"), "samples": samples}
    if len(samples) == 2:
        first, last = samples[n]["rss_mb"], samples[10 * n]["rss_mb"]
        out["growth_mb"] = {pid: round(last[pid] - first[pid], 1) for pid in first if pid in last}
    text = json.dumps(out, indent=2)
    print(text)
    from benchmarks.session import meta, publish, results_path

    path = Path(args.out) if args.out else results_path("memory-flat")
    publish({"meta": meta(f"n={n}", "cpu"), **out}, path, f"```json\n{text}\n```")
    return 0 if summary.get("status") == "ok" and len(samples) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
