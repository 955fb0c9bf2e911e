"""The `recovery` section: what a SIGKILLed worker costs, and what keeping the replica costs (#15).

Owns: two measurements. Must not touch: the training loop, the recovery machinery
(`worker/replica.py`), any run directory but the temporary ones it makes.

`kill`: real runs of the quickstart (`examples/configs/quickstart.yaml`, 2 workers,
through `driver.launcher.run_training` and its embedded Ray start, so Ray's health-check
settings are the product's), storage in a temporary directory, a durable checkpoint
every `CHECKPOINT_EVERY` steps and a metrics line every step. A watcher thread reads
`metrics.jsonl` until step `KILL_AT` is logged, then SIGKILLs one `RayTrainWorker`
process from outside, found through Ray's state API (the rank is read from its
placement-group bundle, which is the world rank on one node without GPUs; rank 1 is
preferred so the driver's rank 0 record stream stays up), and keeps reading until the
restarted group logs a step, noting the last step attempt 1 completed (the driver drops
those lines once the new group says where it resumed, so they are seen only live).
Reported per run: `steps_redone` (attempt 2's train lines at or below the last step
attempt 1 completed), `kill_to_copy_s` (the kill to a survivor's copy being complete,
seen from outside within ~20 ms; None without one), `kill_to_restart_s` (the kill to
the new group's attempts.jsonl line), `kill_to_next_step_s` (the kill to the `time` of attempt 2's first train line),
and `resumed_from` / `resumed_step` from attempts.jsonl; for `run.recovery=replica`
(the default) and, as the comparison, `run.recovery=checkpoint`, where the steps since
the last durable checkpoint are redone. Each run starts its own Ray instance (the
launcher's embedded start, with Ray's default worker niceness as a user's run has it),
so the section runs after the suite's shared one stopped.

`node_loss` (full preset, or `--node-loss`): a whole node lost -- every process of the
second node of `cluster/local-two-node.sh` SIGKILLed once step NODE_KILL_AT of the tiny
config with 1-2 workers is logged; kill -> next trained step against its own target
(20 s) and the steps redone (docs/reliability.md#node-loss).

`overhead`: the steady-state price of the replica is `LastStep.mark()` at every step
boundary (RNG streams and a copy of the module's buffers; parameters and optimizer are
never copied). Timed in this process, without Ray: a plain step (forward and backward
over the micro-batches, gradient clipping, AdamW, zero_grad) with and without `mark()`,
in interleaved rounds, for the quickstart's CNN and a Linear(5120, 5120) with AdamW
(315 MB of state). `mark_ms` is the median of `mark()` itself inside the marked steps;
`overhead_pct` = mark_ms / step_ms; `paired_diff_pct` (marked minus plain step medians)
is shown as well, but on a shared machine it is noise around the tiny true cost.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp.ray_compat import WORKER_NICENESS_ENV
from raytrain_ddp.ops.bench.common import Sizes, stats
from raytrain_ddp.ops.bench.kill import _BUNDLE, QUICKSTART, _kill_a_worker

CHECKPOINT_EVERY = 10  # durable checkpoints at steps 10, 20, ...
KILL_AT = 14  # kill once step 14 is logged: mid-epoch (22 steps), between checkpoints 10 and 20
MAX_STEPS = 40
RUN_TIMEOUT_S = 300.0  # the watcher gives up (and the run is reported failed) after this
TARGETS = {"steps_redone": 1, "kill_to_next_step_s": 10.0, "overhead_pct": 3.0}
_SURVIVOR = re.compile(r"_r(\d+)$")


# ---------------------------------------------------------------- kill


class _Watcher(threading.Thread):
    """Reads metrics.jsonl; at step `kill_at` SIGKILLs a worker; follows until attempt 2 trains."""

    def __init__(self, run_dir: Path, kill_at: int, timeout_s: float) -> None:
        super().__init__(name="recovery-watcher", daemon=True)
        self.run_dir, self.kill_at, self.timeout_s = run_dir, kill_at, timeout_s
        self.stop = threading.Event()
        self.killed_at: Optional[float] = None
        self.killed: dict[str, Any] = {}
        self.last_done_before = 0  # the last step attempt 1 logged
        self.copy_at: Optional[float] = None  # when a survivor's copy had its manifest (written last)
        self.error: Optional[str] = None

    def _lines(self) -> list[dict[str, Any]]:
        from raytrain_ddp.rundir import read_metrics

        return [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "loss" in r]

    def _follow(self) -> list[dict[str, Any]]:
        lines = self._lines()
        first = [r["step"] for r in lines if r.get("attempt") == 1]
        if first:
            self.last_done_before = max(self.last_done_before, max(first))
        return lines

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.stop.is_set() and time.monotonic() < deadline:
                self._follow()
                if self.last_done_before >= self.kill_at:
                    break
                self.stop.wait(0.02)
            else:
                self.error = f"step {self.kill_at} was never logged; no worker killed"
                return
            self.killed = _kill_a_worker()
            self.killed_at = self.killed["time"]
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.copy_at is None and any(self.run_dir.glob("checkpoint_*_r[0-9]*/manifest.json")):
                    self.copy_at = time.time()
                if any(r.get("attempt", 1) > 1 for r in self._follow()):
                    return
                self.stop.wait(0.02)
        except Exception as exc:  # noqa: BLE001 - reported by the section
            self.error = f"{type(exc).__name__}: {exc}"


def _kill_run(mode: str, storage: Path, kill_at: int, log) -> dict[str, Any]:
    """One quickstart run with `run.recovery=<mode>` whose worker is SIGKILLed after step `kill_at`."""
    from raytrain_ddp.config import load_config
    from raytrain_ddp.driver.launcher import run_training
    from raytrain_ddp.rundir import read_jsonl, read_metrics

    name = f"recovery-{mode}"
    cfg = load_config(QUICKSTART, [
        f"run.storage_path={storage}", f"name={name}", f"run.recovery={mode}", "run.log_every_steps=1",
        f"run.checkpoint_every_steps={CHECKPOINT_EVERY}", f"train.max_steps={MAX_STEPS}", "run.max_failures=1",
    ])
    run_dir = storage / name
    watcher = _Watcher(run_dir, kill_at, RUN_TIMEOUT_S)
    watcher.start()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the run's console lines are progress, not the report
            summary = run_training(cfg)
    finally:
        watcher.stop.set()
        watcher.join(timeout=10)
    run_s = time.perf_counter() - started
    if watcher.error or watcher.killed_at is None:
        raise RuntimeError(f"recovery {mode}: {watcher.error or 'no worker was killed'}")
    if summary.get("status") != "ok":
        raise RuntimeError(f"recovery {mode}: the run ended {summary.get('status')}: {summary.get('error')}")
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    attempts = [a for a in read_jsonl(run_dir / "attempts.jsonl") if a.get("fit_id") == summary["fit_id"]]
    if len(attempts) != 2:
        raise RuntimeError(f"recovery {mode}: {len(attempts)} attempts, expected 2 (one kill, one restart)")
    second = [r for r in lines if r.get("attempt") == 2]
    if not second:
        raise RuntimeError(f"recovery {mode}: the restarted group logged no train line")
    last_done = watcher.last_done_before
    resumed = attempts[1]
    # A survivor's copy is named ..._r<rank> (replica.write_last_step); pruned by the run's end.
    copy = _SURVIVOR.search(str(resumed.get("checkpoint") or ""))
    survivor = int(copy.group(1)) if copy and resumed.get("resumed_from") == "replica" else None
    row = {
        "mode": mode, "killed_rank": watcher.killed.get("rank"), "survivor_rank": survivor,
        "last_step_before_kill": last_done,
        "steps_redone": sum(1 for r in second if r["step"] <= last_done),
        "resumed_from": resumed.get("resumed_from"), "resumed_step": resumed.get("resumed_step"),
        "checkpoint": resumed.get("checkpoint"),
        "kill_to_copy_s": watcher.copy_at - watcher.killed_at if watcher.copy_at else None,
        "kill_to_restart_s": float(resumed["time"]) - watcher.killed_at if "time" in resumed else float("nan"),
        "kill_to_next_step_s": min(r["time"] for r in second) - watcher.killed_at,
        "steps": summary.get("steps"), "metrics_once": [r["step"] for r in lines] == list(range(1, MAX_STEPS + 1)),
        "run_s": run_s,
    }
    log(f"    {mode}: killed rank {row['killed_rank']} after step {last_done}; resumed from {row['resumed_from']} "
        f"at step {row['resumed_step']}, {row['steps_redone']} step(s) redone, next trained step "
        f"{row['kill_to_next_step_s']:.1f} s after the kill")
    return row


def kill_section(kills: int, log=print) -> dict[str, Any]:
    """`kills` runs per recovery mode (replica, checkpoint), interleaved; each starts its own Ray."""
    # The launcher's embedded start as `raytrain-ddp train` makes it: never a cluster by
    # chance, and Ray's own worker niceness, not the 0 the suite sets for its A/B sections.
    saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", WORKER_NICENESS_ENV) if k in os.environ}
    modes: dict[str, list[dict[str, Any]]] = {"replica": [], "checkpoint": []}
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-bench-recovery-") as tmp:
            for i in range(kills):
                for mode in modes:
                    modes[mode].append(_kill_run(mode, Path(tmp) / f"{i}", KILL_AT, log))
    finally:
        os.environ.update(saved)
    out: dict[str, Any] = {"kill_at": KILL_AT, "checkpoint_every_steps": CHECKPOINT_EVERY, "max_steps": MAX_STEPS,
                           "world_size": 2, "config": "examples/configs/quickstart.yaml"}
    for mode, rows in modes.items():
        out[mode] = {"runs": rows, "steps_redone_max": max(r["steps_redone"] for r in rows),
                     "kill_to_next_step_s": stats([r["kill_to_next_step_s"] for r in rows]),
                     "kill_to_restart_s": stats([r["kill_to_restart_s"] for r in rows])}
    return out


# ---------------------------------------------------------------- overhead


def _models() -> dict[str, Any]:
    """name -> (model, optimizer, micro-batches, loss, clip norm), as one rank of the run steps them."""
    import torch

    from raytrain_ddp.config import load_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.models import build_model
    from raytrain_ddp.ops.bench.checkpoint import LARGE_FEATURES

    torch.manual_seed(0)
    cfg = load_config(QUICKSTART, [])
    cnn = build_model(cfg, DataSpec("classification", (1, 8, 8), 10, 1438, 359, "digits"))
    micro, accum = cfg.train.micro_batch_size, cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)
    cnn_batches = [(torch.randn(micro, 1, 8, 8), torch.randint(0, 10, (micro,))) for _ in range(accum)]
    ce = torch.nn.functional.cross_entropy
    large = torch.nn.Linear(LARGE_FEATURES, LARGE_FEATURES)
    large_batches = [(torch.randn(16, LARGE_FEATURES), torch.randn(16, LARGE_FEATURES))]
    return {
        "quickstart": (cnn, torch.optim.AdamW(cnn.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay),
                       cnn_batches, ce, cfg.train.clip_grad_norm),
        "large": (large, torch.optim.AdamW(large.parameters(), lr=1e-4), large_batches,
                  torch.nn.functional.mse_loss, 1.0),
    }


def _state_mb(model: Any, optimizer: Any) -> float:
    tensors = list(model.state_dict().values())
    tensors += [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "numel")]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def overhead_section(rounds: int, steps: int, log=print) -> dict[str, Any]:
    import torch

    from raytrain_ddp.worker.replica import LastStep

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one rank of the 2-worker run on this machine
    try:
        out: dict[str, Any] = {"rounds": rounds, "steps_per_round": steps, "threads": 1}
        for name, (model, optimizer, batches, loss_fn, clip) in _models().items():
            per_round = steps if name == "quickstart" else max(2, steps // 5)  # a large step takes ~0.4 s here
            last = LastStep(model)
            plain: list[float] = []
            marked: list[float] = []
            marks: list[float] = []

            def step(mark: bool) -> float:
                started = time.perf_counter()
                for x, y in batches:
                    (loss_fn(model(x), y) / len(batches)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if mark:
                    before = time.perf_counter()
                    last.mark()
                    marks.append(time.perf_counter() - before)
                return time.perf_counter() - started

            for _ in range(2):  # warm-up: the optimizer's moments exist, as after any step
                step(True)
            marks.clear()
            for r in range(rounds):
                for mark in ((False, True) if r % 2 == 0 else (True, False)):
                    (marked if mark else plain).extend(step(mark) for _ in range(per_round))
            p, m, k = stats(plain), stats(marked), stats(marks)
            row = {"state_mb": _state_mb(model, optimizer), "buffers": len(list(model.buffers())),
                   "step_ms": 1e3 * p["median"], "step_with_mark_ms": 1e3 * m["median"], "mark_ms": 1e3 * k["median"],
                   "mark_max_ms": 1e3 * k["max"], "overhead_pct": 100 * k["median"] / p["median"],
                   "paired_diff_pct": 100 * (m["median"] - p["median"]) / p["median"]}
            row["steps_timed"] = 2 * rounds * per_round
            out[name] = row
            log(f"    {name} ({row['state_mb']:.0f} MB of state): step {row['step_ms']:.2f} ms, mark() "
                f"{row['mark_ms']:.3f} ms = {row['overhead_pct']:.2f}%")
            del model, optimizer, batches, last
    finally:
        torch.set_num_threads(threads)
    return out


# ---------------------------------------------------------------- node loss

CLUSTER_SCRIPT = QUICKSTART.parents[2] / "cluster" / "local-two-node.sh"
TINY = QUICKSTART.parent / "tiny.yaml"
NODE_KILL_AT = 30  # of 66 steps (3 epochs of the tiny config)
NODE_TARGET_S = 20.0


def two_node_env(state: Optional[Path] = None) -> dict[str, str]:
    """The environment for `cluster/local-two-node.sh` and its clients: this process's, without
    any Ray, raytrain-ddp or script settings, this Python's bin first on PATH; with `state`
    (`up`'s state directory), the cluster's own exports (RAY_ADDRESS, the token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_", "RT2N_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for line in (state / "env").read_text().splitlines() if state is not None else []:
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value
    return env


def last_logged_step(metrics: Path) -> int:
    """The newest step of a train line in `metrics.jsonl` (0 before the first)."""
    from raytrain_ddp.rundir import read_metrics

    return max([r["step"] for r in read_metrics(metrics) if "loss" in r], default=0) if metrics.exists() else 0


def wait_for_step(metrics: Path, proc: Any, step: int, deadline: float, poll_s: float = 0.05) -> int:
    """Poll until a train line of `step` (or later) is logged, `proc` ends, or `deadline`
    (time.monotonic); returns the newest step seen."""
    seen = 0
    while seen < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)
        seen = last_logged_step(metrics)
    return seen


def follow_to_resume(metrics: Path, proc: Any, seen: int, deadline: float, poll_s: float = 0.05) -> int:
    """After a kill: the last step attempt 1 completed, followed until attempt 2 logs a line.

    The driver drops attempt 1's lines past the resume step once attempt 2 says where it
    resumed, so that step is seen only live. `seen`: the newest step logged before the kill.
    """
    from raytrain_ddp.rundir import read_metrics

    last = seen
    while proc.poll() is None and time.monotonic() < deadline:
        rows = [r for r in read_metrics(metrics) if "loss" in r]
        last = max([last] + [r["step"] for r in rows if r["attempt"] == 1])
        if any(r["attempt"] > 1 for r in rows):
            break
        time.sleep(poll_s)
    return last


def node_loss_run(log=print, timeout_s: float = 300.0) -> dict[str, Any]:
    """Every process of the second node of `cluster/local-two-node.sh` SIGKILLed mid-run.

    The tiny config with `scaling.num_workers=[1,2]` and 2 CPUs per worker (one worker per
    node), a metrics line every step; once step NODE_KILL_AT is logged, `kill-node`. The
    cluster's health-check settings are the cluster files' (the script sets them).
    Reported: the last step logged before the kill, where attempt 2 resumed, the steps
    redone, kill -> next trained step, the two attempts' world sizes.
    """
    import json
    import subprocess

    from raytrain_ddp.rundir import read_jsonl, read_metrics

    base = two_node_env()
    up = subprocess.run([str(CLUSTER_SCRIPT), "up"], env={**base, "RT2N_UP_TIMEOUT_S": "120"},
                        capture_output=True, text=True, timeout=200)
    if up.returncode != 0:
        raise RuntimeError(f"local-two-node.sh up failed: {up.stderr[-2000:]}")
    state = Path(up.stdout.strip().splitlines()[-1])
    try:
        runs = state / "runs"
        cmd = [sys.executable, "-m", "raytrain_ddp", "train", str(TINY), "name=nodeloss", "train.epochs=3",
               "run.log_every_steps=1", "scaling.cpus_per_worker=2", "scaling.num_workers=[1,2]",
               f"run.storage_path={runs}", "run.resume=never"]
        with open(state / "train.log", "wb") as out:
            train = subprocess.Popen(cmd, env={**two_node_env(state), "PYTHONUNBUFFERED": "1"}, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                metrics, deadline = runs / "nodeloss" / "metrics.jsonl", time.monotonic() + timeout_s
                seen = wait_for_step(metrics, train, NODE_KILL_AT, deadline)
                if train.poll() is not None or seen < NODE_KILL_AT:
                    raise RuntimeError(f"the run ended or stalled before step {NODE_KILL_AT}: "
                                       f"{(state / 'train.log').read_text()[-2000:]}")
                killed_at = time.time()
                subprocess.run([str(CLUSTER_SCRIPT), "kill-node", str(state)], env=base, check=True, timeout=60)
                last = follow_to_resume(metrics, train, seen, deadline)
                train.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                if train.poll() is None:
                    os.killpg(train.pid, signal.SIGKILL)  # the group this section started
                    train.wait(timeout=30)
        if train.returncode != 0:
            raise RuntimeError(f"the run failed after the node loss: {(state / 'train.log').read_text()[-2000:]}")
        lines = [r for r in read_metrics(runs / "nodeloss" / "metrics.jsonl") if "loss" in r]
        summary = json.loads((runs / "nodeloss" / "summary.json").read_text())
        attempts = [r for r in read_jsonl(runs / "nodeloss" / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
        resumed = attempts[-1]["resumed_step"]
        back = min(r["time"] for r in lines if r["attempt"] == 2) - killed_at
        log(f"  recovery: node lost after step {last}: resumed at {resumed} ({attempts[-1]['resumed_from']}), "
            f"next trained step {back:.1f}s after the kill")
        return {"last_step_before_kill": last, "resumed_step": resumed, "steps_redone": max(0, last - resumed),
                "resumed_from": attempts[-1]["resumed_from"], "kill_to_next_step_s": back,
                "world_sizes": [r["world_size"] for r in attempts], "attempts": summary["attempts"],
                "metrics_once": [r["step"] for r in lines] == list(range(1, summary["steps"] + 1)),
                "steps": summary["steps"], "target_s": NODE_TARGET_S}
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "down", str(state)], env=base, capture_output=True, timeout=120)


# ---------------------------------------------------------------- section


def run(sizes: Sizes, log=print, with_kill: bool = True, with_node_loss: Optional[bool] = None) -> dict[str, Any]:
    """Needs no Ray from the caller: the kill runs start (and stop) their own; the node-loss
    run (full preset, or asked for) a two-node cluster of its own."""
    with_node_loss = sizes.name == "full" if with_node_loss is None else with_node_loss
    rounds, steps = {"smoke": (1, 3), "quick": (4, 10)}.get(sizes.name, (8, 15))
    log(f"  recovery: mark() per step vs step time, {rounds} interleaved rounds x {steps} steps ...")
    result: dict[str, Any] = {"overhead": overhead_section(rounds, steps, log=log), "targets": dict(TARGETS)}
    if with_kill:
        kills = 2 if sizes.name == "full" else 1
        log(f"  recovery: SIGKILL a worker after step {KILL_AT} of the quickstart (checkpoints every "
            f"{CHECKPOINT_EVERY} steps), run.recovery replica and checkpoint, {kills} run(s) each ...")
        result["kill"] = kill_section(kills, log=log)
        from raytrain_ddp.ops.bench import live_recovery  # issue #28 seam: replica and live side by side

        log(f"  recovery: run.recovery replica and live side by side, {live_recovery.KILLS} kill(s) each ...")
        result["live"] = live_recovery.side_by_side(live_recovery.KILLS, live_recovery.ROUNDS, log=log)
    else:
        result["kill_note"] = f"kill runs skipped in the {sizes.name} preset (two Ray runs with a restart each)"
    if with_node_loss:
        log("  recovery: lose a whole node of the two-node local cluster mid-run (tiny, 1-2 workers) ...")
        try:
            result["node_loss"] = node_loss_run(log=log)
        except Exception as exc:  # noqa: BLE001 - keep the other figures, flag this one
            result["node_loss"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  recovery: node loss FAILED: {type(exc).__name__}: {exc}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    """This section alone: `python -m raytrain_ddp.ops.bench.recovery [--quick] [--out FILE] [--no-kill] [--node-loss]`."""
    import argparse

    from raytrain_ddp.ops.bench import report
    from raytrain_ddp.ops.bench.common import FULL, QUICK
    from raytrain_ddp.ops.bench.session import log, meta

    parser = argparse.ArgumentParser(prog="python -m raytrain_ddp.ops.bench.recovery")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-kill", action="store_true", help="only the in-process overhead (no Ray)")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--node-loss", action="store_true", help="also lose a node of the two-node local cluster "
                        "(the full preset always does)")
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else "full"
    results: dict[str, Any] = {"meta": meta(preset, "cpu")}
    results["recovery"] = run(QUICK if args.quick else FULL, log=log, with_kill=not args.no_kill,
                              with_node_loss=True if args.node_loss else None)
    return report.finish_section_run(results, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
