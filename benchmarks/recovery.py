"""The `recovery` section: what a SIGKILLed worker costs, and what keeping the replica costs (#15, #28).

Owns: the section's parts and their sizes per preset. Must not touch: the training loop,
the recovery machinery (`recovery/replica.py`, `recovery/live.py`), any run directory but the
temporary ones it makes.

`kill` (`live_recovery.side_by_side`): real runs of the quickstart (2 workers, through
`driver.fit.run_training` and its embedded Ray start, so Ray's health-check settings
are the product's), rank 1 SIGKILLed from outside once step `KILL_AT` is logged;
`run.recovery` replica and live side by side, interleaved, from one invocation (5 kills
each in the full preset, 1 in quick), `checkpoint` (the steps since the last durable
checkpoint redone) as the comparison in the first rounds, and pairs of uninterrupted
replica / live runs for live's step-time overhead. The smoke preset skips it. Each run
starts its own Ray instance (the launcher's embedded start, with Ray's default worker
niceness as a user's run has it), so the section runs after the suite's shared one stopped.

`node_loss` (full preset, or `--node-loss`): a whole node lost -- every process of the
second node of `cluster/local-two-node.sh` SIGKILLed once step NODE_KILL_AT of the tiny
config is logged; kill -> next trained step against its own target and the steps redone
(docs/reliability.md#node-loss). `replica`: 1-2 workers of 2 CPUs (one per node), the
group restarts on the survivor; `live` (`--node-loss-live`): 2 workers of 1 CPU spread
over the nodes, the lost one replaced on the head while the other keeps its process.

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

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import Sizes, stats
from benchmarks.kill import QUICKSTART
from tests._two_node import CLUSTER_SCRIPT, follow_to_resume, two_node_cluster, two_node_env, wait_for_step

TARGETS = {"steps_redone": 1, "kill_to_next_step_s": 10.0, "overhead_pct": 3.0}


# ---------------------------------------------------------------- overhead


def _models() -> dict[str, Any]:
    """name -> (model, optimizer, micro-batches, loss, clip norm), as one rank of the run steps them."""
    import torch

    from raytrain_ddp.config import load_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.models import build_model
    from benchmarks.checkpoint import LARGE_FEATURES

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

    from raytrain_ddp.recovery.replica import LastStep

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

TINY = QUICKSTART.parent / "tiny.yaml"
NODE_KILL_AT = 30  # of 66 steps (3 epochs of the tiny config)
NODE_TARGET_S = 20.0


NODE_LOSS = {  # what each mode trains on the two nodes (each has 3 CPUs)
    # 2 CPUs per worker: one per node; the group restarts on the survivor with one worker
    "replica": ("scaling.cpus_per_worker=2", "scaling.num_workers=[1,2]"),
    # 1 CPU per worker, spread: one per node, and the head has room for the replacement
    "live": ("scaling.cpus_per_worker=1", "scaling.num_workers=2", "scaling.placement_strategy=SPREAD",
             "run.recovery=live"),
}
NODE_TARGETS_S = {"replica": NODE_TARGET_S, "live": 15.0}


def node_loss_run(log=print, timeout_s: float = 300.0, mode: str = "replica", runs: int = 1) -> dict[str, Any]:
    """Every process of the second node of `cluster/local-two-node.sh` SIGKILLed mid-run.

    The tiny config as `NODE_LOSS[mode]` says, a metrics line every step; once step
    NODE_KILL_AT is logged, `kill-node`. The cluster's health-check settings are the
    cluster files' (the script sets them). `runs` > 1: the second node comes back
    (`revive-node`) and the next run starts, on the same cluster. Reported per run: the
    last step logged before the kill, where training went on (attempt 2's resume step;
    live: the step the replacement joined at), the steps redone, kill -> next trained step,
    the attempts' world sizes; the first run's fields at the top level, all in `runs`.
    """
    base = two_node_env()
    with two_node_cluster(timeout_s=200) as state:
        rows = []
        for i in range(runs):
            if i:
                subprocess.run([str(CLUSTER_SCRIPT), "revive-node", str(state)], env=base, check=True,
                               capture_output=True, timeout=200)
            rows.append(_node_loss_once(state, f"nodeloss-{mode}-{i}", mode, base, timeout_s, log))
        backs = [r["kill_to_next_step_s"] for r in rows]
        return {**rows[0], "runs": rows, "kill_to_next_step": stats(backs), "mode": mode,
                "target_s": NODE_TARGETS_S[mode]}


def _node_loss_once(state: Path, name: str, mode: str, base: dict[str, str], timeout_s: float, log) -> dict[str, Any]:
    import json

    from raytrain_ddp.rundir import read_jsonl, read_metrics

    runs = state / "runs"
    cmd = [sys.executable, "-m", "raytrain_ddp", "train", str(TINY), f"name={name}", "train.epochs=3",
           "run.log_every_steps=1", *NODE_LOSS[mode], f"run.storage_path={runs}", "run.resume=never"]
    log_path = state / f"{name}.log"
    with open(log_path, "wb") as out:
        train = subprocess.Popen(cmd, env={**two_node_env(state), "PYTHONUNBUFFERED": "1"}, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            metrics, deadline = runs / name / "metrics.jsonl", time.monotonic() + timeout_s
            seen = wait_for_step(metrics, train, NODE_KILL_AT, deadline)
            if train.poll() is not None or seen < NODE_KILL_AT:
                raise RuntimeError(f"the run ended or stalled before step {NODE_KILL_AT}: "
                                   f"{log_path.read_text()[-2000:]}")
            killed_at = time.time()
            subprocess.run([str(CLUSTER_SCRIPT), "kill-node", str(state)], env=base, check=True, timeout=60)
            last = follow_to_resume(metrics, train, seen, deadline) if mode != "live" else seen
            train.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if train.poll() is None:
                os.killpg(train.pid, signal.SIGKILL)  # the group this section started
                train.wait(timeout=30)
    text = log_path.read_text()
    if train.returncode != 0:
        raise RuntimeError(f"the run failed after the node loss: {text[-2000:]}")
    lines = [r for r in read_metrics(runs / name / "metrics.jsonl") if "loss" in r]
    summary = json.loads((runs / name / "summary.json").read_text())
    attempts = [r for r in read_jsonl(runs / name / "attempts.jsonl") if r["fit_id"] == summary["fit_id"]]
    after = [r for r in lines if r["time"] > killed_at]
    last = max([last] + [r["step"] for r in lines if r["time"] < killed_at])
    if mode == "live":
        joined = [int(m.group(1)) for m in re.finditer(r"live: replacement rank \d+ continues at step (\d+)", text)]
        resumed, resumed_from = (joined[0] if joined else None), "live"
    else:
        resumed, resumed_from = attempts[-1]["resumed_step"], attempts[-1]["resumed_from"]
    # live: the first step that needed the replacement (one finished while kill-node ran may come after `killed_at`)
    back = (next(r["time"] for r in lines if r["step"] == resumed + 1) if mode == "live" and resumed is not None
            else min(r["time"] for r in after)) - killed_at
    row = {"mode": mode, "last_step_before_kill": last, "resumed_step": resumed, "resumed_from": resumed_from,
           "steps_redone": sum(1 for r in after if r["step"] <= last), "kill_to_next_step_s": back,
           "world_sizes": [r["world_size"] for r in attempts], "attempts": summary["attempts"],
           "replacements": text.count("live: replacement rank"),
           "metrics_once": [r["step"] for r in lines] == list(range(1, summary["steps"] + 1)),
           "steps": summary["steps"], "load_avg": list(os.getloadavg())}
    log(f"  recovery: node lost after step {last} ({mode}): went on at {resumed} ({resumed_from}), "
        f"next trained step {back:.1f}s after the kill (load {row['load_avg'][0]:.1f})")
    return row


# ---------------------------------------------------------------- section


def run(sizes: Sizes, log=print, with_kill: bool = True, with_node_loss: Optional[bool] = None,
        node_loss_modes: tuple[str, ...] = tuple(NODE_LOSS), node_loss_runs: int = 1) -> dict[str, Any]:
    """Needs no Ray from the caller: the kill runs start (and stop) their own; the node-loss
    run (full preset, or asked for) a two-node cluster of its own."""
    from benchmarks import live_recovery

    with_node_loss = sizes.name == "full" if with_node_loss is None else with_node_loss
    rounds, steps = {"smoke": (1, 3), "quick": (4, 10)}.get(sizes.name, (8, 15))
    log(f"  recovery: mark() per step vs step time, {rounds} interleaved rounds x {steps} steps ...")
    result: dict[str, Any] = {"overhead": overhead_section(rounds, steps, log=log), "targets": dict(TARGETS)}
    if with_kill:
        full = sizes.name == "full"
        kills, pairs, compare = ((live_recovery.KILLS, live_recovery.ROUNDS, live_recovery.COMPARE_KILLS) if full
                                 else (1, 1, 1))
        log(f"  recovery: SIGKILL rank 1 after step {live_recovery.KILL_AT} of the quickstart, run.recovery replica "
            f"and live side by side ({kills} kill(s) each; checkpoint in {compare}), {pairs} pair(s) of "
            "uninterrupted runs ...")
        result["kill"] = live_recovery.side_by_side(kills, pairs, compare, log=log)
    else:
        result["kill_note"] = f"kill runs skipped in the {sizes.name} preset (Ray runs with a restart each)"
    if with_node_loss:
        for mode in node_loss_modes:
            key = "node_loss" if mode == "replica" else f"node_loss_{mode}"
            log(f"  recovery: lose a whole node of the two-node local cluster mid-run (tiny, {mode}) ...")
            try:
                result[key] = node_loss_run(log=log, mode=mode, runs=node_loss_runs)
            except Exception as exc:  # noqa: BLE001 - keep the other figures, flag this one
                result[key] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"  recovery: node loss ({mode}) FAILED: {type(exc).__name__}: {exc}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    """This section alone: `python -m benchmarks.recovery [--quick] [--out FILE] [--no-kill]
    [--node-loss [replica|live ...]] [--node-loss-runs N]`."""
    import argparse

    from benchmarks import report
    from benchmarks.common import FULL, QUICK
    from benchmarks.session import log, meta

    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-kill", action="store_true", help="only the in-process overhead (no Ray)")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--node-loss", nargs="*", choices=tuple(NODE_LOSS), default=None,
                        help="also lose a node of the two-node local cluster, in these modes (default: all; the "
                        "full preset always does)")
    parser.add_argument("--node-loss-runs", type=int, default=1, help="node losses per mode, on one cluster")
    args = parser.parse_args(argv)
    preset = "quick" if args.quick else "full"
    results: dict[str, Any] = {"meta": meta(preset, "cpu")}
    results["recovery"] = run(QUICK if args.quick else FULL, log=log, with_kill=not args.no_kill,
                              with_node_loss=True if args.node_loss is not None else None,
                              node_loss_modes=tuple(args.node_loss or NODE_LOSS), node_loss_runs=args.node_loss_runs)
    return report.finish_section_run(results, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
